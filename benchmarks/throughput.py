#!/usr/bin/env python
"""Throughput benchmark: sync, one_step_off and fully_async on the same model, prompts, batch and
resources in one invocation, against the ideal pipelined bound.

Phases (one local Ray cluster for all of them):

1. Capacity, each side measured alone, on one Run (1 rollout + 1 trainer actor):
   rollout capacity = batches generated back to back (``Run.batches.start`` + ``collect``)
   while the trainer idles; train capacity = ``Run.train`` repeated on one fixed
   pre-generated batch (advantages recomputed each call) while the rollout actor idles; also the
   cost of one weight publication. The ideal pipelined bound is min(rollout, train capacity);
   the ideal *sequential* rate (what sync can reach) is 1 / (1/rollout + 1/train).
   Balancing: unless ``rollout.sde_window_size`` is given, the number of trained denoising steps
   per sample (the SDE window, as in Flow-GRPO-Fast) is adjusted until train time per batch is
   within ±15% of rollout time per batch (at most two re-measurements), since the speed-up of
   pipelining is largest, (R + T) / max(R, T) -> 2, when the two costs are equal.
2. Each mode runs ``--steps`` trainer steps with those settings, ``--repeats`` times, the modes
   interleaved (sync, one_step_off, fully_async, sync, ...) and averaged: on a small VM the
   speed of the same run drifts by +-10% within minutes. Steady state is read from its
   metrics.jsonl between the row of step ``--warmup`` and the last row (actor start-up and the
   first steps excluded): samples/s = consumed-samples difference / time_s difference; the
   share of time in weight sync from the per-step sync/time_s; idle fractions time-weighted over the per-step windows; mean
   staleness; and, from /proc, the cores each actor, Ray's own processes and other jobs used.

Printed: both costs, a table of each mode's samples/s, speed-up over sync, efficiency
(throughput / bound), idle fractions, staleness, sync share, and for the pipelined modes the
targets (fully_async >= 0.90 of the bound, one_step_off >= 0.85, >= 1.8x over sync) with a
decomposition of any shortfall: contention (each side slower when both run than alone), idle
bubbles on the bottleneck side, weight sync, and the cores each actor actually got while busy.

Writes ``benchmarks/results/throughput.json`` and ``benchmarks/results/throughput.png``.

    python benchmarks/throughput.py                                  # CPU, 2 cores: ~7 min on a quiet machine
    python benchmarks/throughput.py --steps 20 --warmup 4 rollout.group_size=16
    python benchmarks/throughput.py --modes one_step_off,fully_async fully_async:algorithm.max_staleness=2

Overrides are ``key=value`` (applied to every mode and to the capacity measurement) or
``<mode>:key=value`` (that mode only).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets HF_HUB_OFFLINE / RAY_AUTH_MODE before ray is imported)
from common import RESULTS, argument_parser, log  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async")
TARGETS = {"fully_async": 0.90, "one_step_off": 0.85}
SPEEDUP_TARGET = 1.8
BALANCE_TOL = 0.15

# Chosen on the 2-core CPU machine (1 rollout + 1 trainer actor, one core each, embedded model
# size, batch 8 x 4 = 32 samples, 10 denoising steps): training 6 of the 9 trainable steps costs
# about as much as generating the batch (train/rollout 0.8 at 5, 0.9-0.95 at 6, 1.2 at 7 under
# load). The capacity phase re-balances when this machine differs.
DEFAULTS = [
    "rollout.group_size=8",
    "rollout.groups_per_step=4",
    "rollout.num_steps=10",
    "rollout.sde_window_range=null",  # the window size is what balancing tunes; let it start anywhere
    "trainer.micro_batch_size=16",
    "trainer.mini_batches=1",
    "trainer.sample_every=0",
    "trainer.checkpoint_every=0",
    "eval.every=0",
    "eval.at_start_and_end=false",
    "logging.progress=false",
    "logging.wandb_mode=disabled",
    "sync.timeout_s=600",
]
DEFAULT_WINDOW_FRACTION = 2 / 3  # of the num_steps - 1 trainable steps: 6 of 9


def parse_args(argv):
    ap = argument_parser(__doc__)
    ap.add_argument("--model", default="auto", help="auto (embedded if shipped, else tiny) | embedded | tiny | a diffusers dir")
    ap.add_argument("--steps", type=int, default=20, help="trainer steps per mode (default 20)")
    ap.add_argument("--warmup", type=int, default=4, help="steps excluded from the steady state (default 4)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of modes (default all three)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="auto: GPUs when present")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved; the mean is reported (default 2)")
    ap.add_argument("--capacity-batches", type=int, default=3, help="timed batches per capacity measurement")
    ap.add_argument("--no-balance", action="store_true", help="keep the SDE window as given (default: balance)")
    ap.add_argument("--no-recheck", action="store_true", help="skip re-measuring the capacities after each round of modes")
    ap.add_argument("--out", default=RESULTS, help="results directory (default benchmarks/results)")
    ap.add_argument("--workdir", default=None, help="run outputs (default: a temp dir, removed afterwards)")
    ap.add_argument("--verbose", action="store_true", help="show the actors' logs")
    ap.add_argument("overrides", nargs="*", help="key=value (every mode) or mode:key=value (one mode)")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    if args.steps < args.warmup + 2:
        ap.error("--steps must be >= --warmup + 2")
    args.common, args.per_mode = common.split_overrides(ap, args.overrides, MODES)
    return args


def dedupe(overrides: list[str]) -> list[str]:
    """Keep the last value of each key (later overrides win anyway; this keeps printouts honest)."""
    last = {o.split("=", 1)[0].strip(): i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0].strip()] == i]


def given(overrides: list[str], key: str) -> bool:
    return any(o.split("=", 1)[0].strip() == key for o in overrides)


# -- phase 1: capacities -------------------------------------------------------------------------
def measure_capacity(overrides: list[str], output_dir: str, batches: int) -> dict:
    """Rollout alone, then training alone, then weight publication, on one Run."""
    import torch

    from async_flowgrpo.driver.run import Run

    cfg = common.load_mode_config("sync", overrides + [f"trainer.output_dir={output_dir}"])
    t0 = time.perf_counter()
    p = Run(cfg)
    gps = cfg.rollout.groups_per_step
    startup = time.perf_counter() - t0
    cpu = common.CpuMonitor()
    try:
        groups = p.batches.collect(p.batches.start(gps))  # warm-up (first-call allocations, caches)
        rollout_s = []
        a = cpu.snapshot()
        for _ in range(batches):
            t = time.perf_counter()
            groups = p.batches.collect(p.batches.start(gps))
            rollout_s.append(time.perf_counter() - t)
        cpu_rollout = cpu.cores(a, cpu.snapshot())
        samples = sum(g.size for g in groups)
        p.train(groups)  # warm-up
        train_s, learner_s = [], []
        a = cpu.snapshot()
        for _ in range(batches):
            t = time.perf_counter()
            m = p.train(groups)
            train_s.append(time.perf_counter() - t)
            learner_s.append(m.get("train/time_s", float("nan")))
        cpu_train = cpu.cores(a, cpu.snapshot())
        sync_s = []
        for _ in range(3):
            sync_s.append(p.publish_weights()["sync/time_s"])
        reward = torch.cat([g.rewards for g in groups])
    finally:
        p.shutdown()
    r, t = sum(rollout_s) / len(rollout_s), sum(train_s) / len(train_s)
    return {
        "samples_per_batch": samples,
        "rollout_s_per_batch": r,
        "train_s_per_batch": t,
        "learner_s_per_batch": sum(learner_s) / len(learner_s),
        "rollout_s_samples": rollout_s,
        "train_s_samples": train_s,
        "sync_s": sorted(sync_s)[len(sync_s) // 2],
        "rollout_capacity": samples / r,
        "train_capacity": samples / t,
        "train_over_rollout": t / r,
        "pipeline_startup_s": startup,
        "reward_mean": reward.float().mean().item(),
        "reward_std": reward.float().std().item(),
        "cpu_rollout_alone": cpu_rollout,  # cores used per process class while only the rollout actor worked
        "cpu_train_alone": cpu_train,
    }


def balanced_capacity(args, base: list[str], workdir: str) -> tuple[dict, list[str], list[dict]]:
    """Measure; unless the window was given, adjust rollout.sde_window_size toward T == R."""
    cfg = common.load_mode_config("sync", base)
    num_steps = cfg.rollout.num_steps
    fixed = args.no_balance or given(args.common, "rollout.sde_window_size")
    window = cfg.rollout.sde_window_size or num_steps - 1
    tried: list[dict] = []
    extra = [] if given(args.common, "rollout.sde_window_size") else [f"rollout.sde_window_size={window}"]
    for attempt in range(3):
        overrides = base + extra
        log(f"capacity: rollout alone, then training alone ({args.capacity_batches} batches each), window {window}/{num_steps - 1}")
        cap = measure_capacity(overrides, os.path.join(workdir, f"capacity_{attempt}"), args.capacity_batches)
        cap["sde_window_size"] = window
        tried.append(cap)
        log(
            f"  rollout {cap['rollout_s_per_batch']:.2f} s/batch ({cap['rollout_capacity']:.2f} samples/s), "
            f"train {cap['train_s_per_batch']:.2f} s/batch ({cap['train_capacity']:.2f} samples/s), "
            f"train/rollout {cap['train_over_rollout']:.2f}, weight sync {cap['sync_s'] * 1e3:.0f} ms"
        )
        ratio = cap["train_over_rollout"]
        if fixed or abs(ratio - 1) <= BALANCE_TOL or attempt == 2:
            break
        # train time ~ proportional to the trained steps; rollout time hardly depends on them
        new = min(num_steps - 1, max(1, round(window / ratio)))
        if new == window or any(c["sde_window_size"] == new for c in tried):
            break
        window = new
        extra = [f"rollout.sde_window_size={window}"]
    best = min(tried, key=lambda c: abs(c["train_over_rollout"] - 1)) if not fixed else tried[-1]
    chosen = [] if given(args.common, "rollout.sde_window_size") else [f"rollout.sde_window_size={best['sde_window_size']}"]
    return best, chosen, tried


def combine(caps: list[dict]) -> dict:
    """Mean per-batch times of several capacity measurements (same settings)."""
    out = dict(caps[-1] if len(caps) > 1 else caps[0])
    for k in ("rollout_s_per_batch", "train_s_per_batch", "learner_s_per_batch", "sync_s"):
        out[k] = sum(c[k] for c in caps) / len(caps)
    n = caps[0]["samples_per_batch"]
    out["rollout_capacity"] = n / out["rollout_s_per_batch"]
    out["train_capacity"] = n / out["train_s_per_batch"]
    out["train_over_rollout"] = out["train_s_per_batch"] / out["rollout_s_per_batch"]
    out["rollout_s_samples"] = [x for c in caps for x in c["rollout_s_samples"]]
    out["train_s_samples"] = [x for c in caps for x in c["train_s_samples"]]
    out["measurements"] = len(caps)
    # drift: largest relative deviation of one measurement's per-batch time from the mean
    out["drift"] = max(abs(c[k] / out[k] - 1) for c in caps for k in ("rollout_s_per_batch", "train_s_per_batch"))
    return out


# -- phase 2: the modes --------------------------------------------------------------------------
def run_mode(mode: str, overrides: list[str], output_dir: str, warmup: int) -> dict:
    shutil.rmtree(output_dir, ignore_errors=True)  # metrics.jsonl appends
    cfg = common.load_mode_config(mode, overrides + [f"trainer.output_dir={output_dir}"])
    t0 = time.perf_counter()
    with common.RunCpuSampler(os.path.join(output_dir, "metrics.jsonl")) as sampler:
        common.run_or_exit(cfg)
    wall = time.perf_counter() - t0
    rows = common.read_metrics(output_dir)
    out = common.steady_state(rows, warmup)
    out["cpu"] = sampler.window(warmup, len(rows))  # cores per process class over the steady state
    out["wall_s"] = wall
    out["steps"] = len(rows)
    out["max_staleness"] = cfg.algorithm.max_staleness
    out["per_step"] = [
        {k: r.get(k) for k in ("step", "time_s", "samples/consumed", "staleness/mean", "sync/time_s", "train/time_s",
                                "perf/trainer_idle_frac", "perf/rollout_idle_frac", "queue/size")}
        for r in rows
    ]
    return out


def merge_runs(rs: list[dict]) -> dict:
    """Mean over repeated runs of one mode (each its own steady state); the runs are kept."""
    out: dict = {}
    for k, v in rs[0].items():
        vals = [r[k] for r in rs]
        if k in ("per_step",):
            continue
        if k == "cpu":
            ok = [c for c in vals if c]
            out[k] = {ck: sum(c[ck] for c in ok) / len(ok) for ck in ok[0]} if ok else None
        elif k == "staleness_max":
            out[k] = max(vals)
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = sum(vals) / len(vals)
        else:
            out[k] = vals[-1]
    rates = [r["samples_per_s"] for r in rs]
    out["samples_per_s_runs"] = rates
    out["samples_per_s_spread"] = (max(rates) - min(rates)) / 2 / out["samples_per_s"]  # half-range, relative
    out["runs"] = rs
    return out


def diagnose(mode: str, m: dict, cap: dict) -> dict:
    """Split a pipelined mode's per-step time into what the bound assumes and what it does not."""
    spb = cap["samples_per_batch"]
    step = spb / m["samples_per_s"]  # seconds per batch of consumed samples, steady state
    ideal = spb / min(cap["rollout_capacity"], cap["train_capacity"])
    trainer_busy = (1 - (m["trainer_idle_frac"] or 0)) * step
    rollout_busy = (1 - (m["rollout_idle_frac"] or 0)) * step
    d = {
        "step_s": step,
        "ideal_step_s": ideal,
        "trainer_busy_s": trainer_busy,
        "rollout_busy_s": rollout_busy,
        "train_alone_s": cap["train_s_per_batch"],
        "rollout_alone_s": cap["rollout_s_per_batch"],
        # > 1: each side is slower while the other runs (shared cores, memory bandwidth, Ray's own processes)
        "train_slowdown": (m["train_time_per_step_s"] or float("nan")) / cap["learner_s_per_batch"],
        "rollout_slowdown": rollout_busy / cap["rollout_s_per_batch"],
        "sync_s": m["sync_time_per_step_s"],
    }
    bottleneck = "rollout" if rollout_busy >= trainer_busy else "trainer"
    d["bottleneck"] = bottleneck
    busy = rollout_busy if bottleneck == "rollout" else trainer_busy
    alone = cap["rollout_s_per_batch"] if bottleneck == "rollout" else cap["train_s_per_batch"]
    d["lost_to_contention_s"] = max(0.0, busy - alone)
    d["lost_to_idle_s"] = max(0.0, step - busy)
    d["lost_to_imbalance_s"] = max(0.0, alone - ideal)
    cpu = m.get("cpu")
    if cpu:
        # cores each actor actually got while it was busy (1.0 = a whole core, as when measured alone)
        d["rollout_cores_while_busy"] = cpu["rollout"] / max(1 - (m["rollout_idle_frac"] or 0), 1e-9)
        d["trainer_cores_while_busy"] = cpu["trainer"] / max(1 - (m["trainer_idle_frac"] or 0), 1e-9)
        d["other_processes_cores"] = cpu["other"]
        d["ray_overhead_cores"] = cpu["ray_system"] + cpu["queue"] + cpu["driver"]
        d["machine_busy_cores"] = cpu["machine_busy"]
    return d


def why(mode: str, d: dict) -> str:
    loss = d["step_s"] - d["ideal_step_s"]
    parts = [
        f"{d['step_s']:.2f} s/batch vs ideal {d['ideal_step_s']:.2f} (+{loss:.2f} s); bottleneck: {d['bottleneck']}",
        f"contention +{d['lost_to_contention_s']:.2f} s (train x{d['train_slowdown']:.2f}, rollout x{d['rollout_slowdown']:.2f} "
        f"slower than alone)",
        f"bottleneck idle +{d['lost_to_idle_s']:.2f} s",
        f"weight sync {d['sync_s']:.3f} s/step",
    ]
    if "rollout_cores_while_busy" in d:
        parts.append(
            f"CPU while busy: rollout {d['rollout_cores_while_busy']:.2f} cores, trainer {d['trainer_cores_while_busy']:.2f}; "
            f"Ray/driver/queue {d['ray_overhead_cores']:.2f}; other jobs {d['other_processes_cores']:.2f} of {os.cpu_count()} cores"
        )
    if d["lost_to_imbalance_s"] > 0.01:
        parts.append(f"the bottleneck side is the slower one alone too (+{d['lost_to_imbalance_s']:.2f} s)")
    return "; ".join(parts)


# -- output --------------------------------------------------------------------------------------
def fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def print_table(result: dict) -> None:
    cap = result["capacity"]
    print()
    print(f"model: {result['model']}   device: {result['machine']['resources']['device']}   "
          f"batch: {cap['samples_per_batch']} samples   settings: {' '.join(result['settings'])}")
    print(f"rollout alone: {cap['rollout_s_per_batch']:.2f} s/batch = {result['rollout_capacity']:.2f} samples/s   "
          f"train alone: {cap['train_s_per_batch']:.2f} s/batch = {result['train_capacity']:.2f} samples/s   "
          f"(train/rollout {cap['train_over_rollout']:.2f})   weight sync {cap['sync_s'] * 1e3:.0f} ms")
    print(f"bound min(rollout, train) = {result['bound']:.2f} samples/s   sequential 1/(1/R+1/T) = {result['sequential_bound']:.2f}")
    head = f"{'mode':<13}{'samples/s':>10}{'vs sync':>9}{'eff':>7}{'tr idle':>9}{'ro idle':>9}{'stale':>7}{'sync %':>8}{'s/step':>8}{'ext cpu':>9}{'±runs':>7}"
    print(head)
    print("-" * len(head))
    for mode, m in result["modes"].items():
        print(f"{mode:<13}{m['samples_per_s']:>10.2f}{fmt(m['speedup_vs_sync'], '.2f') + 'x':>9}{m['efficiency']:>7.2f}"
              f"{fmt(m['trainer_idle_frac']):>9}{fmt(m['rollout_idle_frac']):>9}{m['staleness_mean']:>7.2f}"
              f"{100 * m['sync_time_frac']:>7.1f}%{m['step_time_s']:>8.2f}{fmt((m.get('cpu') or {}).get('other')):>9}{100 * m['samples_per_s_spread']:>6.0f}%")
    print("eff = samples/s / bound; idle = fraction of wall-clock; ext cpu = cores used by processes outside this "
          "benchmark (other jobs) during the steady state; ±runs = half the range of samples/s over the repeated runs")
    print()
    for line in result["verdicts"]:
        print(line)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    vals = [result["modes"][m]["samples_per_s"] for m in modes]
    bars = ax.bar(modes, vals, color=[f"C{i}" for i in range(len(modes))])
    for b, m in zip(bars, modes):
        r = result["modes"][m]
        label = f"{r['samples_per_s']:.2f}\neff {r['efficiency']:.2f}"
        if r["speedup_vs_sync"] is not None:
            label += f"\n{r['speedup_vs_sync']:.2f}x sync"
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), label, ha="center", va="bottom", fontsize=9)
    ax.axhline(result["rollout_capacity"], color="C4", ls="--", label=f"rollout alone {result['rollout_capacity']:.2f}")
    ax.axhline(result["train_capacity"], color="C5", ls="--", label=f"train alone {result['train_capacity']:.2f}")
    ax.axhline(result["bound"], color="k", lw=2, label=f"bound min(R, T) {result['bound']:.2f}")
    ax.axhline(result["sequential_bound"], color="gray", ls=":", label=f"sequential 1/(1/R+1/T) {result['sequential_bound']:.2f}")
    ax.set(ylabel="consumed samples / s (steady state)", title="throughput per mode")
    ax.set_ylim(0, max(vals + [result["rollout_capacity"], result["train_capacity"]]) * 1.3)
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    keys = [("trainer_idle_frac", "trainer idle"), ("rollout_idle_frac", "rollout idle"), ("sync_time_frac", "weight sync"),
            ("efficiency", "efficiency")]
    width = 0.8 / len(keys)
    for i, (k, name) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(modes))]
        ax.bar(xs, [result["modes"][m][k] or 0 for m in modes], width, label=name)
    ax.set_xticks(range(len(modes)), modes)
    top = max([1.0] + [result["modes"][m][k] or 0 for m in modes for k, _ in keys])
    ax.set(ylim=(0, top * 1.1), ylabel="fraction of wall-clock (efficiency: of the bound)", title="where the time goes")
    for m, target in TARGETS.items():
        if m in modes:
            j = modes.index(m)
            ax.plot([j - 0.45, j + 0.45], [target, target], "k:", lw=1)
    ax.legend(fontsize=8)
    machine = result["machine"]
    fig.suptitle(f"async_flowgrpo throughput — {machine['cpu_count']} CPUs {machine['resources']['device']}, "
                 f"1 rollout + 1 trainer actor, {result['capacity']['samples_per_batch']} samples/batch", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    with common.session(args, "afg_throughput_") as (workdir, model, model_desc, res_overrides, machine):
        log(f"model: {model_desc}; device {machine['resources']['device']}; load average {machine['load_average_at_start']}")

        base = [f"model.path={model}", *DEFAULTS, *res_overrides, *args.common]
        if not given(args.common, "rollout.sde_window_size"):
            num_steps = common.load_mode_config("sync", base + ["rollout.sde_window_size=0"]).rollout.num_steps  # base.yaml's window may not fit
            window = max(1, round(DEFAULT_WINDOW_FRACTION * (num_steps - 1)))
            base.insert(-len(args.common) or len(base), f"rollout.sde_window_size={window}")
        cap, chosen, tried = balanced_capacity(args, base, workdir)
        settings = dedupe(base + chosen)

        runs = {mode: [] for mode in args.modes}
        caps = [cap]
        for rep in range(args.repeats):  # interleaved, so that load drift hits every mode alike
            for mode in args.modes:
                log(f"{mode}: {args.steps} steps ({args.warmup} warm-up), run {rep + 1}/{args.repeats}")
                m = run_mode(mode, settings + [f"trainer.total_steps={args.steps}"] + args.per_mode[mode],
                             os.path.join(workdir, f"{mode}_{rep}"), args.warmup)
                log(f"  {m['samples_per_s']:.2f} samples/s, {m['step_time_s']:.2f} s/step, wall {m['wall_s']:.0f} s")
                runs[mode].append(m)
            if not args.no_recheck:
                # Capacities again after every round: the bound is their mean, their spread shows drift.
                log(f"capacity again (drift check), window {cap['sde_window_size']}")
                again = measure_capacity(settings, os.path.join(workdir, f"capacity_after_{rep}"), args.capacity_batches)
                log(f"  rollout {again['rollout_s_per_batch']:.2f} s/batch, train {again['train_s_per_batch']:.2f} s/batch")
                caps.append(again)
        modes = {mode: merge_runs(rs) for mode, rs in runs.items()}
        cap = combine(caps)
        rollout_cap, train_cap = cap["rollout_capacity"], cap["train_capacity"]
        bound = min(rollout_cap, train_cap)
        sequential = 1 / (1 / rollout_cap + 1 / train_cap)

        sync_rate = modes["sync"]["samples_per_s"] if "sync" in modes else None
        ideal_speedup = (1 / rollout_cap + 1 / train_cap) * bound  # (R + T) / max(R, T) in times per batch
        verdicts = []
        out_modes = {}
        for mode, m in modes.items():
            m["speedup_vs_sync"] = m["samples_per_s"] / sync_rate if sync_rate else None
            m["efficiency"] = m["samples_per_s"] / bound
            if mode == "sync":
                m["efficiency_vs_sequential"] = m["samples_per_s"] / sequential
            else:
                m["diagnostics"] = diagnose(mode, m, cap)
                target = TARGETS[mode]
                ok = m["efficiency"] >= target
                per_run = ", ".join(f"{r / bound:.2f}" for r in m["samples_per_s_runs"])
                verdicts.append(f"{mode}: efficiency {m['efficiency']:.2f} (runs: {per_run}; target >= {target:.2f}) "
                                f"{'met' if ok else 'MISSED'}")
                if sync_rate:
                    ok_s = m["speedup_vs_sync"] >= SPEEDUP_TARGET
                    verdicts.append(f"{mode}: speed-up {m['speedup_vs_sync']:.2f}x over sync (target >= {SPEEDUP_TARGET}x at "
                                    f"train/rollout {cap['train_over_rollout']:.2f}; ideal (R+T)/max(R,T) = {ideal_speedup:.2f}x) "
                                    f"{'met' if ok_s else 'MISSED'}")
                verdicts.append(f"  why: {why(mode, m['diagnostics'])}")
            out_modes[mode] = m
        if "sync" in modes:
            s = modes["sync"]
            verdicts.append(f"sync: {s['efficiency_vs_sequential']:.2f} of the sequential rate 1/(1/R+1/T); "
                            f"weight sync {100 * s['sync_time_frac']:.1f}% of its time")
            if s["efficiency_vs_sequential"] > 1.05:
                verdicts.append("WARNING: sync ran faster than its own capacities allow: the capacities were measured "
                                "under more load than the modes ran under (a busy machine); the efficiencies are not trustworthy")
        busy_others = [f"{mode} run {i + 1}: {r['cpu']['other']:.2f}" for mode, rs in runs.items()
                       for i, r in enumerate(rs) if r.get("cpu") and r["cpu"]["other"] > 0.1]
        if busy_others:
            verdicts.append(f"WARNING: other jobs used CPU during the steady state (cores: {'; '.join(busy_others)}): "
                            f"those runs measure the machine's load, not the modes; rerun on a quiet machine")
        if cap["drift"] > 0.10:
            verdicts.append(f"WARNING: the capacity measurements differ by up to {100 * cap['drift']:.0f}% from their mean "
                            f"(load average {os.getloadavg()[0]:.1f} now; see ext cpu): the machine's speed drifted")

        result = {
            "rollout_capacity": rollout_cap,
            "train_capacity": train_cap,
            "bound": bound,
            "sequential_bound": sequential,
            "ideal_speedup_vs_sync": ideal_speedup,
            "machine": machine,
            "model": model_desc,
            "settings": [s for s in settings if not s.startswith("model.path=")],
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "capacity": cap,
            "capacity_measurements": caps,
            "balance_attempts": [{k: c[k] for k in ("sde_window_size", "rollout_s_per_batch", "train_s_per_batch", "train_over_rollout")}
                                 for c in tried],
            "targets": {"efficiency": TARGETS, "speedup_vs_sync": SPEEDUP_TARGET},
            "modes": out_modes,
            "verdicts": verdicts,
            "total_wall_s": time.perf_counter() - t_start,
            "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }
        os.makedirs(args.out, exist_ok=True)
        json_path = os.path.join(args.out, "throughput.json")
        png_path = os.path.join(args.out, "throughput.png")
        common.write_json(json_path, result)
        plot(result, png_path)
        print_table(result)
        print(f"\nwrote {json_path} and {png_path} ({result['total_wall_s']:.0f} s in all)")
        return result


if __name__ == "__main__":
    main()
