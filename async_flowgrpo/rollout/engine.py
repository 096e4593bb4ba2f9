"""Rollout engines: generate(prompts, n, seed, sampling params) -> groups, and take new weights.

`DiffusersEngine` runs the policy in-process with diffusers (CPU and GPU). Weights arrive two ways:
`load_weights` applies them at once (between groups); `stage_weights` (callable from a receiver
thread) leaves them for the next safe point, which is the next denoising step boundary with
update_point "between_steps" (in-flight update: the steps after the switch carry the new
version) or the start of the next `generate` with "between_groups".
"""

from __future__ import annotations

import threading

from torch import Tensor

from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.types import Group

UPDATE_POINTS = ("between_steps", "between_groups")


class DiffusersEngine:
    def __init__(self, policy: DiffusionPolicy, *, version: int = 0, update_point: str = "between_steps"):
        if update_point not in UPDATE_POINTS:
            raise ValueError(f"sync.update_point must be one of {UPDATE_POINTS}, got {update_point!r}")
        self.policy = policy
        self.update_point = update_point
        self._version = version
        self._staged: tuple[dict[str, Tensor], int] | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state: dict[str, Tensor], version: int) -> None:
        self.policy.load_trainable_state(state)
        self._version = version

    def stage_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Keep `state` (not copied: hand over tensors nobody writes to any more) for the next
        safe point; a newer staged state replaces an older one not yet applied."""
        with self._lock:
            self._staged = (state, version)

    def apply_staged(self) -> bool:
        """Swap staged weights in now, if any; returns whether it did."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.load_weights(*staged)
        return staged is not None

    def _step_boundary(self) -> int:
        if self.update_point == "between_steps":
            self.apply_staged()
        return self._version

    def generate(
        self,
        prompts: list[str],
        n: int,
        seed: int,
        *,
        num_steps: int,
        guidance_scale: float,
        noise_level: float,
        sde_type: str,
        window_size: int,
        window_range: tuple[int, int] | None = None,
        shared_initial_noise: bool = False,
        after_window_solver: str = "euler",
        after_window_steps: float = 1.0,
        height: int | None = None,
        width: int | None = None,
        prompt_indices: list[int] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Group]:
        """n samples for each prompt, one Group per prompt, steps stamped with weight versions."""
        self.apply_staged()
        return self.policy.generate(
            prompts,
            n,
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            sde_type=sde_type,
            window_size=window_size,
            window_range=window_range,
            shared_initial_noise=shared_initial_noise,
            after_window_solver=after_window_solver,
            after_window_steps=after_window_steps,
            seed=seed,
            height=height,
            width=width,
            version_fn=self._step_boundary,
            prompt_indices=prompt_indices,
            metadata=metadata,
        )
