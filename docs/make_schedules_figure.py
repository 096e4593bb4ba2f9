#!/usr/bin/env python
"""Draw docs/schedules.png: the three schedules (sync, one_step_off, fully_async) on a rollout lane
and a trainer lane, and the data flow between the actors.

    python docs/make_schedules_figure.py [--out docs/schedules.png]

An illustration with made-up equal costs (a batch's rollout and its update take one unit each),
not a measurement; the measured throughput is in docs/results.md.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROLLOUT, TRAIN, PUBLISH = "#4C72B0", "#DD8452", "#55A868"


def lane(ax, y, spans, color, label_fmt):
    for k, (start, length) in enumerate(spans):
        ax.add_patch(FancyBboxPatch((start + 0.03, y - 0.3), length - 0.06, 0.6, boxstyle="round,pad=0,rounding_size=0.08",
                                    color=color, alpha=0.85, lw=0))
        ax.text(start + length / 2, y, label_fmt(k), ha="center", va="center", color="white", fontsize=8)


def publishes(ax, times, y_from, y_to):
    for t in times:
        ax.add_patch(FancyArrowPatch((t, y_from), (t, y_to), arrowstyle="-|>", mutation_scale=8, color=PUBLISH, lw=1.2))


def timelines(axes):
    # (title, rollout spans, trainer spans, publication times, rollout labels, trainer labels)
    schedules = [
        ("sync: generate batch k, train on it, publish; one side always idle",
         [(2 * k, 1) for k in range(4)], [(2 * k + 1, 1) for k in range(4)], [2 * k + 2 for k in range(3)],
         lambda k: f"batch {k}, v{k}", lambda k: f"train {k}"),
        ("one_step_off: batch k+1 generates with v while batch k trains (staleness exactly 1)",
         [(k, 1) for k in range(8)], [(k + 1, 1) for k in range(7)], [k + 1 for k in range(7)],
         lambda k: f"b{k}, v{max(k - 1, 0)}", lambda k: f"train {k}"),
        ("fully_async: groups stream into a bounded queue; new weights land between denoising steps",
         [(k * 0.5, 0.5) for k in range(16)], [(0.5 + k, 1) for k in range(7)], [1.5 + k for k in range(6)],
         lambda k: f"g{k}", lambda k: f"train {k}"),
    ]
    for ax, (title, roll, train, pubs, rl, tl) in zip(axes, schedules):
        lane(ax, 1, roll, ROLLOUT, rl)
        lane(ax, 0, train, TRAIN, tl)
        publishes(ax, pubs, 0.3, 0.7)
        ax.set_xlim(0, 8)
        ax.set_ylim(-0.6, 1.6)
        ax.set_yticks([0, 1], ["trainer", "rollout"])
        ax.set_xticks([])
        ax.set_title(title, fontsize=9, loc="left")
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("time (one unit = one batch's rollout = one update; green arrows: weights published)", fontsize=8)


def box(ax, xy, w, h, text, color):
    ax.add_patch(FancyBboxPatch(xy, w, h, boxstyle="round,pad=0.02,rounding_size=0.05", fc=color, alpha=0.15, ec=color))
    ax.text(xy[0] + w / 2, xy[1] + h / 2, text, ha="center", va="center", fontsize=8)


def arrow(ax, a, b, text, color="0.3", dy=0.04):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=color, lw=1.2))
    ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, ha="center", va="bottom", fontsize=7, color=color)


def dataflow(ax):
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title("data flow (fully_async; the batch modes skip the queue actor)", fontsize=9, loc="left")
    y, h = 0.3, 0.34
    box(ax, (0.0, y), 0.15, h, "rollout actors\ngenerate; record\nlog-probs, versions", ROLLOUT)
    box(ax, (0.2, y), 0.17, h, "reward stage\nscored while the\nnext group generates", "0.4")
    box(ax, (0.42, y), 0.15, h, "queue actor\nadmission: staleness\n<= max_staleness", "0.4")
    box(ax, (0.62, y), 0.15, h, "driver\nrecords only:\nadvantages, metrics", "0.4")
    box(ax, (0.82, y), 0.18, h, "trainer actors\nclipped loss,\nstaleness weight", TRAIN)
    box(ax, (0.3, 0.8), 0.4, 0.17, "Ray object store: groups (latents, log-probs, images)", "0.6")
    mid = y + h / 2
    arrow(ax, (0.15, mid), (0.2, mid), "group")
    arrow(ax, (0.37, mid), (0.42, mid), "record")
    arrow(ax, (0.57, mid), (0.62, mid), "records")
    arrow(ax, (0.77, mid), (0.82, mid), "refs")
    arrow(ax, (0.285, y + h), (0.36, 0.8), "put", "0.5", dy=0.0)
    arrow(ax, (0.7, 0.86), (0.9, y + h), "fetch", "0.5", dy=0.0)
    ax.add_patch(FancyArrowPatch((0.9, y), (0.07, y), connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                 mutation_scale=10, color=PUBLISH, lw=1.4))
    ax.text(0.5, -0.16, "weights, every sync.every updates: bucketed broadcast (NCCL / gloo), digest-checked, "
            "taken between denoising steps", ha="center", fontsize=8, color=PUBLISH)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedules.png"))
    args = ap.parse_args(argv)
    fig = plt.figure(figsize=(10, 8))
    grid = fig.add_gridspec(4, 1, height_ratios=[1, 1, 1, 1.5], hspace=0.6)
    timelines([fig.add_subplot(grid[i, 0]) for i in range(3)])
    dataflow(fig.add_subplot(grid[3, 0]))
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
