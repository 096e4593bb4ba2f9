"""The rollout actor: a `RolloutWorker` (generation + reward) in a Ray process.

Generation runs on the default thread, weight receive on the "sync" thread, counters on "control".
What leaves the actor is small: a `GroupRecord` per group (prompt, rewards, version); the group
itself (latents, embeddings, images) goes to Ray's object store, where trainers fetch it:
- batch modes: `generate` returns the records list and each group as separate return objects
  (num_returns = 1 + groups), so the driver owns them and gets only the records;
- fully_async: each group is put into the object store by this actor and only its record goes
  into the queue. (Ray >= 2.56 has no way to hand the object to a longer-lived owner: if this
  actor dies, its queued groups are lost with it; the trainer skips them and counts samples/lost.)
"""

from __future__ import annotations

import os

import ray

from async_flowgrpo.actors import quiet_actor_output
from async_flowgrpo.builders import set_cpu_threads
from async_flowgrpo.config import Config
from async_flowgrpo.gpu_monitor import GpuMonitor
from async_flowgrpo.rewards.pool import PooledReward
from async_flowgrpo.rollout.worker import RolloutWorker
from async_flowgrpo.types import GroupRecord


class WeightsNotReceived(RuntimeError):
    """A restarted rollout actor was asked to generate before it got the current weights."""


@ray.remote(concurrency_groups={"sync": 1, "control": 1}, max_restarts=-1)
class RolloutActor:
    """Ray restarts a dead rollout actor (max_restarts); the driver then rebuilds the weight-sync
    group and pushes the current weights before the actor generates again. Until then a restarted
    actor refuses to generate (`WeightsNotReceived`): it holds the base weights, not the run's."""

    def __init__(self, cfg: Config, worker_id: int, transport, reward_actors: list | None = None):
        quiet_actor_output(cfg.trainer.output_dir, f"rollout-{worker_id}", cfg.logging.actor_output == "file")
        set_cpu_threads(cfg.rollout.cpus_per_worker)
        reward = PooledReward(reward_actors, cfg.reward.timeout_s) if reward_actors else None
        self.worker = RolloutWorker(cfg, worker_id, reward=reward)
        self.poll_s = cfg.ray.poll_s
        self.receiver = transport.receiver()
        self.gpu = GpuMonitor().start()  # reports nothing on machines without NVIDIA GPUs
        self.has_weights = not ray.get_runtime_context().was_current_actor_reconstructed

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="sync")
    def sync_connect(self, address, rank: int, world_size: int) -> None:
        self.receiver.connect(address, rank, world_size)

    @ray.method(concurrency_group="sync")
    def pull(self, handle: list) -> dict:
        result = self.receiver.receive(handle[0])
        self.worker.stage_weights(result.state, result.version)
        self.has_weights = True
        return {"version": result.version, "seconds": result.stats.seconds, "digest": result.stats.digest}

    def generate(self, tickets: list[int]) -> tuple:
        """Call with .options(num_returns=len(tickets) + 1): returns ([record or None per ticket],
        *groups). A group whose reward failed is None in both."""
        self._check_weights()
        groups = self.worker.generate(tickets)
        records = [None if g is None else GroupRecord.of(g) for g in groups]
        return (records, *groups)

    def run(self, queue) -> dict:
        self._check_weights()
        return self.worker.run(queue, lambda group: GroupRecord.of(group, ray.put(group)), self.poll_s)

    def _check_weights(self) -> None:
        if not self.has_weights:
            raise WeightsNotReceived("restarted rollout actor: no weights received yet")

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self.worker.stop()

    @ray.method(concurrency_group="control")
    def stats(self) -> dict[str, float]:
        return {**self.worker.stats(), **{f"rollout/{k.split('/')[-1]}": v for k, v in self.gpu.read().items()}}

    @ray.method(concurrency_group="control")
    def weights_digest(self) -> str:
        from async_flowgrpo.sync import digest

        engine = self.worker.engine
        return digest(getattr(engine, "policy", engine).trainable_state())
