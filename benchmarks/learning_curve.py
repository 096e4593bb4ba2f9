#!/usr/bin/env python
"""Learning curves: reward and eval accuracy against consumed samples and against wall-clock,
sync vs fully_async, several seeds, on the embedded shapes model with the shapes reward.

Every run uses the embedded default configuration (config/base.yaml: batch 8 x 4, 10 denoising
steps, its SDE window) with periodic held-out evaluation (eval.every, ODE sampling on
shapes_eval, fixed seeds) and the same 1 rollout + 1 trainer actor resources; runs are
interleaved (sync seed 0, fully_async seed 0, sync seed 1, ...) so load drift hits both modes.
Seed s sets trainer.seed = s and rollout.seed = s (prompt order, sampling noise, LoRA init).

Reported per mode (mean ± std over seeds): training reward over the last quarter of the steps,
the final eval accuracy, wall-clock; then the per-sample comparison (fully_async - sync final
reward against the seed noise, and the mean gap over the whole curve) and the per-second one
(time to reach 80% of sync's reward gain, reward when the faster mode finishes).
Wall-clock is each run's time_s (from the end of actor start-up; evaluations included, the same
number at the same steps in both modes).

Writes ``benchmarks/results/learning_curve.json`` and ``benchmarks/results/learning_curve.png``.

    python benchmarks/learning_curve.py                      # 2 seeds x 2 modes x 40 steps: ~15 min on 2 cores
    python benchmarks/learning_curve.py --seeds 3 --steps 60 --eval-every 10 rollout.sde_window_size=3
    python benchmarks/learning_curve.py --merge a/learning_curve.json b/learning_curve.json  # a: --seeds 0, b: --seeds 1,

Overrides are ``key=value`` (every run) or ``<mode>:key=value`` (that mode only).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import RESULTS, argument_parser, log  # noqa: E402

MODES = ("sync", "fully_async")
ALL_MODES = ("sync", "one_step_off", "fully_async")
DEFAULTS = [
    "trainer.sample_every=0",
    "trainer.checkpoint_every=0",
    "eval.at_start_and_end=true",
    "eval.samples_per_prompt=1",  # 64 held-out prompts x 1: a quarter of the default eval cost
    "logging.progress=false",
    "logging.wandb_mode=disabled",
    "sync.timeout_s=600",
]


def parse_args(argv):
    ap = argument_parser(__doc__)
    ap.add_argument("--model", default="embedded", help="embedded (default) | tiny (random: reward stays flat) | auto | a dir")
    ap.add_argument("--seeds", default="2", help="number of seeds (0..n-1) or a comma list, e.g. 0,3,7 or 1, for seed 1 alone (default 2)")
    ap.add_argument("--steps", type=int, default=40, help="trainer steps per run (default 40)")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (default 10; 0 = start and end only)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list (default sync,fully_async)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    ap.add_argument("--smooth", type=int, default=5, help="moving-average window (steps) for the reward curves in the plot")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--workdir", default=None, help="keep the run outputs here (default: a temp dir, removed)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no runs: combine these invocations' learning_curve.json "
                    "files (other seeds, same settings) into one result in --out")
    ap.add_argument("overrides", nargs="*", help="key=value (every run) or mode:key=value (one mode)")
    args = ap.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if "," in args.seeds else list(range(int(args.seeds)))
    except ValueError:
        ap.error("--seeds: a count (2) or a comma list (0,3,7; one seed: 1,)")
    if not args.seeds:
        ap.error("--seeds: at least one seed (seed 0 alone: --seeds 0,)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ALL_MODES:
            ap.error(f"--modes: unknown mode {m!r}")
    args.common, args.per_mode = common.split_overrides(ap, args.overrides, ALL_MODES)
    return args


def run_one(mode: str, seed: int, overrides: list[str], output_dir: str) -> dict:
    shutil.rmtree(output_dir, ignore_errors=True)
    cfg = common.load_mode_config(mode, overrides + [f"trainer.seed={seed}", f"rollout.seed={seed}", f"trainer.output_dir={output_dir}"])
    t0 = time.perf_counter()
    common.run_or_exit(cfg)
    wall = time.perf_counter() - t0
    rows = common.read_metrics(output_dir)
    evals = [
        {"step": r["step"], "samples": r.get("samples/consumed", 0), "time_s": r.get("time_s", 0.0),
         "accuracy": r.get("eval/accuracy"), "reward": r.get("eval/reward")}
        for r in rows if "eval/reward" in r or "eval/accuracy" in r
    ]
    evals = [e for e in evals if e["accuracy"] is not None or e["reward"] is not None]
    rows = [r for r in rows if "reward/mean" in r]  # training steps (a step-0 eval-only row, if logged, is in evals)
    return {
        "seed": seed,
        "wall_s": wall,
        "step": [r["step"] for r in rows],
        "samples": [r["samples/consumed"] for r in rows],
        "time_s": [r["time_s"] for r in rows],
        "reward": [r.get("reward/mean") for r in rows],
        "staleness": [r.get("staleness/mean") for r in rows],
        "evals": evals,
        "samples_per_s": rows[-1]["samples/consumed"] / rows[-1]["time_s"],
    }


# -- statistics ------------------------------------------------------------------------------------
def mean_std(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def smooth(ys, k):
    out = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - k + 1) : i + 1] if y is not None]
        out.append(sum(window) / len(window) if window else None)
    return out


def interp(xs, ys, x):
    """Linear interpolation of the curve (xs increasing) at x; None outside."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if xs[i] >= x:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def first_reach(xs, ys, level):
    for x, y in zip(xs, ys):
        if y is not None and y >= level:
            return x
    return None


def aggregate(runs: list[dict], smooth_k: int) -> dict:
    n = min(len(r["reward"]) for r in runs)
    tail = max(1, n // 4)
    finals = [sum(r["reward"][n - tail : n]) / tail for r in runs]
    per_step = [mean_std([r["reward"][i] for r in runs]) for i in range(n)]
    ev_final = [r["evals"][-1]["accuracy"] if r["evals"] else None for r in runs]
    ev_first = [r["evals"][0]["accuracy"] if r["evals"] else None for r in runs]
    ev_steps = sorted({e["step"] for r in runs for e in r["evals"]})
    ev_curve = []
    for s in ev_steps:
        accs = [e["accuracy"] for r in runs for e in r["evals"] if e["step"] == s]
        rews = [e["reward"] for r in runs for e in r["evals"] if e["step"] == s]
        samples = [e["samples"] for r in runs for e in r["evals"] if e["step"] == s]
        ev_curve.append({"step": s, "samples": mean_std(samples)[0], "accuracy": mean_std(accs), "reward": mean_std(rews)})
    # mean curve against wall-clock: each seed's smoothed curve interpolated on a common grid
    t_start = max(r["time_s"][0] for r in runs)  # where every seed has a point
    t_end = min(r["time_s"][-1] for r in runs)
    grid = [t_start + (t_end - t_start) * i / 100 for i in range(101)]
    sm = [smooth(r["reward"], smooth_k) for r in runs]
    by_time = [mean_std([interp(r["time_s"], s, t) for r, s in zip(runs, sm)]) for t in grid]
    return {
        "final_reward": mean_std(finals),
        "final_reward_per_seed": finals,
        "final_eval_accuracy": mean_std(ev_final),
        "first_eval_accuracy": mean_std(ev_first),
        "first_eval_step": min((r["evals"][0]["step"] for r in runs if r["evals"]), default=None),
        "wall_s": mean_std([r["time_s"][-1] for r in runs]),
        "samples_per_s": mean_std([r["samples_per_s"] for r in runs]),
        "staleness_mean": mean_std([sum(x for x in r["staleness"] if x is not None) / len(r["staleness"]) for r in runs]),
        "curve_samples": [sum(r["samples"][i] for r in runs) / len(runs) for i in range(n)],
        "curve_reward_mean": [m for m, _ in per_step],
        "curve_reward_std": [s for _, s in per_step],
        "curve_time_grid": grid,
        "curve_reward_by_time": [m for m, _ in by_time],
        "eval_curve": ev_curve,
        "tail_steps": tail,
    }


def compare(agg: dict) -> tuple[dict, list[str]]:
    s, a = agg["sync"], agg["fully_async"]
    lines, out = [], {}
    (ms, ss), (ma, sa) = s["final_reward"], a["final_reward"]
    k_s, k_a = len(s["final_reward_per_seed"]), len(a["final_reward_per_seed"])
    se = math.sqrt((ss or 0) ** 2 / k_s + (sa or 0) ** 2 / k_a)
    diff = ma - ms
    out["final_reward_diff"] = diff
    out["final_reward_diff_se"] = se
    within = se > 0 and abs(diff) <= 2 * se
    out["per_sample_within_noise"] = within if se > 0 else None
    n = min(len(s["curve_reward_mean"]), len(a["curve_reward_mean"]))
    gaps = [a["curve_reward_mean"][i] - s["curve_reward_mean"][i] for i in range(n)]
    out["mean_curve_gap_per_sample"] = sum(gaps) / n
    lines.append(
        f"per sample: final reward fully_async {ma:.3f} ± {sa or 0:.3f} vs sync {ms:.3f} ± {ss or 0:.3f} "
        f"(diff {diff:+.3f}, 2 SE = {2 * se:.3f}: {'within noise' if within else 'NOT within noise' if se > 0 else 'one seed: no noise estimate'}); "
        f"mean gap over the curve {out['mean_curve_gap_per_sample']:+.3f}"
    )
    (ea_s, es_s), (ea_a, es_a) = s["final_eval_accuracy"], a["final_eval_accuracy"]
    if ea_s is not None and ea_a is not None:
        lines.append(f"per sample: final eval accuracy fully_async {ea_a:.3f} ± {es_a or 0:.3f} vs sync {ea_s:.3f} ± {es_s or 0:.3f}")
    # per second
    start = s["curve_reward_mean"][0]
    gain = ms - start
    out["wall_speedup"] = s["wall_s"][0] / a["wall_s"][0]
    out["samples_per_s_ratio"] = a["samples_per_s"][0] / s["samples_per_s"][0]
    if gain > 0:
        level = start + 0.8 * gain
        t_s = first_reach(s["curve_time_grid"], s["curve_reward_by_time"], level)
        t_a = first_reach(a["curve_time_grid"], a["curve_reward_by_time"], level)
        out["reach_level"] = level
        out["time_to_level"] = {"sync": t_s, "fully_async": t_a}
        if t_s and t_a:
            out["time_to_level_speedup"] = t_s / t_a
        lines.append(
            f"per second: 80% of sync's reward gain ({level:.3f}) reached at {fmt_s(t_s)} (sync) vs {fmt_s(t_a)} (fully_async)"
            + (f" = {t_s / t_a:.2f}x" if t_s and t_a else "")
        )
    else:
        lines.append(f"per second: sync's reward did not rise ({start:.3f} -> {ms:.3f}); no time-to-level comparison")
    t_a_end = a["curve_time_grid"][-1]
    r_s_at = interp(s["curve_time_grid"], s["curve_reward_by_time"], t_a_end)
    out["reward_at_async_end"] = {"sync": r_s_at, "fully_async": a["curve_reward_by_time"][-1]}
    lines.append(
        f"per second: when fully_async finished ({t_a_end:.0f} s) its reward was {fmt(a['curve_reward_by_time'][-1])}, "
        f"sync's {fmt(r_s_at)}; same samples in {out['wall_speedup']:.2f}x less wall-clock "
        f"({out['samples_per_s_ratio']:.2f}x samples/s)"
    )
    return out, lines


def fmt(v, spec=".3f"):
    return "n/a" if v is None else format(v, spec)


def fmt_s(v):
    return "never" if v is None else f"{v:.0f} s"


# -- plot -----------------------------------------------------------------------------------------
def plot(result: dict, path: str, smooth_k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for i, (mode, runs) in enumerate(result["runs"].items()):
        color = f"C{i}"
        agg = result["aggregate"][mode]
        for j, r in enumerate(runs):
            axes[0].plot(r["samples"], smooth(r["reward"], smooth_k), color=color, alpha=0.35, lw=1)
            axes[1].plot(r["time_s"], smooth(r["reward"], smooth_k), color=color, alpha=0.35, lw=1)
            ev = [e for e in r["evals"] if e["accuracy"] is not None]
            axes[2].plot([e["samples"] for e in ev], [e["accuracy"] for e in ev], color=color, alpha=0.35, lw=1, marker=".")
        axes[0].plot(agg["curve_samples"], smooth(agg["curve_reward_mean"], smooth_k), color=color, lw=2.5,
                     label=f"{mode} (mean of {len(runs)} seeds)")
        axes[1].plot(agg["curve_time_grid"], agg["curve_reward_by_time"], color=color, lw=2.5, label=f"{mode}")
        ev = [e for e in agg["eval_curve"] if e["accuracy"][0] is not None]
        if ev:
            axes[2].errorbar([e["samples"] for e in ev], [e["accuracy"][0] for e in ev], yerr=[e["accuracy"][1] or 0 for e in ev],
                             color=color, lw=2.5, capsize=3, label=f"{mode}")
    axes[0].set(xlabel="consumed samples", ylabel=f"training reward (moving avg {smooth_k} steps)", title="reward vs samples")
    axes[1].set(xlabel="wall-clock s (after actor start-up)", ylabel="training reward", title="reward vs wall-clock")
    axes[2].set(xlabel="consumed samples", ylabel="eval accuracy (held-out prompts, ODE)", title="eval accuracy vs samples")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"async_flowgrpo learning curves — {result['model']}; thin: seeds, thick: mean", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.merge:
        return merge(args.merge, args)
    t_start = time.perf_counter()
    with common.session(args, "afg_learning_curve_") as (workdir, model, model_desc, res_overrides, machine):
        if "random" in model_desc:
            log("WARNING: a random model: the shapes reward will stay near 0 (this only checks the script)")
        base = [f"model.path={model}", *DEFAULTS, f"eval.every={args.eval_every}", f"trainer.total_steps={args.steps}",
                *res_overrides, *args.common]
        log(f"model: {model_desc}; {len(args.seeds)} seeds x {args.modes} x {args.steps} steps; "
            f"device {machine['resources']['device']}")

        runs = {m: [] for m in args.modes}
        for seed in args.seeds:
            for mode in args.modes:
                log(f"{mode} seed {seed}")
                r = run_one(mode, seed, base + args.per_mode[mode], os.path.join(workdir, f"{mode}_seed{seed}"))
                ev = r["evals"][-1]["accuracy"] if r["evals"] else None
                log(f"  reward {fmt(r['reward'][0])} -> {fmt(r['reward'][-1])}, eval accuracy {fmt(ev)}, "
                    f"{r['time_s'][-1]:.0f} s, {r['samples_per_s']:.2f} samples/s")
                runs[mode].append(r)

        return report({
            "model": model_desc,
            "machine": machine,
            "settings": [s for s in base if not s.startswith("model.path=")],
            "seeds": args.seeds,
            "steps": args.steps,
            "runs": runs,
        }, args, time.perf_counter() - t_start)


def merge(paths: list[str], args) -> dict:
    """Several invocations' JSONs (seeds run in parallel, or on several machines) as one result:
    the same model, settings and steps; the seeds must differ."""
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: cannot read {path}: {e}") from None
    first = docs[0]
    for path, doc in zip(paths[1:], docs[1:]):
        for key in ("model", "settings", "steps"):
            if doc.get(key) != first.get(key):
                raise SystemExit(f"--merge: {path} has another {key} than {paths[0]}")
    seeds = [s for d in docs for s in d["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: a seed appears twice ({seeds})")
    modes = list(dict.fromkeys(m for d in docs for m in d["runs"]))
    runs = {m: [r for d in docs for r in d["runs"].get(m, [])] for m in modes}
    return report({**{k: first[k] for k in ("model", "machine", "settings", "steps")}, "seeds": seeds, "runs": runs,
                   "merged_from": paths}, args, sum(d.get("total_wall_s", 0.0) for d in docs))


def report(result: dict, args, wall_s: float) -> dict:
    """Aggregate the runs over seeds, compare the modes, write the JSON and the plot, print the table."""
    runs = result["runs"]
    agg = {m: aggregate(rs, args.smooth) for m, rs in runs.items()}
    comparison, lines = compare(agg) if {"sync", "fully_async"} <= set(agg) else ({}, [])
    result = {**result, "aggregate": agg, "comparison": comparison, "verdicts": lines, "total_wall_s": wall_s}
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "learning_curve.json")
    png_path = os.path.join(args.out, "learning_curve.png")
    common.write_json(json_path, result)
    plot(result, png_path, args.smooth)

    print()
    head = f"{'mode':<13}{'final reward':>18}{'first eval acc':>18}{'last eval acc':>18}{'wall s':>10}{'samples/s':>11}{'stale':>7}"
    print(head)
    print("-" * len(head))
    for m, a in agg.items():
        def pm(ms):
            return "n/a" if ms[0] is None else f"{ms[0]:.3f} ± {ms[1] or 0:.3f}"
        print(f"{m:<13}{pm(a['final_reward']):>18}{pm(a['first_eval_accuracy']):>18}{pm(a['final_eval_accuracy']):>18}"
              f"{a['wall_s'][0]:>10.0f}{a['samples_per_s'][0]:>11.2f}{a['staleness_mean'][0]:>7.2f}")
    first = {m: a["first_eval_step"] for m, a in agg.items()}
    if all(v for v in first.values()):
        print(f"(first logged evaluation at step {first}: the run-start evaluation did not reach metrics.jsonl)")
    print()
    for line in lines:
        print(line)
    print(f"\nwrote {json_path} and {png_path} ({wall_s:.0f} s in all)")
    return result


if __name__ == "__main__":
    main()
