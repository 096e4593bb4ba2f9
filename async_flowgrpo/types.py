"""The data that flows between rollout, queue and trainer.

The queue's unit is a `Group`: the n samples generated for one prompt. Everything a trainer needs
to recompute log-probs for the recorded (stochastic) steps travels with it, on CPU, so a group can
be pickled through Ray's object store and trained on any trainer actor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


@dataclass
class SamplingParams:
    """How a group was (or is to be) sampled. Recorded with the group so the trainer replays it."""

    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_type: str  # "sde" | "cps"
    window_start: int  # first recorded (stochastic) denoising step
    window_size: int  # number of recorded steps; 0 means a pure ODE sample (evaluation)
    height: int
    width: int


@dataclass
class Group:
    """n samples of one prompt with their denoising trajectories on the recorded steps.

    Two kinds, one layout. A window (Flow-GRPO, W = window size > 0) records the stochastic steps;
    window_size 0 (an ODE sample: DiffusionNFT, evaluation) records only the final latent x_N
    (sigma 0), which all num_steps steps made, and no log-probs.
    Shapes (n = group size, latent shape C,H,W):
      latents    [n, W + 1, C, H, W]  x_j for j = window_start .. window_start + W (inputs and output);
                 [n, 1, C, H, W]      the final latent when window_size is 0
      sigmas     [W + 1] or [1]       sigma of each latent in `latents`
      log_probs  [n, W] or [n, 0]     behaviour log-prob of x_{j+1} given x_j (float32)
      versions   [W] or [num_steps]   weight version of each step that produced the recorded latents
      images     [n, H, W, 3] uint8   decoded final images
      prompt_embeds [L, D], pooled_prompt_embeds [P]: the prompt's conditioning (shared by the n samples)
      negative_* : the unconditional conditioning used for CFG (None when guidance_scale <= 1)
    """

    prompt: str
    prompt_index: int  # position in the prompt stream: resume and "no group trained twice" rely on it
    metadata: dict
    params: SamplingParams
    latents: torch.Tensor
    sigmas: torch.Tensor
    log_probs: torch.Tensor
    versions: torch.Tensor
    images: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # [n] combined reward
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n]
    advantages: torch.Tensor | None = None  # [n], set on arrival (see algo.group_advantages)
    worker_id: int = 0
    seed: int = 0
    time_generate_s: float = 0.0

    @property
    def size(self) -> int:
        return self.latents.shape[0]

    def to_state(self) -> dict:
        """Tensors, numbers and strings only (checkpoint.encode stores it without pickle)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["params"] = asdict(self.params)
        return state

    @classmethod
    def from_state(cls, state: dict) -> "Group":
        return cls(**{**state, "params": SamplingParams(**state["params"])})

    @property
    def min_version(self) -> int:
        return int(self.versions.min())

    def staleness(self, current_version: int) -> int:
        return current_version - self.min_version


@dataclass
class GroupRecord:
    """What the driver and the queue see of a group: its rewards and bookkeeping, a few hundred
    bytes. The group itself (latents, embeddings, images: megabytes at real sizes) stays in Ray's
    object store under `ref` until a trainer fetches it, so the driver handles O(rewards) per step.
    """

    prompt: str
    prompt_index: int
    size: int
    min_version: int
    rewards: torch.Tensor  # [n] combined reward
    reward_components: dict[str, torch.Tensor]  # name -> [n]
    worker_id: int = 0
    ref: Any = None  # ray.ObjectRef of the Group (batch modes: kept beside the record by the driver)

    @classmethod
    def of(cls, group: Group, ref: Any = None) -> "GroupRecord":
        return cls(group.prompt, group.prompt_index, group.size, group.min_version, group.rewards,
                   dict(group.reward_components), group.worker_id, ref)

    def staleness(self, current_version: int) -> int:
        return current_version - self.min_version

    @property
    def nbytes(self) -> int:
        """The payload the driver receives for this group (tensors and prompt; the ref is a few bytes)."""
        tensors = [self.rewards, *self.reward_components.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + len(self.prompt.encode())
