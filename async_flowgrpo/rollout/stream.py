"""A fully_async producer's protocol with the queue actor, shared by the rollout worker and the
scale simulation's stand-in (which is why it imports neither torch nor the rest of the package)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import ray

logger = logging.getLogger(__name__)

def stream_groups(queue, worker_id: int, make_record: Callable[[int], Any],
                  stopped: threading.Event, poll_s: float) -> None:
    """A fully_async producer's protocol with the queue actor: take an admission ticket, make its
    group's record, hand it in; until `stopped` is set or the queue shuts down. `make_record`
    returns the record, None (the group is not delivered, e.g. its reward failed: its slot goes
    back), or a Future of either: the group is being scored while the next one is made.

    The queue calls overlap making the group: the next admission is asked for as a group starts,
    and records are handed in by a thread of their own (`_HandIn`), so the producer waits on the
    queue actor only when admission itself holds it back (max_staleness ahead), not for two round
    trips per group (4% of rollout time on 2 cores).

    A group is handed in as soon as its score arrives (also while the next group is being made),
    in the order the groups were made; its ticket stays taken meanwhile (the admission bound counts
    it). At a stop, groups not yet handed in give their slots back: the stop's checkpoint, written
    before the producers stop, lists their tickets as in flight, and a resumed run regenerates
    them. A producer that fails (its engine, its hand-in, reward.max_consecutive_failures) gives
    nothing back: the checkpoint written after the failure still lists every ticket it had not
    delivered as in flight, so a resumed run makes those groups instead of skipping their prompts.
    """
    hand_in = _HandIn(queue, worker_id, stopped, poll_s)
    next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
    failed = True
    try:
        while not stopped.is_set() and hand_in.error is None:
            ticket, next_ticket = ray.get(next_ticket), None
            if ticket is None:  # no admission yet: re-check the stop flag
                next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
                continue
            if ticket < 0:
                break  # queue shut down
            next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
            hand_in.add(ticket, make_record(ticket))
        failed = hand_in.error is not None
    finally:
        hand_in.finish(give_back=not failed)
        if next_ticket is not None and not failed:
            _give_back(queue, worker_id, next_ticket)
    if hand_in.error is not None:
        raise hand_in.error


class _HandIn(threading.Thread):
    """Hands a producer's made groups in to the queue, in the order made, each once it is scored."""

    def __init__(self, queue, worker_id: int, stopped: threading.Event, poll_s: float):
        super().__init__(name=f"hand-in-{worker_id}", daemon=True)
        self.queue, self.worker_id, self.stopped, self.poll_s = queue, worker_id, stopped, poll_s
        self._made: deque[tuple[int, Future]] = deque()  # (ticket, future record), not yet handed in
        self._cond = threading.Condition()
        self._ending: str | None = None  # "stop": hand in what is scored, then end; "failure": end now
        self._handing_in: tuple | None = None  # (ref of the last put, its record)
        self.error: BaseException | None = None
        self.start()

    def add(self, ticket: int, record) -> None:
        if not isinstance(record, Future):
            record = _done(record)
        with self._cond:
            self._made.append((ticket, record))
            self._cond.notify_all()
        record.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _next_scored(self) -> bool:
        return bool(self._made) and self._made[0][1].done()

    def run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._ending or self._next_scored())
                    if self._ending == "failure" or not self._next_scored():
                        return
                    ticket, record = self._made.popleft()
                self._handing_in, delivered = _hand_in(self.queue, self.worker_id, ticket, record.result(),
                                                       self._handing_in, self.stopped, self.poll_s)
                if not delivered:
                    return
        except BaseException as e:  # the producer raises it
            self.error = e

    def finish(self, give_back: bool) -> None:
        """The producer has ended. give_back (a stop or the queue's shutdown): the groups scored by
        now are handed in, the last put is waited for, and the groups still being scored give their
        slots back. Else (a failure) it is not waited for (a put may wait on a full queue), hands
        in nothing more once its put is done, and every ticket not delivered stays in flight."""
        with self._cond:
            self._ending = "stop" if give_back else "failure"
            self._cond.notify_all()
        if not give_back:
            return
        self.join()
        if self.error is not None:
            return
        _handed_in(self.queue, self.worker_id, self._handing_in, self.stopped, self.poll_s)
        for ticket, _ in self._made:  # not handed in: regenerated on resume (the checkpoint has their tickets)
            _release(self.queue, self.worker_id, ticket)


def _done(record) -> Future:
    future: Future = Future()
    future.set_result(record)
    return future


def chain(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of fn(future's result), computed where the result is (an error passes through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # the record's failure reaches whoever hands it in
            out.set_exception(e)

    future.add_done_callback(done)
    return out


def _hand_in(queue, worker_id: int, ticket: int, record, handing_in: tuple | None, stopped: threading.Event,
             poll_s: float) -> tuple[tuple | None, bool]:
    """Hand in one made group's record (None: give its slot back). Returns the put now in flight and
    whether the producer goes on (False: stopped while the previous put waited)."""
    if record is None:
        ray.get(queue.release_ticket.remote(worker_id, ticket))
        return handing_in, True
    if not _handed_in(queue, worker_id, handing_in, stopped, poll_s):
        _release(queue, worker_id, ticket)
        return None, False
    return (queue.put.remote(record, poll_s), record), True


def _handed_in(queue, worker_id: int, handing_in: tuple | None, stopped: threading.Event, poll_s: float) -> bool:
    """Wait for the last put to be accepted (it waits only while the queue is full), retrying after
    a timeout; False when stopped first (its slot is given back: the group is not delivered)."""
    if handing_in is None:
        return True
    ref, record = handing_in
    while not ray.get(ref):
        if stopped.is_set():
            ray.get(queue.release_ticket.remote(worker_id, record.prompt_index))
            return False
        ref = queue.put.remote(record, poll_s)
    return True


def _release(queue, worker_id: int, ticket: int) -> None:
    """Best effort, as `_give_back`."""
    try:
        ray.get(queue.release_ticket.remote(worker_id, ticket))
    except ray.exceptions.RayError as e:
        logger.debug("worker %d: ticket %d not given back: %s", worker_id, ticket, e)


def _give_back(queue, worker_id: int, next_ticket) -> None:
    """An admission asked for a group that will not be started: its slot goes back (best effort:
    when the loop ends on an error, that error is what the caller must see)."""
    try:
        ticket = ray.get(next_ticket)
        if ticket is not None and ticket >= 0:
            ray.get(queue.release_ticket.remote(worker_id, ticket))
    except ray.exceptions.RayError as e:
        logger.debug("worker %d: admission not given back: %s", worker_id, e)
