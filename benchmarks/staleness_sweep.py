#!/usr/bin/env python
"""How much staleness learning can take: fully_async at max_staleness (eta) 1, 2, 4, 8, each with
no importance correction, the per-element correction (flow_grpo's log-prob, the default) and the
per-step one, over several seeds; DiffusionNFT beside it (its v_old is exact per version, so it
has no correction to switch: one cell per eta).

Each cell is seed_runs.py's run (`python launch/fully_async.py ... trainer.seed=S rollout.seed=S`
as a subprocess, same held-out evaluation), kept under
benchmarks/results/seed_runs/<NAME>/<algorithm>/eta<E>_<correction>/seed<S>/. Cells run
interleaved (for each seed, each algorithm, each eta, each correction), a finished cell is
skipped, so a sweep continues across invocations.

Reaching the staleness: on a 2-core machine rollout is the bottleneck (the trainer idles about
three quarters of the time), so the queue stays nearly empty and every batch is about one version
old whatever eta allows. Every cell therefore runs with a paced trainer
(`trainer.min_step_time_s`, default --pace 1.5 s, above a batch's rollout time): rollouts fill the
queue and each batch is trained eta versions after it was admitted. The pacing changes when an
update happens, not what it computes; all cells train the same number of samples, so the final
rise compares learning per consumed sample. `report` gives the staleness each cell reached (the
mean of staleness/mean over its steps) beside eta.

    python benchmarks/staleness_sweep.py run sweep --seeds 0,1,2                       # every cell
    python benchmarks/staleness_sweep.py run sweep --seeds 0 --etas 1,8 --corrections none
    python benchmarks/staleness_sweep.py report sweep --plot benchmarks/results/seed_runs/sweep/rise.png
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import seed_runs  # noqa: E402
from common import argument_parser, log  # noqa: E402

ALGORITHMS = ("flow_grpo", "diffusion_nft")
CORRECTIONS = ("none", "element_mean", "step")
NFT_FILE = "config/diffusion_nft.yaml"


def cells(algorithms, etas, corrections) -> list[tuple[str, int, str]]:
    """(algorithm, eta, correction) in run order; DiffusionNFT has one cell per eta ("-")."""
    out = []
    for algorithm in algorithms:
        for eta in etas:
            for correction in (corrections if algorithm == "flow_grpo" else ("-",)):
                out.append((algorithm, eta, correction))
    return out


def cell_name(name: str, algorithm: str, eta: int, correction: str) -> str:
    return os.path.join(name, algorithm, f"eta{eta}" + ("" if correction == "-" else f"_{correction}"))


def cell_args(algorithm: str, eta: int, correction: str, pace: float, extra: list[str]) -> list[str]:
    args = [NFT_FILE] if algorithm == "diffusion_nft" else []
    args += [f"algorithm.max_staleness={eta}", f"trainer.min_step_time_s={pace:g}"]
    if correction != "-":
        args.append(f"algorithm.is_correction={correction}")
    return args + extra


def report(name: str) -> dict:
    """Every finished cell: mean rise, SE, worst, staleness reached; written to <name>/sweep.json."""
    rows = []
    base = os.path.join(seed_runs.ROOT, name)
    for algorithm in ALGORITHMS:
        adir = os.path.join(base, algorithm)
        for cell in sorted(os.listdir(adir)) if os.path.isdir(adir) else []:
            eta_part, _, correction = cell.partition("_")
            try:
                summary = seed_runs.summarize(os.path.join(name, algorithm, cell))
            except SystemExit:
                continue  # nothing finished in this cell yet
            reached = [r["staleness_mean"] for r in summary["runs"]]
            rows.append({"algorithm": algorithm, "eta": int(eta_part.removeprefix("eta")), "correction": correction or "-",
                         "n": summary["n"], "rise_mean": summary["rise_mean"], "rise_se": summary["rise_se"],
                         "rise_worst": summary["rise_worst"], "staleness_reached": round(sum(reached) / len(reached), 3),
                         "rises": [r["rise"] for r in summary["runs"]], "seeds": [r["seed"] for r in summary["runs"]]})
    rows.sort(key=lambda r: (r["algorithm"], r["correction"], r["eta"]))
    out = {"name": name, "cells": rows}
    with open(os.path.join(base, "sweep.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def table(result: dict) -> str:
    lines = ["| algorithm | correction | eta | staleness reached | n | rise (mean, SE) | worst | per seed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["cells"]:
        low = " (< 0.7 eta)" if r["staleness_reached"] < 0.7 * r["eta"] else ""
        lines.append(f"| {r['algorithm']} | {r['correction']} | {r['eta']} | {r['staleness_reached']:.2f}{low} | {r['n']} | "
                     f"{r['rise_mean']:+.3f} ({r['rise_se']:.3f}) | {r['rise_worst']:+.3f} | "
                     + ", ".join(f"{s}: {x:+.3f}" for s, x in zip(r["seeds"], r["rises"])) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, algorithm in zip(axes, ALGORITHMS):
        for correction in sorted({r["correction"] for r in result["cells"] if r["algorithm"] == algorithm}):
            pts = [r for r in result["cells"] if r["algorithm"] == algorithm and r["correction"] == correction]
            ax.errorbar([r["eta"] for r in pts], [r["rise_mean"] for r in pts], yerr=[r["rise_se"] for r in pts],
                        marker="o", capsize=3, label=f"correction {correction}")
        ax.set_xscale("log", base=2)
        ax.set_title(algorithm)
        ax.set_xlabel("max_staleness (eta)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("held-out accuracy, last - step 0 (mean, SE)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    ap = argument_parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cells not yet finished, interleaved")
    r.add_argument("name")
    r.add_argument("--seeds", required=True, help="comma list, e.g. 0,1,2")
    r.add_argument("--etas", default="1,2,4,8")
    r.add_argument("--corrections", default=",".join(CORRECTIONS), help=f"comma list of {', '.join(CORRECTIONS)}")
    r.add_argument("--algorithms", default=",".join(ALGORITHMS))
    r.add_argument("--pace", type=float, default=1.5, help="trainer.min_step_time_s of every cell (seconds)")
    r.add_argument("args", nargs="*", help="more YAML files and key=value overrides for every run")
    p = sub.add_parser("report", help="table of every finished cell, sweep.json, and a plot")
    p.add_argument("name")
    p.add_argument("--plot", default=None, metavar="PNG")
    a = ap.parse_args(argv)
    if a.command == "report":
        result = report(a.name)
        print(table(result))
        if a.plot:
            plot(result, a.plot)
        return
    algorithms = [x for x in a.algorithms.split(",") if x]
    corrections = [x for x in a.corrections.split(",") if x]
    if set(algorithms) - set(ALGORITHMS) or set(corrections) - set(CORRECTIONS):
        ap.error(f"--algorithms from {ALGORITHMS}, --corrections from {CORRECTIONS}")
    etas = [int(x) for x in a.etas.split(",") if x]
    for seed in (int(s) for s in a.seeds.split(",") if s):
        for algorithm, eta, correction in cells(algorithms, etas, corrections):
            log(f"seed {seed}: {algorithm} eta {eta} correction {correction}")
            seed_runs.run_seed(cell_name(a.name, algorithm, eta, correction), seed, "fully_async",
                               cell_args(algorithm, eta, correction, a.pace, a.args), other_cfg=[])


if __name__ == "__main__":
    main()
