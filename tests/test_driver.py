"""The driver's plain parts, without Ray: a batch from group records (advantages from rewards
alone), the step schedule, and what a group record and a saved group carry."""

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import AlgorithmConfig
from async_flowgrpo.driver.batch import make_batch
from async_flowgrpo.driver.run import Schedule
from async_flowgrpo.types import Group, GroupRecord, SamplingParams


def record(index: int, rewards: list[float], min_version: int = 0) -> GroupRecord:
    r = torch.tensor(rewards)
    return GroupRecord(f"p{index}", index, len(rewards), min_version, r, {"correct": (r > 0.5).float()}, ref=f"ref{index}")


def test_batch_advantages_are_the_group_advantages_of_the_rewards():
    records = [record(0, [1.0, 0.0, 0.5, 0.5]), record(1, [0.2, 0.4, 0.6, 0.8]), record(2, [0.9, 0.1, 0.3, 0.3])]
    for global_std in (True, False):
        batch = make_batch(records, version=0, a=AlgorithmConfig(global_std=global_std))
        rewards = torch.cat([r.rewards for r in records])
        ids = torch.arange(3).repeat_interleave(4)
        expected, _ = algo.group_advantages(rewards, ids, global_std=global_std)
        torch.testing.assert_close(torch.cat(batch.advantages), expected)
    assert batch.metrics["reward/mean"] == pytest.approx(rewards.mean().item())
    assert batch.metrics["reward/correct"] == pytest.approx((rewards > 0.5).float().mean().item())
    assert batch.samples == 12


def test_batch_staleness_histogram_and_zero_std_groups():
    records = [record(0, [1.0, 0.0], min_version=5), record(1, [0.5, 0.5], min_version=4), record(2, [0.3, 0.7], min_version=2)]
    batch = make_batch(records, version=5, a=AlgorithmConfig(max_staleness=1))
    assert [batch.metrics[f"staleness/hist_{k}"] for k in ("0", "1", "over")] == [1, 1, 1]
    assert batch.metrics["reward/zero_std_frac"] == pytest.approx(1 / 3)
    assert len(batch.records) == 3 and torch.equal(batch.advantages[1], torch.zeros(2))
    dropped = make_batch(records, version=5, a=AlgorithmConfig(max_staleness=1, drop_zero_std=True))
    assert [r.prompt_index for r in dropped.records] == [0, 2]
    assert dropped.metrics["samples/dropped_zero_std"] == 2
    # the driver's payload is the rewards and prompts, not the trajectories
    assert batch.metrics["driver/bytes_per_step"] == sum(r.nbytes for r in records) < 200


def test_shards_split_round_robin_and_keep_the_refs():
    records = [record(i, [float(i), 0.0]) for i in range(4)]
    shards = make_batch(records, version=0, a=AlgorithmConfig()).shards(2)
    assert [[r.ref for r, _ in shard] for shard in shards] == [["ref0", "ref2"], ["ref1", "ref3"]]


def test_schedule():
    s = Schedule(total_steps=10, eval_every=4, eval_at_start_and_end=True, checkpoint_every=3, sample_every=0)
    assert [k for k in range(1, 11) if s.evaluate(k)] == [4, 8, 10]
    assert [k for k in range(1, 11) if s.checkpoint(k)] == [3, 6, 9, 10]
    assert not any(s.samples(k) for k in range(1, 11))
    quiet = Schedule(total_steps=10, eval_every=0, eval_at_start_and_end=False, checkpoint_every=0, sample_every=5)
    assert [k for k in range(1, 11) if quiet.evaluate(k)] == []
    assert [k for k in range(1, 11) if quiet.checkpoint(k)] == [10]  # the last step is always kept
    assert [k for k in range(1, 11) if quiet.samples(k)] == [5, 10]


def test_a_group_survives_its_checkpoint_form_and_its_record_is_small():
    from async_flowgrpo import checkpoint

    n, w = 4, 3
    group = Group(
        prompt="a red circle", prompt_index=7, metadata={"kind": "single", "spec": {"objects": [1, 2]}},
        params=SamplingParams(10, 4.5, 0.7, "sde", 0, w, 32, 32),
        latents=torch.randn(n, w + 1, 4, 16, 16), sigmas=torch.linspace(1, 0, w + 1), log_probs=torch.randn(n, w),
        versions=torch.tensor([3, 3, 4]), images=torch.zeros(n, 32, 32, 3, dtype=torch.uint8),
        prompt_embeds=torch.randn(77, 32), pooled_prompt_embeds=torch.randn(64),
        rewards=torch.rand(n), reward_components={"correct": torch.ones(n)}, worker_id=1, seed=11,
    )
    tree, tensors = checkpoint.encode(group.to_state())  # tensors, numbers and strings only: no pickle
    back = Group.from_state(checkpoint.decode(tree, tensors))
    assert back.params == group.params and back.metadata == group.metadata and back.min_version == 3
    for name in ("latents", "sigmas", "log_probs", "versions", "images", "prompt_embeds", "rewards"):
        assert torch.equal(getattr(back, name), getattr(group, name)), name
    rec = GroupRecord.of(group, ref="r")
    assert (rec.prompt_index, rec.size, rec.min_version, rec.staleness(5)) == (7, 4, 3, 2)
    assert rec.nbytes < group.latents.numel() * 4 / 100
