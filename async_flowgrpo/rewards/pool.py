"""A pool of reward actors, so slow rewards (model-based, remote) do not stall generation and a
reward that hangs is cut off by reward.timeout_s. Same call as CombinedReward."""

from __future__ import annotations

import itertools
import time

import ray
import torch

from async_flowgrpo.rewards import CombinedReward, RewardError
from async_flowgrpo.rewards.batching import Batcher

RESTART_WAIT_S = 300.0


@ray.remote
class RewardActor:
    """batch_size > 0: the groups sent at about the same time (from every rollout worker: the
    actor takes that many calls at once) are scored in one call of the reward (`Batcher`)."""

    def __init__(self, weights: dict[str, float], options: dict[str, dict], batch_size: int = 0, batch_wait_s: float = 0.0):
        self.reward = CombinedReward(weights, options)
        self.batcher = Batcher(self.reward.score_groups, batch_size, batch_wait_s) if batch_size else None

    def ready(self) -> bool:
        return True

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        if self.batcher is None:
            return self.reward(images, prompts, metadata)
        return self.batcher.submit((images, prompts, metadata), images.shape[0])


class PooledReward:
    """Each group is sent once: a call that fails in any way (timed out, the actor died or became
    unavailable while it ran) skips the group and is never sent again, since the reward may have
    run. Only waiting for a restarting actor before sending happens more than once."""

    def __init__(self, actors: list, timeout_s: float):
        self.actors, self.timeout_s = actors, timeout_s
        self._turn = itertools.cycle(range(len(actors)))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        actor = self.actors[next(self._turn)]
        try:
            _wait_ready(actor)  # restarting after an earlier timeout or death: its start-up does not count against this group
            return ray.get(actor.score.remote(images, prompts, metadata), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=False)  # stop the hung call; Ray restarts the actor (max_restarts)
            raise RewardError("pool", f"timed out after {self.timeout_s:g}s (reward.timeout_s)") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RewardError):
                raise e.cause from None
            raise RewardError("pool", str(e).splitlines()[0]) from None
        except ray.exceptions.RayActorError as e:
            raise RewardError("pool", f"reward actor died: {str(e).splitlines()[0]}") from None


def _wait_ready(actor) -> None:
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=RESTART_WAIT_S)
            return
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def make_reward_pool(num_workers: int, weights: dict[str, float], options: dict[str, dict], cpus_per_worker: float,
                     gpus_per_worker: float = 0.0, resources: dict[str, float] | None = None,
                     max_concurrency: int = 1, batch_size: int = 0, batch_wait_s: float = 0.0) -> list:
    """max_restarts: a reward actor cancelled after a timeout (or killed) comes back for the next
    group. max_concurrency: the groups one actor scores at once (every rollout worker's pending
    groups), so one slow group neither holds back the others nor eats their reward.timeout_s."""
    return [
        RewardActor.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, resources=dict(resources or {}),
                            max_restarts=-1, max_concurrency=max_concurrency).remote(weights, options, batch_size, batch_wait_s)
        for _ in range(num_workers)
    ]
