"""Replay queue, admission control and the Ray queue actor (async_flowgrpo.queue)."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

os.environ["RAY_AUTH_MODE"] = "disabled"

import pytest
import ray
import torch

from async_flowgrpo.queue import QueueActor, ReplayQueue, StalenessController, make_queue_actor
from async_flowgrpo.types import Group, SamplingParams

T = 30  # timeout on every ray.get


def make_group(index: int, version: int | list[int] = 0, n: int = 2, worker_id: int = 0) -> Group:
    versions = torch.tensor(version if isinstance(version, list) else [version], dtype=torch.long)
    w = len(versions)
    return Group(
        prompt=f"p{index}",
        prompt_index=index,
        metadata={},
        params=SamplingParams(2, 1.0, 0.7, "sde", 0, w, 2, 2),
        latents=torch.zeros(n, w + 1, 1, 2, 2),
        sigmas=torch.zeros(w + 1),
        log_probs=torch.zeros(n, w),
        versions=versions,
        images=torch.zeros(n, 2, 2, 3, dtype=torch.uint8),
        prompt_embeds=torch.zeros(1, 2),
        pooled_prompt_embeds=torch.zeros(2),
        worker_id=worker_id,
    )


@pytest.fixture
def actor(ray_cluster):
    """Factory for queue actors that are killed after the test."""
    made = []

    def make(capacity=8, groups_per_step=2, max_staleness=1, drop_policy="block"):
        a = make_queue_actor(capacity, groups_per_step, max_staleness, drop_policy)
        made.append(a)
        return a

    yield make
    for a in made:
        ray.kill(a)


def pending(ref, wait_s: float = 0.4) -> bool:
    """True if `ref` is still unresolved after wait_s (the call is blocked)."""
    ready, _ = ray.wait([ref], timeout=wait_s)
    return not ready


# ---------------------------------------------------------------- plain classes


def test_fifo_order_plain():
    q = ReplayQueue(capacity=10)
    for i in range(5):
        q.put(make_group(i))
    assert [g.prompt_index for g in q.take(3)] == [0, 1, 2]
    q.put(make_group(5))
    assert [g.prompt_index for g in q.take(3)] == [3, 4, 5]
    with pytest.raises(RuntimeError):
        q.take(1)


def test_capacity_plain():
    q = ReplayQueue(capacity=2)
    q.put(make_group(0))
    q.put(make_group(1))
    assert q.full
    with pytest.raises(RuntimeError):
        q.put(make_group(2))


def test_a_batch_put_back_is_first_again_and_not_consumed_plain():
    """A batch taken and not trained (a stop came first) is queued again at the head, in its order;
    the counters balance as if it had never been taken, the capacity notwithstanding."""
    c = StalenessController(groups_per_step=2, max_staleness=1)
    q = ReplayQueue(capacity=2, controller=c)
    for i in range(2):
        c.start()
        q.put(make_group(i, n=3))
    batch = q.take(2)
    for i in (2, 3):
        c.start()
        q.put(make_group(i, n=3))
    q.put_back(batch)
    assert [g.prompt_index for g in q.queued()] == [0, 1, 2, 3] and q.full
    assert (q.consumed, q.consumed_samples, q.produced) == (0, 0, 4)
    assert q.produced == q.consumed + q.dropped_stale + q.drained + len(q)
    assert c.admitted == q.consumed + len(q)


def test_controller_limit_and_release():
    c = StalenessController(groups_per_step=2, max_staleness=1)
    for _ in range(4):  # (0 + 1 + 1) * 2
        assert c.can_start()
        c.start()
    assert not c.can_start()
    with pytest.raises(RuntimeError):
        c.start()
    c.release()  # a started group will never come: its slot is free again
    assert c.can_start()
    c.start()
    c.set_version(1)
    assert c.limit == 6 and c.admitted == 4
    with pytest.raises(ValueError):
        c.set_version(0)
    with pytest.raises(ValueError):
        c.release(5)


def simulate(eta: int, gps: int = 2, latency: int = 3, train_ticks: int = 2, steps: int = 12, seed: int = 0):
    """Discrete-time trainer + producers on the plain classes; groups are delivered in start order.

    Producers start as many groups as admission allows each tick (infinitely many workers), a group
    takes `latency` ticks, the trainer takes `train_ticks` per step and publishes every step.
    Returns the staleness of every consumed group and the max (started - consumed) seen.
    """
    rng = random.Random(seed)
    c = StalenessController(gps, eta)
    q = ReplayQueue(capacity=1000, max_staleness=eta, controller=c)
    in_flight: list[tuple[int, Group]] = []  # (ready tick, group), in start order
    stalenesses, ahead = [], 0
    busy_until, step, tick, index = 0, 0, 0, 0
    while step < steps:
        tick += 1
        while c.can_start():
            c.start()
            in_flight.append((tick + latency + rng.randint(0, 1), make_group(index, c.version)))
            index += 1
        # in-order delivery: a group is delivered only once all groups started before it are
        while in_flight and in_flight[0][0] <= tick:
            q.put(in_flight.pop(0)[1])
        if tick >= busy_until and len(q) >= gps:
            batch = q.take(gps)
            stalenesses += [g.staleness(c.version) for g in batch]
            ahead = max(ahead, c.started - q.consumed)
            busy_until = tick + train_ticks
            step += 1
            c.set_version(step)
        assert c.started == q.consumed + len(q) + len(in_flight) + c.released
    return stalenesses, ahead


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_admission_bounds_staleness_plain(eta):
    stalenesses, ahead = simulate(eta)
    assert len(stalenesses) == 12 * 2
    assert max(stalenesses) <= eta
    # The bound is tight: fast producers run exactly eta versions ahead (catches an off-by-one).
    assert max(stalenesses) == eta
    # Right after consuming a batch, at most the next eta batches are already started.
    assert ahead == eta * 2
    if eta == 0:
        assert set(stalenesses) == {0}


def test_drop_policy_plain_counts_and_releases():
    c = StalenessController(groups_per_step=1, max_staleness=1)
    q = ReplayQueue(capacity=10, max_staleness=1, drop_policy="drop", controller=c)
    c.start()  # A, version 0: the straggler
    c.start()  # B, version 0
    q.put(make_group(1, 0, n=3))  # B arrives first
    assert [g.prompt_index for g in q.take(1)] == [1]
    c.set_version(1)
    c.start()  # C at version 1
    q.put(make_group(2, 1))
    q.take(1)
    c.set_version(2)
    assert c.admitted == 3  # A (in flight), B and C (consumed)
    q.put(make_group(0, 0, n=3))  # A arrives with staleness 2 > 1
    released_before = c.released
    dropped = q.prune(c.version)
    assert [g.prompt_index for g in dropped] == [0]
    assert (q.dropped_stale, q.dropped_stale_samples) == (1, 3)
    assert c.released == released_before + 1
    assert len(q) == 0
    assert q.produced == q.consumed + q.dropped_stale + q.drained + len(q)
    assert c.started == q.consumed + len(q) + 0 + c.released


def test_block_policy_keeps_stragglers_plain():
    """Without "drop", a straggler overtaken by later groups is delivered (the documented limit)."""
    q = ReplayQueue(capacity=10, max_staleness=1, drop_policy="block")
    q.put(make_group(0, 0))
    assert q.prune(2) == []
    assert q.take(1)[0].staleness(2) == 2 and q.dropped_stale == 0


def test_controller_state_dict_roundtrip():
    c = StalenessController(groups_per_step=2, max_staleness=1)
    for _ in range(4):
        c.start()
    c.release()
    c.set_version(1)
    c.start()
    c.start()
    state = c.state_dict()
    c2 = StalenessController(groups_per_step=2, max_staleness=1)
    c2.load_state_dict(state)
    assert c2.state_dict() == state
    # Resume after 2 consumed groups: the 3 queued/in-flight ones died with the old run.
    c3 = StalenessController(groups_per_step=2, max_staleness=1)
    c3.load_state_dict(state, kept_groups=2)
    assert c3.version == 1 and c3.admitted == 2
    n = 0
    while c3.can_start():
        c3.start()
        n += 1
    assert n == (1 + 1 + 1) * 2 - 2  # as a fresh run at version 1 would: eta + 1 batches ahead


# ---------------------------------------------------------------- Ray actor


def test_actor_fifo_backpressure_and_get_batch(actor):
    q = actor(capacity=3)
    # FIFO, and put awaits while the queue is full (backpressure) until a get makes room.
    for i in range(3):
        assert ray.get(q.put.remote(make_group(i, 0, n=2 + i % 2)), timeout=T)
    blocked = q.put.remote(make_group(3))
    assert pending(blocked)
    assert ray.get(q.put.remote(make_group(99), timeout=0.2), timeout=T) is False  # timed out: not enqueued
    assert [g.prompt_index for g in ray.get(q.get_batch.remote(1, timeout=5), timeout=T)] == [0]
    assert ray.get(blocked, timeout=T) is True
    assert [g.prompt_index for g in ray.get(q.get_batch.remote(3, timeout=5), timeout=T)] == [1, 2, 3]
    # get_batch awaits until enough groups are there.
    ref = q.get_batch.remote(3, timeout=20)
    for i in (4, 5):  # one at a time: concurrent calls to an async actor may run in any order
        assert ray.get(q.put.remote(make_group(i)), timeout=T)
    assert pending(ref)
    ray.get(q.put.remote(make_group(6)), timeout=T)
    assert [g.prompt_index for g in ray.get(ref, timeout=T)] == [4, 5, 6]
    # Timeout: all or nothing, the queue is left untouched.
    ray.get(q.put.remote(make_group(7)), timeout=T)
    assert ray.get(q.get_batch.remote(2, timeout=0.2), timeout=T) == []
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(q.get_batch.remote(4, timeout=0.1), timeout=T)  # more than capacity: never satisfiable
    s = ray.get(q.stats.remote(), timeout=T)
    assert s["queue/size"] == 1 and s["queue/size_samples"] == 2
    assert (s["groups/produced"], s["groups/consumed"]) == (8, 7)
    assert s["samples/produced"] == 2 + 3 + 2 + 2 * 5 and s["samples/consumed"] == s["samples/produced"] - 2
    assert s["samples/dropped_stale"] == 0
    assert s["queue/producer_wait_s"] >= 0.4 + 0.2 and s["queue/consumer_wait_s"] >= 0.4 + 0.2
    # shutdown wakes a put blocked on a full queue; the group is not enqueued.
    for i in (8, 9):
        assert ray.get(q.put.remote(make_group(i)), timeout=T)
    blocked = q.put.remote(make_group(10))
    assert pending(blocked)
    ray.get(q.shutdown.remote(), timeout=T)
    assert ray.get(blocked, timeout=5) is False
    assert [g.prompt_index for g in ray.get(q.drain.remote(), timeout=T)] == [7, 8, 9]


def test_actor_release_and_drop_free_slots(actor):
    q = actor(groups_per_step=1, max_staleness=1, drop_policy="drop")
    assert ray.get(q.acquire_start.remote(0, timeout=5), timeout=T)  # A at version 0: a straggler
    assert ray.get(q.acquire_start.remote(1, timeout=5), timeout=T)  # B at version 0
    assert ray.get(q.acquire_start.remote(2, timeout=0.2), timeout=T) is False  # limit (0+1+1)*1
    waiting = q.acquire_start.remote(2, timeout=20)
    assert pending(waiting)
    ray.get(q.release_start.remote(), timeout=T)  # B's reward failed: its slot goes to C
    assert ray.get(waiting, timeout=T) is True
    ray.get(q.put.remote(make_group(2, 0)), timeout=T)  # C
    assert [g.prompt_index for g in ray.get(q.get_batch.remote(1, timeout=5), timeout=T)] == [2]
    ray.get(q.set_version.remote(1), timeout=T)
    assert ray.get(q.acquire_start.remote(3, timeout=5), timeout=T)  # D at version 1
    ray.get(q.put.remote(make_group(3, 1)), timeout=T)
    assert [g.prompt_index for g in ray.get(q.get_batch.remote(1, timeout=5), timeout=T)] == [3]
    ray.get(q.set_version.remote(2), timeout=T)
    ray.get(q.put.remote(make_group(0, 0, n=3)), timeout=T)  # A finally arrives: staleness 2 > 1
    assert ray.get(q.get_batch.remote(1, timeout=0.3), timeout=T) == []  # dropped, never served
    s = ray.get(q.stats.remote(), timeout=T)
    assert (s["groups/dropped_stale"], s["samples/dropped_stale"]) == (1, 3)
    assert (s["admission/started"], s["admission/released"], s["admission/in_flight"]) == (4, 2, 0)
    # started = consumed + queued + in_flight + released
    assert s["admission/started"] == s["groups/consumed"] + s["queue/size"] + 0 + s["admission/released"]
    assert s["groups/produced"] == s["groups/consumed"] + s["groups/dropped_stale"] + s["queue/size"]


def ahead(q) -> int:
    """Groups started beyond what the trainer has consumed."""
    s = ray.get(q.stats.remote(), timeout=T)
    return s["admission/started"] - s["groups/consumed"]


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_actor_admission_trainer_producer_loop(actor, eta):
    """A producer thread and a trainer loop through the actor, "block" policy, in-order delivery;
    groups are stamped with the version the producer saw when its slot was granted."""
    gps, steps = 2, 4
    q = actor(capacity=16, groups_per_step=gps, max_staleness=eta)
    published = [0]  # what a rollout worker would have loaded
    stop = threading.Event()

    def producer():
        i, rng = 0, random.Random(eta)
        while not stop.is_set():
            if not ray.get(q.acquire_start.remote(0, timeout=10), timeout=T):
                return
            g = make_group(i, published[0])
            time.sleep(rng.uniform(0, 0.01))
            if not ray.get(q.put.remote(g, timeout=10), timeout=T):
                return
            i += 1

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    stalenesses = []
    try:
        for step in range(steps):
            batch = ray.get(q.get_batch.remote(gps, timeout=20), timeout=T)
            assert len(batch) == gps
            stalenesses += [g.staleness(step) for g in batch]
            # While the trainer "trains", the producer runs ahead until admission stops it at
            # exactly eta batches (eta = 0: nothing new starts, the synchronous schedule).
            deadline = time.monotonic() + 10
            while ahead(q) < eta * gps and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)  # give a (buggy) producer the chance to overshoot
            assert ahead(q) == eta * gps
            published[0] = step + 1  # weights reach the workers before admission opens
            ray.get(q.set_version.remote(step + 1), timeout=T)
    finally:
        stop.set()
        ray.get(q.shutdown.remote(), timeout=T)
        th.join(timeout=T)
    assert not th.is_alive()
    assert len(stalenesses) == steps * gps and max(stalenesses) <= eta
    if eta > 0:
        assert max(stalenesses) == eta  # the producer really ran ahead
    left = ray.get(q.drain.remote(), timeout=T)
    s = ray.get(q.stats.remote(), timeout=T)
    assert s["groups/produced"] == s["groups/consumed"] + s["groups/dropped_stale"] + len(left)


def test_actor_counts_balance_with_drops(actor):
    """Several producer threads, out-of-order delivery, drop policy: nothing is lost silently."""
    gps, eta = 2, 1
    q = actor(capacity=4, groups_per_step=gps, max_staleness=eta, drop_policy="drop")
    published = [0]

    def producer(wid: int):
        rng = random.Random(wid)
        i = 0
        while ray.get(q.acquire_start.remote(wid, timeout=10), timeout=T):
            g = make_group(1000 * wid + i, published[0], n=2 + wid % 2)
            time.sleep(rng.choice([0.0, 0.0, 0.05, 0.3]))  # occasional stragglers
            if rng.random() < 0.1:  # a failed reward: hand the slot back
                ray.get(q.release_start.remote(), timeout=T)
            elif not ray.get(q.put.remote(g, timeout=10), timeout=T):
                ray.get(q.release_start.remote(), timeout=T)  # shut down: never delivered
                return
            i += 1

    threads = [threading.Thread(target=producer, args=(w,), daemon=True) for w in range(3)]
    for th in threads:
        th.start()
    consumed = []
    for step in range(8):
        batch = ray.get(q.get_batch.remote(gps, timeout=20), timeout=T)
        assert len(batch) == gps
        assert all(g.staleness(step) <= eta for g in batch)  # strict under "drop"
        consumed += batch
        published[0] = step + 1
        ray.get(q.set_version.remote(step + 1), timeout=T)
    ray.get(q.shutdown.remote(), timeout=T)
    for th in threads:
        th.join(timeout=T)
        assert not th.is_alive()
    left = ray.get(q.drain.remote(), timeout=T)
    s = ray.get(q.stats.remote(), timeout=T)
    assert s["groups/consumed"] == len(consumed) == 8 * gps
    assert s["groups/produced"] == s["groups/consumed"] + s["groups/dropped_stale"] + len(left)
    assert s["samples/produced"] == (
        s["samples/consumed"] + s["samples/dropped_stale"] + sum(g.size for g in left)
    )
    assert s["samples/consumed"] == sum(g.size for g in consumed)
    # Everything delivered or given back (drain released the leftovers' slots):
    # started = consumed + queued + in_flight + released with queued = in_flight = 0.
    assert s["admission/started"] == s["groups/consumed"] + s["admission/released"]
    assert s["admission/in_flight"] == 0 and s["queue/size"] == 0


def test_actor_shutdown_wakes_waiters(actor):
    q = actor(capacity=4, groups_per_step=1, max_staleness=0)
    assert ray.get(q.acquire_start.remote(0), timeout=T)
    assert ray.get(q.put.remote(make_group(0, n=3)), timeout=T)
    blocked = [q.acquire_start.remote(1), q.get_batch.remote(2)]  # no timeouts: would wait forever
    ready, _ = ray.wait(blocked, num_returns=2, timeout=0.5)
    assert not ready
    t0 = time.monotonic()
    ray.get(q.shutdown.remote(), timeout=T)
    assert ray.get(blocked, timeout=5) == [False, []]
    assert time.monotonic() - t0 < 5
    # After shutdown nothing blocks and nothing is accepted (a put on a full queue is in the FIFO test).
    assert ray.get(q.put.remote(make_group(1)), timeout=5) is False
    assert ray.get(q.acquire_start.remote(2), timeout=5) is False
    assert ray.get(q.get_batch.remote(1), timeout=5) == []
    # What was produced but never trained comes back from drain, counted, its slot released.
    assert [g.prompt_index for g in ray.get(q.drain.remote(), timeout=T)] == [0]
    s = ray.get(q.stats.remote(), timeout=T)
    assert (s["groups/produced"], s["groups/drained"], s["samples/drained"], s["queue/size"]) == (1, 1, 3, 0)
    assert (s["admission/started"], s["admission/released"], s["admission/in_flight"]) == (1, 1, 0)


@pytest.mark.parametrize("restore_queued", [True, False])
def test_actor_state_dict_roundtrip(actor, restore_queued):
    """Save from a QueueActor run in-process (plain asyncio), resume in a Ray actor. The queued group
    comes back (or, when the resuming driver could not fetch it, counts as drained); the in-flight
    group's ticket is handed out again before any new one."""
    gps, eta = 2, 1

    async def run_old() -> tuple[dict, dict]:
        old = QueueActor(capacity=8, groups_per_step=gps, max_staleness=eta)
        tickets = [await old.acquire_ticket(w, timeout=5) for w in range(4)]
        assert tickets == [0, 1, 2, 3]
        for i in range(3):  # ticket 3 is still in flight at the checkpoint
            assert await old.put(make_group(i, 0, n=3, worker_id=i))
        assert len(await old.get_batch(gps, timeout=5)) == gps
        await old.set_version(1)
        return {**await old.state_dict(), "queued": old.queue.queued()}, await old.stats()

    state, before = asyncio.run(run_old())
    assert [g.prompt_index for g in state["queued"]] == [2] and state["in_flight_tickets"] == [3]
    if not restore_queued:  # the resuming driver could not fetch it
        state["queued"] = []
    q = actor(capacity=8, groups_per_step=gps, max_staleness=eta)
    ray.get(q.load_state_dict.remote(state), timeout=T)
    s = ray.get(q.stats.remote(), timeout=T)
    for key in ("samples/produced", "samples/consumed", "samples/dropped_stale", "admission/version"):
        assert s[key] == before[key]
    kept = 1 if restore_queued else 0
    assert s["queue/size"] == kept and s["groups/drained"] == 1 - kept and s["samples/drained"] == 3 * (1 - kept)
    assert s["admission/in_flight"] == 0
    assert s["groups/produced"] == s["groups/consumed"] + s["groups/dropped_stale"] + s["groups/drained"] + s["queue/size"]
    assert s["admission/started"] == s["groups/consumed"] + s["queue/size"] + s["admission/released"]
    # The ticket in flight at the checkpoint first, then new ones; exactly (v + eta + 1) * gps -
    # consumed - queued groups may start, so staleness stays <= eta.
    tickets = []
    while (t := ray.get(q.acquire_ticket.remote(0, timeout=0.1), timeout=T)) is not None:
        tickets.append(t)
    assert tickets == list(range(3, 3 + (1 + eta + 1) * gps - gps - kept))
    if restore_queued:
        assert [g.prompt_index for g in ray.get(q.get_batch.remote(1, timeout=5), timeout=T)] == [2]


def test_a_dead_workers_tickets_are_reissued_first_and_a_failed_rewards_is_not():
    """release_worker (the driver, for a dead rollout actor) hands all its tickets out again, in
    order, before new ones; a worker dropping its own group (reward failed) gives the slot back only."""

    async def scenario() -> list[int]:
        q = QueueActor(capacity=8, groups_per_step=2, max_staleness=1)
        # worker 1 holds two tickets: the group it generates and its next admission
        assert [await q.acquire_ticket(w, timeout=5) for w in (0, 1, 1)] == [0, 1, 2]
        await q.release_ticket(0, 0)  # reward failed: ticket 0 is not made again
        await q.release_ticket(0, 0)  # not held any more: no second slot back
        assert await q.release_worker(1) == [1, 2]  # worker 1 died: both come back
        assert await q.release_worker(1) == []  # nothing more held
        stats = await q.stats()
        assert stats["admission/in_flight"] == 0 and stats["admission/released"] == 3
        return [await q.acquire_ticket(w, timeout=0.1) for w in range(5)]

    assert asyncio.run(scenario()) == [1, 2, 3, 4, None]  # then the admission limit (v + eta + 1) * 2 = 4


class _Producer:
    """`stream_groups` on a thread of the test process, making records of `make_group` (or None
    for the tickets in `fail`), noting the queue's admission count as each group starts."""

    def __init__(self, queue, fail=(), make_s: float = 0.0):
        self.queue, self.fail, self.make_s = queue, set(fail), make_s
        self.stop = threading.Event()
        self.made: list[int] = []
        self.started_at_make: list[int] = []

    def make_record(self, ticket: int):
        from async_flowgrpo.types import GroupRecord

        time.sleep(self.make_s)  # the next admission is asked for meanwhile
        self.started_at_make.append(ray.get(self.queue.stats.remote(), timeout=T)["admission/started"])
        if ticket in self.fail:
            return None
        self.made.append(ticket)
        group = make_group(ticket, 0, n=2)
        return GroupRecord.of(group, ray.put(group))

    def start(self) -> threading.Thread:
        from async_flowgrpo.rollout.stream import stream_groups

        thread = threading.Thread(target=stream_groups, args=(self.queue, 0, self.make_record, self.stop, 0.2), daemon=True)
        thread.start()
        return thread


def test_a_producer_asks_for_its_next_admission_while_it_makes_a_group(actor):
    """The queue round trips overlap generation: when group k is being made, ticket k + 1 is already
    admitted; the admission limit still holds (gps 2, eta 1: 4 groups before version 1)."""
    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    producer = _Producer(q, make_s=0.1)
    thread = producer.start()
    deadline = time.monotonic() + T
    while ray.get(q.stats.remote(), timeout=T)["queue/size"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a fifth group would have been made by now if admission let it
    assert producer.made == [0, 1, 2, 3]
    assert producer.started_at_make[:3] == [2, 3, 4]  # ticket k + 1 admitted while k is made
    producer.stop.set()
    thread.join(timeout=T)
    assert not thread.is_alive()
    s = ray.get(q.stats.remote(), timeout=T)
    assert (s["queue/size"], s["admission/in_flight"]) == (4, 0)


def test_a_stopped_producer_gives_back_its_next_admission_and_a_failed_group_its_slot(actor):
    """A failed group's slot comes back (its ticket is not made again); stopping gives back the
    admission taken for the group after the last one; what was made is queued, nothing is lost."""
    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    producer = _Producer(q, fail={1})
    thread = producer.start()
    deadline = time.monotonic() + T
    while ray.get(q.stats.remote(), timeout=T)["queue/size"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    producer.stop.set()
    ray.get(q.set_version.remote(1), timeout=T)  # wakes the admission the producer waits on
    thread.join(timeout=T)
    assert not thread.is_alive()
    s = ray.get(q.stats.remote(), timeout=T)
    queued = [r.prompt_index for r in ray.get(q.get_batch.remote(s["queue/size"], 5), timeout=T)]
    assert queued == producer.made and 1 not in queued and queued[:3] == [0, 2, 3]
    assert s["admission/in_flight"] == 0
    assert s["admission/started"] == len(queued) + s["admission/released"]
    assert ray.get(q.state_dict.remote(), timeout=T)["in_flight_tickets"] == []


def test_a_snapshot_fetches_the_queued_groups_and_leaves_the_queue_as_it_was(actor):
    """Producers queue records whose groups wait in the object store; for a checkpoint the queue
    actor fetches the groups themselves, with its counters of the same moment."""
    from async_flowgrpo.types import GroupRecord

    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    for i in range(3):
        assert ray.get(q.acquire_ticket.remote(i, 5), timeout=T) == i
        group = make_group(i, 0, n=2, worker_id=i)
        group.rewards = torch.tensor([0.0, 1.0])
        assert ray.get(q.put.remote(GroupRecord.of(group, ray.put(group)), 5), timeout=T)
    assert ray.get(q.acquire_ticket.remote(3, 5), timeout=T) == 3  # in flight: a ticket, not a group
    state, groups = ray.get(q.snapshot.remote(), timeout=T)
    assert [g.prompt_index for g in groups] == [0, 1, 2] and all(isinstance(g, Group) for g in groups)
    assert state["in_flight_tickets"] == [3] and state["queue"]["produced"] == 3
    assert [r.prompt_index for r in ray.get(q.get_batch.remote(2, 5), timeout=T)] == [0, 1]


class _ScoringProducer(_Producer):
    """A producer whose groups are scored on other threads (`make_record` returns a Future): each
    score takes `score_s` and `fail` tickets score None."""

    def __init__(self, queue, score_s: float, fail=()):
        super().__init__(queue)
        from concurrent.futures import ThreadPoolExecutor

        self.score_s, self.fail_scores = score_s, set(fail)
        self.pool = ThreadPoolExecutor(max_workers=4)
        self.scored: list[int] = []

    def make_record(self, ticket: int):
        from async_flowgrpo.types import GroupRecord

        self.made.append(ticket)

        def score():
            time.sleep(self.score_s)
            self.scored.append(ticket)
            if ticket in self.fail_scores:
                return None
            group = make_group(ticket, 0, n=2)
            return GroupRecord.of(group, ray.put(group))

        return self.pool.submit(score)


def test_groups_scored_meanwhile_are_handed_in_once_scored_in_the_order_made(actor):
    """With scores in flight the producer goes on making groups; a group joins the queue once
    scored, a failed score gives its slot back, and admission (which counts groups still being
    scored) holds the producer at the bound: gps 2, eta 1, so 4 groups before version 1."""
    q = actor(capacity=8, groups_per_step=2, max_staleness=1)
    producer = _ScoringProducer(q, score_s=0.3, fail={1})
    try:
        _check_scored_meanwhile(q, producer)
    finally:
        # Scores still running after the stop would call ray.put once the module's Ray is shut
        # down, and Ray's auto-init would start a half-made second Ray that ends the process later.
        producer.pool.shutdown(wait=True)


def _check_scored_meanwhile(q, producer):
    thread = producer.start()
    deadline = time.monotonic() + T
    while ray.get(q.stats.remote(), timeout=T)["queue/size"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        if len(producer.made) >= 4:
            assert ray.get(q.stats.remote(), timeout=T)["admission/in_flight"] <= 4
    queued_at_bound = ray.get(q.stats.remote(), timeout=T)["queue/size"]
    assert producer.made[:5] == [0, 1, 2, 3, 4] and queued_at_bound == 4  # ticket 1 failed: 4 admitted
    producer.stop.set()
    ray.get(q.set_version.remote(1), timeout=T)
    thread.join(timeout=T)
    assert not thread.is_alive()
    s = ray.get(q.stats.remote(), timeout=T)
    queued = [r.prompt_index for r in ray.get(q.get_batch.remote(s["queue/size"], 5), timeout=T)]
    assert queued[:4] == [0, 2, 3, 4] and 1 not in queued
    # groups still being scored at the stop gave their slots back: nothing is held, all accounted for
    assert s["admission/in_flight"] == 0
    assert s["admission/started"] == len(queued) + s["admission/released"]
