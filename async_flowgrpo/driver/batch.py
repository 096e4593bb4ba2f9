"""A training batch from group records: advantages from the rewards alone, the batch's reward and
staleness metrics, and its split over data-parallel trainers. Plain code: no Ray, no tensors
bigger than the rewards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_flowgrpo import algo
from async_flowgrpo.config import AlgorithmConfig
from async_flowgrpo.types import GroupRecord


@dataclass
class Batch:
    records: list[GroupRecord]  # the groups to train on
    advantages: list[torch.Tensor]  # [n] per record
    metrics: dict[str, float]

    @property
    def samples(self) -> int:
        return sum(r.size for r in self.records)

    def shards(self, n: int) -> list[list[tuple[GroupRecord, torch.Tensor]]]:
        """Round-robin over n data-parallel trainers (equal group counts when n divides the batch)."""
        pairs = list(zip(self.records, self.advantages))
        return [pairs[i::n] for i in range(n)]


def make_batch(records: list[GroupRecord], version: int, a: AlgorithmConfig) -> Batch:
    """Group-relative advantages over the batch (algo.group_advantages), the reward and staleness
    metrics, and, with algorithm.drop_zero_std, the groups with all-equal rewards left out."""
    rewards = torch.cat([r.rewards for r in records])
    group_ids = torch.cat([torch.full((r.size,), i) for i, r in enumerate(records)])
    advantages, zero_std = algo.group_advantages(rewards, group_ids, global_std=a.global_std, mean_only=a.mean_only)
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "reward/zero_std_frac": algo.zero_std_fraction(rewards, group_ids),
        "driver/bytes_per_step": sum(r.nbytes for r in records),
    }
    staleness = torch.tensor([r.staleness(version) for r in records])
    for k in range(a.max_staleness + 2):  # histogram; the last bin is "> eta"
        over = k > a.max_staleness
        metrics[f"staleness/hist_{'over' if over else k}"] = int((staleness > a.max_staleness if over else staleness == k).sum())
    for name in records[0].reward_components:
        metrics[f"reward/{name}"] = torch.cat([r.reward_components[name] for r in records]).mean().item()
    per_group = [advantages[group_ids == i] for i in range(len(records))]
    if a.drop_zero_std:
        keep = [i for i in range(len(records)) if not zero_std[group_ids == i].all()]
        metrics["samples/dropped_zero_std"] = sum(r.size for r in records) - sum(records[i].size for i in keep)
        records, per_group = [records[i] for i in keep], [per_group[i] for i in keep]
    return Batch(records, per_group, metrics)
