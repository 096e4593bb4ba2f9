#!/usr/bin/env python
"""Plot runs' metrics.jsonl: training reward (rolling mean) and eval metrics against step.

    python benchmarks/plot_run.py outputs/fully_async/metrics.jsonl [out.png]
    python benchmarks/plot_run.py seed0/metrics.jsonl seed1/metrics.jsonl seed2/metrics.jsonl curve.png

One file: every eval metric. Several (e.g. seeds of one command): the training reward and
eval/accuracy of each, one colour per file. A path may name a metrics.jsonl archived as
metrics.jsonl.gz (benchmarks keep finished runs' metrics so).
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import argument_parser, open_metrics  # noqa: E402  (benchmarks/ is on the path of a script run from it)

WINDOW = 10
EVAL_KEYS = ("eval/reward", "eval/accuracy", "eval/color_ok", "eval/shape_ok", "eval/count_ok", "eval/position_ok")


def rolling(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1) : i + 1]) / min(i + 1, WINDOW) for i in range(len(values))]


def main(paths: list[str], out: str) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for n, path in enumerate(paths):
        with open_metrics(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        train = [r for r in rows if r.get("reward/mean") is not None]
        evals = [r for r in rows if r.get("eval/reward") is not None]
        name = os.path.basename(os.path.dirname(path)) or path
        steps, rewards = [r["step"] for r in train], [r["reward/mean"] for r in train]
        if len(paths) == 1:
            a.plot(steps, rewards, alpha=0.3, label="batch reward")
        a.plot(steps, rolling(rewards), color=f"C{n}", label=f"rolling mean ({WINDOW})" if len(paths) == 1 else name)
        keys = EVAL_KEYS if len(paths) == 1 else ("eval/accuracy",)
        for key in keys:
            if any(key in r for r in evals):
                color = {} if len(paths) == 1 else {"color": f"C{n}"}
                b.plot([r["step"] for r in evals], [r.get(key) for r in evals], marker="o", label=key if len(paths) == 1 else name, **color)
    a.set_xlabel("trainer step")
    a.set_title("training reward")
    a.legend(fontsize=7)
    b.set_xlabel("trainer step")
    b.set_title("evaluation (ODE, fixed seeds, held-out prompts)" if len(paths) == 1 else "held-out eval/accuracy")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    ap = argument_parser(__doc__)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="metrics.jsonl (or .jsonl.gz) files, then optionally the PNG to write (default run.png)")
    paths = ap.parse_args().paths
    pngs = [p for p in paths if p.endswith(".png")]
    metrics = [p for p in paths if not p.endswith(".png")]
    if not metrics:
        ap.error("no metrics.jsonl given")
    main(metrics, pngs[-1] if pngs else "run.png")
