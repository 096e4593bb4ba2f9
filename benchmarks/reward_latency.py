#!/usr/bin/env python
"""Reward latency benchmark: how much a slow reward costs each mode, with reward.overlap on and off.

The reward is a local scoring service (an HTTP server in this process) that sleeps a set time and
uses no CPU: a stand-in for a remote judge. ``--reward remote`` (default): the `remote` reward's
JSON protocol, one request per group, its sleep proportional to the group's images.
``--reward vlm_judge``: an OpenAI-compatible chat endpoint for `vlm_judge`, one request per image
(a group's requests in flight at once), each sleeping the group's time. Its time per group is
set to a multiple (``--ratios``, default 0.5 and 1) of the time a rollout worker takes to generate
a group, measured first with a zero-latency service.

Phases (one local Ray cluster, 1 rollout + 1 trainer actor):

1. Generation time per group: batches generated back to back (``Run.batches``), zero-latency reward.
2. Each mode runs ``--steps`` steps per setting: each ratio with overlap on and off (fully_async
   also with a zero-latency reward, the reference of its target); settings and modes interleaved, the whole round ``--repeats`` times (the
   machine is shared and drifts). Steady-state samples/s from metrics.jsonl after ``--warmup``
   steps (`common.steady_state`), with the mean reward/latency_s and perf/reward_wait_frac.

Printed: samples/s per mode and setting (mean and spread over the repeats), the overlap speed-up at
each ratio, and the share of the zero-latency rate kept. Targets: fully_async with overlap >= 1.6x
without it at ratio 1; >= 0.9x the zero-latency rate at ratio 0.5.

Writes ``benchmarks/results/reward_latency.json``.

    python benchmarks/reward_latency.py                                # CPU, 2 cores: ~15 min
    python benchmarks/reward_latency.py --repeats 1 --modes fully_async --ratios 1

Overrides are ``key=value`` (every run) or ``<mode>:key=value`` (that mode only).
"""

from __future__ import annotations

import http.server
import json
import os
import random
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets HF_HUB_OFFLINE / RAY_AUTH_MODE before ray is imported)
from common import RESULTS, argument_parser, log  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async")
TARGET_SPEEDUP_AT_1 = 1.6
TARGET_KEPT_AT_HALF = 0.9

# Generation is the side a reward stalls: training is kept cheap (one trained step per sample), so
# the rollout worker is the bottleneck in the pipelined modes and the reward's cost shows in full.
DEFAULTS = [
    "rollout.group_size=4",
    "rollout.groups_per_step=4",
    "rollout.num_steps=8",
    "rollout.sde_window_range=null",
    "rollout.sde_window_size=1",
    "trainer.micro_batch_size=16",
    "trainer.sample_every=0",
    "trainer.checkpoint_every=0",
    "eval.every=0",
    "eval.at_start_and_end=false",
    "logging.progress=false",
    "sync.timeout_s=600",
    "reward.weights={remote: 1.0}",
]


def parse_args(argv):
    ap = argument_parser(__doc__)
    ap.add_argument("--steps", type=int, default=8, help="trainer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the steady state")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every setting, interleaved")
    ap.add_argument("--ratios", default="0.5,1", help="reward time per group / generation time per group")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model", default="auto", help="auto | embedded | tiny | a model directory")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "reward_latency.json"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--reward", default="remote", choices=["remote", "vlm_judge"], help="the reward the service stands behind")
    ap.add_argument("overrides", nargs="*", help="key=value or <mode>:key=value")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    args.ratios = [float(r) for r in args.ratios.split(",") if r]
    args.common, args.per_mode = common.split_overrides(ap, args.overrides, MODES)
    if args.steps < args.warmup + 2:
        ap.error("--steps must be at least --warmup + 2")
    return args


class ScoringService:
    """The reward's server: a group costs `seconds_per_group` (the remote protocol's request of n
    images sleeps n / group_size of it; a chat request, one image of a group sent at once, all of
    it), then random scores."""

    def __init__(self, reward: str = "remote", group_size: int = 1):
        self.seconds_per_group, self.reward, self.group_size = 0.0, reward, group_size
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/chat/completions"):  # vlm_judge: one image
                    time.sleep(service.seconds_per_group)
                    reply = {"role": "assistant", "content": f"Score: {random.randint(0, 10)}"}
                    data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                       "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}).encode()
                else:
                    n = len(body["prompts"])
                    time.sleep(service.seconds_per_group * n / service.group_size)
                    data = json.dumps({"scores": [random.random() for _ in range(n)]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the run ended (its actors killed) while this group was scored

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def overrides(self) -> list[str]:
        if self.reward == "vlm_judge":
            base_url = self.url.removesuffix("/score") + "/v1"
            return ["reward.weights={vlm_judge: 1.0}",
                    f"reward.options={{vlm_judge: {{base_url: '{base_url}', model: fake-judge, retries: 0}}}}"]
        return [f"reward.options={{remote: {{url: '{self.url}', retries: 0}}}}"]


def measure_generation(overrides: list[str], output_dir: str, batches: int = 3) -> dict:
    """Seconds per group, generated back to back with a zero-latency reward (after one warm-up batch)."""
    from async_flowgrpo.driver.run import Run

    cfg = common.load_mode_config("sync", overrides + [f"trainer.output_dir={output_dir}"])
    p = Run(cfg)
    try:
        p.batches.collect(p.batches.start(cfg.rollout.groups_per_step))
        times = []
        for _ in range(batches):
            t = time.perf_counter()
            p.batches.collect(p.batches.start(cfg.rollout.groups_per_step))
            times.append((time.perf_counter() - t) / cfg.rollout.groups_per_step)
    finally:
        p.shutdown()
    return {"seconds_per_group": sum(times) / len(times), "samples": times, "group_size": cfg.rollout.group_size}


def run_setting(mode: str, overrides: list[str], output_dir: str, warmup: int) -> dict:
    shutil.rmtree(output_dir, ignore_errors=True)
    cfg = common.load_mode_config(mode, overrides + [f"trainer.output_dir={output_dir}"])
    common.run_or_exit(cfg)
    rows = common.read_metrics(output_dir)
    out = common.steady_state(rows, warmup)
    after = rows[warmup:]
    for key in ("reward/latency_s", "perf/reward_wait_frac"):
        out[key] = common._mean([r.get(key) for r in after])
    return out


def spread(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    return {"mean": mean, "min": min(values), "max": max(values), "runs": values}


def summarize(runs: dict, ratios: list[float]) -> dict:
    """Per mode: samples/s per setting; overlap speed-up per ratio; the zero-latency rate kept."""
    out = {}
    for mode, settings in runs.items():
        rates = {name: spread([r["samples_per_s"] for r in rs]) for name, rs in settings.items()}
        m = {"samples_per_s": rates}
        for ratio in ratios:
            on, off = rates[f"{ratio:g}x_overlap"]["mean"], rates[f"{ratio:g}x_blocking"]["mean"]
            m[f"speedup_{ratio:g}x"] = on / off
            if "zero_latency" in rates:
                m[f"kept_{ratio:g}x"] = on / rates["zero_latency"]["mean"]
        out[mode] = m
    return out


def print_table(summary: dict, ratios: list[float]) -> None:
    names = ["zero_latency"] + [f"{r:g}x_{k}" for r in ratios for k in ("blocking", "overlap")]
    print("\nsamples/s (mean [min, max] over repeats)")
    print(f"{'mode':<14}" + "".join(f"{n:>22}" for n in names) + "".join(f"{'speed-up ' + format(r, 'g') + 'x':>14}" for r in ratios))
    for mode, m in summary.items():
        rates = m["samples_per_s"]
        cells = [f"{rates[n]['mean']:.2f} [{rates[n]['min']:.2f}, {rates[n]['max']:.2f}]" if n in rates else "-" for n in names]
        print(f"{mode:<14}" + "".join(f"{c:>22}" for c in cells) + "".join(f"{m[f'speedup_{r:g}x']:>14.2f}" for r in ratios))
    fa = summary.get("fully_async")
    if fa and 1.0 in ratios and 0.5 in ratios:
        print(f"fully_async: overlap/blocking at 1x {fa['speedup_1x']:.2f} (target >= {TARGET_SPEEDUP_AT_1}); "
              f"overlap at 0.5x keeps {fa['kept_0.5x']:.2f} of the zero-latency rate (target >= {TARGET_KEPT_AT_HALF})")


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    service = ScoringService(args.reward)
    with common.session(args, "reward_latency_") as (workdir, model, model_desc, res_overrides, machine):
        base = [f"model.path={model}", f"trainer.total_steps={args.steps}", *DEFAULTS, *res_overrides,
                *service.overrides(), *args.common]
        log(f"model: {model_desc}; generation time per group, zero-latency reward")
        gen = measure_generation(base, os.path.join(workdir, "generation"))
        g, service.group_size = gen["seconds_per_group"], gen["group_size"]
        log(f"  {g:.2f} s per group of {gen['group_size']}")
        settings = {"zero_latency": (0.0, True)}
        for ratio in args.ratios:
            settings[f"{ratio:g}x_blocking"] = (ratio, False)
            settings[f"{ratio:g}x_overlap"] = (ratio, True)
        # the zero-latency reference only where a target uses it
        runs: dict = {m: {name: [] for name in settings if m == "fully_async" or name != "zero_latency"} for m in args.modes}
        for rep in range(args.repeats):
            for name, (ratio, overlap) in settings.items():
                for mode in [m for m in args.modes if name in runs[m]]:  # interleaved: drift spreads over every setting alike
                    service.seconds_per_group = ratio * g
                    overrides = [*base, f"reward.overlap={str(overlap).lower()}", *args.per_mode[mode]]
                    r = run_setting(mode, overrides, os.path.join(workdir, f"{mode}_{name}_{rep}"), args.warmup)
                    runs[mode][name].append(r)
                    log(f"[{rep + 1}/{args.repeats}] {mode:<13} {name:<13} {r['samples_per_s']:.2f} samples/s, "
                        f"reward latency {r['reward/latency_s'] or 0:.2f} s, reward wait {r['perf/reward_wait_frac'] or 0:.2f}")
        summary = summarize(runs, args.ratios)
    print_table(summary, args.ratios)
    result = {
        "command": " ".join(["python", "benchmarks/reward_latency.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "note": "shared machine: other engineers' tests ran meanwhile; settings and modes interleaved",
        "model": model_desc,
        "reward": args.reward,
        "overrides": base[1:],
        "generation": gen,
        "settings": {n: {"ratio": r, "overlap": o} for n, (r, o) in settings.items()},
        "summary": summary,
        "runs": runs,
        "targets": {"fully_async_speedup_1x": TARGET_SPEEDUP_AT_1, "fully_async_kept_0.5x": TARGET_KEPT_AT_HALF},
        "wall_s": time.perf_counter() - t_start,
    }
    common.write_json(args.out, result)
    log(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
