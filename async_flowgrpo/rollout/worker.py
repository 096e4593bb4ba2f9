"""Rollout worker: engine + reward + prompt tickets (a plain class; `actors.rollout.RolloutActor` is
its Ray shell).

A generated group goes to a `Scorer`: with reward.overlap it is scored on another thread while the
next group generates (at most reward.max_pending wait for a score) and delivered once scored, its
ticket, prompt, seed and weight versions unchanged (so its staleness counts from the version that
generated it). reward.overlap=false scores each group before the next starts.

The worker never blocks on weight sync: received weights are *staged* by the actor's
sync thread and the engine swaps them in at a safe point — before a denoising step
(`between_steps`, the in-flight update: steps after the switch carry the new version) or before a
group (`between_groups`). Nothing is aborted or regenerated.

Ticket = the global index of a started group. It fixes the group's prompt (prompt stream index)
and its seed, so which worker generates a group never changes what is generated.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

from async_flowgrpo import algorithms
from async_flowgrpo.builders import build_engine
from async_flowgrpo.conditioning import with_sources
from async_flowgrpo.config import Config
from async_flowgrpo.metrics import BusyTracker
from async_flowgrpo.prompts import PromptStream, load_prompts
from async_flowgrpo.rewards import CombinedReward, RewardError
from async_flowgrpo.rollout.scoring import Scorer
from async_flowgrpo.sampling import rollout_sampling
from async_flowgrpo.types import Group, GroupRecord

logger = logging.getLogger(__name__)


def group_seed(base_seed: int, ticket: int) -> int:
    return (base_seed * 1_000_003 + ticket) % (2**62)


class RolloutWorker:
    """update_point: "between_steps" (in-flight updates, fully_async) or "between_groups"."""

    def __init__(self, cfg: Config, worker_id: int = 0, engine: Any = None, update_point: str | None = None, reward=None):
        self.cfg = cfg
        self.worker_id = worker_id
        update_point = update_point or (cfg.sync.update_point if cfg.mode == "fully_async" else "between_groups")
        self.engine = engine if engine is not None else build_engine(cfg, update_point)
        self.reward = reward or CombinedReward(cfg.reward.weights, cfg.reward.options)
        self.prompts = PromptStream(load_prompts(cfg.rollout.prompts), seed=cfg.rollout.seed, mix=cfg.rollout.prompt_mix)
        self.sampling = rollout_sampling(cfg.rollout)
        self._stop = threading.Event()
        # counters reported through stats()
        self.groups_generated = 0
        self.reward_errors = 0
        self.consecutive_reward_failures = 0
        self.last_reward_error = ""
        self.inflight_updates = 0  # groups whose steps carry two or more weight versions
        # algorithm.resample_flat_groups: groups left out for all-equal rewards, their samples' reward sum,
        # and how many in a row (at most max_flat_in_a_row, then one is kept)
        self.resampled_flat, self.resampled_flat_reward, self.flat_in_a_row = 0, 0.0, 0
        self.max_flat_in_a_row = 4 * cfg.rollout.groups_per_step
        self.busy = BusyTracker()  # perf/rollout_idle_frac: generating, or waiting for a reward
        self.generate_s: list[float] = []  # each group's generation seconds since the last stats()
        self.scorer = Scorer(overlap=cfg.reward.overlap, max_pending=cfg.reward.max_pending)
        self._counters = threading.Lock()  # the counters above: scoring threads update them

    def stage_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Called from the sync thread; the engine swaps them in at its next safe point."""
        self.engine.stage_weights(state, version)

    # -- generation ----------------------------------------------------------------------------
    def start_group(self, ticket: int) -> Future:
        """Generate the group for `ticket` and hand it to scoring; the future gives the scored group,
        or None when its reward failed (counted). With reward.overlap it returns once the group is
        handed off (at most reward.max_pending wait for a score), else once it is scored."""
        prompt = self.prompts.prompt_at(ticket)
        with self.busy.busy():
            group = self.engine.generate(
                [prompt.text],
                self.cfg.rollout.group_size,
                group_seed(self.cfg.rollout.seed, ticket),
                prompt_indices=[ticket],
                metadata=[with_sources(prompt)],  # an edit model's input images, loaded once per group
                # the algorithm may place the window by the weights held (MixGRPO's moving window)
                **algorithms.rollout_sampling(self.cfg.algorithm, self.sampling, self.engine.version),
            )[0]
            group.worker_id = self.worker_id
            if group.versions.numel() and group.versions.min() != group.versions.max():
                self.inflight_updates += 1
            with self._counters:
                self.generate_s.append(group.time_generate_s)
            return self.scorer.submit(lambda: self._score(group, prompt))

    def _score(self, group: Group, prompt) -> Group | None:
        """On a scoring thread (the caller's on the blocking path): the reward, its counters, and the
        stop after reward.max_consecutive_failures (raised to whoever takes the group)."""
        n = group.size
        try:
            group.rewards, group.reward_components = self.reward(group.images, [prompt.text] * n, [group.metadata] * n)
        except RewardError as e:
            logger.warning("worker %d: skipping group %d: %s", self.worker_id, group.prompt_index, e)
            with self._counters:
                self.reward_errors += 1
                self.consecutive_reward_failures += 1
                self.last_reward_error = str(e)
                if self.consecutive_reward_failures >= self.cfg.reward.max_consecutive_failures:
                    raise RuntimeError(
                        f"rollout worker {self.worker_id}: {self.consecutive_reward_failures} consecutive reward "
                        f"failures (reward.max_consecutive_failures); last: {self.last_reward_error}"
                    ) from None
            return None
        with self._counters:
            self.consecutive_reward_failures = 0
            self.groups_generated += 1
        return group

    def generate(self, tickets: list[int]) -> list[Group | None]:
        """Batch modes (sync, one_step_off): the driver hands out the tickets. Group k is scored
        while group k + 1 generates; the batch returns once every group is scored, in ticket order."""
        with self.busy.busy():
            futures = [self.start_group(t) for t in tickets]
            return [self.scorer.result(f) for f in futures]

    def run(self, queue, store: Callable[[Group], GroupRecord], poll_s: float) -> dict:
        """fully_async: stream groups into the queue actor (`stream_groups`), each once it is
        scored. `store` puts a group where trainers can fetch it and returns its record: only the
        record goes through the queue."""
        from async_flowgrpo.rollout.stream import chain, stream_groups  # (Ray's protocol: the batch modes need no Ray)

        def make_record(ticket: int) -> Future:
            return chain(self.start_group(ticket), lambda group: None if group is None or self._resample(group) else store(group))

        stream_groups(queue, self.worker_id, make_record, self._stop, poll_s)
        return self.stats()

    def _resample(self, group: Group) -> bool:
        """algorithm.resample_flat_groups: True for a group whose rewards are all equal (no advantage
        to learn from), which is then not delivered: its slot goes back and starts another group."""
        if not self.cfg.algorithm.resample_flat_groups:
            return False
        with self._counters:
            flat = bool((group.rewards == group.rewards[0]).all())
            if not flat or self.flat_in_a_row >= self.max_flat_in_a_row:
                self.flat_in_a_row = 0
                return False
            self.flat_in_a_row += 1
            self.resampled_flat += group.size
            self.resampled_flat_reward += float(group.rewards.sum())
            return True

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, float]:
        """Counters; the busy fraction (rollout idle = 1 - busy) and the mean seconds a group took to
        generate (what a sampler costs: MixGRPO-Flash's shorter ODE shows here), since the previous call."""
        with self._counters:
            generate_s, self.generate_s = self.generate_s, []
        return {
            "rollout/groups": self.groups_generated,
            "rewards/errors": self.reward_errors,
            "rollout/inflight_updates": self.inflight_updates,
            "rollout/version": self.engine.version,
            "perf/rollout_idle_frac": self.busy.idle_frac(),
            **({"samples/resampled_flat": self.resampled_flat,  # and their mean reward: all right (1) or all wrong (0)?
                "rollout/resampled_flat_reward": self.resampled_flat_reward / max(self.resampled_flat, 1)}
               if self.cfg.algorithm.resample_flat_groups else {}),
            **({"perf/generate_s_per_group": sum(generate_s) / len(generate_s)} if generate_s else {}),
            **self.scorer.stats(),
        }

