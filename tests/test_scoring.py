"""rollout/scoring.py: groups scored off the generation thread, bounded by max_pending, each once."""

import threading
import time

import pytest

from async_flowgrpo.rollout.scoring import Scorer


class Gate:
    """A reward that blocks until released; counts its calls per group."""

    def __init__(self):
        self.open = threading.Event()
        self.calls: dict[int, int] = {}
        self.lock = threading.Lock()

    def score(self, group: int, fail: bool = False):
        def run():
            with self.lock:
                self.calls[group] = self.calls.get(group, 0) + 1
            assert self.open.wait(10)
            if fail:
                raise RuntimeError(f"group {group} failed")
            return group * 10

        return run


def test_overlap_hands_off_at_once_and_holds_at_most_max_pending():
    scorer, gate = Scorer(overlap=True, max_pending=2), Gate()
    futures = [scorer.submit(gate.score(0)), scorer.submit(gate.score(1))]  # both return before any score
    assert scorer.pending == 2 and not any(f.done() for f in futures)
    third = {}
    thread = threading.Thread(target=lambda: third.setdefault("f", scorer.submit(gate.score(2))))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and scorer.pending == 2  # back-pressure: a third waits for a slot
    gate.open.set()
    thread.join(5)
    assert [scorer.result(f) for f in [*futures, third["f"]]] == [0, 10, 20]
    assert gate.calls == {0: 1, 1: 1, 2: 1}
    stats = scorer.stats()
    assert stats["reward/pending"] == 0 and stats["reward/latency_s"] > 0.2
    assert 0 < stats["perf/reward_wait_frac"] < 1  # the third hand-off waited


def test_the_blocking_path_scores_before_it_returns_and_counts_the_whole_call_as_waiting():
    scorer = Scorer(overlap=False, max_pending=1)
    future = scorer.submit(lambda: time.sleep(0.2) or 7)
    assert future.done() and scorer.result(future) == 7
    assert scorer.stats()["perf/reward_wait_frac"] > 0.9


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_score_reaches_whoever_takes_the_group_and_is_never_run_twice(overlap):
    scorer, gate = Scorer(overlap=overlap, max_pending=2), Gate()
    gate.open.set()
    bad, good = scorer.submit(gate.score(0, fail=True)), scorer.submit(gate.score(1))
    with pytest.raises(RuntimeError, match="group 0 failed"):
        scorer.result(bad)
    assert scorer.result(good) == 10 and gate.calls == {0: 1, 1: 1}
    assert scorer.pending == 0  # a failure frees its slot


def test_max_pending_must_be_positive():
    with pytest.raises(ValueError, match="max_pending"):
        Scorer(overlap=True, max_pending=0)
