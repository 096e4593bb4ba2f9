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

SCORE_POLL_S = 0.02  # how often a producer held back by admission looks for groups scored meanwhile


def stream_groups(queue, worker_id: int, make_record: Callable[[int], Any],
                  stopped: threading.Event, poll_s: float) -> None:
    """A fully_async producer's protocol with the queue actor: take an admission ticket, make its
    group's record, hand it in; until `stopped` is set or the queue shuts down. `make_record`
    returns the record, None (the group is not delivered, e.g. its reward failed: its slot goes
    back), or a Future of either: the group is being scored while the next one is made.

    The queue calls overlap making the group: the next admission is asked for as a group starts,
    and a record is handed in without waiting for the answer (checked at the next hand-in). So the
    producer waits on the queue actor only when admission itself holds it back (max_staleness
    ahead), not for two round trips per group (4% of rollout time on 2 cores).

    Groups being scored are handed in once scored, in the order they were made; their tickets stay
    taken meanwhile (the admission bound counts them). While admission holds the producer back, it
    keeps handing in groups as their scores come. At a stop, groups not yet handed in give their
    slots back: the checkpoint lists their tickets as in flight, and a resumed run regenerates them.
    """
    next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
    handing_in = None  # (ref of the last put, its record)
    scoring: deque[tuple[int, Future]] = deque()  # (ticket, future record) in the order made
    try:
        while not stopped.is_set():
            while scoring and scoring[0][1].done():
                ticket, record = scoring.popleft()
                handing_in, delivered = _hand_in(queue, worker_id, ticket, record.result(), handing_in, stopped, poll_s)
                if not delivered:
                    return
            if scoring and not ray.wait([next_ticket], timeout=SCORE_POLL_S)[0]:
                continue  # no admission yet: hand in what was scored meanwhile
            ticket, next_ticket = ray.get(next_ticket), None
            if ticket is None:  # no admission yet: re-check the stop flag
                next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
                continue
            if ticket < 0:
                break  # queue shut down
            next_ticket = queue.acquire_ticket.remote(worker_id, poll_s)
            record = make_record(ticket)
            if isinstance(record, Future):
                scoring.append((ticket, record))
                continue
            handing_in, delivered = _hand_in(queue, worker_id, ticket, record, handing_in, stopped, poll_s)
            if not delivered:
                return
        _handed_in(queue, worker_id, handing_in, stopped, poll_s)
    finally:
        if next_ticket is not None:
            _give_back(queue, worker_id, next_ticket)
        for ticket, _ in scoring:  # not handed in: regenerated on resume (the checkpoint has their tickets)
            _release(queue, worker_id, ticket)


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
