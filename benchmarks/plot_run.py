#!/usr/bin/env python
"""Plot a run's metrics.jsonl: training reward (rolling mean) and eval metrics against step.

    python benchmarks/plot_run.py outputs/fully_async/metrics.jsonl [out.png]
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str, out: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    train = [r for r in rows if r.get("reward/mean") is not None]
    evals = [r for r in rows if r.get("eval/reward") is not None]
    window = 10
    rolling = [sum(r["reward/mean"] for r in train[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(train))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot([r["step"] for r in train], [r["reward/mean"] for r in train], alpha=0.3, label="batch reward")
    a.plot([r["step"] for r in train], rolling, label=f"rolling mean ({window})")
    a.set_xlabel("trainer step")
    a.set_title("training reward")
    a.legend()
    for key in ("eval/reward", "eval/accuracy", "eval/color_ok", "eval/shape_ok", "eval/count_ok", "eval/position_ok"):
        if any(key in r for r in evals):
            b.plot([r["step"] for r in evals], [r.get(key) for r in evals], marker="o", label=key)
    b.set_xlabel("trainer step")
    b.set_title("evaluation (ODE, fixed seeds, held-out prompts)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "run.png")
