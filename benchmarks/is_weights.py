#!/usr/bin/env python
"""How large is the staleness weight pi_prox / pi_behav of a denoising step? Measured in-process (no
Ray) on the config's model and learner, at its default lr, to ground `algorithm.is_cap`.

Sync-style training from the base: at version v a batch is generated with the live weights (the
behaviour log-probs recorded, as a rollout does) and trained on, and the weights are kept. Then the
batch of version a is rescored under version a + s for each staleness s, giving per (sample, step):

    element_mean:  log w = prox - behav         (the recorded per-element-mean log-probs: today's weight)
    step:          log w = D * (prox - behav)   (the log density ratio of the step's whole latent, D = C*H*W)

For Gaussian steps of equal std, log w_step ~ N(-K, 2K) under the behaviour policy, K the step's KL
between the two versions: the mean is about -var/2, and E[w] = 1. Reported per staleness: quantiles
of both, the share of pairs whose step weight is above each cap (and below 1/cap), the uncapped ESS
and the step-level std per window step. JSON to benchmarks/results/is_weights/<name>.json.

    python benchmarks/is_weights.py                           # embedded model, sync defaults, < 3 min
    python benchmarks/is_weights.py --name lr3e-4 trainer.lr=3e-4
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS, argument_parser, load_mode_config, log, set_group_advantages, write_json  # noqa: E402

import torch  # noqa: E402

CAPS = (1.5, 2.0, 3.0, 5.0, 10.0, 100.0)
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


@torch.no_grad()
def step_log_probs(policy, groups, uncond_grad: bool) -> torch.Tensor:
    """The per-element-mean log-prob of every recorded step under the policy's current weights,
    [samples, W], as the learner's recompute scores it."""
    rows = []
    for g in groups:
        p, n = g.params, g.size
        cond = [None if t is None else t.unsqueeze(0).expand(n, *t.shape) for t in
                (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]
        cols = [policy.recompute(g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n), g.sigmas[j + 1].expand(n),
                                 *cond, guidance_scale=p.guidance_scale, noise_level=p.noise_level, sde_type=p.sde_type,
                                 uncond_grad=uncond_grad)[0]
                for j in range(g.log_probs.shape[1])]
        rows.append(torch.stack(cols, 1))
    return torch.cat(rows).float().cpu()


def describe(log_w: torch.Tensor) -> dict:
    flat = log_w.flatten().double()
    q = torch.quantile(flat, torch.tensor(QUANTILES, dtype=torch.float64))
    w = flat.exp()
    ess = float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if torch.isfinite(w).all() else 0.0
    return {"pairs": flat.numel(), "mean": float(flat.mean()), "std": float(flat.std()), "min": float(flat.min()),
            "max": float(flat.max()), "quantiles": {str(k): float(v) for k, v in zip(QUANTILES, q)},
            "ess_uncapped": ess,
            "above_cap": {str(c): float((flat > math.log(c)).double().mean()) for c in CAPS},
            "below_inv_cap": {str(c): float((flat < -math.log(c)).double().mean()) for c in CAPS}}


def main(argv=None) -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--name", default="default", help="results go to benchmarks/results/is_weights/NAME.json")
    ap.add_argument("--updates", type=int, default=7, help="trainer updates from the base (versions 0..N)")
    ap.add_argument("--warmup", type=int, default=1, help="leave out batches generated before this version")
    ap.add_argument("--staleness", default="0,1,2,4", help="comma list of version gaps to rescore at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (on config/sync.yaml)")
    a = ap.parse_args(argv)
    gaps = [int(s) for s in a.staleness.split(",")]
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    from async_flowgrpo.builders import build_learner
    from async_flowgrpo.rollout.engine import DiffusersEngine
    from async_flowgrpo.rollout.worker import RolloutWorker

    cfg = load_mode_config("sync", [f"trainer.seed={a.seed}", f"rollout.seed={a.seed}", *a.overrides])
    t0 = time.perf_counter()
    learner = build_learner(cfg)
    worker = RolloutWorker(cfg, engine=DiffusersEngine(learner.policy, update_point="between_groups"))
    per_step = cfg.rollout.groups_per_step
    batches, weights = [], []
    for v in range(a.updates + 1):
        weights.append({k: t.clone() for k, t in learner.policy.trainable_state().items()})
        worker.engine.load_weights(weights[-1], v)
        groups = worker.generate(list(range(v * per_step, (v + 1) * per_step)))
        set_group_advantages(groups, cfg.algorithm)
        batches.append(groups)
        if v < a.updates:
            m = learner.train_step(groups, version=v)
            log(f"version {v}: reward {m['reward/mean']:.3f}, grad norm {m['train/grad_norm']:.3f}, lr {m['train/lr']:g}")

    elements = batches[0][0].latents[0, 0].numel()
    behav = [torch.cat([g.log_probs for g in b]).float() for b in batches]
    diffs: dict[int, list[torch.Tensor]] = {s: [] for s in gaps}
    for b in range(a.updates + 1):  # load each version once, rescore every batch that is s older
        olds = [(s, b - s) for s in gaps if a.warmup <= b - s]
        if olds:
            learner.policy.load_trainable_state(weights[b])
            for s, old in olds:
                diffs[s].append(step_log_probs(learner.policy, batches[old], cfg.algorithm.flow_grpo.uncond_grad) - behav[old])

    result = {"command": " ".join(["python benchmarks/is_weights.py", *(argv if argv is not None else sys.argv[1:])]),
              "latent_elements": elements, "lr": cfg.trainer.lr, "lr_schedule": cfg.trainer.lr_schedule,
              "beta": cfg.algorithm.beta, "samples_per_batch": cfg.batch_size,
              "window_steps": behav[0].shape[1], "updates": a.updates, "warmup": a.warmup, "staleness": {}}
    print(f"D = {elements} latent elements; per (sample, step) log w at each staleness "
          f"(batches from version {a.warmup} on):")
    print("| s | pairs | element_mean log w: min .. max | step log w: mean, std | q05 .. q95 | w_step > 2 | > 5 | "
          "< 1/2 | ESS uncapped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in gaps:
        if not diffs[s]:
            continue
        d = torch.cat(diffs[s])
        mean_level, step_level = describe(d), describe(d * elements)
        per_window_step = [float((d[:, j] * elements).std()) for j in range(d.shape[1])]
        result["staleness"][str(s)] = {"element_mean": mean_level, "step": step_level,
                                       "step_std_per_window_step": per_window_step}
        q = step_level["quantiles"]
        print(f"| {s} | {step_level['pairs']} | {mean_level['min']:.2e} .. {mean_level['max']:.2e} | "
              f"{step_level['mean']:.3f}, {step_level['std']:.3f} | {q['0.05']:.3f} .. {q['0.95']:.3f} | "
              f"{step_level['above_cap']['2.0']:.3f} | {step_level['above_cap']['5.0']:.3f} | "
              f"{step_level['below_inv_cap']['2.0']:.3f} | {step_level['ess_uncapped']:.3f} |")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(RESULTS, "is_weights", f"{a.name}.json")
    write_json(path, result)
    log(f"wrote {path} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
