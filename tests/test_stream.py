"""rollout/stream.py: a fully_async producer's hand-in of scored groups to the queue actor (a real
queue actor on a 2-CPU Ray; the producer runs on a thread of the test process)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import ray

from async_flowgrpo.rollout.stream import stream_groups
from async_flowgrpo.types import GroupRecord
from test_queue import T, actor, make_group  # noqa: F401  (actor: a fixture)


def record_of(ticket: int) -> GroupRecord:
    group = make_group(ticket, 0, n=2)
    return GroupRecord.of(group, ray.put(group))


def run_producer(queue, make_record, stop: threading.Event) -> tuple[threading.Thread, list]:
    """stream_groups on a thread; the list gets the exception it ended with, if any."""
    errors: list[BaseException] = []

    def produce():
        try:
            stream_groups(queue, 0, make_record, stop, 0.2)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread, errors


def test_a_group_scored_while_the_next_generates_is_handed_in_when_its_score_arrives(actor):
    """Generating a group takes 1 s, scoring one 0.1 s: group 0 reaches the queue about 0.1 s after
    its generation, while group 1 generates, not once group 1's generation is over."""
    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    pool, scored_at, stop = ThreadPoolExecutor(max_workers=2), {}, threading.Event()

    def make_record(ticket: int) -> Future:
        time.sleep(1.0)  # generation, on the producer's thread

        def score():
            time.sleep(0.1)
            scored_at[ticket] = time.monotonic()
            return record_of(ticket)

        return pool.submit(score)

    thread, errors = run_producer(q, make_record, stop)
    try:
        deadline = time.monotonic() + T
        while ray.get(q.stats.remote(), timeout=T)["queue/size"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        queued_at = time.monotonic()
        assert queued_at - scored_at[0] < 0.5  # (was 0.9 s: it waited for group 1's generation)
    finally:
        stop.set()
        thread.join(T)
        pool.shutdown(wait=True)
    assert not thread.is_alive() and not errors
    groups = ray.get(q.get_batch.remote(ray.get(q.stats.remote(), timeout=T)["queue/size"], 5), timeout=T)
    assert [g.prompt_index for g in groups] == sorted(g.prompt_index for g in groups)  # in the order made


@pytest.mark.parametrize("fails_in", ["generation", "scoring"])
def test_a_failing_producer_leaves_its_undelivered_tickets_in_flight(actor, fails_in):
    """A producer that ends on an error (a broken engine, reward.max_consecutive_failures) gives no
    ticket back: the checkpoint written after the failure lists every group not delivered as in
    flight, so a resumed run makes them instead of skipping their prompts."""
    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    pool, release, stop = ThreadPoolExecutor(max_workers=4), threading.Event(), threading.Event()

    def make_record(ticket: int) -> Future:
        if ticket == 2 and fails_in == "generation":
            raise RuntimeError("engine broke")

        def score():
            release.wait(T)  # tickets 0 and 1 are still being scored when the producer fails
            if ticket == 2:
                raise RuntimeError("too many reward failures")
            return record_of(ticket)

        future = pool.submit(score)
        if ticket == 2:
            release.set()
        return future

    thread, errors = run_producer(q, make_record, stop)
    thread.join(T)
    try:
        assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], RuntimeError)
        state = ray.get(q.state_dict.remote(), timeout=T)  # what a checkpoint saves, at one moment
        admission, counts = state["controller"], state["queue"]
        delivered = counts["produced"]
        # scoring: tickets 0 and 1 were scored before 2 failed and may be in the queue; every other
        # ticket taken is in flight, none was given back
        assert set(range(delivered, 3)) <= set(state["in_flight_tickets"])
        assert admission["released"] == 0
        assert admission["started"] - delivered == len(state["in_flight_tickets"])
    finally:
        release.set()
        pool.shutdown(wait=True)
