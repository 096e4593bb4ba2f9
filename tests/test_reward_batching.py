"""rewards/batching.py and CombinedReward.score_groups: groups from several callers scored in one
reward call, each group once, each group's result (or failure) its own."""

import threading
from collections import deque
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
    assert sorted(map(len, calls)) == [2, 2] and sorted(x for c in calls for x in c) == [1, 2, 3, 4]  # each once


def test_a_lone_group_waits_only_wait_s():
    calls = []
    batcher = Batcher(lambda items: calls.append(items) or list(items), batch_size=64, wait_s=0.2)
    start = time.monotonic()
    assert batcher.submit(7, 4) == 7
    assert 0.2 <= time.monotonic() - start < 2 and calls == [[7]]


def test_a_group_larger_than_batch_size_is_scored_alone():
    calls = []
    batcher = Batcher(lambda items: calls.append(items) or list(items), batch_size=2, wait_s=0.1)
    assert _callers(batcher, ["a", "b"], [4, 4]) == ["a", "b"] and sorted(calls) == [["a"], ["b"]]


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


def test_a_caller_returns_once_its_own_group_is_scored():
    """A caller whose group is scored returns then, not after scoring a group that arrived meanwhile
    (that group's own caller scores it at its own wait_s): each score takes 0.3 s here."""
    def score_many(items):
        time.sleep(0.3)
        return list(items)

    batcher = Batcher(score_many, batch_size=64, wait_s=0.1)
    returned_after = {}

    def call(item):
        start = time.monotonic()
        batcher.submit(item, 1)
        returned_after[item] = time.monotonic() - start

    first = threading.Thread(target=call, args=("first",))
    first.start()
    time.sleep(0.33)  # "second" arrives while "first" is scored (0.1 s to 0.4 s), to wait until 0.43 s
    second = threading.Thread(target=call, args=("second",))
    second.start()
    first.join(5), second.join(5)
    assert returned_after["first"] < 0.55  # scored at 0.4 s (was 0.7 s: it went on to score "second")
    assert returned_after["second"] < 0.55  # its own wait_s, then its score: 0.4 s after it arrived


def test_a_long_run_keeps_no_per_batch_history():
    """What the batcher holds does not grow with the number of batches it scored."""
    batcher = Batcher(lambda items: list(items), batch_size=1, wait_s=0.0)
    for i in range(2000):
        assert batcher.submit(i, 1) == i
    held = [v for v in vars(batcher).values() if isinstance(v, (list, dict, set, deque))]
    assert all(len(v) < 10 for v in held)


def test_a_reward_error_survives_the_pickling_that_carries_it_out_of_a_reward_actor():
    """A reward actor's RewardError reaches the rollout through Ray, pickled: it must come back as
    itself, so the pool skips the group (it came back as Ray's UnserializableException, which ended
    the run)."""
    import pickle

    error = pickle.loads(pickle.dumps(RewardError("remote", "malformed response: non-finite score")))
    assert isinstance(error, RewardError) and error.name == "remote"
    assert str(error) == "reward 'remote' failed: malformed response: non-finite score"
