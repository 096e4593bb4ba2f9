#!/usr/bin/env python
"""Time to accuracy: held-out accuracy against wall seconds of training, per mode and algorithm.

Each cell is one launcher run, `python launch/<mode>.py [algorithm.name=diffusion_nft] [ARGS]
trainer.seed=S rollout.seed=S`, as a subprocess (seed_runs.py's way: what a user runs is what is
measured), kept under benchmarks/results/time_to_accuracy/<name>/<algorithm>/<mode>/seed<S>/.
Cells run interleaved (for each seed, each algorithm, each mode) so that a slower stretch of the
machine hits every mode alike; a finished cell is skipped, so a sweep continues across invocations,
and invocations with different --seeds can run one after another into the same name.

The clock is the run's own `time_s` (wall seconds since its first step started) with **evaluation
time taken out**: at each evaluation, training seconds = time_s minus the `eval/time_s` of every
evaluation so far (step 0's included). In fully_async the rollout actors keep generating while the
trainer evaluates, so that work is not charged: a small advantage to fully_async, bounded by the
evaluation share of the run (reported per run as eval_s). Accuracy is known at evaluations only
(eval.every), so the time to the target is the training seconds at the first evaluation that
reaches it: an upper bound at the evaluation grid.

    python benchmarks/time_to_accuracy.py run main --seeds 0,1,2              # 3 modes x 2 algorithms x 3 seeds
    python benchmarks/time_to_accuracy.py run main --seeds 3 --modes sync,fully_async fully_async:sync.every=1
    python benchmarks/time_to_accuracy.py report main --target-rise 0.10      # tables, summary.json, PNG
    python benchmarks/time_to_accuracy.py report main --target-rise flow_grpo=0.07,diffusion_nft=0.15

`report` merges every finished cell of the name, whatever invocation ran it. Per run: step-0
accuracy, the target (step 0 + --target-rise), the training seconds and step at which it was first
reached (none if never), the final accuracy, training and evaluation seconds; per (algorithm, mode):
mean and SE (std / sqrt(n)) over the seeds that reached the target and over all for the final
accuracy; per algorithm: the ratio of each mode's mean time to target to sync's.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (REPO, RESULTS, argument_parser, log, parse_run_overrides, prune_run_outputs, read_metrics,  # noqa: E402
                    split_overrides, write_json)
from seed_runs import MODES, finished, finished_runs  # noqa: E402

ROOT = os.path.join(RESULTS, "time_to_accuracy")
ALGORITHMS = ("flow_grpo", "diffusion_nft")


def cell_dir(name: str, algorithm: str, mode: str, seed: int) -> str:
    return os.path.join(ROOT, name, algorithm, mode, f"seed{seed}")


def run_cell(out: str, algorithm: str, mode: str, seed: int, args: list[str]) -> bool:
    """One launcher run into `out`; False (nothing run) when it finished before."""
    if finished(out):
        return False
    shutil.rmtree(out, ignore_errors=True)  # an interrupted run starts again
    cmd = [sys.executable, os.path.join("launch", f"{mode}.py"), f"algorithm.name={algorithm}", *args,
           f"trainer.seed={seed}", f"rollout.seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    log(f"{out}: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, f"trainer.output_dir={out}", "logging.progress=false"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{out}: exit {proc.returncode}: {' | '.join(tail)}")
    prune_run_outputs(out)
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"command": shlex.join(c if c != sys.executable else "python" for c in cmd), "seed": seed,
                   "mode": mode, "algorithm": algorithm, "wall_s": round(wall, 1)}, f, indent=1)
    log(f"{out}: {wall:.0f} s")
    return True


def training_curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds, accuracy) at each evaluation: time_s less all evaluation time so far."""
    curve, eval_s = [], 0.0
    for r in rows:
        if "eval/accuracy" in r:
            eval_s += r.get("eval/time_s", 0.0)
            curve.append((r["step"], max(0.0, r["time_s"] - eval_s), r["eval/accuracy"]))
    return curve


def summarize_run(run_dir: str, target_rise: float) -> dict:
    rows = read_metrics(run_dir)
    info = json.load(open(os.path.join(run_dir, "run.json")))
    curve = training_curve(rows)
    if not curve or curve[0][0] != 0:
        raise SystemExit(f"{run_dir}: no step-0 evaluation (eval.at_start_and_end=false?): no target to rise from")
    target = curve[0][2] + target_rise
    hit = next(((step, s) for step, s, acc in curve[1:] if acc >= target - 1e-9), None)
    return {
        "seed": info["seed"], "command": info["command"],
        "step0_accuracy": curve[0][2], "target": round(target, 4),
        "time_to_target_s": None if hit is None else round(hit[1], 1),
        "step_to_target": None if hit is None else hit[0],
        "final_accuracy": curve[-1][2], "final_step": curve[-1][0],
        "train_s": round(curve[-1][1], 1), "eval_s": round(sum(r.get("eval/time_s", 0.0) for r in rows), 1),
        "curve": [[step, round(s, 1), acc] for step, s, acc in curve],
    }


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    n = len(values)
    if not n:
        return None, None
    mean = sum(values) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n) if n > 1 else None
    return mean, se


def parse_target_rises(text: str) -> dict[str, float]:
    """`0.1` (every algorithm) or `flow_grpo=0.07,diffusion_nft=0.15` (one each; each algorithm's
    rise is on its own evaluation) -> {algorithm: rise}."""
    try:
        if "=" not in text:
            return dict.fromkeys(ALGORITHMS, float(text))
        rises = {k.strip(): float(v) for k, v in (item.split("=", 1) for item in text.split(","))}
    except ValueError:
        raise ValueError(f"--target-rise {text!r}: expected a number or algorithm=number,...") from None
    if set(rises) != set(ALGORITHMS):
        raise ValueError(f"--target-rise {text!r}: give one rise for each of {', '.join(ALGORITHMS)}")
    return rises


def summarize(name: str, target_rises: dict[str, float]) -> dict:
    """Every finished cell under the name, per algorithm and mode, with the ratios to sync."""
    base = os.path.join(ROOT, name)
    if not os.path.isdir(base):
        raise SystemExit(f"{name}: nothing under {base}")
    out = {"name": name, "target_rise": target_rises, "cells": {}, "ratio_to_sync": {}}
    for algorithm in ALGORITHMS:
        for mode in MODES:
            d = os.path.join(base, algorithm, mode)
            runs = [summarize_run(r, target_rises[algorithm]) for r in finished_runs(d)] if os.path.isdir(d) else []
            if not runs:
                continue
            runs.sort(key=lambda r: r["seed"])
            reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
            t_mean, t_se = mean_se(reached)
            f_mean, f_se = mean_se([r["final_accuracy"] for r in runs])
            out["cells"].setdefault(algorithm, {})[mode] = {
                "n": len(runs), "reached": len(reached), "time_to_target_mean_s": t_mean, "time_to_target_se_s": t_se,
                "final_accuracy_mean": f_mean, "final_accuracy_se": f_se, "runs": runs}
        cells = out["cells"].get(algorithm, {})
        sync = cells.get("sync", {}).get("time_to_target_mean_s")
        out["ratio_to_sync"][algorithm] = {
            mode: c["time_to_target_mean_s"] / sync for mode, c in cells.items()
            if mode != "sync" and sync and c["time_to_target_mean_s"] is not None}
    if not out["cells"]:
        raise SystemExit(f"{name}: no finished run under {base}")
    write_json(os.path.join(base, "summary.json"), out)
    return out


def _fmt(mean, se, spec=".0f") -> str:
    if mean is None:
        return "-"
    return f"{mean:{spec}}" + ("" if se is None else f" ± {se:{spec}}")


def tables(summary: dict) -> str:
    lines = [f"{summary['name']}: target = step-0 accuracy + the algorithm's rise; "
             "seconds of training (evaluation taken out)", ""]
    for algorithm, cells in summary["cells"].items():
        lines += [f"{algorithm} (target: step 0 + {summary['target_rise'][algorithm]:.2f}):", "",
                  "| mode | seed | step 0 | time to target | step | final accuracy | training s | eval s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for mode, c in cells.items():
            for r in c["runs"]:
                t = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s"
                lines.append(f"| {mode} | {r['seed']} | {r['step0_accuracy']:.3f} | {t} | {r['step_to_target'] or '-'} | "
                             f"{r['final_accuracy']:.3f} | {r['train_s']:.0f} | {r['eval_s']:.0f} |")
            lines.append(f"| {mode} mean (n={c['n']}, reached {c['reached']}) | | | "
                         f"**{_fmt(c['time_to_target_mean_s'], c['time_to_target_se_s'])} s** | | "
                         f"**{_fmt(c['final_accuracy_mean'], c['final_accuracy_se'], '.3f')}** | | |")
        ratios = summary["ratio_to_sync"].get(algorithm, {})
        if ratios:
            lines += ["", "time to target / sync's: " + ", ".join(f"{m} {v:.2f}x" for m, v in ratios.items())]
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    """One panel per algorithm: accuracy vs training seconds, a line per run, a colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = list(summary["cells"])
    fig, axes = plt.subplots(1, len(algorithms), figsize=(6 * len(algorithms), 4), squeeze=False)
    for ax, algorithm in zip(axes[0], algorithms):
        for k, (mode, c) in enumerate(summary["cells"][algorithm].items()):
            for i, r in enumerate(c["runs"]):
                xs, ys = [p[1] for p in r["curve"]], [p[2] for p in r["curve"]]
                ax.plot(xs, ys, color=f"C{k}", marker="o", ms=3, alpha=0.7, label=f"{mode} (n={c['n']})" if i == 0 else None)
            targets = [r["target"] for r in c["runs"]]
            ax.axhline(sum(targets) / len(targets), color="grey", ls="--", lw=0.8)
        ax.set_title(f"{algorithm} (dashed: target)")
        ax.set_xlabel("training wall seconds (evaluation taken out)")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


def main(argv=None) -> None:
    ap = argument_parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the cells not yet finished, interleaved")
    r.add_argument("name", help="results go to benchmarks/results/time_to_accuracy/NAME/<algorithm>/<mode>/seed<S>/")
    r.add_argument("--seeds", required=True, help="comma list, e.g. 0,1,2")
    r.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    r.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma list of {', '.join(ALGORITHMS)}")
    r.add_argument("args", nargs="*", help="YAML files and key=value overrides for every run; "
                   "<mode>:key=value or <algorithm>:key=value for those runs only")
    p = sub.add_parser("report", help="merge every finished cell: tables, summary.json and a PNG")
    p.add_argument("name")
    p.add_argument("--target-rise", default="0.10", help="target = each run's step-0 accuracy + this: a number, "
                   "or one per algorithm (flow_grpo=0.07,diffusion_nft=0.15)")
    p.add_argument("--plot", help="the PNG (default: benchmarks/results/time_to_accuracy/NAME/accuracy_vs_time.png)")
    a = parse_run_overrides(ap, argv)
    if a.cmd == "report":
        try:
            rises = parse_target_rises(a.target_rise)
        except ValueError as e:
            ap.error(str(e))
        summary = summarize(a.name, rises)
        print(tables(summary))
        plot(summary, a.plot or os.path.join(ROOT, a.name, "accuracy_vs_time.png"))
        return
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds {a.seeds!r}: expected a comma list of integers")
    modes, algorithms = a.modes.split(","), a.algorithms.split(",")
    for value, known in ((modes, MODES), (algorithms, ALGORITHMS)):
        if set(value) - set(known):
            ap.error(f"{','.join(value)}: expected some of {', '.join(known)}")
    files = [x for x in a.args if x.endswith((".yaml", ".yml")) and "=" not in x]
    common, per = split_overrides(ap, [x for x in a.args if x not in files], (*MODES, *ALGORITHMS))
    for seed in seeds:
        for algorithm in algorithms:
            for mode in modes:
                out = cell_dir(a.name, algorithm, mode, seed)
                if not run_cell(out, algorithm, mode, seed, [*files, *common, *per[algorithm], *per[mode]]):
                    log(f"{out}: done before, skipped")


if __name__ == "__main__":
    main()
