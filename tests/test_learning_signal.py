"""A guard against silent regressions of learning: a few updates raise the expected reward.

On the shipped shapes model, with the launcher's own sampling settings, each algorithm takes a few
updates on freshly generated groups, rewarded by a smooth reward (mean brightness: every sample
gets a different score, so the signal is strong enough for a handful of updates). The expected
reward is then measured with many samples from fixed seeds, the same before and after, so the
comparison is paired. Its control is the same run with the advantages negated: a working update
moves the reward up with +A and down with -A. A flipped sign, advantages that never reach the loss,
a gradient cut off from the weights, or rollouts sampling with other weights than the trained ones
(DiffusionNFT's old copy) break one of the two directions.
"""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.builders import build_learner
from async_flowgrpo.config import load_config
from async_flowgrpo.sampling import rollout_sampling

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red circle", "two blue squares"]


def brightness(groups) -> torch.Tensor:
    return torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])


def expected_reward_change(algorithm: str, sign: float, updates: int = 3, group_size: int = 8, samples: int = 32) -> float:
    """Mean brightness of 2 x `samples` samples (fixed seeds) after `updates` updates minus before."""
    cfg = load_config("sync", [f"algorithm.name={algorithm}", "trainer.lr=1e-3"])
    learner = build_learner(cfg)
    sampling = rollout_sampling(cfg.rollout)
    policy = learner.policy

    def generate(n: int, seed: int, version: int = 0):
        trained = {k: v.clone() for k, v in policy.trainable_state().items()}
        policy.load_trainable_state(learner.sampling_state())  # what the rollout actors are sent
        try:
            with torch.no_grad():
                return policy.generate(PROMPTS, n, **sampling, seed=seed, version_fn=lambda: version)
        finally:
            policy.load_trainable_state(trained)

    before = brightness(generate(samples, seed=1234)).mean().item()  # seeds apart from the training ones
    for step in range(updates):
        groups = generate(group_size, seed=step, version=step)
        rewards = brightness(groups)
        ids = torch.arange(len(groups)).repeat_interleave(group_size)
        advantages, _ = algo.group_advantages(rewards, ids, global_std=True)
        for i, g in enumerate(groups):
            g.rewards, g.advantages = rewards[ids == i], sign * advantages[ids == i]
        learner.train_step(groups, version=step)
    after = brightness(generate(samples, seed=1234)).mean().item()
    return after - before


@pytest.mark.slow  # tens of updates of the embedded model: 10-20 s each
@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_updates_raise_the_expected_reward(algorithm):
    up = expected_reward_change(algorithm, +1.0)
    down = expected_reward_change(algorithm, -1.0)
    assert up > 0 > down, f"{algorithm}: expected reward moved {up:+.4f} with +A and {down:+.4f} with -A"
