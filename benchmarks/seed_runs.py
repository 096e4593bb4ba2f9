#!/usr/bin/env python
"""Learning on several seeds: run a launcher once per seed, then report every run.

What a user runs is what is measured: each seed is `python launch/<mode>.py [FILES] [key=value ...]
trainer.seed=S rollout.seed=S` as a subprocess, with the launcher's own held-out evaluation. A run
keeps its metrics.jsonl, config.yaml, the command, its wall time and its first and last evaluation
grids under benchmarks/results/seed_runs/<name>/seed<S>/ (checkpoints and rollout grids are
deleted). A seed whose run finished is skipped, and one that was cut off (a signal, a session's end)
continues from its last checkpoint with the same command, so a sweep spans sessions; two
invocations with different --seeds can run side by side into the same <name>.

    python benchmarks/seed_runs.py run recipe --seeds 0,1,2,3,4                 # the defaults
    python benchmarks/seed_runs.py run nft --seeds 0,1 config/diffusion_nft.yaml
    python benchmarks/seed_runs.py run lr3e-4 --seeds 10,11 --mode sync trainer.lr=3e-4
    python benchmarks/seed_runs.py run edit --seeds 0 --final-samples 8 config/shapes_edit.yaml  # + a larger last evaluation
    python benchmarks/seed_runs.py report recipe nft                            # tables + summary.json
    python benchmarks/seed_runs.py report recipe nft --plot benchmarks/results/seed_runs/curves.png
    python benchmarks/seed_runs.py compare recipe recipe_sync dgpo_fully_async --target 0.087  # one row a name
    python benchmarks/seed_runs.py paired dgpo_sync dgpo_fully_async               # the difference, seed by seed

The report gives per seed the held-out accuracy at every evaluation, the rise of the **last**
evaluation over step 0, the training reward's first and last quarter and the wall time; then the
mean rise, its standard error (std / sqrt(n)) and the worst seed.
"""

from __future__ import annotations

import contextlib
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
                    write_json)

ROOT = os.path.join(RESULTS, "seed_runs")
MODES = ("sync", "one_step_off", "fully_async")


def finished(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, "run.json"))


def evaluate(args: list[str], env: dict, overrides: list[str], flags: list[str] = ()) -> float:
    """Held-out accuracy from `python -m async_flowgrpo.evaluation` with the run's files and overrides."""
    cmd = [sys.executable, "-m", "async_flowgrpo.evaluation", *args, *overrides, *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.split()[:1] == ["eval/accuracy"]:
            return float(line.split()[1])
    raise SystemExit(f"evaluation {shlex.join([*overrides, *flags])} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")


def evaluate_final(out: str, args: list[str], env: dict, guidance: float | None = None, live: bool = False,
                   samples: int | None = None) -> float:
    """Held-out accuracy of the run's last checkpoint (the same evaluation): at another CFG scale, of
    its live weights where the run evaluated a weight average (trainer.ema_decay), or on more samples
    per prompt (a smaller standard error than the run's own evaluations)."""
    overrides = [f"trainer.output_dir={out}", "trainer.resume=latest",
                 *([f"eval.guidance_scale={guidance}"] if guidance is not None else []),
                 *([f"eval.samples_per_prompt={samples}"] if samples else [])]
    return evaluate(args, env, overrides, ["--live"] if live else [])


def base_accuracy(name: str, args: list[str], env: dict, samples: int) -> float:
    """The base model's held-out accuracy on `samples` per prompt: the evaluation's noise is fixed by
    eval.seed, not the training seed, so one value serves every seed of `name` (kept in
    <name>/base_samples<N>.json)."""
    path = os.path.join(ROOT, name, f"base_samples{samples}.json")
    if os.path.exists(path):
        return json.load(open(path))["accuracy"]
    scratch = os.path.join(ROOT, name, f".base_samples{samples}_{os.getpid()}")  # output_dir: nothing is written there
    accuracy = evaluate(args, env, [f"trainer.output_dir={scratch}", "trainer.resume=null", f"eval.samples_per_prompt={samples}"])
    shutil.rmtree(scratch, ignore_errors=True)
    write_json(path, {"samples_per_prompt": samples, "accuracy": accuracy, "args": args})
    return accuracy


def weight_average_on(run_dir: str) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.load(os.path.join(run_dir, "config.yaml")).trainer.ema_decay > 0


LAUNCH = "launch.json"  # a started run's command (but the interpreter) and the seconds it ran, for continuing it


def write_launch(out: str, full: list[str], wall_s: float, started: float | None) -> None:
    """The run's command and its seconds so far; `started` (perf_counter) while it runs: a run cut
    off counts up to its metrics' last write."""
    with open(os.path.join(out, LAUNCH), "w") as f:
        json.dump({"command": shlex.join(full[1:]), "wall_s": round(wall_s, 1), "running_since": started is not None,
                   "started_unix": time.time() if started is not None else None}, f)


def resumable_wall(out: str, full: list[str]) -> float | None:
    """The seconds an unfinished run of the same command ran before, when it left a checkpoint to
    continue from (None: start again). A run cut off mid-segment counts to its metrics' last write."""
    try:
        launch = json.load(open(os.path.join(out, LAUNCH)))
    except (OSError, ValueError):
        return None
    if launch.get("command") != shlex.join(full[1:]) or not os.path.exists(os.path.join(out, "checkpoints", "latest")):
        return None
    wall = float(launch.get("wall_s", 0.0))
    if launch.get("running_since") and launch.get("started_unix"):
        metrics = os.path.join(out, "metrics.jsonl")
        last_write = os.path.getmtime(metrics) if os.path.exists(metrics) else launch["started_unix"]
        wall += max(0.0, last_write - launch["started_unix"])
    return max(wall, 1e-3)  # (> 0: a run that continues)


def run_seed(name: str, seed: int, mode: str, args: list[str], other_cfg: list[float], final_samples: int = 0) -> None:
    out = os.path.join(ROOT, name, f"seed{seed}")
    if finished(out):
        log(f"{name} seed {seed}: done before, skipped")
        return
    cmd = [sys.executable, os.path.join("launch", f"{mode}.py"), *args, f"trainer.seed={seed}", f"rollout.seed={seed}"]
    full = [*cmd, f"trainer.output_dir={out}", "logging.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    wall_before = resumable_wall(out, full)
    if wall_before is None:  # nothing to continue: start again
        shutil.rmtree(out, ignore_errors=True)
        wall_before = 0.0
    else:  # the same command stopped (a signal, the session's end): its last checkpoint continues
        log(f"{name} seed {seed}: continuing from its last checkpoint ({wall_before:.0f} s run before)")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    write_launch(out, full, wall_before, t0)
    log(f"{name} seed {seed}: {shlex.join(full)}")
    proc = subprocess.run([*full, *(["trainer.resume=latest"] if wall_before else [])], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = wall_before + time.perf_counter() - t0
    write_launch(out, full, wall, None)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        if proc.returncode == 2 and not wall_before:  # refused before it ran (a config error): no run to keep
            shutil.rmtree(out, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(out))  # the sweep's directory, when this was its only seed
            print(f"{name} seed {seed}: {tail[-1] if tail else 'exit 2'}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(f"{name} seed {seed}: exit {proc.returncode}: {' | '.join(tail)}")
    final_at = {str(g): evaluate_final(out, args, env, guidance=g) for g in other_cfg}
    # the run evaluated its weight average: the same last checkpoint's live weights, a paired comparison
    final_live = evaluate_final(out, args, env, live=True) if weight_average_on(out) else None
    final_large = None
    if final_samples:  # the last checkpoint and the base on more samples per prompt: a rise with a smaller SE
        final_large = {"samples_per_prompt": final_samples, "base": base_accuracy(name, args, env, final_samples),
                       "last": evaluate_final(out, args, env, samples=final_samples)}
        if final_live is not None:  # the paired comparison at the smaller SE too
            final_large["last_live"] = evaluate_final(out, args, env, live=True, samples=final_samples)
    prune_run_outputs(out)
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"command": shlex.join(c if c != sys.executable else "python" for c in cmd), "seed": seed,
                   "mode": mode, "wall_s": round(wall, 1), "final_eval_accuracy_at_cfg": final_at,
                   "final_eval_accuracy_live": final_live, "final_eval_large": final_large,
                   "last_line": proc.stdout.strip().splitlines()[-1:]}, f, indent=1)
    os.remove(os.path.join(out, LAUNCH))  # (run.json holds the command and the time)
    log(f"{name} seed {seed}: {wall:.0f} s")


def summarize_run(run_dir: str) -> dict:
    rows = read_metrics(run_dir)
    info = json.load(open(os.path.join(run_dir, "run.json")))
    # the shapes model's accuracy; other rewards (the Wan demo's temporal consistency): the eval reward
    metric = "eval/accuracy" if any("eval/accuracy" in r for r in rows) else "eval/reward"
    evals = {r["step"]: r[metric] for r in rows if metric in r}
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    quarter = max(1, len(rewards) // 4)
    steps = sorted(evals)
    # the run's seconds at each evaluation less the evaluations' own (time_s is written after it)
    train_s, eval_s = {}, 0.0
    for r in rows:
        if metric in r and "time_s" in r:
            eval_s += r.get("eval/time_s", 0.0)
            train_s[r["step"]] = round(r["time_s"] - eval_s, 1)
    return {
        "seed": info["seed"],
        "command": info["command"],
        "wall_s": info["wall_s"],
        "eval_metric": metric,
        "eval_accuracy": {s: round(evals[s], 4) for s in steps},  # of eval_metric
        "eval_train_s": {s: train_s[s] for s in steps if s in train_s},  # seconds of the run but its evaluations
        "rise": round(evals[steps[-1]] - evals[steps[0]], 4),
        "reward_first_quarter": round(sum(rewards[:quarter]) / quarter, 4),
        "reward_last_quarter": round(sum(rewards[-quarter:]) / quarter, 4),
        "final_at_cfg": info.get("final_eval_accuracy_at_cfg", {}),
        "final_live": info.get("final_eval_accuracy_live"),  # where the evaluations are of a weight average
        "final_large": info.get("final_eval_large"),  # {samples_per_prompt, base, last[, last_live]}: --final-samples
        "staleness_mean": round(sum(r.get("staleness/mean", 0) for r in rows) / max(1, len(rewards)), 3),
        "mode": info.get("mode"),
        "train_step_s_median": _median([r["train/time_s"] for r in rows if "train/time_s" in r]),
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round((v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2, 3)


def _se(values: list[float]) -> float:
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n) if n > 1 else math.nan


def finished_runs(base: str) -> list[str]:
    """The run directories under `base` whose run finished (seed<S>/ with a run.json)."""
    return [os.path.join(base, d) for d in sorted(os.listdir(base)) if d.startswith("seed") and finished(os.path.join(base, d))]


def summarize(name: str) -> dict:
    base = os.path.join(ROOT, name)
    runs = [summarize_run(d) for d in finished_runs(base)]
    if not runs:
        raise SystemExit(f"{name}: no finished run under {base}")
    runs.sort(key=lambda r: r["seed"])
    rises = [r["rise"] for r in runs]
    n = len(rises)
    mean = sum(rises) / n
    se = _se(rises)
    from omegaconf import OmegaConf

    eval_cfg = OmegaConf.load(os.path.join(base, f"seed{runs[0]['seed']}", "config.yaml")).eval.guidance_scale
    summary = {"name": name, "eval_guidance_scale": eval_cfg, "runs": runs, "n": n, "rise_mean": round(mean, 4), "rise_se": round(se, 4),
               "rise_worst": min(rises), "reward_quarters_rising": sum(r["reward_last_quarter"] > r["reward_first_quarter"] for r in runs)}
    if all(r["final_live"] is not None for r in runs):  # the average's last evaluation less the live weights', per seed
        gaps = [list(r["eval_accuracy"].values())[-1] - r["final_live"] for r in runs]
        summary["average_minus_live"] = {"mean": round(sum(gaps) / n, 4), "se": round(_se(gaps), 4), "per_seed": [round(g, 4) for g in gaps]}
    large = [r["final_large"] for r in runs if r.get("final_large")]
    if len(large) == n and len({x["samples_per_prompt"] for x in large}) == 1:  # the rise on the larger evaluation
        rises_large = [x["last"] - x["base"] for x in large]
        summary["rise_large"] = {"samples_per_prompt": large[0]["samples_per_prompt"], "base": large[0]["base"],
                                 "mean": round(sum(rises_large) / n, 4), "se": round(_se(rises_large), 4),
                                 "worst": round(min(rises_large), 4), "per_seed": [round(x, 4) for x in rises_large]}
        if all("last_live" in x for x in large):  # the weight average less the live weights, on the larger evaluation
            gaps = [x["last"] - x["last_live"] for x in large]
            summary["rise_large"]["average_minus_live"] = {"mean": round(sum(gaps) / n, 4), "se": round(_se(gaps), 4),
                                                           "per_seed": [round(g, 4) for g in gaps]}
    with open(os.path.join(base, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def table(summary: dict) -> str:
    lines = [f"{summary['name']}: `{summary['runs'][0]['command']}` (seed varies; evaluated at CFG "
             f"{summary['eval_guidance_scale']:g})", "",
             f"| seed | held-out {summary['runs'][0].get('eval_metric', 'eval/accuracy')} by evaluation | rise (last - step 0) "
             "| training reward, first -> last quarter | wall |",
             "| --- | --- | --- | --- | --- |"]
    for r in summary["runs"]:
        curve = " -> ".join(f"{v:.3f}" for v in r["eval_accuracy"].values())
        curve += "".join(f"; CFG {g}: {v:.3f}" for g, v in r["final_at_cfg"].items())
        curve += f"; live weights: {r['final_live']:.3f}" if r.get("final_live") is not None else ""
        if r.get("final_large"):
            x = r["final_large"]
            curve += f"; on {x['samples_per_prompt']} samples a prompt: {x['base']:.3f} -> {x['last']:.3f}"
            curve += f" (live weights: {x['last_live']:.3f})" if "last_live" in x else ""
        wall = "n/a" if r["wall_s"] is None else f"{r['wall_s']:.0f} s"
        lines.append(f"| {r['seed']} | {curve} | {r['rise']:+.3f} | {r['reward_first_quarter']:.3f} -> "
                     f"{r['reward_last_quarter']:.3f} | {wall} |")
    lines.append(f"| mean (n={summary['n']}) | | **{summary['rise_mean']:+.3f}** (SE {summary['rise_se']:.3f}, "
                 f"worst {summary['rise_worst']:+.3f}) | last quarter above first in "
                 f"{summary['reward_quarters_rising']}/{summary['n']} | |")
    if "rise_large" in summary:
        x = summary["rise_large"]
        lines.append(f"\nthe last checkpoint against the base on {x['samples_per_prompt']} samples a prompt (base "
                     f"{x['base']:.3f}): rise {x['mean']:+.3f} (SE {x['se']:.3f}, worst {x['worst']:+.3f})")
        if "average_minus_live" in x:
            gap = x["average_minus_live"]
            lines.append(f"the weight average less the live weights there: {gap['mean']:+.3f} (SE {gap['se']:.3f}; "
                         f"per seed {', '.join(f'{g:+.3f}' for g in gap['per_seed'])})")
    if "average_minus_live" in summary:
        gap = summary["average_minus_live"]
        lines.append(f"\nthe weight average's last evaluation less the live weights': {gap['mean']:+.3f} (SE {gap['se']:.3f}; "
                     f"per seed {', '.join(f'{g:+.3f}' for g in gap['per_seed'])})")
    return "\n".join(lines)


def first_step_at(run: dict, target: float) -> int | None:
    """The first evaluation's step whose accuracy is at least step 0's + target (None: never)."""
    curve = [(int(k), v) for k, v in run["eval_accuracy"].items()]
    start = min(curve)[1]
    return next((step for step, acc in sorted(curve) if step > 0 and acc >= start + target), None)


def compare_row(summary: dict, target: float) -> dict:
    """One name's seeds in a line: the last evaluation, its rise, the other CFG's, the steps (and the
    run's seconds, evaluations left out) to a rise of `target`, how far the last evaluation is under
    the run's best, a trainer step's time."""
    runs, n = summary["runs"], summary["n"]
    last = [list(r["eval_accuracy"].values())[-1] for r in runs]
    reached = [first_step_at(r, target) for r in runs]
    hit = sorted(s for s in reached if s is not None)
    secs = sorted(r["eval_train_s"][s] for r, s in zip(runs, reached) if s is not None and s in r["eval_train_s"])
    other = {}
    for g in sorted({g for r in runs for g in r["final_at_cfg"]}):
        values = [r["final_at_cfg"][g] for r in runs if g in r["final_at_cfg"]]
        other[g] = {"n": len(values), "mean": round(sum(values) / len(values), 4), "worst": min(values)}
    times = [r["train_step_s_median"] for r in runs if r.get("train_step_s_median") is not None]
    return {"name": summary["name"], "mode": runs[0].get("mode"), "n": n, "seeds": [r["seed"] for r in runs],
            "eval_guidance_scale": summary["eval_guidance_scale"], "step0": list(runs[0]["eval_accuracy"].values())[0],
            "last_mean": round(sum(last) / n, 4), "last_worst": min(last),
            "rise_mean": summary["rise_mean"], "rise_se": summary["rise_se"], "rise_worst": summary["rise_worst"],
            "other_cfg": other, "target": target, "reached": len(hit), "steps_to_target": hit,
            "step_to_target_median": _median([float(s) for s in hit]) if len(hit) * 2 > n else None,  # else the range
            "seconds_to_target": secs,
            "seconds_to_target_median": _median(secs) if len(hit) * 2 > n and len(secs) == len(hit) else None,
            "best_minus_last_max": round(max(max(r["eval_accuracy"].values()) - l for r, l in zip(runs, last)), 4),
            "train_step_s_median": _median(times)}


def paired(base: dict, other: dict) -> dict:
    """`other`'s last evaluation less `base`'s, seed by seed on the seeds both ran: runs of one
    commit and evaluation schedule that differ in one setting share their sync-mode randomness, so
    the difference has a smaller SE than the two rises' (fully_async runs pair less well)."""
    a, b = ({r["seed"]: list(r["eval_accuracy"].values())[-1] for r in s["runs"]} for s in (base, other))
    seeds = sorted(a.keys() & b.keys())
    if not seeds:
        raise SystemExit(f"{base['name']} and {other['name']}: no seed in common")
    diffs = [round(b[k] - a[k], 4) for k in seeds]
    return {"base": base["name"], "other": other["name"], "seeds": seeds, "per_seed": diffs,
            "mean": round(sum(diffs) / len(diffs), 4), "se": round(_se(diffs), 4), "worst": min(diffs)}


def compare_table(rows: list[dict]) -> str:
    target = rows[0]["target"]
    lines = ["| name | mode | seeds | CFG | step 0 | last: mean (worst) | rise: mean (SE), worst | last at the other CFG: mean (worst) "
             f"| to +{target:g}: median step (seeds) | seconds | best - last, max | trainer step, median |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        other = "; ".join(f"CFG {float(g):g}: {o['mean']:.3f} ({o['worst']:.3f})" + (f", n={o['n']}" if o["n"] != r["n"] else "")
                          for g, o in r["other_cfg"].items()) or "-"
        step = ("never" if not r["reached"] else f"{r['step_to_target_median']:g}" if r["step_to_target_median"] is not None
                else "-".join(f"{s:g}" for s in sorted({min(r["steps_to_target"]), max(r["steps_to_target"])})))
        secs = ("-" if not r["seconds_to_target"] else f"{r['seconds_to_target_median']:.0f}" if r["seconds_to_target_median"] is not None
                else "-".join(f"{t:.0f}" for t in sorted({min(r["seconds_to_target"]), max(r["seconds_to_target"])})))
        seeds = ",".join(str(s) for s in r["seeds"])
        se = "n/a" if math.isnan(r["rise_se"]) else f"{r['rise_se']:.3f}"
        t = "n/a" if r["train_step_s_median"] is None else f"{r['train_step_s_median']:.2f} s"
        lines.append(f"| {r['name']} | {r['mode']} | {seeds} | {r['eval_guidance_scale']:g} | {r['step0']:.3f} | "
                     f"{r['last_mean']:.3f} ({r['last_worst']:.3f}) | {r['rise_mean']:+.3f} ({se}), {r['rise_worst']:+.3f} | "
                     f"{other} | {step} ({r['reached']}/{r['n']}) | {secs} | {r['best_minus_last_max']:.3f} | {t} |")
    return "\n".join(lines)


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7 + 3 * (len(summaries) > 3), 4))
    for k, s in enumerate(summaries):
        color = f"C{k}"
        for i, r in enumerate(s["runs"]):
            steps = [int(x) for x in r["eval_accuracy"]]
            ax.plot(steps, list(r["eval_accuracy"].values()), color=color, alpha=0.35, lw=1)
        steps = sorted({int(x) for r in s["runs"] for x in r["eval_accuracy"]})
        mean = [sum(r["eval_accuracy"].get(st, r["eval_accuracy"].get(str(st), math.nan)) for r in s["runs"]) / s["n"] for st in steps]
        ax.plot(steps, mean, color=color, lw=2.5, label=f"{s['name']} (eval CFG {s['eval_guidance_scale']:g}; mean of {s['n']})")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    if len(summaries) > 3:  # beside the axes: inside it would hide curves
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def plot_metrics(names: list[str], keys: list[str], path: str, window: int = 10) -> None:
    """One panel a metric, one line a run (colour by name): the update size and the gradient norm
    show a collapse coming before the held-out accuracy does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        for k, name in enumerate(names):
            for i, run_dir in enumerate(finished_runs(os.path.join(ROOT, name))):
                rows = [r for r in read_metrics(run_dir) if key in r and r["step"] >= 1]
                windows = [rows[max(0, j - window + 1):j + 1] for j in range(len(rows))]
                smooth = [sum(r[key] for r in w) / len(w) for w in windows]
                ax.plot([r["step"] for r in rows], smooth, color=f"C{k}", alpha=0.6, lw=1, label=name if i == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main(argv=None) -> None:
    ap = argument_parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the seeds not yet finished")
    r.add_argument("name", help="results go to benchmarks/results/seed_runs/NAME/seed<S>/")
    r.add_argument("--seeds", required=True, help="comma list, e.g. 0,1,2,3,4")
    r.add_argument("--mode", default="fully_async", choices=MODES)
    r.add_argument("--other-cfg", default="", help="also evaluate the last checkpoint at these CFG scales, e.g. 1.0")
    r.add_argument("--final-samples", type=int, default=0, metavar="N",
                   help="also evaluate the last checkpoint and the base on N samples a prompt (eval.samples_per_prompt)")
    r.add_argument("args", nargs="*", help="YAML files and key=value overrides, as the launcher takes them")
    p = sub.add_parser("report", help="per-seed tables and summary.json of finished runs")
    p.add_argument("names", nargs="+")
    p.add_argument("--plot", help="write a PNG of the held-out accuracy curves")
    p.add_argument("--plot-metrics", metavar="KEYS:PNG", help="a PNG of training metrics by step, one panel a key, "
                   "e.g. train/grad_norm,nft/old_deviation:curves.png (a 10-step running mean, log scale)")
    c = sub.add_parser("compare", help="one row a name: last evaluation, rise, other CFG, steps to a rise, step time")
    c.add_argument("names", nargs="+")
    c.add_argument("--target", type=float, default=0.087, help="the rise whose first evaluation is counted (Flow-GRPO's mean)")
    c.add_argument("--json", help="also write the rows here")
    d = sub.add_parser("paired", help="the second name's last evaluation less the first's, seed by seed")
    d.add_argument("names", nargs=2, metavar="NAME")
    a = parse_run_overrides(ap, argv)
    if a.cmd == "run":
        try:
            seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        except ValueError:
            ap.error(f"--seeds {a.seeds!r}: expected a comma list of integers")
        if a.final_samples < 0:
            ap.error(f"--final-samples {a.final_samples}: expected a number of samples a prompt (0: none)")
        for seed in seeds:
            run_seed(a.name, seed, a.mode, a.args, [float(g) for g in a.other_cfg.split(",") if g.strip()], a.final_samples)
        return
    missing = [n for n in a.names if not os.path.isdir(os.path.join(ROOT, n))]
    if missing:
        ap.error(f"no runs named {', '.join(missing)} under {ROOT}")
    summaries = [summarize(n) for n in a.names]
    if a.cmd == "paired":
        x = paired(*summaries)
        print(f"{x['other']} - {x['base']}, last evaluation, seeds {','.join(map(str, x['seeds']))}: "
              f"{x['mean']:+.3f} (SE {x['se']:.3f}, worst {x['worst']:+.3f}; per seed {', '.join(f'{v:+.3f}' for v in x['per_seed'])})")
        return
    if a.cmd == "compare":
        rows = [compare_row(s, a.target) for s in summaries]
        print(compare_table(rows))
        if a.json:
            write_json(a.json, rows)
        return
    for s in summaries:
        print(table(s), end="\n\n")
    if a.plot:
        plot(summaries, a.plot)
    if a.plot_metrics:
        keys, _, path = a.plot_metrics.rpartition(":")
        if not keys or not path:
            ap.error(f"--plot-metrics {a.plot_metrics!r}: expected KEY[,KEY...]:PNG")
        plot_metrics(a.names, keys.split(","), path)


if __name__ == "__main__":
    main()
