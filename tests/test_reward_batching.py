"""rewards/batching.py and CombinedReward.score_groups: groups from several callers scored in one
reward call, each group once, each group's result (or failure) its own."""

import threading
import time

import pytest
import torch

from async_flowgrpo import rewards
from async_flowgrpo.rewards import CombinedReward, RewardError
from async_flowgrpo.rewards.batching import Batcher


def _callers(batcher, items, sizes, stagger_s=0.0):
    results, threads = [None] * len(items), []

    def call(i):
        try:
            results[i] = batcher.submit(items[i], sizes[i])
        except Exception as e:
            results[i] = e

    for i in range(len(items)):
        threads.append(threading.Thread(target=call, args=(i,)))
        threads[-1].start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(10)
    return results


def test_groups_arriving_together_are_scored_in_one_call_up_to_batch_size():
    calls = []

    def score_many(items):
        calls.append(list(items))
        return [item * 10 for item in items]

    batcher = Batcher(score_many, batch_size=8, wait_s=0.5)
    results = _callers(batcher, [1, 2, 3, 4], [4, 4, 4, 4])  # 16 images: two batches of 8
    assert results == [10, 20, 30, 40]
    assert sorted(batcher.batches) == [2, 2] and sorted(x for c in calls for x in c) == [1, 2, 3, 4]  # each once


def test_a_lone_group_waits_only_wait_s():
    batcher = Batcher(lambda items: [i for i in items], batch_size=64, wait_s=0.2)
    start = time.monotonic()
    assert batcher.submit(7, 4) == 7
    assert 0.2 <= time.monotonic() - start < 2 and batcher.batches == [1]


def test_a_group_larger_than_batch_size_is_scored_alone():
    batcher = Batcher(lambda items: list(items), batch_size=2, wait_s=0.1)
    assert _callers(batcher, ["a", "b"], [4, 4]) == ["a", "b"] and batcher.batches == [1, 1]


def test_a_failed_group_fails_alone_and_a_raising_batch_fails_all_of_it():
    batcher = Batcher(lambda items: [RewardError("r", "nan") if i == 2 else i for i in items], batch_size=8, wait_s=0.3)
    results = _callers(batcher, [1, 2, 3], [2, 2, 2])
    assert results[0] == 1 and results[2] == 3 and isinstance(results[1], RewardError)

    def boom(items):
        raise RuntimeError("model crashed")

    results = _callers(Batcher(boom, batch_size=8, wait_s=0.3), [1, 2], [2, 2])
    assert all(isinstance(r, RuntimeError) for r in results)


def test_score_groups_checks_each_groups_scores_on_their_own(monkeypatch):
    def nan_for_blue(images, prompts, metadata):
        return torch.tensor([float("nan") if "blue" in p else 1.0 for p in prompts])

    monkeypatch.setitem(rewards._REGISTRY, "_nan_for_blue", nan_for_blue)  # registered for this test only
    reward = CombinedReward({"_nan_for_blue": 2.0})
    images = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)
    red, blue = (images, ["red"] * 2, [{}] * 2), (images, ["blue"] * 2, [{}] * 2)
    out = reward.score_groups([red, blue, red])
    assert torch.equal(out[0][0], torch.tensor([2.0, 2.0])) and torch.equal(out[2][1]["_nan_for_blue"], torch.ones(2))
    assert isinstance(out[1], RewardError) and "non-finite" in str(out[1])
    with pytest.raises(RewardError, match="non-finite"):
        reward(*blue)  # one group: the plain call, as before
