"""Bounded replay queue with admission control: the buffer between rollout and trainer (DESIGN §3).

Three layers, so the logic is testable without Ray:

* `StalenessController` bounds how far rollout may run ahead of the trainer (AReaL-style admission
  control): a rollout worker may *start* a group only while
  ``admitted < (v + max_staleness + 1) * groups_per_step`` where ``admitted = started - released``
  and v is the last published weight version.
* `ReplayQueue` is a FIFO of `Group`s with a capacity (in groups) and the counters the metrics need,
  plus an optional "drop" policy for groups that still arrive too stale.
* `QueueActor` is a thin asyncio shell around both: blocking becomes awaiting on one
  `asyncio.Condition`; `make_queue_actor` turns it into a Ray async actor.

Accounting (groups; every group a worker starts ends up in exactly one bucket):

    started  = consumed + queued + in_flight + released
    produced = consumed + dropped_stale + drained + queued

``started``/``released`` are the controller's counters, ``produced``/``consumed``/``dropped_stale``/
``drained``/``queued`` the queue's, ``in_flight`` is what workers are generating (or scoring) right
now. ``released`` counts every slot given back: `release_start` by a worker whose started group
will never be delivered (reward failed, worker died, stopped; without it the slot stays
taken and the trainer may wait forever), groups dropped as stale, groups drained at shutdown, and
on resume the groups lost with the old run. So ``admitted = started - released`` is exactly
``consumed + queued + in_flight``. (This holds when every producer takes a slot with
`acquire_start`; producers that skip admission, e.g. a plain one-step-off loop, simply leave the
controller unused.)

Staleness bound: if groups are consumed in the order their slots were admitted, the k-th admitted
group (0-based) is trained at version floor(k / groups_per_step) <= v_start + max_staleness, so no
consumed group is staler than max_staleness. A straggler that finishes long after groups started
later can exceed it; the "drop" policy (or the importance-weight correction in the loss) handles
those. `groups_per_step` must be the number of groups the trainer consumes between two published
versions (groups_per_step * sync_every when it publishes every sync_every updates), otherwise the
trainer waits for groups that admission control will not let anyone start. Staleness is measured
on the versions a group's steps actually carry, so a worker that starts a group before loading the
newest published weights adds its own lag on top of the bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Literal

from async_flowgrpo.types import Group, GroupRecord

logger = logging.getLogger(__name__)

DropPolicy = Literal["block", "drop"]


class StalenessController:
    """Admission control: how many groups may be started given the published version."""

    def __init__(self, groups_per_step: int, max_staleness: int, version: int = 0) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.version = version
        self.started = 0  # groups ever admitted (monotonic)
        self.released = 0  # admitted groups whose slot was handed back (never delivered, or dropped)

    @property
    def limit(self) -> int:
        """Admitted groups allowed at the current version."""
        return (self.version + self.max_staleness + 1) * self.groups_per_step

    @property
    def admitted(self) -> int:
        """Groups holding a slot: consumed + queued + in flight."""
        return self.started - self.released

    def can_start(self) -> bool:
        return self.admitted < self.limit

    def start(self) -> None:
        """Take a slot. Callers check `can_start` first; starting past the limit is a bug."""
        if not self.can_start():
            raise RuntimeError(
                f"admission limit reached ({self.admitted} admitted, limit {self.limit} at version {self.version})"
            )
        self.started += 1

    def release(self, n: int = 1) -> None:
        """Give back the slots of n started groups that will never be trained."""
        if n < 0 or self.admitted - n < 0:
            raise ValueError(f"cannot release {n} slots: only {self.admitted} admitted")
        self.released += n

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"version went backwards: {self.version} -> {version}")
        self.version = version

    def state_dict(self) -> dict[str, int]:
        return {
            "version": self.version,
            "started": self.started,
            "released": self.released,
            "groups_per_step": self.groups_per_step,
            "max_staleness": self.max_staleness,
        }

    def load_state_dict(self, state: dict[str, int], kept_groups: int | None = None) -> None:
        """Restore after a restart.

        Groups in flight when the checkpoint was written did not survive the restart (their
        tickets are handed out again and take new slots), so their slots must not stay taken: the
        trainer would wait for them forever. With ``kept_groups`` (the groups consumed at the
        checkpoint plus those restored to the queue) every other slot is released:
        ``released = started - kept_groups``, so ``admitted = kept_groups``, exactly as a fresh run
        at that version that had made those groups, and staleness <= max_staleness keeps holding.
        Without it the saved counters come back verbatim. groups_per_step / max_staleness keep the
        constructor's values (the config may have changed on resume).
        """
        self.version = int(state["version"])
        self.started = int(state["started"])
        self.released = int(state["released"])
        if kept_groups is not None:
            self.started = max(self.started, int(kept_groups))
            self.released = self.started - int(kept_groups)


class ReplayQueue:
    """FIFO of groups with a capacity (in groups) and counters. Non-blocking; `QueueActor` waits.

    drop_policy "block" (default) keeps every group. "drop" removes, on `prune` (called by the actor
    on every get and version change), each queued group whose staleness against the version exceeds
    max_staleness; it is counted in dropped_stale and its admission slot released via `controller`.
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int = 0,
        drop_policy: DropPolicy = "block",
        controller: StalenessController | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if drop_policy not in ("block", "drop"):
            raise ValueError(f"drop_policy must be 'block' or 'drop', got {drop_policy!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.drop_policy = drop_policy
        self.controller = controller
        self._groups: deque[Group] = deque()
        # Counters in groups and in samples (groups differ in size only if configs mix).
        self.produced = self.consumed = self.dropped_stale = self.drained = 0
        self.produced_samples = self.consumed_samples = self.dropped_stale_samples = 0
        self.drained_samples = 0
        self.producer_wait_s = 0.0
        self.consumer_wait_s = 0.0

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def full(self) -> bool:
        return len(self._groups) >= self.capacity

    @property
    def size_samples(self) -> int:
        return sum(g.size for g in self._groups)

    def put(self, group: Group) -> None:
        if self.full:
            raise RuntimeError(f"queue full ({self.capacity} groups)")
        self._groups.append(group)
        self.produced += 1
        self.produced_samples += group.size

    def prune(self, version: int) -> list[Group]:
        """Under the "drop" policy, remove (and count) groups staler than max_staleness at `version`."""
        if self.drop_policy != "drop":
            return []
        stale = [g for g in self._groups if g.staleness(version) > self.max_staleness]
        if stale:
            self._groups = deque(g for g in self._groups if g.staleness(version) <= self.max_staleness)
            self.dropped_stale += len(stale)
            self.dropped_stale_samples += sum(g.size for g in stale)
            self._release_slots(len(stale))
            logger.info("dropped %d stale groups at version %d", len(stale), version)
        return stale

    def take(self, n: int) -> list[Group]:
        """Pop exactly n groups in FIFO order (all or nothing)."""
        if n > len(self._groups):
            raise RuntimeError(f"asked for {n} groups, {len(self._groups)} queued")
        out = [self._groups.popleft() for _ in range(n)]
        self.consumed += n
        self.consumed_samples += sum(g.size for g in out)
        return out

    def put_back(self, groups: list[Group]) -> None:
        """Groups that `take` returned and that will not be trained (a stop came first): back at the
        head, in their order, no longer counted as consumed. They may exceed the capacity for a
        while: their slots were taken all along."""
        self._groups.extendleft(reversed(groups))
        self.consumed -= len(groups)
        self.consumed_samples -= sum(g.size for g in groups)

    def drain(self) -> list[Group]:
        """Remove and return everything queued (counted as drained, not consumed)."""
        out = list(self._groups)
        self._groups.clear()
        self.drained += len(out)
        self.drained_samples += sum(g.size for g in out)
        self._release_slots(len(out))
        return out

    def queued(self) -> list:
        """The queued groups in order, left in the queue."""
        return list(self._groups)

    def _release_slots(self, n: int) -> None:
        """Give back the admission slots of n groups just removed untrained.

        Slots held by groups not yet trained = admitted - consumed - queued (= in flight + these n
        when every producer used admission); the clamp keeps producers that skipped admission
        (nothing to give back) from corrupting the counters.
        """
        c = self.controller
        if c is None or n == 0:
            return
        held = c.admitted - self.consumed - len(self._groups)
        c.release(min(n, max(0, held)))

    def state_dict(self) -> dict[str, Any]:
        """Counters only; `queued()` lists the groups themselves."""
        keys = (
            "produced consumed dropped_stale drained produced_samples consumed_samples "
            "dropped_stale_samples drained_samples producer_wait_s consumer_wait_s"
        ).split()
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any], queued: list | None = None) -> None:
        """Restore the counters; `queued`: the groups that were queued at save time, back in the
        queue in their order (they were counted as produced then). Any other group queued at save
        time is gone and counts as drained, so produced = consumed + dropped_stale + drained +
        queued holds in the resumed run."""
        for k, v in state.items():
            setattr(self, k, v)
        self._groups = deque(queued or [])
        self.drained = self.produced - self.consumed - self.dropped_stale - len(self._groups)
        self.drained_samples = (self.produced_samples - self.consumed_samples - self.dropped_stale_samples
                                - self.size_samples)


class QueueActor:
    """asyncio shell around `StalenessController` + `ReplayQueue`; run as a Ray async actor.

    Every state change does `notify_all` on one Condition and each waiter re-checks its own
    predicate: simple, and with a handful of workers the spurious wake-ups cost nothing.
    Timeouts are in seconds; None waits forever (until `shutdown`).
    """

    def __init__(
        self,
        capacity: int,
        groups_per_step: int,
        max_staleness: int,
        drop_policy: DropPolicy = "block",
    ) -> None:
        self.controller = StalenessController(groups_per_step, max_staleness)
        self.queue = ReplayQueue(capacity, max_staleness, drop_policy, self.controller)
        self.admission_wait_s = 0.0  # part of producer_wait_s spent in acquire_start
        self.next_ticket = 0  # see acquire_ticket
        # worker id -> its tickets not yet delivered: the group it is generating, and the next one
        # (a worker asks for its next admission while it generates, see RolloutWorker.run)
        self.tickets_in_flight: dict[int, list[int]] = {}
        self.pending_tickets: deque[int] = deque()  # in flight when the run was checkpointed: handed out first
        self._closed = False
        self._cond: asyncio.Condition | None = None  # created on the actor's event loop

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _wait(self, predicate: Callable[[], bool], timeout: float | None) -> tuple[bool, float]:
        """Wait (holding self.cond) until predicate() or shutdown or timeout.

        Returns (predicate held and not shut down, seconds waited).
        """
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        while not (self._closed or predicate()):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            try:
                await asyncio.wait_for(self.cond.wait(), remaining)
            except asyncio.TimeoutError:
                pass  # loop re-checks the predicate and the deadline
        ok = not self._closed and predicate()
        return ok, time.monotonic() - t0

    async def put(self, group: Group, timeout: float | None = None) -> bool:
        """Enqueue `group`, awaiting while the queue is full (backpressure).

        True when enqueued; False on timeout or shutdown, and then the group is NOT in the queue:
        the caller retries or calls `release_start`.
        """
        async with self.cond:
            ok, waited = await self._wait(lambda: not self.queue.full, timeout)
            self.queue.producer_wait_s += waited
            if ok:
                self.queue.put(group)
                self._forget_ticket(group.worker_id, group.prompt_index)
                self.cond.notify_all()
            return ok

    async def acquire_start(self, worker_id: int = 0, timeout: float | None = None) -> bool:
        """Await an admission slot for one new group; True when taken.

        False on timeout or shutdown (no slot taken). The slot stays with the group through `put`
        and consumption (that is what bounds staleness); it comes back only when the group is
        dropped as stale or drained, or when the worker calls `release_start` because the group
        will never be delivered (also after a `put` that returned False).
        """
        async with self.cond:
            ok, waited = await self._wait(self.controller.can_start, timeout)
            self.queue.producer_wait_s += waited
            self.admission_wait_s += waited
            if ok:
                self.controller.start()
            elif waited > 0 and not self._closed:
                logger.debug("worker %s: no admission slot after %.1fs", worker_id, waited)
            return ok

    async def acquire_ticket(self, worker_id: int = 0, timeout: float | None = None) -> int | None:
        """`acquire_start` that also hands out the group's ticket: the global index of the started
        group, which fixes its prompt and seed. None on timeout (no slot taken), -1 after shutdown."""
        if not await self.acquire_start(worker_id, timeout):
            return -1 if self._closed else None
        if self.pending_tickets:
            ticket = self.pending_tickets.popleft()
        else:
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.tickets_in_flight.setdefault(worker_id, []).append(ticket)
        return ticket

    def _forget_ticket(self, worker_id: int, ticket: int) -> bool:
        held = self.tickets_in_flight.get(worker_id, [])
        if ticket not in held:
            return False
        held.remove(ticket)
        return True

    async def release_ticket(self, worker_id: int, ticket: int) -> None:
        """A worker will not deliver this ticket's group (its reward failed, or the worker is
        stopping before it started the group): the slot comes back, the ticket is not made again."""
        if self._forget_ticket(worker_id, ticket):
            await self.release_start(1)

    async def release_worker(self, worker_id: int) -> list[int]:
        """A worker died: its tickets are handed out again before any new one (their prompts are
        regenerated, not lost) and their slots come back; returns them."""
        tickets = self.tickets_in_flight.pop(worker_id, [])
        self.pending_tickets.extendleft(reversed(tickets))
        if tickets:
            await self.release_start(len(tickets))
        return tickets

    async def release_start(self, n: int = 1) -> None:
        """Give back n slots of started groups that will never be delivered."""
        async with self.cond:
            self.controller.release(n)
            self.cond.notify_all()

    async def get_batch(self, num_groups: int, timeout: float | None = None) -> list[Group]:
        """Await until `num_groups` groups are queued, then pop exactly that many (FIFO).

        All or nothing: on timeout or shutdown it returns [] and leaves the queue untouched, so a
        batch never comes out short (group counts drive advantages and admission accounting).
        Under the "drop" policy stale groups are dropped first and do not count.
        """
        if num_groups > self.queue.capacity:
            raise ValueError(f"num_groups {num_groups} > queue capacity {self.queue.capacity}: would wait forever")
        async with self.cond:
            warned = False

            def ready() -> bool:
                # Re-evaluated on every wake-up, so stale groups are dropped as soon as they
                # are seen (a side effect, under the lock) and never counted towards the batch.
                nonlocal warned
                if self.queue.prune(self.controller.version):
                    self.cond.notify_all()  # freed slots and queue space
                if len(self.queue) >= num_groups:
                    return True
                c = self.controller
                if not warned and not c.can_start() and c.admitted - self.queue.consumed < num_groups:
                    # Everything admitted is queued or in flight and still too few: unless someone
                    # else raises the version, this waits forever (groups_per_step misconfigured?).
                    logger.warning(
                        "get_batch(%d) can never be satisfied at version %d: %d groups queued or in "
                        "flight, admission limit %d reached",
                        num_groups, c.version, c.admitted - self.queue.consumed, c.limit,
                    )
                    warned = True
                return False

            ok, waited = await self._wait(ready, timeout)
            self.queue.consumer_wait_s += waited
            if not ok:
                return []
            batch = self.queue.take(num_groups)
            self.cond.notify_all()  # space for blocked producers
            return batch

    async def put_back(self, groups: list[Group]) -> None:
        """A batch from `get_batch` that will not be trained (the run is stopping): queued again at
        the head, so the stop's checkpoint holds it as queued and a resumed run trains it first."""
        async with self.cond:
            self.queue.put_back(groups)
            self.cond.notify_all()

    async def set_version(self, version: int) -> None:
        """Publish a new weight version: raises the admission limit (and prunes under "drop")."""
        async with self.cond:
            self.controller.set_version(version)
            self.queue.prune(version)
            self.cond.notify_all()

    async def stats(self) -> dict[str, float]:
        q, c = self.queue, self.controller
        return {
            "queue/size": len(q),  # groups
            "queue/size_samples": q.size_samples,
            "queue/capacity": q.capacity,
            "queue/producer_wait_s": q.producer_wait_s,
            "queue/admission_wait_s": self.admission_wait_s,
            "queue/consumer_wait_s": q.consumer_wait_s,
            "samples/produced": q.produced_samples,
            "samples/consumed": q.consumed_samples,
            "samples/dropped_stale": q.dropped_stale_samples,
            "samples/drained": q.drained_samples,
            "groups/produced": q.produced,
            "groups/consumed": q.consumed,
            "groups/dropped_stale": q.dropped_stale,
            "groups/drained": q.drained,
            "admission/version": c.version,
            "admission/started": c.started,
            "admission/released": c.released,
            "admission/limit": c.limit,
            # started = consumed + queued + in_flight + released  (negative only if producers skip admission)
            "admission/in_flight": c.admitted - q.consumed - len(q),
        }

    async def shutdown(self) -> None:
        """Wake every waiter (put/acquire_start return False, get_batch []); later calls do the same."""
        async with self.cond:
            self._closed = True
            self.cond.notify_all()

    async def drain(self) -> list[Group]:
        """Remove and return the queued groups (after shutdown: what was produced but never trained).

        They count as drained and their admission slots are released."""
        async with self.cond:
            out = self.queue.drain()
            self.cond.notify_all()
            return out

    async def state_dict(self) -> dict[str, Any]:
        """Counters, and the tickets of groups in flight (a resumed run hands them out first)."""
        return {
            "controller": self.controller.state_dict(),
            "queue": self.queue.state_dict(),
            "admission_wait_s": self.admission_wait_s,
            "next_ticket": self.next_ticket,
            "in_flight_tickets": sorted([t for held in self.tickets_in_flight.values() for t in held] + [*self.pending_tickets]),
        }

    async def snapshot(self) -> tuple[dict[str, Any], list]:
        """(`state_dict`, the queued groups themselves in order), taken at one moment, for a
        checkpoint: a group put in between would otherwise be saved both as queued and as a ticket
        in flight. The queue is left as it was. The groups are fetched here, by the actor holding
        their refs, so that the refs are never handed on a second time (Ray's nested reference
        counting can lose an object whose ref is deserialized twice in one process)."""
        async with self.cond:
            state, records = await self.state_dict(), self.queue.queued()
        groups = []
        for record in records:
            try:
                groups.append(await record.ref)
            except Exception as e:  # lost with its rollout actor: left out, counted as drained on resume
                logger.warning("queued group %d not saved: %s", record.prompt_index, str(e).splitlines()[0][:200])
        return state, groups

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state: the queued groups are queued again and the in-flight tickets are
        handed out before new ones, so a stop loses no rollout work. The other slots are released
        (admitted := consumed + queued, see `StalenessController.load_state_dict`).

        The groups to put back (possibly fewer than were saved): "queued", as the queue holds them,
        or "queued_groups", their checkpoint form (`Group.to_state`), which this actor puts into the
        object store itself, so that it owns them, not the driver. A driver that owns an object in
        the object store exits 1 when the node's raylet dies before it (Ray cannot recover a put
        object, then ends the owner on its broken store connection), which is what a SIGTERM to
        every process of the run does."""
        queued = list(state.get("queued", []))
        if state.get("queued_groups"):
            import ray  # (in the actor; the plain classes above need no Ray)

            for saved in state["queued_groups"]:
                group = Group.from_state(saved)
                queued.append(GroupRecord.of(group, ray.put(group)))
        async with self.cond:
            self.queue.load_state_dict(state["queue"], queued)
            self.controller.load_state_dict(state["controller"], kept_groups=self.queue.consumed + len(self.queue))
            self.admission_wait_s = float(state.get("admission_wait_s", 0.0))
            self.next_ticket = int(state.get("next_ticket", 0))
            self.pending_tickets = deque(int(t) for t in state.get("in_flight_tickets", []))
            self.cond.notify_all()


def make_queue_actor(
    capacity: int,
    groups_per_step: int,
    max_staleness: int,
    drop_policy: DropPolicy = "block",
    *,
    name: str | None = None,
    max_concurrency: int = 1000,
):
    """Create the `QueueActor` as a Ray async actor (needs `ray.init`).

    num_cpus=0: it only shuffles references and must never wait for a free CPU. max_concurrency
    bounds how many calls may be awaiting at once (every blocked put/acquire/get holds one).
    """
    import ray  # imported here so the module works without a Ray cluster

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": max_concurrency}
    if name is not None:
        options["name"] = name
    cls = ray.remote(QueueActor)
    return cls.options(**options).remote(capacity, groups_per_step, max_staleness, drop_policy)
