"""modes/fully_async.py's loop with a stand-in for `Run` (no model, no rollout actors): a real queue
actor that the test fills itself, and a signal at a chosen moment. What the stop starts, and what
its checkpoint holds."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from async_flowgrpo.config import load_config
from async_flowgrpo.modes import fully_async
from async_flowgrpo.queue import QueueActor
from async_flowgrpo.stop import GracefulStop, StopRequested
from async_flowgrpo.types import GroupRecord
from test_queue import T, make_group

GPS = 2


class FakeRun:
    """What fully_async.run uses of `Run`. `started`: the prompt indices of each update started, and
    whether a stop had been asked for then; `saved`: the queue's part of the stop's checkpoint.
    `during_update(run)` runs inside each update, `at_start(run)` just before the loop."""

    during_update = at_start = staticmethod(lambda run: None)
    resumed_state: dict = {}

    def __init__(self, cfg, actor_classes=None, start_early=None):
        self.cfg, self.started_early = cfg, start_early()
        self.stop, self.step, self.version, self.lost_groups = GracefulStop(), 0, 0, 0
        self.rollouts, self.started, self.saved, self.owners = [], [], None, []
        self.log, self._on_exit = SimpleNamespace(summary=lambda extra: {}), []
        FakeRun.instance = self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, StopRequested):
            self.saved = self.checkpoint_extra()["queue"]
        for fn in self._on_exit:
            fn()

    def on_exit(self, fn):
        self._on_exit.append(fn)
        return fn

    def evaluate_at_start(self):
        FakeRun.at_start(self)

    def start_train(self, records):
        if not records:
            return None
        self.started.append(([r.prompt_index for r in records], self.stop.requested))
        self.owners += [owner_of(r.ref) for r in records]
        return records

    def finish_train(self, records):
        if records is None:
            return None
        FakeRun.during_update(self)
        self.step += 1
        self.version += 1
        return {}

    def needs_trainers_after(self, step):
        return False

    def publish_weights(self):
        return {}

    def end_step(self, metrics, extra):
        pass


def owner_of(ref) -> str:
    """The id of the worker (process) that owns `ref`'s object."""
    from ray.core.generated import common_pb2

    address = common_pb2.Address()
    address.ParseFromString(ray._private.worker.global_worker.core_worker.get_owner_address(ref))
    return address.worker_id.hex()


def put_groups(queue, indices):
    for i in indices:
        group = make_group(i, 0, n=2)
        assert ray.get(queue.put.remote(GroupRecord.of(group, ray.put(group)), 5), timeout=T)


@pytest.fixture
def fake_run(ray_cluster, monkeypatch):
    monkeypatch.setattr(fully_async, "Run", FakeRun)
    cfg = load_config("fully_async", [f"rollout.groups_per_step={GPS}", "algorithm.max_staleness=1",
                                      "trainer.total_steps=5", "ray.batch_wait_s=2", "sync.every=1"])
    yield cfg
    ray.kill(FakeRun.instance.started_early)


def stopped_run(cfg) -> FakeRun:
    with pytest.raises(StopRequested):
        fully_async.run(cfg)
    return FakeRun.instance


def queued(saved) -> list[int]:
    return [g["prompt_index"] for g in saved["queued_groups"]]


def test_a_stop_while_the_driver_waits_for_a_batch_starts_no_update(fake_run, monkeypatch):
    """The signal comes while get_batch waits; then the groups arrive: the batch is not trained, it
    is in the stop's checkpoint as queued, not counted as consumed."""

    def signal_then_groups(run):
        def later():
            time.sleep(0.5)  # the loop is waiting in get_batch (up to ray.batch_wait_s)
            run.stop.request(signal.SIGTERM)
            put_groups(run.started_early, [0, 1])

        threading.Thread(target=later, daemon=True).start()

    monkeypatch.setattr(FakeRun, "at_start", staticmethod(signal_then_groups))
    run = stopped_run(fake_run)
    assert run.started == [] and run.step == 0
    assert queued(run.saved) == [0, 1] and run.saved["queue"]["consumed"] == 0


def test_a_stop_during_an_update_does_not_start_the_prefetched_one(fake_run, monkeypatch):
    """The next batch was taken while update 1 ran; the signal comes during update 1: the stop
    ends the run at step 1 (one update to wait for, not two) and the prefetched batch is saved
    as queued, at the head of the queue, in its order."""
    monkeypatch.setattr(FakeRun, "at_start", staticmethod(lambda run: put_groups(run.started_early, [0, 1, 2, 3])))
    monkeypatch.setattr(FakeRun, "during_update", staticmethod(lambda run: run.stop.request(signal.SIGTERM)))
    run = stopped_run(fake_run)
    assert run.started == [([0, 1], False)] and run.step == 1
    assert queued(run.saved) == [2, 3] and run.saved["queue"]["consumed"] == GPS


def test_the_groups_a_resumed_run_restores_are_owned_by_the_queue_not_the_driver(fake_run, monkeypatch):
    """A driver that owns an object in the object store exits 1 when the node's raylet dies first
    (Ray cannot recover a put object, then ends the owner on its broken store connection): what a
    SIGTERM to every process of the run does. The groups a checkpoint restores are put into the
    object store by the queue actor, which owns them from then on."""

    async def saved_with_two_queued() -> dict:
        q = QueueActor(capacity=4, groups_per_step=GPS, max_staleness=1)
        for i in range(2):
            assert await q.acquire_ticket(0, timeout=5) == i
            assert await q.put(make_group(i, 0, n=2))
        return await q.state_dict()

    groups = [make_group(i, 0, n=2) for i in range(2)]
    for g in groups:
        g.rewards = torch.tensor([0.0, 1.0])
    saved = {**asyncio.run(saved_with_two_queued()), "queued_groups": [g.to_state() for g in groups]}
    monkeypatch.setattr(FakeRun, "resumed_state", {"queue": saved})
    monkeypatch.setattr(FakeRun, "during_update", staticmethod(lambda run: run.stop.request(signal.SIGTERM)))
    run = stopped_run(fake_run)
    assert run.started == [([0, 1], False)]  # the restored groups, trained first
    driver = ray._private.worker.global_worker.worker_id.hex()
    assert len(run.owners) == 2 and driver not in run.owners
