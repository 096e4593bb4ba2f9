#!/usr/bin/env python
"""What one short run costs in CPU, by process: the rollout actor, the trainer, the queue actor, Ray's own processes and the driver.

A local Ray (2 CPUs) is started once (its own cost reported first); then `--runs` runs of
`--steps` trainer steps of the embedded model at the tests' small settings (groups of 2, 2 groups a
step, 4 denoising steps, no evaluation), each in a fresh set of actors as every test run and every
launch has. Every process descending from this driver is sampled from /proc every 0.1 s and keeps
its last reading, so a process that exits between two samples still counts, less at most 0.1 s
(Linux only). The first run is a warm-up (printed, not counted). Reported per run: wall seconds
and CPU seconds by role; then their medians. It says where an end-to-end test's time goes on a
CPU machine: mostly in starting actor processes (imports), not in the steps.

    python benchmarks/run_cost.py --mode fully_async
    python benchmarks/run_cost.py --mode sync --runs 5 --steps 10
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time

from common import CpuMonitor, argument_parser, load_mode_config, log, run_or_exit, write_json

ROLES = ("rollout", "trainer", "queue", "ray_system", "driver")


class ProcessCpu:
    """CPU seconds of the driver's process tree since `start()`, per role, with every process's last
    reading kept (a process gone by the end still counts)."""

    def __init__(self, interval: float = 0.1):
        self.monitor, self.interval = CpuMonitor(), interval
        self.seen: dict[str, tuple[str, int]] = {}  # pid -> (role, jiffies at the last sample)
        self.base: dict[str, int] = {}  # pid -> jiffies when counting began
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for pid, (role, jiffies) in self.monitor.snapshot().get("procs", {}).items():
            if role != "other":
                # an actor's process is titled by its class until it is killed: its role stays
                known = self.seen.get(pid, ("ray_system", 0))[0]
                self.seen[pid] = (known if role == "ray_system" else role, jiffies)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self._sample()
        self.base = {pid: j for pid, (_, j) in self.seen.items()}
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()
        out = dict.fromkeys(ROLES, 0.0)
        for pid, (role, jiffies) in self.seen.items():
            out[role] = out.get(role, 0.0) + (jiffies - self.base.get(pid, 0)) / self.monitor.tick
        return {k: round(v, 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("--mode", default="fully_async", choices=["sync", "one_step_off", "fully_async"])
    ap.add_argument("--runs", type=int, default=3, help="counted runs, after one warm-up run")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps per run")
    ap.add_argument("--out", default=None, help="JSON path (default: none written)")
    a = ap.parse_args(argv)
    if not os.path.exists("/proc/stat"):
        raise SystemExit("run_cost needs Linux's /proc to count each process's CPU")

    import ray
    import torch

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="run_cost_")
    prompts = os.path.join(workdir, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("a red circle\na blue square\na red square\na blue circle\n")
    counter, results = ProcessCpu(), []
    counter.start()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    time.sleep(3.0)  # the processes it starts, settled
    started = counter.stop()
    log(f"ray.init and 3 s after it: {started} (CPU s)")
    try:
        for i in range(a.runs + 1):
            cfg = load_mode_config(a.mode, [
                f"rollout.prompts={prompts}", f"eval.prompts={prompts}", "rollout.prompt_mix=null",
                "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=4",
                "rollout.sde_window_range=null", "rollout.sde_window_size=0", "rollout.cpus_per_worker=0.25",
                "trainer.cpus_per_worker=0.25", "trainer.micro_batch_size=4", f"trainer.total_steps={a.steps}",
                "trainer.sample_every=0", "trainer.checkpoint_every=0", f"trainer.output_dir={workdir}/run{i}",
                "eval.every=0", "eval.at_start_and_end=false", "logging.progress=false"])
            counter.start()
            t0 = time.perf_counter()
            run_or_exit(cfg)
            wall = time.perf_counter() - t0
            time.sleep(0.5)  # the actors' ends
            cpu = counter.stop()
            row = {"wall_s": round(wall, 2), "cpu_s": cpu, "cpu_total_s": round(sum(cpu.values()), 2)}
            log(f"{'warm-up' if i == 0 else f'run {i}'}: {row}")
            if i:
                results.append(row)
    finally:
        ray.shutdown()
    median = {"wall_s": statistics.median(r["wall_s"] for r in results),
              "cpu_total_s": statistics.median(r["cpu_total_s"] for r in results),
              "cpu_s": {k: statistics.median(r["cpu_s"][k] for r in results) for k in ROLES}}
    log(f"median of {len(results)} {a.mode} runs of {a.steps} steps: {median}")
    summary = {"mode": a.mode, "steps": a.steps, "ray_init_cpu_s": started, "runs": results, "median": median}
    if a.out:
        write_json(a.out, summary)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
