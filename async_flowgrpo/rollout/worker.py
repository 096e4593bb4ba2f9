"""Rollout worker: engine + reward + prompt tickets; the Ray actor that streams groups.

`RolloutWorker` is a plain class (testable without Ray); `RolloutActor` at the bottom is the thin
Ray shell. The worker never blocks on weight sync: received weights are *staged* by the actor's
sync thread and the engine swaps them in at a safe point — before a denoising step
(`between_steps`, the in-flight update: steps after the switch carry the new version) or before a
group (`between_groups`). Nothing is aborted or regenerated.

Ticket = the global index of a started group. It fixes the group's prompt (prompt stream index)
and its seed, so which worker generates a group never changes what is generated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray
import torch

from async_flowgrpo.builders import build_engine, set_cpu_threads
from async_flowgrpo.config import Config, RolloutConfig
from async_flowgrpo.prompts import PromptStream, load_prompts
from async_flowgrpo.rewards import CombinedReward, RewardError
from async_flowgrpo.types import Group

logger = logging.getLogger(__name__)


def group_seed(base_seed: int, ticket: int) -> int:
    return (base_seed * 1_000_003 + ticket) % (2**62)


def sampling_kwargs(r: RolloutConfig) -> dict:
    """The rollout.* sampling settings as keyword arguments of `generate` (engines and policy)."""
    return dict(
        num_steps=r.num_steps,
        guidance_scale=r.guidance_scale,
        noise_level=r.noise_level,
        sde_type=r.sde_type,
        window_size=0 if r.sampler == "ode" else r.sde_window_size or r.num_steps - 1,  # 0: ODE, final latent
        window_range=tuple(r.sde_window_range) if r.sde_window_range else None,
        shared_initial_noise=r.shared_initial_noise,
        height=r.resolution or None,
        width=r.resolution or None,
    )


class RolloutWorker:
    """update_point: "between_steps" (in-flight updates, fully_async) or "between_groups"."""

    def __init__(self, cfg: Config, worker_id: int = 0, engine: Any = None, update_point: str | None = None, reward=None):
        self.cfg = cfg
        self.worker_id = worker_id
        update_point = update_point or (cfg.sync.update_point if cfg.mode == "fully_async" else "between_groups")
        self.engine = engine if engine is not None else build_engine(cfg, update_point)
        self.reward = reward or CombinedReward(cfg.reward.weights, cfg.reward.options)
        self.prompts = PromptStream(load_prompts(cfg.rollout.prompts), seed=cfg.rollout.seed, mix=cfg.rollout.prompt_mix)
        self.sampling = sampling_kwargs(cfg.rollout)
        self._stop = threading.Event()
        # counters reported through stats()
        self.groups_generated = 0
        self.reward_errors = 0
        self.consecutive_reward_failures = 0
        self.last_reward_error = ""
        self.inflight_updates = 0  # groups whose steps carry two or more weight versions
        self._window_start = time.perf_counter()
        self._window_busy = 0.0

    def stage_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Called from the sync thread; the engine swaps them in at its next safe point."""
        self.engine.stage_weights(state, version)

    # -- generation --------------------------------------------------------------------------
    def generate_group(self, ticket: int) -> Group | None:
        """Generate and score the group for `ticket`; None when its reward failed (counted)."""
        prompt = self.prompts.prompt_at(ticket)
        start = time.perf_counter()
        group = self.engine.generate(
            [prompt.text],
            self.cfg.rollout.group_size,
            group_seed(self.cfg.rollout.seed, ticket),
            prompt_indices=[ticket],
            metadata=[prompt.metadata],
            **self.sampling,
        )[0]
        group.worker_id = self.worker_id
        if group.versions.numel() and group.versions.min() != group.versions.max():
            self.inflight_updates += 1
        try:
            n = group.size
            group.rewards, group.reward_components = self.reward(group.images, [prompt.text] * n, [prompt.metadata] * n)
            self.consecutive_reward_failures = 0
        except RewardError as e:
            self.reward_errors += 1
            self.consecutive_reward_failures += 1
            self.last_reward_error = str(e)
            logger.warning("worker %d: skipping group %d: %s", self.worker_id, ticket, e)
            group = None
        elapsed = time.perf_counter() - start
        self._window_busy += elapsed
        if group is not None:
            group.time_generate_s = elapsed
            self.groups_generated += 1
        if self.consecutive_reward_failures >= self.cfg.reward.max_consecutive_failures:
            raise RuntimeError(
                f"rollout worker {self.worker_id}: {self.consecutive_reward_failures} consecutive reward failures "
                f"(reward.max_consecutive_failures); last: {self.last_reward_error}"
            )
        return group

    def generate(self, tickets: list[int]) -> list[Group | None]:
        """Batch mode (sync, one_step_off): the driver hands out the tickets."""
        return [self.generate_group(t) for t in tickets]

    def run(self, queue, poll_s: float = 1.0) -> dict:
        """Fully async mode: take admission tickets from the queue and stream groups into it."""
        while not self._stop.is_set():
            ticket = ray.get(queue.acquire_ticket.remote(self.worker_id, poll_s))
            if ticket is None:
                continue  # no admission yet: re-check the stop flag
            if ticket < 0:
                break  # queue shut down
            group = self.generate_group(ticket)
            if group is None:
                ray.get(queue.release_worker.remote(self.worker_id))
                continue
            while not ray.get(queue.put.remote(group, poll_s)):
                if self._stop.is_set():
                    ray.get(queue.release_worker.remote(self.worker_id))
                    return self.stats()
        return self.stats()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, float]:
        """Counters, and the busy fraction since the previous call (rollout idle = 1 - busy)."""
        now = time.perf_counter()
        busy_frac = min(self._window_busy / max(now - self._window_start, 1e-9), 1.0)
        self._window_start, self._window_busy = now, 0.0
        return {
            "rollout/groups": self.groups_generated,
            "rewards/errors": self.reward_errors,
            "rollout/inflight_updates": self.inflight_updates,
            "rollout/aborted": 0,  # weight updates never abort a trajectory
            "rollout/version": self.engine.version,
            "perf/rollout_idle_frac": 1.0 - busy_frac,
        }


@ray.remote(concurrency_groups={"sync": 1, "control": 1}, max_restarts=-1)
class RolloutActor:
    """Ray shell: generation on the default thread, weight receive on the "sync" thread.

    Ray restarts a dead rollout actor (max_restarts); the pipeline then rebuilds the weight-sync
    group and pushes the current weights before the actor generates again."""

    def __init__(self, cfg: Config, worker_id: int, transport, reward_actors: list | None = None):
        from async_flowgrpo.gpu_monitor import GpuMonitor
        from async_flowgrpo.rewards.pool import PooledReward

        set_cpu_threads(cfg.rollout.cpus_per_worker)
        reward = PooledReward(reward_actors, cfg.reward.timeout_s) if reward_actors else None
        self.worker = RolloutWorker(cfg, worker_id, reward=reward)
        self.receiver = transport.receiver()
        self.gpu = GpuMonitor().start()  # reports nothing on machines without NVIDIA GPUs

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="sync")
    def sync_connect(self, address, rank: int, world_size: int) -> None:
        self.receiver.connect(address, rank, world_size)

    @ray.method(concurrency_group="sync")
    def pull(self, handle: list) -> dict:
        result = self.receiver.receive(handle[0])
        self.worker.stage_weights(result.state, result.version)
        return {"version": result.version, "seconds": result.stats.seconds, "digest": result.stats.digest}

    def generate(self, tickets: list[int]) -> list[Group | None]:
        return self.worker.generate(tickets)

    def run(self, queue) -> dict:
        return self.worker.run(queue)

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
