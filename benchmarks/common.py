"""Helpers shared by the benchmark scripts: the command line, configs and Ray, metrics files, results.

Not a library module: the scripts put the repository root on sys.path themselves (like
launch/*.py) and import this file as ``common``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "benchmarks", "results")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- command line and config ------------------------------------------------------------------------
def argument_parser(doc: str, formatter_class=argparse.RawDescriptionHelpFormatter) -> argparse.ArgumentParser:
    """A script's parser from its docstring: the first paragraph describes it, the rest (what it
    measures, example commands) follows the options, so `--help` is all a user needs to run it."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(description=head, epilog=rest or None, formatter_class=formatter_class)

def split_overrides(ap, overrides: list[str], modes) -> tuple[list[str], dict[str, list[str]]]:
    """key=value applies to every run, <mode>:key=value to that mode's; anything else is an argparse error."""
    common, per_mode = [], {m: [] for m in modes}
    for o in overrides:
        head, sep, rest = o.partition(":")
        if sep and head in modes and "=" in rest:
            per_mode[head].append(rest)
        elif "=" in o:
            common.append(o)
        else:
            ap.error(f"{o}: expected key=value or mode:key=value")
    return common, per_mode


def parse_run_overrides(ap, argv):
    """`ap.parse_args`, where a `run` command's key=value overrides may also follow its options
    (`run NAME --seeds 0,1 trainer.lr=3e-4`): they are added to its positional `args`."""
    a, rest = ap.parse_known_args(argv)
    bad = [x for x in rest if x.startswith("-")] if a.cmd == "run" else rest
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    if a.cmd == "run":
        a.args += rest
    return a


def load_mode_config(mode: str, overrides: list[str]):
    from async_flowgrpo.config import ConfigError, load_config

    try:
        return load_config(mode, overrides)
    except ConfigError as e:  # exit 2, as the launchers' config errors
        print(f"config error ({mode}): {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_or_exit(cfg):
    """`modes.run(cfg)` with a signal or a failed run as one line and its exit code, not a
    traceback. A benchmark does not resume: what finished before is in the work dir (--workdir)."""
    from async_flowgrpo.driver.cluster import RunError
    from async_flowgrpo.modes import run
    from async_flowgrpo.stop import Stopped

    try:
        return run(cfg)
    except Stopped as e:
        log(f"stopped by a signal at step {e.step} of {cfg.trainer.output_dir}; no results written")
        raise SystemExit(e.exit_code) from None
    except RunError as e:
        log(f"error in {cfg.trainer.output_dir}: {e}")
        raise SystemExit(1) from None


@contextlib.contextmanager
def session(args, prefix: str):
    """What every benchmark run shares: a work dir (a temp one unless --workdir, removed after),
    one driver thread, the model, Ray with 1 rollout + 1 trainer actor's resources. Yields
    (workdir, model path, model description, resource overrides, machine info)."""
    workdir = args.workdir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(workdir, exist_ok=True)
    try:
        import torch

        torch.set_num_threads(1)  # the driver only orchestrates; leave the cores to the actors
        model, model_desc = resolve_model(args.model, workdir)
        res_overrides, resources = resource_overrides(args.device)
        start_ray(resources, verbose=args.verbose)
        yield workdir, model, model_desc, res_overrides, machine_info(resources)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


# -- model ----------------------------------------------------------------------------------------
def embedded_model_present() -> bool:
    from async_flowgrpo.config import EMBEDDED_MODEL

    return os.path.exists(os.path.join(EMBEDDED_MODEL, "model_index.json"))


def resolve_model(arg: str | None, workdir: str) -> tuple[str, str]:
    """(model.path value, description). auto: the embedded shapes model if shipped, else a tiny
    random model of the same architecture and vocabulary (same compute per step, reward ~flat)."""
    if arg in (None, "", "auto"):
        arg = "embedded" if embedded_model_present() else "tiny"
    if arg == "embedded":
        if not embedded_model_present():
            raise SystemExit("--model embedded: async_flowgrpo/assets/shapes_sd3 is not there (yet); use --model tiny")
        return "embedded", "embedded shapes SD3 (async_flowgrpo/assets/shapes_sd3)"
    if arg == "tiny":
        from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
        from async_flowgrpo.shapes.scenes import vocabulary

        path = os.path.join(workdir, "tiny_sd3")
        if not os.path.exists(os.path.join(path, "model_index.json")):
            make_tiny_model_dir(path, vocab=vocabulary())
        return path, "tiny random SD3 (embedded architecture and vocabulary, random weights)"
    if not os.path.isdir(arg):
        raise SystemExit(f"--model: not a directory: {arg}")
    return arg, arg


# -- resources ------------------------------------------------------------------------------------
def resource_overrides(device: str) -> tuple[list[str], dict]:
    """1 rollout + 1 trainer actor. CPU: one core each (ray.num_cpus=2). GPU: one GPU each when
    there are two or more, else both on the one GPU (0.5 each: no real overlap on its compute)."""
    import torch

    n_gpus = torch.cuda.device_count() if device in ("auto", "gpu") else 0
    if device == "gpu" and n_gpus == 0:
        raise SystemExit("--device gpu: no CUDA device visible")
    if n_gpus == 0:
        return (
            ["ray.num_cpus=2", "ray.num_gpus=0", "rollout.cpus_per_worker=1", "trainer.cpus_per_worker=1",
             "rollout.gpus_per_worker=0", "trainer.gpus_per_worker=0"],
            {"num_cpus": 2, "num_gpus": 0, "device": "cpu"},
        )
    per = 1.0 if n_gpus >= 2 else 0.5
    cpus = max(2, (os.cpu_count() or 2))
    per_cpu = max(1, cpus // 2 - 1)
    return (
        [f"ray.num_cpus={cpus}", f"ray.num_gpus={min(n_gpus, 2)}", f"rollout.cpus_per_worker={per_cpu}",
         f"trainer.cpus_per_worker={per_cpu}", f"rollout.gpus_per_worker={per}", f"trainer.gpus_per_worker={per}"],
        {"num_cpus": cpus, "num_gpus": min(n_gpus, 2), "device": "cuda"},
    )


def start_ray(resources: dict, verbose: bool = False) -> None:
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address="local",
        num_cpus=resources["num_cpus"],
        num_gpus=resources["num_gpus"],
        include_dashboard=False,
        log_to_driver=verbose,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}},
    )


def machine_info(resources: dict | None = None) -> dict:
    import torch

    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if resources:
        info["resources"] = resources
    return info


# -- metrics.jsonl --------------------------------------------------------------------------------
def open_metrics(path: str):
    """A metrics.jsonl for reading, or its gzip archive (path + ".gz": what prune_run_outputs keeps)."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_metrics(output_dir: str) -> list[dict]:
    """Rows of a run's metrics.jsonl (or .jsonl.gz), the last line per step (a resumed run appends)."""
    by_step: dict[int, dict] = {}
    with open_metrics(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def archive_metrics(out: str) -> None:
    """Replace a finished run's metrics.jsonl by metrics.jsonl.gz (an eighth of the size: the
    committed results stay small enough to clone and to carry to a GPU machine)."""
    path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(path):
        with open(path, "rb") as src, gzip.open(path + ".gz.tmp", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        os.replace(path + ".gz.tmp", path + ".gz")
        os.remove(path)


def _weighted(rows: list[dict], prev: dict, key: str) -> float | None:
    """Time-weighted mean of a per-step windowed fraction over rows (each row covers
    (previous row's time_s, its time_s])."""
    total = acc = 0.0
    t_prev = prev["time_s"]
    for r in rows:
        dt = r["time_s"] - t_prev
        t_prev = r["time_s"]
        if key in r and r[key] is not None:
            total += dt
            acc += dt * r[key]
    return acc / total if total > 0 else None


def steady_state(rows: list[dict], warmup: int) -> dict:
    """Throughput and shares between the row of step `warmup` and the last row.

    samples_per_s = consumed-samples difference / time_s difference (excludes actor start-up and
    the warm-up steps); sync_time_frac = sum of the per-step sync/time_s over the same time;
    idle fractions are time-weighted means of the per-step windows after the warm-up row.
    """
    rows = [r for r in rows if "samples/consumed" in r]  # trainer steps, not a step-0 evaluation row
    if len(rows) < warmup + 2:
        raise ValueError(f"need more than warmup + 1 = {warmup + 1} steps, got {len(rows)}")
    w = rows[warmup - 1] if warmup > 0 else None
    after = rows[warmup:]
    last = rows[-1]
    if w is None:  # no warm-up: from the start of the run (actor start-up is never in time_s)
        w = {"time_s": 0.0, "samples/consumed": 0, "sync/time_s": 0.0, "sync/bytes": 0.0}
    dt = last["time_s"] - w["time_s"]
    sync_s = sum(r.get("sync/time_s", 0.0) for r in after)  # each row: that step's publication, 0 if none
    out = {
        "steps_measured": len(after),
        "seconds_measured": dt,
        "samples_measured": last["samples/consumed"] - w["samples/consumed"],
        "samples_per_s": (last["samples/consumed"] - w["samples/consumed"]) / dt,
        "step_time_s": dt / len(after),
        "sync_time_frac": sync_s / dt,
        "sync_time_per_step_s": sync_s / len(after),
        "trainer_idle_frac": _weighted(after, w, "perf/trainer_idle_frac"),
        "rollout_idle_frac": _weighted(after, w, "perf/rollout_idle_frac"),
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in after) / len(after),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in after),
        "train_time_per_step_s": _mean([r.get("train/time_s") for r in after]),
        "queue_size_last": last.get("queue/size"),
        "reward_mean": _mean([r.get("reward/mean") for r in after]),
    }
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def set_group_advantages(groups, a) -> "torch.Tensor":
    """In-process training (no driver): each group's `advantages` from the batch's rewards, as the
    driver's make_batch computes them (algorithm config `a`). Returns the batch's rewards."""
    import torch

    from async_flowgrpo import algo

    rewards = torch.cat([g.rewards for g in groups])
    group_ids = torch.cat([torch.full((g.size,), i) for i, g in enumerate(groups)])
    advantages, _ = algo.group_advantages(rewards, group_ids, global_std=a.global_std, mean_only=a.mean_only)
    for i, g in enumerate(groups):
        g.advantages = advantages[group_ids == i]
    return rewards


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(path + ".tmp", path)


# -- CPU accounting (Linux /proc) -----------------------------------------------------------------
class CpuMonitor:
    """Who used the CPUs: this driver's Ray actors by role, Ray's own processes, everyone else.

    A snapshot reads utime+stime of every process and the machine totals from /proc; the
    difference of two snapshots, in cores (CPU seconds / wall seconds), says e.g. whether the
    rollout actor had a whole core while it was busy, or whether other jobs took the machine.
    Processes descending from this driver are ours (ray.init starts the raylet, which starts the
    workers); actors are told apart by the process title Ray gives them.
    """

    ROLES = (("RolloutActor", "rollout"), ("TrainerActor", "trainer"), ("QueueActor", "queue"))

    def __init__(self, root_pid: int | None = None):
        self.root = root_pid or os.getpid()
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = os.path.exists("/proc/stat")

    @staticmethod
    def _stat(pid: str) -> tuple[int, int] | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
        except OSError:
            return None
        rest = s[s.rfind(")") + 2 :].split()  # fields after "(comm)": state ppid ... utime(12) stime(13)
        return int(rest[1]), int(rest[11]) + int(rest[12])

    @staticmethod
    def _cmdline(pid: str) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def snapshot(self) -> dict:
        t = time.perf_counter()
        if not self.available:
            return {"t": t}
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        procs = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                st = self._stat(pid)
                if st is not None:
                    procs[pid] = st
        # descendants of the driver
        children: dict[str, list[str]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(str(ppid), []).append(pid)
        ours, todo = set(), [str(self.root)]
        while todo:
            p = todo.pop()
            if p not in ours:
                ours.add(p)
                todo += children.get(p, [])
        classes = {}
        for pid, (_, jiffies) in procs.items():
            if pid == str(self.root):
                cls = "driver"
            elif pid in ours:
                cmd = self._cmdline(pid)
                cls = next((role for key, role in self.ROLES if key in cmd), "ray_system")
            else:
                cls = "other"
            classes[pid] = (cls, jiffies)
        return {"t": t, "machine": (sum(vals) - idle, sum(vals)), "procs": classes}

    def cores(self, a: dict, b: dict) -> dict | None:
        """CPU used between two snapshots, in cores, per class; plus the machine's busy cores."""
        if "machine" not in a or "machine" not in b:
            return None
        dt = b["t"] - a["t"]
        if dt <= 0:
            return None
        out: dict[str, float] = {}
        for pid, (cls, j) in b["procs"].items():
            j0 = a["procs"].get(pid, (None, 0))[1]
            out[cls] = out.get(cls, 0.0) + max(0, j - j0) / self.tick / dt
        busy = b["machine"][0] - a["machine"][0]
        total = b["machine"][1] - a["machine"][1]
        n = os.cpu_count() or 1
        out["machine_busy"] = n * busy / total if total else None
        out["cpu_count"] = n
        out["seconds"] = dt
        for k in ("rollout", "trainer", "queue", "ray_system", "driver", "other"):
            out.setdefault(k, 0.0)
        return out


class RunCpuSampler:
    """Samples CpuMonitor every `interval` s in a thread while a mode runs, with the number of
    metrics.jsonl rows written so far, so the steady-state window (rows warmup..last) can be cut
    out afterwards."""

    def __init__(self, metrics_path: str, interval: float = 1.0):
        import threading

        self.monitor = CpuMonitor()
        self.path, self.interval = metrics_path, interval
        self.samples: list[tuple[int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _rows(self) -> int:
        try:
            with open(self.path) as f:
                return sum(1 for line in f if line.strip())
        except OSError:
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((self._rows(), self.monitor.snapshot()))
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.monitor.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def window(self, first_row: int, last_row: int) -> dict | None:
        """Cores used from the first sample with >= first_row rows to the last one with < last_row."""
        start = next((s for n, s in self.samples if n >= first_row), None)
        end = next((s for n, s in reversed(self.samples) if n < last_row), None)
        if start is None or end is None or end["t"] - start["t"] < 2 * self.interval:
            return None
        return self.monitor.cores(start, end)


def prune_run_outputs(out: str) -> None:
    """What a benchmark keeps of a finished run: no checkpoints (MBs of weights), no lock, the
    metrics gzipped, and of the sample grids only the first and last evaluation's."""
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    archive_metrics(out)
    if os.path.exists(os.path.join(out, ".lock")):
        os.remove(os.path.join(out, ".lock"))
    samples = os.path.join(out, "samples")
    if not os.path.isdir(samples):
        return
    grids = sorted(f for f in os.listdir(samples) if f.startswith("eval_"))
    for f in os.listdir(samples):
        if f not in grids[:1] + grids[-1:]:
            os.remove(os.path.join(samples, f))
