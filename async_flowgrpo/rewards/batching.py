"""Batching for a reward actor: the groups that reach it from several rollout workers at about the
same time are scored in one call, up to `batch_size` images or `wait_s` after the first of them
arrived, so a reward model on a GPU runs at a useful batch size. Plain code: no Ray, no torch.

Each caller (one thread per call, the actor's concurrency) adds its group and waits. Whoever sees
the batch full, or its own wait over, takes the groups waiting (oldest first, up to batch_size
images: at least one group) and scores them; every caller gets its own group's result, and returns
as soon as it has it (a group that arrived meanwhile is its own caller's to score, at its own
`wait_s`). A group is in exactly one batch, so it is scored once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable


class _Request:
    def __init__(self, item: Any, size: int):
        self.item, self.size = item, size
        self.done = threading.Event()
        self.result: Any = None


class Batcher:
    """score_many(items) -> one result per item; a result that is an exception is raised to its
    caller only. score_many raising fails every item of that batch."""

    def __init__(self, score_many: Callable[[list], list], batch_size: int, wait_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.score_many, self.batch_size, self.wait_s, self._clock = score_many, batch_size, wait_s, clock
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()

    def submit(self, item: Any, size: int) -> Any:
        """Score `item` (`size` images) in a batch; returns its result or raises its error."""
        request = _Request(item, size)
        deadline = self._clock() + self.wait_s
        with self._cond:
            self._waiting.append(request)
            self._cond.notify_all()  # the batch may be full now
        while True:  # until its own group is scored (by this caller or another), and not one batch more
            with self._cond:
                batch = None
                while not request.done.is_set() and (batch := self._take_ready(deadline)) is None:
                    remaining = deadline - self._clock()
                    self._cond.wait(timeout=remaining if remaining > 0 else None)
            if batch is None:
                break
            self._score(batch)
        if isinstance(request.result, BaseException):
            raise request.result
        return request.result

    def _take_ready(self, deadline: float) -> list[_Request] | None:
        """The oldest waiting groups, up to batch_size images (at least one), once that many wait
        or the caller's wait is over; else None."""
        if not self._waiting:
            return None
        if sum(r.size for r in self._waiting) < self.batch_size and self._clock() < deadline:
            return None
        batch = [self._waiting.popleft()]
        while self._waiting and sum(r.size for r in batch) + self._waiting[0].size <= self.batch_size:
            batch.append(self._waiting.popleft())
        return batch

    def _score(self, batch: list[_Request]) -> None:
        try:
            results = self.score_many([r.item for r in batch])
        except BaseException as e:  # the whole batch fails; each caller sees it
            results = [e] * len(batch)
        with self._cond:
            for r, result in zip(batch, results):
                r.result = result
                r.done.set()
            self._cond.notify_all()
