#!/usr/bin/env python
"""How much of one update's gradient is signal? Measured in-process (no Ray) at the config's base
weights, for either algorithm, with the run's own rollouts, rewards and advantages.

N independent batches (the config's groups_per_step x group_size each, prompts drawn as a rollout
actor draws them) are generated and each one's gradient is taken exactly as an update takes it;
no optimizer step is applied, so every gradient is at the same weights. Write a batch gradient
g_i = s + n_i (s: the expected gradient, n_i: its noise). For independent batches
E[cos(g_i, g_j)] ~ |s|^2 / (|s|^2 + E|n|^2): the share of a batch gradient's squared norm that is
signal, the same for every batch. Reported: the mean over all pairs, with a jackknife standard
error over batches (pairs that share a batch are not independent). JSON to
benchmarks/results/grad_signal/<name>.json.

Two refinements. Adam steps each coordinate by its gradient over its own running scale, so the
direction a step takes is the gradient with each coordinate divided by its RMS: the same cosine on
those standardized gradients (coordinates no batch moves, LoRA A at B = 0, drop out) is reported
beside the plain one. And --null takes every batch's gradient a second time with its rewards
shuffled across the batch's samples: no advantage then depends on the sample, the expected
gradient is zero, and the null's mean cosine (plain and standardized) is what noise alone reads.

    python benchmarks/grad_signal.py --name flow_grpo                                  # about 5 min
    python benchmarks/grad_signal.py --name diffusion_nft config/diffusion_nft.yaml
    python benchmarks/grad_signal.py --name flow_grpo_null --null                      # twice the gradients
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS, argument_parser, load_mode_config, log, set_group_advantages, write_json  # noqa: E402

import torch  # noqa: E402


def signal_share(grads: list[torch.Tensor]) -> tuple[float, float]:
    """Mean pairwise cosine of the batch gradients and its jackknife standard error over batches."""
    n = len(grads)
    if n < 3:
        raise ValueError(f"need at least 3 batches for a standard error, got {n}")
    flat = torch.nn.functional.normalize(torch.stack([g.double() for g in grads]), dim=1)
    cos = flat @ flat.T
    off_diagonal = cos - torch.diag(torch.diag(cos))
    total = float(off_diagonal.sum()) / 2  # each pair once
    mean = total / (n * (n - 1) / 2)
    leave_out = (total - off_diagonal.sum(dim=1)) / ((n - 1) * (n - 2) / 2)  # batch k and its pairs left out
    se = float(((n - 1) / n * ((leave_out - leave_out.mean()) ** 2).sum()) ** 0.5)
    return mean, se


def standardized(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each coordinate divided by its RMS over the batches (the scale Adam divides by): the directions
    Adam steps would take. Coordinates that no batch moves are dropped."""
    stack = torch.stack([g.double() for g in grads])
    rms = stack.pow(2).mean(0).sqrt()
    moved = rms > 0
    return list(stack[:, moved] / rms[moved])


def shuffled_rewards(groups, a, generator: torch.Generator) -> None:
    """The null control: the batch's rewards shuffled across all its samples (over groups), then each
    group's advantages from them as a run computes them (set_group_advantages); the groups' rewards
    stay shuffled."""
    rewards = torch.cat([g.rewards for g in groups])
    shuffled = rewards[torch.randperm(len(rewards), generator=generator)]
    start = 0
    for g in groups:
        g.rewards = shuffled[start : start + g.size]
        start += g.size
    set_group_advantages(groups, a)


def batch_gradient(learner, groups, version: int = 0) -> torch.Tensor:
    """The flattened gradient the learner's update would step with on `groups` (its first mini-batch),
    leaving the weights as they are."""
    captured = []
    step = learner.optimizer.step
    learner.optimizer.step = lambda *a, **k: captured.append(torch.cat([p.grad.detach().flatten() for p in learner.params]))
    try:
        learner.train_step(groups, version=version)
    finally:
        learner.optimizer.step = step
    return captured[0]


def main(argv=None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("--name", default="default", help="results go to benchmarks/results/grad_signal/NAME.json")
    ap.add_argument("--batches", type=int, default=200, help="independent batches (pairs: N(N-1)/2)")
    ap.add_argument("--seed", type=int, default=1000, help="rollout seed: prompts and noise")
    ap.add_argument("--out", default=os.path.join(RESULTS, "grad_signal"), help="folder for NAME.json")
    ap.add_argument("--null", action="store_true", help="also each batch's gradient with its rewards shuffled (a null control)")
    ap.add_argument("overrides", nargs="*", help="YAML files and key=value config overrides (on config/sync.yaml)")
    a = ap.parse_args(argv)
    if a.batches < 3:
        ap.error("--batches must be >= 3")
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    from async_flowgrpo.builders import build_learner
    from async_flowgrpo.rollout.engine import DiffusersEngine
    from async_flowgrpo.rollout.worker import RolloutWorker

    cfg = load_mode_config("sync", [f"rollout.seed={a.seed}", *a.overrides])
    t0 = time.perf_counter()
    learner = build_learner(cfg)
    worker = RolloutWorker(cfg, engine=DiffusersEngine(learner.policy, update_point="between_groups"))
    per_step, grads, null_grads, rewards = cfg.rollout.groups_per_step, [], [], []
    shuffle = torch.Generator().manual_seed(a.seed)
    for b in range(a.batches):
        groups = worker.generate(list(range(b * per_step, (b + 1) * per_step)))
        batch_rewards = set_group_advantages(groups, cfg.algorithm)
        grads.append(batch_gradient(learner, groups))
        rewards.append(float(batch_rewards.mean()))
        if a.null:
            shuffled_rewards(groups, cfg.algorithm, shuffle)
            null_grads.append(batch_gradient(learner, groups))
        log(f"batch {b}: reward {rewards[-1]:.3f}, gradient norm {float(grads[-1].norm()):.3g}")
    result = {"command": " ".join(["python benchmarks/grad_signal.py", *(argv if argv is not None else sys.argv[1:])]),
              "algorithm": cfg.algorithm.name, "batches": a.batches, "samples_per_batch": cfg.batch_size,
              **cosines(grads), "reward_mean": sum(rewards) / len(rewards)}
    if a.null:
        result["null"] = cosines(null_grads)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(a.out, f"{a.name}.json")
    write_json(path, result)
    null = (f"; rewards shuffled: {result['null']['mean_cos']:.4f} (SE {result['null']['se']:.4f}), standardized "
            f"{result['null']['mean_cos_standardized']:.4f} (SE {result['null']['se_standardized']:.4f})") if a.null else ""
    log(f"{cfg.algorithm.name}: mean cosine between batch gradients {result['mean_cos']:.4f} (jackknife SE "
        f"{result['se']:.4f}), standardized {result['mean_cos_standardized']:.4f} (SE {result['se_standardized']:.4f}), "
        f"{a.batches} batches of {cfg.batch_size}{null}; wrote {path}")
    return result


def cosines(grads: list[torch.Tensor]) -> dict:
    mean, se = signal_share(grads)
    mean_std, se_std = signal_share(standardized(grads))
    return {"mean_cos": mean, "se": se, "mean_cos_standardized": mean_std, "se_standardized": se_std}


if __name__ == "__main__":
    main()
