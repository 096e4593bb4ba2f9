"""Headroom: how often the base model can already draw a held-out prompt right, best-of-k.

For every held-out prompt (eval.prompts) the model draws `--samples` images by the evaluation's ODE
sampler (eval.num_steps, the given CFG scales, seeds fixed from eval.seed) and the reward's
per-sample "correct" check scores them. Reported per CFG scale: pass@1 (what eval/accuracy
measures), and best-of-k for k = 1, 2, 4, ..., samples: the share of prompts with at least one
right image among k, by the unbiased estimator 1 - C(n - c, k) / C(n, k) over the n samples (c
right), so best-of-n is the plain "any right" share. An RL run's held-out accuracy (pass@1) far
below the base's best-of-16 means the model can draw those images and the algorithm has not
made them likely yet; near it, the base has little more to give. Prints a table and writes
benchmarks/results/headroom/<name>.json.

    python benchmarks/headroom.py                         # the embedded model, CFG 4.5 and 1, 16 samples
    python benchmarks/headroom.py --cfg 4.5 --samples 16 --name embedded model.path=embedded
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def best_of(correct_counts: list[int], n: int, k: int) -> float:
    """Share of prompts with at least one right sample among k drawn from their n (c right)."""
    return sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in correct_counts) / len(correct_counts)


def measure(policy, cfg, guidance: float, samples: int) -> dict:
    import torch

    from async_flowgrpo.conditioning import with_sources
    from async_flowgrpo.evaluation import PROMPTS_PER_CALL
    from async_flowgrpo.prompts import load_prompts
    from async_flowgrpo.rewards import CombinedReward
    from async_flowgrpo.sampling import eval_sampling

    sampling = {**eval_sampling(cfg), "guidance_scale": guidance}
    prompts = load_prompts(cfg.eval.prompts)
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    counts, kinds = [], []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), PROMPTS_PER_CALL):
        chunk = prompts[start : start + PROMPTS_PER_CALL]
        metadata = [with_sources(p) for p in chunk]  # an edit model's input images, as the evaluation loads them
        with torch.no_grad():
            groups = policy.generate([p.text for p in chunk], samples, seed=cfg.eval.seed + start, **sampling,
                                     metadata=metadata)
        for p, m, g in zip(chunk, metadata, groups):
            _, components = reward(g.images, [p.text] * g.size, [m] * g.size)
            if "correct" not in components:
                raise SystemExit(f"reward {list(cfg.reward.weights)} has no per-sample 'correct' check to count")
            counts.append(int(components["correct"].sum()))
            kinds.append(p.metadata.get("kind"))
        common.log(f"cfg {guidance:g}: {len(counts)}/{len(prompts)} prompts")
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]
    out = {"guidance_scale": guidance, "prompts": len(counts), "samples_per_prompt": samples,
           "pass@1": sum(counts) / (len(counts) * samples),
           "best_of": {str(k): best_of(counts, samples, k) for k in ks},
           "time_s": time.perf_counter() - t0}
    by_kind = {}
    for kind in sorted({k for k in kinds if isinstance(k, str)}):
        sel = [c for c, kk in zip(counts, kinds) if kk == kind]
        by_kind[kind] = {"prompts": len(sel), "pass@1": sum(sel) / (len(sel) * samples),
                         f"best_of_{samples}": best_of(sel, samples, samples)}
    out["by_kind"] = by_kind
    return out


def main(argv: list[str]) -> None:
    ap = common.argument_parser(__doc__)
    ap.add_argument("--cfg", default="4.5,1", help="CFG scales, comma-separated (default 4.5,1)")
    ap.add_argument("--samples", type=int, default=16, help="samples per prompt (default 16)")
    ap.add_argument("--name", default="embedded", help="results file name (default embedded)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (model.path=..., eval.prompts=...)")
    a = ap.parse_args(argv)
    if a.samples < 1:
        ap.error("--samples must be >= 1")
    import torch

    from async_flowgrpo.builders import build_policy

    torch.set_num_threads(1)
    cfg = common.load_mode_config("sync", a.overrides)
    policy = build_policy(cfg)
    results = [measure(policy, cfg, float(g), a.samples) for g in a.cfg.split(",")]
    ks = list(results[0]["best_of"])
    print(f"\nheadroom of {cfg.model.path} on {cfg.eval.prompts} ({results[0]['prompts']} prompts, "
          f"{a.samples} samples each, {cfg.eval.num_steps} ODE steps)")
    print("| CFG | pass@1 | " + " | ".join(f"best-of-{k}" for k in ks) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in ks) + " |")
    for r in results:
        print(f"| {r['guidance_scale']:g} | {r['pass@1']:.3f} | " + " | ".join(f"{r['best_of'][k]:.3f}" for k in ks) + " |")
    path = os.path.join(common.RESULTS, "headroom", f"{a.name}.json")
    common.write_json(path, {"command": "python benchmarks/headroom.py " + " ".join(argv), "model": cfg.model.path,
                             "eval_prompts": cfg.eval.prompts, "eval_num_steps": cfg.eval.num_steps,
                             "eval_seed": cfg.eval.seed, "results": results, "machine": common.machine_info()})
    print(f"wrote {os.path.relpath(path, common.REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
