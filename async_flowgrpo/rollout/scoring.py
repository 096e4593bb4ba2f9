"""Scoring off the generation thread: a rollout worker hands a generated group to a `Scorer` and
goes on generating while the reward runs (a remote judge, a reward actor, a model on another
device). Plain code: no Ray.

Bounded: at most `max_pending` groups handed off and not yet scored. A worker that would hand off
one more waits for a slot (back-pressure, not unbounded memory); that wait, like the whole reward
call on the blocking path (`overlap=False`), counts as time the worker waited on rewards.

Each group is scored exactly once, on one of `max_pending` threads, so up to that many reward calls
are in flight at once (several requests to a remote judge, several groups to a reward pool).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from async_flowgrpo.metrics import BusyTracker

T = TypeVar("T")


class Scorer:
    def __init__(self, *, overlap: bool, max_pending: int, clock: Callable[[], float] = time.monotonic):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.overlap, self.max_pending, self._clock = overlap, max_pending, clock
        self._pool = ThreadPoolExecutor(max_workers=max_pending, thread_name_prefix="reward") if overlap else None
        self._slots = threading.Condition()
        self._pending = 0
        self._latency_s: list[float] = []  # hand-off to score, per group scored since the last stats()
        self.waiting = BusyTracker(clock)  # perf/reward_wait_frac: "busy" = waiting on rewards

    @property
    def pending(self) -> int:
        """Groups handed off and not yet scored."""
        return self._pending

    def submit(self, score: Callable[[], T]) -> Future:
        """Hand off one group's scoring (`score()` returns its result or raises). Overlap: waits
        only for a free slot and returns at once; blocking path: returns a finished future."""
        if not self.overlap:
            with self.waiting.busy():
                return self._run(score, self._clock())
        with self._slots:
            if self._pending >= self.max_pending:
                with self.waiting.busy():
                    self._slots.wait_for(lambda: self._pending < self.max_pending)
            self._pending += 1
        return self._pool.submit(self._run_and_free, score, self._clock())

    def result(self, future: Future) -> T:
        """A handed-off group's result; the wait for it counts as waiting on rewards."""
        if future.done():
            return future.result()
        with self.waiting.busy():
            return future.result()

    def _run_and_free(self, score: Callable[[], T], handed_off: float) -> T:
        try:
            return self._run(score, handed_off).result()
        finally:
            with self._slots:
                self._pending -= 1
                self._slots.notify_all()

    def _run(self, score: Callable[[], T], handed_off: float) -> Future:
        future: Future = Future()
        try:
            future.set_result(score())
        except BaseException as e:  # the group's failure travels with its future, to whoever takes it
            future.set_exception(e)
        with self._slots:
            self._latency_s.append(self._clock() - handed_off)
        return future

    def stats(self) -> dict[str, float]:
        """Since the previous call: mean hand-off-to-score latency, the wait share; and the pending now."""
        with self._slots:
            latency, self._latency_s = self._latency_s, []
        out = {"reward/pending": self._pending, "perf/reward_wait_frac": 1.0 - self.waiting.idle_frac()}
        if latency:
            out["reward/latency_s"] = sum(latency) / len(latency)
        return out
