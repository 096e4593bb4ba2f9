"""Learner: one FlowGRPO update from a batch of groups (plain class; Ray actors wrap it).

Per call of `train_step`: the samples are split into `mini_batches` contiguous chunks, one
optimizer step each; within a chunk, micro-batches of samples and, for each, every recorded step
are scored by `policy.recompute` and backpropagated at once (gradient accumulation). Each step's
loss is scaled by (its samples) / (recorded steps in the chunk), so the accumulated gradient is
that of the mean over (sample, step) pairs, whatever the micro-batch size.

Data parallelism: `grad_all_reduce(params)` is called once per optimizer step, after
accumulation and before clipping, with the trainable parameters, every one of which has a .grad
(zeros where unused) so that all ranks reduce the same list; it must average the .grad tensors in
place across the data-parallel ranks. With equally sized shards this makes M ranks on a split
batch equal one rank on the whole batch. A non-finite gradient on any rank becomes non-finite on
all of them after the reduce, so every rank skips that step together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from async_flowgrpo import algo
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.types import Group

PROX_MODES = ("recompute", "bypass")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_cosine(a: list[Tensor], b: list[Tensor]) -> float:
    """Cosine between two gradients given as lists of tensors (NaN when either is zero)."""
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    na = math.sqrt(sum(float((x * x).sum()) for x in a))
    nb = math.sqrt(sum(float((y * y).sum()) for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else math.nan


@dataclass
class _Sample:
    latents: Tensor  # [W + 1, C, H, W]
    sigmas: Tensor  # [W + 1]
    behav: Tensor  # [W] behaviour log-probs
    versions: Tensor  # [W]
    advantage: Tensor  # 0-dim
    cond: tuple[Tensor, Tensor, Tensor | None, Tensor | None]  # embeds, pooled, negatives

    @property
    def num_steps(self) -> int:
        return self.behav.shape[0]


def _stack(tensors: list[Tensor | None]) -> Tensor | None:
    return None if tensors[0] is None else torch.stack(tensors)


def _cpu_copy(obj):
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class Learner:
    def __init__(
        self,
        policy: DiffusionPolicy,
        *,
        lr: float = 3e-4,
        weight_decay: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        clip_range: float = 1e-4,
        adv_clip: float = 5.0,
        is_cap: float | None = 2.0,
        is_correction: str = "element_mean",
        is_mode: str = "truncate",
        beta: float = 0.0,
        prox_mode: str = "recompute",
        micro_batch_size: int = 8,
        mini_batches: int = 1,
        uncond_grad: bool = True,
        grad_all_reduce: Callable[[list[nn.Parameter]], None] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
    ):
        if prox_mode not in PROX_MODES:
            raise ValueError(f"prox_mode must be one of {PROX_MODES}, got {prox_mode!r}")
        if is_correction not in algo.IS_CORRECTIONS or is_mode not in algo.IS_MODES:
            raise ValueError(f"is_correction must be one of {algo.IS_CORRECTIONS} and is_mode one of "
                             f"{algo.IS_MODES}, got {is_correction!r}, {is_mode!r}")
        if micro_batch_size < 1 or mini_batches < 1:
            raise ValueError("micro_batch_size and mini_batches must be >= 1")
        if beta > 0 and not policy.has_reference:
            raise ValueError(
                "algorithm.beta > 0 with model.lora_rank 0 needs a frozen reference: build the policy "
                "with reference_copy=True (or set algorithm.beta 0)"
            )
        self.policy = policy
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.clip_range = clip_range
        self.adv_clip = adv_clip
        self.is_cap = is_cap
        self.is_correction = is_correction  # what the staleness weight is (algo.log_importance_weights)
        self.is_mode = is_mode  # and what happens above is_cap
        self.beta = beta
        self.prox_mode = prox_mode
        self.micro_batch_size = micro_batch_size
        self.mini_batches = mini_batches
        self.uncond_grad = uncond_grad
        self.grad_all_reduce = grad_all_reduce
        self.base_lr = lr
        self.lr_schedule = lr_schedule or (lambda step: 1.0)
        self.steps = 0  # train_step calls: the lr schedule's clock
        self._cond_cache: tuple[tuple[int, ...], list[Tensor | None]] | None = None
        self._sharded = any(isinstance(p, DTensor) for p in self.params)

    def sampling_state(self) -> dict[str, Tensor]:
        """The weights rollout actors sample with: Flow-GRPO's policy is the trained one."""
        return self.policy.publishable(self.policy.trainable_state())

    # ------------------------------------------------------------------ data

    @staticmethod
    def _samples(groups: list[Group]) -> list[_Sample]:
        samples = []
        for g in groups:
            if g.advantages is None:
                raise ValueError(f"group of prompt {g.prompt_index} has no advantages: set them on arrival")
            cond = (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)
            for k in range(g.size):
                samples.append(_Sample(g.latents[k], g.sigmas, g.log_probs[k], g.versions, g.advantages[k], cond))
        return samples

    @staticmethod
    def _sampling(groups: list[Group]) -> tuple[float, float, str]:
        """The settings recompute replays; one batch is trained with one set of them."""
        keys = {(g.params.guidance_scale, g.params.noise_level, g.params.sde_type) for g in groups}
        if len(keys) != 1:
            raise ValueError(f"groups in one train_step must share guidance_scale, noise_level, sde_type; got {keys}")
        return keys.pop()

    def _micro_steps(self, samples: list[_Sample], indices: list[int]):
        """(sample indices, step j) for each forward: micro-batches of samples, then their steps."""
        for m in range(0, len(indices), self.micro_batch_size):
            micro = indices[m : m + self.micro_batch_size]
            for j in range(max(samples[i].num_steps for i in micro)):
                yield [i for i in micro if samples[i].num_steps > j], j

    def _cond(self, samples: list[_Sample], sel: list[int]) -> list[Tensor | None]:
        """The micro-batch's conditioning, stacked and on the device once for all its steps (the
        same for every step j while `sel` stays the same; one entry, cleared after train_step)."""
        key = tuple(sel)
        if self._cond_cache is None or self._cond_cache[0] != key:
            dev = self.policy.device
            cond = [_stack([samples[i].cond[c] for i in sel]) for c in range(4)]
            self._cond_cache = (key, [None if t is None else t.to(dev) for t in cond])
        return self._cond_cache[1]

    def _forward(self, samples: list[_Sample], sel: list[int], j: int, sampling, with_ref: bool):
        guidance_scale, noise_level, sde_type = sampling
        batch = [samples[i] for i in sel]
        sigma = torch.stack([s.sigmas[j] for s in batch])
        sigma_next = torch.stack([s.sigmas[j + 1] for s in batch])
        cond = self._cond(samples, sel)
        log_prob, mean, std, ref_mean = self.policy.recompute(
            torch.stack([s.latents[j] for s in batch]),
            torch.stack([s.latents[j + 1] for s in batch]),
            sigma,
            sigma_next,
            *cond,
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            sde_type=sde_type,
            with_ref=with_ref,
            uncond_grad=self.uncond_grad,
        )
        kl = None
        if with_ref:
            kl = algo.kl_penalty(mean, ref_mean, algo.kl_std(std.detach(), sigma, sigma_next, sde_type))
        return log_prob, kl

    # ------------------------------------------------------------------ update

    def train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        lr = self.base_lr * self.lr_schedule(self.steps)
        set_lr(self.optimizer, lr)
        try:
            metrics = self._train_step(groups, version)
        finally:
            self._cond_cache = None  # do not keep a batch's embeddings alive between updates
        self.steps += 1
        metrics["train/lr"] = lr
        return metrics

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        samples = self._samples(groups)
        sampling = self._sampling(groups)
        if len(samples) < self.mini_batches:
            raise ValueError(f"{len(samples)} samples cannot fill {self.mini_batches} mini-batches")
        minis = [c.tolist() for c in torch.arange(len(samples)).tensor_split(self.mini_batches)]
        dev = self.policy.device
        fresh_sample = [bool((s.versions == version).all()) for s in samples]  # every step at `version`
        elements = samples[0].latents[0].numel()  # D: the recorded log-probs are means over a latent's entries
        is_kw = dict(correction=self.is_correction, elements=elements)

        # log-probs under the weights at the start of the update, per (sample, step)
        start_logp: dict[tuple[int, int], Tensor] = {}
        if self.prox_mode == "recompute" and self.mini_batches > 1:
            with torch.no_grad():
                for mini in minis:
                    for sel, j in self._micro_steps(samples, mini):
                        log_prob, _ = self._forward(samples, sel, j, sampling, with_ref=False)
                        start_logp.update({(i, j): lp for i, lp in zip(sel, log_prob)})

        ratios, weights, log_ws, fresh_diffs = [], [], [], []
        pg_sum = kl_sum = torch.zeros((), device=dev)
        grad_norms, pairs_trained, samples_trained, skipped = [], 0, 0, 0
        half_cos = []
        for mi, mini in enumerate(minis):
            n_pairs = sum(samples[i].num_steps for i in mini)
            if n_pairs == 0:
                raise ValueError("no recorded steps to train on (window_size 0 groups are for evaluation)")
            mb_pg = mb_kl = torch.zeros((), device=dev)
            mb_ratios, mb_weights, mb_log_w = [], [], []
            first_half, seen = None, set()
            for sel, j in self._micro_steps(samples, mini):
                # (sharded: each rank holds a slice of every gradient, so no cosine of whole ones)
                if first_half is None and j == 0 and 2 * len(seen) >= len(mini) and not self._sharded:
                    first_half = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
                seen.update(sel)
                log_prob, kl = self._forward(samples, sel, j, sampling, with_ref=self.beta > 0)
                behav = torch.stack([samples[i].behav[j] for i in sel]).to(dev)
                adv = torch.stack([samples[i].advantage for i in sel]).to(dev)
                if self.prox_mode == "bypass":
                    prox = behav
                elif self.mini_batches == 1:
                    prox = log_prob.detach()  # the current forward is the start-of-update policy
                else:
                    prox = torch.stack([start_logp[(i, j)] for i in sel])
                pg, _ = algo.policy_loss(
                    log_prob, prox, behav, adv, clip_range=self.clip_range, adv_clip=self.adv_clip, is_cap=self.is_cap,
                    is_correction=self.is_correction, is_mode=self.is_mode, elements=elements,
                )
                loss = pg if kl is None else pg + self.beta * kl.mean()
                (loss * (len(sel) / n_pairs)).backward()

                mb_pg = mb_pg + pg.detach() * len(sel)
                if kl is not None:
                    mb_kl = mb_kl + self.beta * kl.detach().sum()
                mb_ratios.append(torch.exp(log_prob.detach() - prox))
                mb_weights.append(algo.importance_weights(prox, behav, self.is_cap, mode=self.is_mode, **is_kw))
                mb_log_w.append(algo.log_importance_weights(prox, behav, **is_kw))
                at_start = prox if self.prox_mode == "recompute" else (log_prob.detach() if mi == 0 else None)
                fresh = [k for k, i in enumerate(sel) if fresh_sample[i]]
                if at_start is not None and fresh:
                    fresh_diffs.append((at_start[fresh] - behav[fresh]).abs().max())

            for p in self.params:
                if p.grad is None:  # unused this mini-batch (or the first backward left none)
                    p.grad = torch.zeros_like(p)
            if first_half is not None:  # this rank's two halves: different prompts, same weights
                half_cos.append(grad_cosine(first_half, [p.grad - g for p, g in zip(self.params, first_half)]))
            if self.grad_all_reduce is not None:
                self.grad_all_reduce(self.params)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # DTensor under FSDP
            if not (math.isfinite(grad_norm) and bool(torch.isfinite(mb_pg + mb_kl))):
                skipped += 1  # a NaN/inf update would poison the weights for good: drop it
            else:
                self.optimizer.step()
                grad_norms.append(grad_norm)
                pg_sum, kl_sum = pg_sum + mb_pg, kl_sum + mb_kl
                pairs_trained += n_pairs
                samples_trained += len(mini)
                ratios += mb_ratios
                weights += mb_weights
                log_ws += mb_log_w
            # set_to_none: the next mini-batch's first backward writes its gradient instead of
            # adding it to zeros (no memset of every grad, no extra read); the loop above still
            # gives every parameter a .grad before the reduce, so the math is unchanged
            self.optimizer.zero_grad(set_to_none=True)

        metrics = self._batch_metrics(groups, version)
        metrics["train/skipped_nonfinite"] = float(skipped)
        metrics["samples/trained"] = float(samples_trained)
        metrics["train/time_s"] = time.perf_counter() - t0
        if fresh_diffs:  # omitted without fresh samples: 0.0 would read as a perfect match
            metrics["logp/max_abs_diff"] = float(torch.stack(fresh_diffs).max())
        if half_cos:
            metrics["grad/half_cos"] = sum(half_cos) / len(half_cos)
        if pairs_trained:
            ratio, w = torch.cat(ratios), torch.cat(weights)
            metrics.update(
                {
                    "loss/policy": float(pg_sum) / pairs_trained,
                    "loss/kl": float(kl_sum) / pairs_trained,
                    "policy/clip_frac": float(((ratio - 1).abs() > self.clip_range).float().mean()),
                    "policy/ratio_mean": float(ratio.mean()),
                    "is/weight_mean": float(w.mean()),
                    "is/weight_max": float(w.max()),
                    "is/ess": float(algo.effective_sample_size(w)),
                    "is/capped_frac": float(algo.capped_fraction(torch.cat(log_ws), self.is_cap)),
                    "train/grad_norm": sum(grad_norms) / len(grad_norms),
                }
            )
        return metrics

    @staticmethod
    def _batch_metrics(groups: list[Group], version: int) -> dict[str, float]:
        staleness = torch.tensor([float(g.staleness(version)) for g in groups for _ in range(g.size)])
        metrics = {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())}
        if all(g.rewards is not None for g in groups):
            rewards = torch.cat([g.rewards.float() for g in groups])
            metrics["reward/mean"] = float(rewards.mean())
            metrics["reward/std"] = float(rewards.std(correction=0))
        return metrics

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """A CPU snapshot (optimizer.state_dict() alone would alias the live, mutating moments)."""
        return _cpu_copy({"trainable": self.policy.trainable_state(), "optimizer": self.optimizer.state_dict(),
                          "steps": self.steps})

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_trainable_state(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state.get("steps", 0)  # checkpoints from before the lr schedule: its start
