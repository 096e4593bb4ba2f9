"""Learner: one FlowGRPO update from a batch of groups (plain class; Ray actors wrap it).

Per call of `train_step`: the samples are split into `mini_batches` contiguous chunks, one
optimizer step each. The unit of the replay is the (sample, step) pair: a chunk's recorded steps
are rows, sample-major, and `micro_batch_size` consecutive rows go through the transformer in one
call, each at its own step's sigma with its own prompt's conditioning, scored by
`policy.recompute` and backpropagated at once (gradient accumulation over the calls). Each call's
loss is scaled by (its rows) / (rows in the chunk), so the accumulated gradient is that of the
mean over (sample, step) pairs, whatever the micro-batch size. The calls stop at the chunk's half
(in samples), where the gradient so far is the first half's (grad/half_cos).

Data parallelism: `grad_all_reduce(params)` is called once per optimizer step (`reduce_grads`),
after accumulation and before clipping, with the trainable parameters; it must average the .grad
tensors in place across the data-parallel ranks. A parameter that no backward on this rank reached
comes with .grad None: the reduce must count it as zeros where another rank reached it and leave
it None where no rank did (seqpar.all_reduce_grads), so that every rank skips the same ones. With
equally sized shards this makes M ranks on a split batch equal one rank on the whole batch. A non-finite gradient on any rank becomes non-finite on
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


def reduce_grads(params: list[nn.Parameter], grad_all_reduce: Callable[[list[nn.Parameter]], None] | None) -> None:
    """Every learner's gradients before clipping and the optimizer step. A parameter that no backward
    reached (a Wan2.2 expert without rows in the mini-batch) keeps .grad None, so AdamW leaves it
    alone: a zero gradient would still move it (its momentum, weight decay) and count a step.
    Sharded (FSDP, whose reduce-scatter ran inside backward), each gets zeros as before: two-expert
    models are not sharded (config.validate)."""
    if any(isinstance(p, DTensor) for p in params):
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


@dataclass
class _Rows:
    """A batch's trained (sample, step j) pairs, sample-major (a sample's window steps are
    consecutive rows), as flat tensors on the CPU; a contiguous range of rows is one call's input."""

    x: Tensor  # [P, C, H, W] latent at step j
    x_next: Tensor  # [P, C, H, W] latent at step j + 1 (what the step is scored against)
    sigma: Tensor  # [P] s_j
    sigma_next: Tensor  # [P] s_{j+1}
    behav: Tensor  # [P] behaviour log-prob
    advantage: Tensor  # [P] the row's sample's advantage
    fresh: Tensor  # [P] bool: the row's sample has every step at the trained version
    group: Tensor  # [P] long, on the device: the row's group (an index into cond)
    cond: list[Tensor | None]  # per group [G, ...] on the device: embeds, pooled, negatives
    starts: list[int]  # row offset of each sample, then P

    def __len__(self) -> int:
        return self.starts[-1]


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
        uncond_grad: bool = False,
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
        self._sharded = any(isinstance(p, DTensor) for p in self.params)

    def sampling_state(self) -> dict[str, Tensor]:
        """The weights rollout actors sample with: Flow-GRPO's policy is the trained one."""
        return self.policy.publishable(self.policy.trainable_state())

    # ------------------------------------------------------------------ data

    def _rows(self, groups: list[Group], version: int) -> _Rows:
        """Every recorded step of every sample as one row, sample-major. The latents are copied
        once here (as x and x_next), a call slices them; the conditioning goes to the device once
        per group and a call gathers its rows' from there."""
        parts: dict[str, list[Tensor]] = {k: [] for k in ("x", "x_next", "sigma", "sigma_next", "behav", "adv", "fresh", "group")}
        starts = [0]
        for gi, g in enumerate(groups):
            if g.advantages is None:
                raise ValueError(f"group of prompt {g.prompt_index} has no advantages: set them on arrival")
            n, w = g.size, g.log_probs.shape[1]
            parts["x"].append(g.latents[:, :-1].flatten(0, 1))
            parts["x_next"].append(g.latents[:, 1:].flatten(0, 1))
            parts["sigma"].append(g.sigmas[:-1].repeat(n))
            parts["sigma_next"].append(g.sigmas[1:].repeat(n))
            parts["behav"].append(g.log_probs.flatten())
            parts["adv"].append(g.advantages.repeat_interleave(w))
            parts["fresh"].append(torch.full((n * w,), bool((g.versions == version).all())))
            parts["group"].append(torch.full((n * w,), gi))
            starts += [starts[-1] + w * (k + 1) for k in range(n)]
        dev = self.policy.device
        conds = [[g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds]
                 for g in groups]
        cond = [None if conds[0][c] is None else torch.stack([gc[c] for gc in conds]).to(dev) for c in range(4)]
        cat = {k: torch.cat(v) for k, v in parts.items()}
        return _Rows(cat["x"], cat["x_next"], cat["sigma"], cat["sigma_next"], cat["behav"], cat["adv"],
                     cat["fresh"], cat["group"].to(dev), cond, starts)

    @staticmethod
    def _sampling(groups: list[Group]) -> tuple[float, float, str]:
        """The settings recompute replays; one batch is trained with one set of them."""
        keys = {(g.params.guidance_scale, g.params.noise_level, g.params.sde_type) for g in groups}
        if len(keys) != 1:
            raise ValueError(f"groups in one train_step must share guidance_scale, noise_level, sde_type; got {keys}")
        return keys.pop()

    def _calls(self, lo: int, hi: int) -> list[slice]:
        """Rows [lo, hi) as the row ranges of successive transformer calls, micro_batch_size each."""
        return [slice(a, min(a + self.micro_batch_size, hi)) for a in range(lo, hi, self.micro_batch_size)]

    def _forward(self, rows: _Rows, sel: slice, sampling, with_ref: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and the KL to the reference) of rows `sel`: one transformer call for all of
        them, each row at its own step's sigma with its own group's conditioning."""
        guidance_scale, noise_level, sde_type = sampling
        group = rows.group[sel]
        cond = [None if c is None else c[group] for c in rows.cond]
        sigma, sigma_next = rows.sigma[sel], rows.sigma_next[sel]
        log_prob, mean, std, ref_mean = self.policy.recompute(
            rows.x[sel], rows.x_next[sel], sigma, sigma_next, *cond,
            guidance_scale=guidance_scale, noise_level=noise_level, sde_type=sde_type,
            with_ref=with_ref, uncond_grad=self.uncond_grad,
        )
        kl = None
        if with_ref:
            kl = algo.kl_penalty(mean, ref_mean, algo.kl_std(std.detach(), sigma, sigma_next, sde_type))
        return log_prob, kl

    # ------------------------------------------------------------------ update

    def train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        lr = self.base_lr * self.lr_schedule(self.steps)
        set_lr(self.optimizer, lr)
        metrics = self._train_step(groups, version)
        self.steps += 1
        metrics["train/lr"] = lr
        return metrics

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = self._rows(groups, version)
        sampling = self._sampling(groups)
        n_samples = len(rows.starts) - 1
        if n_samples < self.mini_batches:
            raise ValueError(f"{n_samples} samples cannot fill {self.mini_batches} mini-batches")
        # a mini-batch: a contiguous range of samples, so of rows
        minis = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n_samples).tensor_split(self.mini_batches)]
        dev = self.policy.device
        elements = rows.x[0].numel()  # D: the recorded log-probs are means over a latent's entries
        is_kw = dict(correction=self.is_correction, elements=elements)

        # log-probs under the weights at the start of the update, per row
        start_logp = None
        if self.prox_mode == "recompute" and self.mini_batches > 1:
            start_logp = torch.empty(len(rows), device=dev)
            with torch.no_grad():
                for sel in self._calls(0, len(rows)):
                    start_logp[sel] = self._forward(rows, sel, sampling, with_ref=False)[0]

        ratios, weights, log_ws, fresh_diffs = [], [], [], []
        pg_sum = kl_sum = torch.zeros((), device=dev)
        grad_norms, pairs_trained, samples_trained, skipped = [], 0, 0, 0
        half_cos = []
        for mi, (s0, s1) in enumerate(minis):
            lo, hi = rows.starts[s0], rows.starts[s1]
            n_pairs = hi - lo
            if n_pairs == 0:
                raise ValueError("no recorded steps to train on (window_size 0 groups are for evaluation)")
            # the calls of the first half of the samples, then of the second: the gradient at the
            # boundary is the first half's (grad/half_cos; sharded, each rank holds a slice of
            # every gradient, so no cosine of whole ones)
            half = rows.starts[s0 + (s1 - s0) // 2]
            split = lo < half < hi and not self._sharded
            calls = self._calls(lo, half) + self._calls(half, hi) if split else self._calls(lo, hi)
            mb_pg = mb_kl = torch.zeros((), device=dev)
            mb_ratios, mb_weights, mb_log_w = [], [], []
            first_half = None
            for sel in calls:
                if split and sel.start == half:
                    first_half = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
                log_prob, kl = self._forward(rows, sel, sampling, with_ref=self.beta > 0)
                behav = rows.behav[sel].to(dev)
                adv = rows.advantage[sel].to(dev)
                if self.prox_mode == "bypass":
                    prox = behav
                elif start_logp is None:
                    prox = log_prob.detach()  # the current forward is the start-of-update policy
                else:
                    prox = start_logp[sel]
                pg, _ = algo.policy_loss(
                    log_prob, prox, behav, adv, clip_range=self.clip_range, adv_clip=self.adv_clip, is_cap=self.is_cap,
                    is_correction=self.is_correction, is_mode=self.is_mode, elements=elements,
                )
                n_rows = sel.stop - sel.start
                loss = pg if kl is None else pg + self.beta * kl.mean()
                if loss.requires_grad:  # (not when every row is a step of an expert left untrained: model.trained_experts)
                    (loss * (n_rows / n_pairs)).backward()  # the gradient of the mean over the mini-batch's pairs

                mb_pg = mb_pg + pg.detach() * n_rows
                if kl is not None:
                    mb_kl = mb_kl + self.beta * kl.detach().sum()
                mb_ratios.append(torch.exp(log_prob.detach() - prox))
                mb_weights.append(algo.importance_weights(prox, behav, self.is_cap, mode=self.is_mode, **is_kw))
                mb_log_w.append(algo.log_importance_weights(prox, behav, **is_kw))
                at_start = prox if self.prox_mode == "recompute" else (log_prob.detach() if mi == 0 else None)
                fresh = rows.fresh[sel]
                if at_start is not None and bool(fresh.any()):  # a CPU tensor: no device sync
                    fresh_diffs.append((at_start - behav).abs()[fresh.to(dev)].max())

            if first_half is not None:  # this rank's two halves: different prompts, same weights
                second_half = [torch.zeros_like(g) if p.grad is None else p.grad - g for p, g in zip(self.params, first_half)]
                half_cos.append(grad_cosine(first_half, second_half))
            reduce_grads(self.params, self.grad_all_reduce)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # DTensor under FSDP
            if not (math.isfinite(grad_norm) and bool(torch.isfinite(mb_pg + mb_kl))):
                skipped += 1  # a NaN/inf update would poison the weights for good: drop it
            else:
                self.optimizer.step()
                grad_norms.append(grad_norm)
                pg_sum, kl_sum = pg_sum + mb_pg, kl_sum + mb_kl
                pairs_trained += n_pairs
                samples_trained += s1 - s0
                ratios += mb_ratios
                weights += mb_weights
                log_ws += mb_log_w
            # set_to_none: the next mini-batch's first backward writes its gradient instead of
            # adding it to zeros (no memset of every grad, no extra read)
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
