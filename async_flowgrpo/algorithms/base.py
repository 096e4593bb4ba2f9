"""What every algorithm's learner shares: the optimizer and its lr schedule, transformer calls of
`micro_batch_size` rows, mini-batches of whole samples, the gradient reduce and the guarded
optimizer step, the batch's staleness and reward metrics, the checkpoint. An algorithm
(`flow_grpo.py`, `diffusion_nft.py`, `awm.py`) subclasses `Learner` and writes `_train_step`: what
a row is (a recorded SDE step, or a clean sample noised to one level), its loss, and how a stale
sample is weighted.

Data parallelism: `grad_all_reduce(params)` is called once per optimizer step (`reduce_grads`),
after accumulation and before clipping, with the trainable parameters; it must average the .grad
tensors in place across the data-parallel ranks. A parameter that no backward on this rank reached
comes with .grad None: the reduce must count it as zeros where another rank reached it and leave
it None where no rank did (seqpar.all_reduce_grads), so that every rank skips the same ones. With
equally sized shards this makes M ranks on a split batch equal one rank on the whole batch. A
non-finite gradient on any rank becomes non-finite on all of them after the reduce, so every rank
skips that step together.

The policy is any object with DiffusionPolicy's training interface (`trainable_parameters`,
`trainable_state`, `load_trainable_state`, `publishable`, `device`, `recompute`, `velocity`,
`sigmas`): this package is plain torch, below the components that build it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from async_flowgrpo import seqpar
from async_flowgrpo.types import Group


def is_dtensor(t: Tensor) -> bool:
    """Whether `t` is sharded (FSDP's DTensor). Without torch.distributed.tensor imported, nothing can
    be: not importing it here keeps a second off every launcher's start (the config imports this module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def reduce_grads(params: list[nn.Parameter], grad_all_reduce: Callable[[list[nn.Parameter]], None] | None) -> None:
    """Every learner's gradients before clipping and the optimizer step. A parameter that no backward
    reached (a Wan2.2 expert without rows in the mini-batch) keeps .grad None, so AdamW leaves it
    alone: a zero gradient would still move it (its momentum, weight decay) and count a step.
    Sharded (FSDP, whose reduce-scatter ran inside backward), each gets zeros as before: two-expert
    models are not sharded (config.validate)."""
    if any(is_dtensor(p) for p in params):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    if grad_all_reduce is not None:
        grad_all_reduce(params)


def grad_cosine(a: list[Tensor], b: list[Tensor]) -> float:
    """Cosine between two gradients given as lists of tensors (NaN when either is zero)."""
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    na = math.sqrt(sum(float((x * x).sum()) for x in a))
    nb = math.sqrt(sum(float((y * y).sum()) for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else math.nan


def cpu_copy(obj):
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def batch_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Staleness and reward of the batch, whatever the algorithm."""
    staleness = torch.tensor([float(g.staleness(version)) for g in groups for _ in range(g.size)])
    metrics = {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())}
    if all(g.rewards is not None for g in groups):
        rewards = torch.cat([g.rewards.float() for g in groups])
        metrics["reward/mean"] = float(rewards.mean())
        metrics["reward/std"] = float(rewards.std(correction=0))
    return metrics


class Learner:
    """The shell an algorithm fills in: `_train_step(groups, version) -> metrics`, and optionally
    `sampling_state` (what rollouts sample with) and `_extra_state` / `_load_extra_state` (what a
    checkpoint keeps beyond the weights, the optimizer and the lr clock)."""

    def __init__(
        self,
        policy: Any,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        max_grad_norm: float,
        micro_batch_size: int,
        mini_batches: int,
        grad_all_reduce: Callable[[list[nn.Parameter]], None] | None,
        lr_schedule: Callable[[int], float] | None,
    ):
        if micro_batch_size < 1 or mini_batches < 1:
            raise ValueError("micro_batch_size and mini_batches must be >= 1")
        self.policy = policy
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.mini_batches = mini_batches
        self.grad_all_reduce = grad_all_reduce
        self.base_lr = lr
        self.lr_schedule = lr_schedule or (lambda step: 1.0)
        self.steps = 0  # train_step calls: the lr schedule's clock
        # no rank holds a whole gradient before the reduce: FSDP gives each a slice of every one,
        # sequence parallelism its tokens' share (so no cosine of whole ones, grad/half_cos)
        self._sharded = any(is_dtensor(p) for p in self.params) or seqpar.splits_tokens(policy)

    def sampling_state(self) -> dict[str, Tensor]:
        """The weights rollout actors sample with: by default the trained ones."""
        return self.policy.publishable(self.policy.trainable_state())

    # ------------------------------------------------------------------ update

    def train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        """One update on `groups`; `version` is the published version (the weights held now)."""
        t0 = time.perf_counter()
        lr = self.base_lr * self.lr_schedule(self.steps)
        set_lr(self.optimizer, lr)
        metrics = self._train_step(groups, version)
        self.steps += 1
        metrics["train/lr"] = lr
        metrics["train/time_s"] = time.perf_counter() - t0
        return metrics

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        raise NotImplementedError

    def _calls(self, lo: int, hi: int) -> list[slice]:
        """Rows [lo, hi) as the row ranges of successive transformer calls, micro_batch_size each."""
        return [slice(a, min(a + self.micro_batch_size, hi)) for a in range(lo, hi, self.micro_batch_size)]

    def _minis(self, n_samples: int) -> list[tuple[int, int]]:
        """The mini-batches: contiguous ranges of samples, one optimizer step each."""
        if n_samples < self.mini_batches:
            raise ValueError(f"{n_samples} samples cannot fill {self.mini_batches} mini-batches")
        return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n_samples).tensor_split(self.mini_batches)]

    def _optimizer_step(self, loss: Tensor) -> float | None:
        """Reduce, clip and step on the accumulated gradient; the grad norm, or None when the
        gradient or the mini-batch's `loss` is not finite (a NaN/inf update would poison the weights
        for good, so it is dropped). The gradients are cleared either way (set_to_none: the next
        mini-batch's first backward writes its gradient instead of adding it to zeros)."""
        reduce_grads(self.params, self.grad_all_reduce)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        grad_norm = float(norm.full_tensor() if is_dtensor(norm) else norm)  # DTensor under FSDP
        finite = math.isfinite(grad_norm) and bool(torch.isfinite(loss))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm if finite else None

    # ------------------------------------------------------------------ checkpoint

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """A CPU snapshot (optimizer.state_dict() alone would alias the live, mutating moments)."""
        return cpu_copy({"trainable": self.policy.trainable_state(), "optimizer": self.optimizer.state_dict(),
                         "steps": self.steps, **self._extra_state()})

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_trainable_state(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state.get("steps", 0)  # checkpoints from before the lr schedule: its start
        self._load_extra_state(state)


class VersionedCopies:
    """Copies of the sampling weights by the version they were published at, for algorithms that
    score a stale sample against the weights that generated it (DiffusionNFT's v_old, AWM's old
    log-likelihood). A copy is never written in place; `keep` versions are kept (staleness bound +
    publication interval); an older sample (or one from before a resume) falls back to `fallback`,
    counted by the caller."""

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError("keep_versions must be >= 1")
        self.keep = keep
        self.copies: dict[int, dict[str, Tensor]] = {}

    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        """The copy rollouts got at `version`; copies older than `keep` versions are dropped."""
        self.copies[version] = weights
        for v in [v for v in self.copies if v <= version - self.keep]:
            del self.copies[v]

    @torch.no_grad()
    def under_each(self, policy: Any, versions: Tensor, fallback: dict[str, Tensor],
                   compute: Callable[[Tensor], None]) -> int:
        """compute(index) with the policy holding the copy of the version of rows `index`, once per
        distinct version in `versions` (the trained weights are restored after); returns how many
        rows fell back to `fallback`."""
        theta = {n: p.clone() for n, p in policy.trainable_state().items()}
        missing = 0
        try:
            for version in versions.unique().tolist():
                index = (versions == version).nonzero().flatten()
                weights = self.copies.get(version)
                if weights is None:
                    missing += len(index)
                    weights = fallback
                policy.load_trainable_state(weights)
                compute(index)
        finally:
            policy.load_trainable_state(theta)
        return missing


class SoftCopyLearner(Learner):
    """A learner with a soft copy `old` of its trained weights, the update clock `updates` that sets
    the copy's decay, and `copies_by_version` (a VersionedCopies): DiffusionNFT, AWM, DGPO. A
    checkpoint keeps the copy and its clock, not the per-version copies: after a resume the rollouts
    regenerate with the published weights, and an older sample falls back (counted)."""

    old: dict[str, Tensor]
    updates: int
    copies_by_version: VersionedCopies

    def _move_old(self, decay: float) -> dict[str, Tensor]:
        """old <- decay * old + (1 - decay) * theta, as a new dict (the published and snapshotted
        copies stay as they were); returns theta, the trained weights now."""
        with torch.no_grad():
            theta = self.policy.trainable_state()
            self.old = {n: decay * self.old[n] + (1 - decay) * theta[n] for n in theta}
        return theta

    def _extra_state(self) -> dict:
        return {"old": self.old, "updates": self.updates}

    def _load_extra_state(self, state: dict) -> None:
        device = self.policy.device
        self.old = {n: t.to(device) for n, t in state["old"].items()}
        self.updates = state["updates"]
        self.copies_by_version.copies = {}


def versions_to_keep(c: Any) -> int:
    """Per-version copies a stale sample may need: the staleness bound plus the publication interval."""
    return c.algorithm.max_staleness + c.sync.every + 1
