"""An exponential moving average of the trained weights (Flow-GRPO's `train.ema`).

Evaluation and the saved weights use the average; rollouts keep sampling with the live policy,
whose exploration the update needs. One RL update moves the weights by a noisy step, so the last
iterate scores a few points above or below the path it is on; the average scores the path.

    average <- d * average + (1 - d) * live,   d = min((1 + n) / (10 + n), decay)

after the n-th update (n from 0), Flow-GRPO's warm-up: early on the average forgets the base
weights quickly (d = 0.1 at the first update, 0.9 at the 80th), later `decay` caps it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor


class WeightAverage:
    """`live`: name -> views of the live trainable parameters (`DiffusionPolicy.trainable_state()`;
    local shards under FSDP, averaged shard by shard)."""

    def __init__(self, live: dict[str, Tensor], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.live = live
        self.decay = decay
        self.average = {name: t.detach().clone() for name, t in live.items()}
        self.updates = 0

    def current_decay(self) -> float:
        return min((1 + self.updates) / (10 + self.updates), self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """After an update of the live weights."""
        weight = 1.0 - self.current_decay()
        for name, t in self.live.items():
            self.average[name].lerp_(t, weight)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The average in the live parameters for the block (evaluate, save), the live weights after."""
        kept = {name: t.clone() for name, t in self.live.items()}
        for name, t in self.live.items():
            t.copy_(self.average[name])
        try:
            yield
        finally:
            for name, t in self.live.items():
                t.copy_(kept[name])

    def state_dict(self) -> dict:
        """Plain (unsharded) weights only: a sharded trainer gathers `average` itself."""
        return {"average": {n: t.detach().to("cpu", copy=True) for n, t in self.average.items()}, "updates": self.updates}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """`state["average"]` holds whole tensors; under FSDP each rank keeps its own shards."""
        if state["average"].keys() != self.average.keys():
            raise KeyError("weight average: saved names differ from the trainable weights")
        for name, t in self.average.items():
            t.copy_(_like(state["average"][name], t))
        self.updates = int(state["updates"])


def _like(whole: Tensor, target: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        return distribute_tensor(whole, target.device_mesh, target.placements)
    return whole
