"""Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): PPO on the recorded steps of an SDE window.

Needs from a rollout: an SDE window (`rollout.sampler=sde`), each recorded step's latents and
behaviour log-prob. Stale samples: the decoupled-PPO staleness weight w = pi_prox / pi_behav,
capped (`importance_weights`; docs/design.md says what it means for a denoising step).

Per call of `train_step`: the samples are split into `mini_batches` contiguous chunks, one
optimizer step each. The unit of the replay is the (sample, step) pair: a chunk's recorded steps
are rows, sample-major, and `micro_batch_size` consecutive rows go through the transformer in one
call, each at its own step's sigma with its own prompt's conditioning, scored by
`policy.recompute` and backpropagated at once (gradient accumulation over the calls). Each call's
loss is scaled by (its rows) / (rows in the chunk), so the accumulated gradient is that of the
mean over (sample, step) pairs, whatever the micro-batch size. The calls stop at the chunk's half
(in samples), where the gradient so far is the first half's (grad/half_cos).

Two variants are options here, the loss being Flow-GRPO's:
- MixGRPO (Li et al. 2025, arXiv 2507.21802): the SDE window moves along the schedule as training
  goes (`window_shift_every`, `moving_window`), ODE steps outside it.
- GRPO-Guard (Wang et al. 2025, arXiv 2510.22319): RatioNorm (`ratio_norm`, `guard_log_ratio`)
  and the 1/dt gradient reweighting (`dt_weight`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_flowgrpo import algo
from async_flowgrpo.algorithms.base import Learner, batch_metrics, grad_cosine
from async_flowgrpo.types import Group

NAME = "flow_grpo"
SAMPLER = "sde"
PROX_MODES = ("recompute", "bypass")
IS_CORRECTIONS = ("element_mean", "step", "none")
IS_MODES = ("truncate", "mask")


@dataclass
class FlowGRPOSettings:
    """Flow-GRPO's keys (async_flowgrpo/algorithms/flow_grpo.py), read when algorithm.name is
    flow_grpo; MixGRPO's moving window (config/mixgrpo.yaml) and GRPO-Guard (config/grpo_guard.yaml)
    are options of it."""
    clip_range: float = 1e-4  # PPO clip of the ratio to the proximal policy (per-element-mean log-probs' scale)
    is_cap: float = 2.0  # cap of the staleness weight exp(prox - behav) (is_mode: what happens above it)
    # what the staleness weight is (docs/design.md): element_mean = exp of the per-element-mean log-probs'
    # difference (Flow-GRPO's scale, the D-th root of a step's ratio) | step = the step's whole latent,
    # exp(D x that difference) | none = w 1 exactly, the same clipped objective against the proximal policy
    is_correction: str = "element_mean"
    is_mode: str = "truncate"  # a weight above is_cap: truncate (w = is_cap) | mask (w = 0, as AReaL)
    # recompute: the proximal policy is the trainer's weights at the start of the update | bypass: the
    # behaviour log-probs themselves (w = 1)
    prox_mode: str = "recompute"
    # with CFG, false: the gradient through the conditional branch only (flow_grpo's compute_log_prob
    # detaches the unconditional half since its commit 2d76907); true: through both (its earlier code)
    uncond_grad: bool = False
    # GRPO-Guard's RatioNorm: log u = (logp - prox + b) * s, b = mean|mean - mean_prox|^2 / (2 s^2), s the
    # step's std: the ratio centred on 1 with one spread at every step (sde_type sde, prox_mode recompute).
    # Logs policy/ratio_step<j>_{mean,std} before and policy/ratio_norm_step<j>_{mean,std} after
    ratio_norm: bool = False
    dt_weight: bool = False  # GRPO-Guard's gradient reweighting: each step's loss times 1 / (-dt) = 1 / (s - s')
    # MixGRPO: > 0 moves the SDE window (rollout.sde_window_size steps) one stride down the schedule every
    # this many trained versions, back to the start after the last trainable step; 0: rollout.sde_window_range places it
    window_shift_every: int = 0
    window_shift_stride: int = 1  # steps the window moves each time (MixGRPO's prog_overlap_step)


def validate(s: FlowGRPOSettings, c: Any, require) -> None:
    """Checks of `algorithm.flow_grpo.*` against the rest of the config (`require(ok, key, message)`)."""
    key = "algorithm.flow_grpo"
    require(s.clip_range > 0, f"{key}.clip_range", "must be > 0")
    require(s.is_cap >= 1, f"{key}.is_cap", "must be >= 1")
    require(s.prox_mode in PROX_MODES, f"{key}.prox_mode", f"must be one of {', '.join(PROX_MODES)}, got {s.prox_mode!r}")
    require(s.is_correction in IS_CORRECTIONS, f"{key}.is_correction",
            f"must be one of {', '.join(IS_CORRECTIONS)}, got {s.is_correction!r}")
    require(s.is_mode in IS_MODES, f"{key}.is_mode", f"must be one of {', '.join(IS_MODES)}, got {s.is_mode!r}")
    if s.ratio_norm:
        require(c.rollout.sde_type == "sde", f"{key}.ratio_norm", "RatioNorm is derived for sde_type sde; use rollout.sde_type=sde")
        require(s.prox_mode == "recompute", f"{key}.ratio_norm",
                "needs the proximal policy's step means, which only recompute has; use prox_mode=recompute")
    require(s.window_shift_every >= 0, f"{key}.window_shift_every", "must be >= 0 (0 = off)")
    require(s.window_shift_stride >= 1, f"{key}.window_shift_stride", "must be >= 1")
    if s.window_shift_every > 0:
        r = c.rollout
        require(0 < r.sde_window_size < r.num_steps - 1, "rollout.sde_window_size",
                f"a moving window (algorithm.flow_grpo.window_shift_every > 0) needs a window shorter than the "
                f"{r.num_steps - 1} trainable steps; set 1..{r.num_steps - 2}")
        require(r.sde_window_range is None, "rollout.sde_window_range",
                "the moving window (algorithm.flow_grpo.window_shift_every > 0) places the window itself; use null")


def sampling(s: FlowGRPOSettings, sampling: dict, version: int) -> dict:
    """The rollout's generate() arguments for a group started at `version`: the moving window's
    place when window_shift_every > 0 (MixGRPO), else unchanged. `version` is what the rollout holds
    as it starts the group: weights published but not yet swapped in (they are at the group's first
    step) count from its next group, a lag of one publication at a move, against moves every
    window_shift_every versions."""
    if s.window_shift_every == 0:
        return sampling
    lo, hi = moving_window(version, num_steps=sampling["num_steps"], window_size=sampling["window_size"],
                           every=s.window_shift_every, stride=s.window_shift_stride)
    return {**sampling, "window_range": (lo, hi), "window_size": hi - lo}


def moving_window(version: int, *, num_steps: int, window_size: int, every: int, stride: int) -> tuple[int, int]:
    """MixGRPO's progressive window [start, end) at trained version `version`: it starts at step 0
    and moves `stride` steps every `every` versions; past the last trainable step it goes back to 0,
    and near the end it is cut at the last trainable step (num_steps - 2).

    The public code (Tencent-Hunyuan/MixGRPO, fastvideo/utils/grpo_states.py,
    GRPOTrainingStates.update_iteration and get_current_timesteps) moves cur_timestep by
    prog_overlap_step after iters_per_group iterations, rolls back to the start past max_timesteps
    (= sampling_steps - 2, train_grpo_flux.py) and trains range(cur, min(cur + group_size,
    max_timesteps)). Here the last start is num_steps - 2 itself, so a window is never empty.
    """
    last = num_steps - 1  # a window ends at most here: the last step (s' = 0) is never trained
    starts = (last - 1) // stride + 1  # 0, stride, ... up to num_steps - 2
    start = (version // every) % starts * stride
    return start, min(start + window_size, last)


# ---------------------------------------------------------------- the loss


def log_importance_weights(prox_log_prob: Tensor, behav_log_prob: Tensor, *, correction: str = "element_mean",
                           elements: int = 1) -> Tensor:
    """log(pi_prox / pi_behav) per (sample, step), no gradient. The log-probs are means over the
    latent's `elements` entries (sde_step), so their difference is the log of the D-th root of the
    step's density ratio. "element_mean" keeps it (Flow-GRPO's scale); "step" multiplies it back to
    the log-ratio of the whole transition x -> x', the action of a denoising step (AReaL's per-token
    ratio, with a step for a token); "none" is 0: w = 1 exactly."""
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {correction!r}")
    log_w = prox_log_prob.detach().float() - behav_log_prob.detach().float()
    if correction == "none":
        return torch.zeros_like(log_w)
    return log_w * elements if correction == "step" else log_w


def importance_weights(prox_log_prob: Tensor, behav_log_prob: Tensor, is_cap: float | None, *,
                       correction: str = "element_mean", mode: str = "truncate", elements: int = 1) -> Tensor:
    """Staleness correction w = pi_prox / pi_behav (`log_importance_weights`), no gradient. Above
    is_cap: "truncate" clamps w to is_cap (truncated IS: the pair still pushes, at most is_cap times);
    "mask" sets w = 0 (AReaL's decoupled loss: the pair leaves the loss but still counts in its mean)."""
    if mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES}, got {mode!r}")
    log_w = log_importance_weights(prox_log_prob, behav_log_prob, correction=correction, elements=elements)
    w = torch.exp(log_w)
    if is_cap is None:
        return w
    above = log_w > math.log(is_cap)  # in log space: exp overflows to inf for large step ratios
    return torch.where(above, torch.full_like(w, is_cap if mode == "truncate" else 0.0), w)


def effective_sample_size(w: Tensor) -> Tensor:
    """Normalised ESS (sum w)^2 / (n sum w^2), in (0, 1]; 1 when all weights are equal, 0 when all
    are 0 (every pair masked)."""
    w = w.detach().flatten().double()
    return torch.nan_to_num(w.sum() ** 2 / (w.numel() * (w**2).sum()), nan=0.0).float()


def capped_fraction(log_w: Tensor, is_cap: float | None) -> Tensor:
    """Share of pairs whose weight is above is_cap (clamped or masked, per is_mode)."""
    if is_cap is None:
        return torch.zeros((), device=log_w.device)
    return (log_w > math.log(is_cap)).float().mean()


def guard_log_ratio(log_prob: Tensor, prox_log_prob: Tensor, mean: Tensor, prox_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's RatioNorm, per row: (logp - prox + b) * s with s the step's std (sde_step's, the
    std of x') and b = mean over entries of (mean - prox_mean)^2 / (2 s^2). For Gaussian steps of one
    std this is mean((mean - prox_mean) * (x' - prox_mean)) / s: the -KL offset that puts the plain
    ratio's mean below 1 is gone, and the spread no longer grows as s shrinks. Forms as verl-omni's
    GRPOGuardLoss (its docs, algo/grpo_guard) and Flow-Factory's GRPOGuardTrainer.optimize
    (src/flow_factory/trainers/grpo.py: `ratio = exp((log_prob - old_log_prob) * scale_factor +
    mse / (2 * scale_factor))`, the same with b multiplied out)."""
    s = std.detach().float().flatten(1).mean(1)
    b = (mean.float() - prox_mean.detach().float()).pow(2).flatten(1).mean(1) / (2 * s**2)
    return (log_prob - prox_log_prob.detach() + b) * s


def policy_loss(
    log_prob: Tensor,
    prox_log_prob: Tensor,
    behav_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    adv_clip: float,
    is_cap: float | None,
    is_correction: str = "element_mean",
    is_mode: str = "truncate",
    elements: int = 1,
    log_ratio: Tensor | None = None,
    row_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO clipped loss (mean over every element), and its metrics.

    u = exp(logp - prox) is the PPO ratio to the proximal policy (the trainer's weights at the
    start of the update, "recompute" mode), on the per-element-mean scale the clip range is set
    for; w = `importance_weights(prox, behav, is_cap, ...)` corrects for the rollout having used
    older weights. "bypass" mode: pass prox_log_prob = behav_log_prob, so w = 1 and u is the plain
    ratio to the behaviour policy. prox and behav are detached here. `log_ratio` replaces
    logp - prox (GRPO-Guard's `guard_log_ratio`); `row_weight` multiplies each row's term (its 1/dt).
    `advantages` align from the left: [B] works with log_prob [B, T]. Metrics are detached 0-dim
    tensors (float() them when logging; no device sync here).
    """
    prox = prox_log_prob.detach()
    adv = advantages.detach().to(log_prob.dtype).clamp(-adv_clip, adv_clip)
    adv = adv.reshape(*adv.shape, *([1] * (log_prob.ndim - adv.ndim)))
    ratio = torch.exp(log_prob - prox if log_ratio is None else log_ratio)
    is_kw = dict(correction=is_correction, elements=elements)
    w = importance_weights(prox, behav_log_prob, is_cap, mode=is_mode, **is_kw).to(log_prob.dtype)
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    terms = w * torch.maximum(-adv * ratio, -adv * clipped)
    loss = (terms if row_weight is None else terms * row_weight.detach().to(terms.dtype)).mean()
    with torch.no_grad():
        log_w = log_importance_weights(prox, behav_log_prob, **is_kw)
        metrics = {
            "policy/clip_frac": ((ratio - 1).abs() > clip_range).float().mean(),
            "policy/ratio_mean": ratio.mean(),
            "policy/approx_kl": 0.5 * ((log_prob - prox) ** 2).mean(),
            "is/weight_mean": w.mean(),
            "is/weight_max": w.max(),
            "is/ess": effective_sample_size(w),
            "is/capped_frac": capped_fraction(log_w, is_cap),
        }
    return loss, metrics


# ---------------------------------------------------------------- the learner


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
    step: Tensor  # [P] long: j, the denoising step's index in the sampler's schedule
    group: Tensor  # [P] long, on the device: the row's group (an index into cond)
    cond: list[Tensor | None]  # per group [G, ...] on the device: embeds, pooled, negatives
    starts: list[int]  # row offset of each sample, then P

    def __len__(self) -> int:
        return self.starts[-1]


class FlowGRPOLearner(Learner):
    def __init__(
        self,
        policy: Any,
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
        ratio_norm: bool = False,
        dt_weight: bool = False,
        grad_all_reduce=None,
        lr_schedule=None,
    ):
        if prox_mode not in PROX_MODES:
            raise ValueError(f"prox_mode must be one of {PROX_MODES}, got {prox_mode!r}")
        if is_correction not in IS_CORRECTIONS or is_mode not in IS_MODES:
            raise ValueError(f"is_correction must be one of {IS_CORRECTIONS} and is_mode one of "
                             f"{IS_MODES}, got {is_correction!r}, {is_mode!r}")
        if ratio_norm and prox_mode != "recompute":
            raise ValueError("ratio_norm needs prox_mode recompute (the proximal policy's step means)")
        if beta > 0 and not policy.has_reference:
            raise ValueError(
                "algorithm.beta > 0 with model.lora_rank 0 needs a frozen reference: build the policy "
                "with reference_copy=True (or set algorithm.beta 0)"
            )
        super().__init__(policy, lr=lr, weight_decay=weight_decay, betas=betas, max_grad_norm=max_grad_norm,
                         micro_batch_size=micro_batch_size, mini_batches=mini_batches,
                         grad_all_reduce=grad_all_reduce, lr_schedule=lr_schedule)
        self.clip_range = clip_range
        self.adv_clip = adv_clip
        self.is_cap = is_cap
        self.is_correction = is_correction  # what the staleness weight is (log_importance_weights)
        self.is_mode = is_mode  # and what happens above is_cap
        self.beta = beta
        self.prox_mode = prox_mode
        self.uncond_grad = uncond_grad
        self.ratio_norm = ratio_norm
        self.dt_weight = dt_weight

    # ------------------------------------------------------------------ data

    def _rows(self, groups: list[Group], version: int) -> _Rows:
        """Every recorded step of every sample as one row, sample-major. The latents are copied
        once here (as x and x_next), a call slices them; the conditioning goes to the device once
        per group and a call gathers its rows' from there."""
        keys = ("x", "x_next", "sigma", "sigma_next", "behav", "adv", "fresh", "step", "group")
        parts: dict[str, list[Tensor]] = {k: [] for k in keys}
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
            parts["step"].append((g.params.window_start + torch.arange(w)).repeat(n))
            parts["group"].append(torch.full((n * w,), gi))
            starts += [starts[-1] + w * (k + 1) for k in range(n)]
        dev = self.policy.device
        conds = [[g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds]
                 for g in groups]
        cond = [None if conds[0][c] is None else torch.stack([gc[c] for gc in conds]).to(dev) for c in range(4)]
        cat = {k: torch.cat(v) for k, v in parts.items()}
        return _Rows(cat["x"], cat["x_next"], cat["sigma"], cat["sigma_next"], cat["behav"], cat["adv"],
                     cat["fresh"], cat["step"], cat["group"].to(dev), cond, starts)

    @staticmethod
    def _sampling(groups: list[Group]) -> tuple[float, float, str]:
        """The settings recompute replays; one batch is trained with one set of them."""
        keys = {(g.params.guidance_scale, g.params.noise_level, g.params.sde_type) for g in groups}
        if len(keys) != 1:
            raise ValueError(f"groups in one train_step must share guidance_scale, noise_level, sde_type; got {keys}")
        return keys.pop()

    def _forward(self, rows: _Rows, sel: slice, sampling, with_ref: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Log-probs (and the KL to the reference), means and stds of rows `sel`: one transformer
        call for all of them, each row at its own step's sigma with its own group's conditioning."""
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
        return log_prob, kl, mean, std

    # ------------------------------------------------------------------ update

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        rows = self._rows(groups, version)
        sampling = self._sampling(groups)
        minis = self._minis(len(rows.starts) - 1)
        dev = self.policy.device
        # D: the recorded log-probs are means over a latent's sampled entries (not a held first frame)
        elements = self.policy.sampled_elements(rows.x[0], rows.cond[1][0])
        is_kw = dict(correction=self.is_correction, elements=elements)

        # log-probs (and, for RatioNorm, step means) under the weights at the start of the update, per row
        start_logp = start_mean = None
        if self.prox_mode == "recompute" and self.mini_batches > 1:
            start_logp = torch.empty(len(rows), device=dev)
            with torch.no_grad():
                for sel in self._calls(0, len(rows)):
                    log_prob, _, mean, _ = self._forward(rows, sel, sampling, with_ref=False)
                    start_logp[sel] = log_prob
                    if self.ratio_norm:  # (the means of the sampled entries: a held frame has none)
                        if start_mean is None:
                            start_mean = torch.empty((len(rows), *mean.shape[1:]), device=dev)
                        start_mean[sel] = mean

        ratios, weights, log_ws, fresh_diffs, guard = [], [], [], [], []
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
            mb_ratios, mb_weights, mb_log_w, mb_guard = [], [], [], []
            first_half = None
            for sel in calls:
                if split and sel.start == half:
                    first_half = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
                log_prob, kl, mean, std = self._forward(rows, sel, sampling, with_ref=self.beta > 0)
                behav = rows.behav[sel].to(dev)
                adv = rows.advantage[sel].to(dev)
                if self.prox_mode == "bypass":
                    prox = behav
                elif start_logp is None:
                    prox = log_prob.detach()  # the current forward is the start-of-update policy
                else:
                    prox = start_logp[sel]
                guard_kw = {}
                if self.ratio_norm:
                    prox_mean = mean.detach() if start_mean is None else start_mean[sel]
                    guard_kw["log_ratio"] = guard_log_ratio(log_prob, prox, mean, prox_mean, std)
                if self.dt_weight:
                    guard_kw["row_weight"] = 1 / (rows.sigma[sel] - rows.sigma_next[sel]).to(dev)
                pg, _ = policy_loss(
                    log_prob, prox, behav, adv, clip_range=self.clip_range, adv_clip=self.adv_clip, is_cap=self.is_cap,
                    is_correction=self.is_correction, is_mode=self.is_mode, elements=elements, **guard_kw,
                )
                n_rows = sel.stop - sel.start
                loss = pg if kl is None else pg + self.beta * kl.mean()
                if loss.requires_grad:  # (not when every row is a step of an expert left untrained: model.trained_experts)
                    (loss * (n_rows / n_pairs)).backward()  # the gradient of the mean over the mini-batch's pairs

                mb_pg = mb_pg + pg.detach() * n_rows
                if kl is not None:
                    mb_kl = mb_kl + self.beta * kl.detach().sum()
                raw = torch.exp(log_prob.detach() - prox)
                mb_ratios.append(raw)
                if self.ratio_norm:
                    mb_guard.append((rows.step[sel], raw, torch.exp(guard_kw["log_ratio"].detach())))
                mb_weights.append(importance_weights(prox, behav, self.is_cap, mode=self.is_mode, **is_kw))
                mb_log_w.append(log_importance_weights(prox, behav, **is_kw))
                at_start = prox if self.prox_mode == "recompute" else (log_prob.detach() if mi == 0 else None)
                fresh = rows.fresh[sel]
                if at_start is not None and bool(fresh.any()):  # a CPU tensor: no device sync
                    fresh_diffs.append((at_start - behav).abs()[fresh.to(dev)].max())

            if first_half is not None:  # this rank's two halves: different prompts, same weights
                second_half = [torch.zeros_like(g) if p.grad is None else p.grad - g for p, g in zip(self.params, first_half)]
                half_cos.append(grad_cosine(first_half, second_half))
            grad_norm = self._optimizer_step(mb_pg + mb_kl)
            if grad_norm is None:
                skipped += 1
            else:
                grad_norms.append(grad_norm)
                pg_sum, kl_sum = pg_sum + mb_pg, kl_sum + mb_kl
                pairs_trained += n_pairs
                samples_trained += s1 - s0
                ratios += mb_ratios
                weights += mb_weights
                log_ws += mb_log_w
                guard += mb_guard

        metrics = batch_metrics(groups, version)
        metrics["train/skipped_nonfinite"] = float(skipped)
        metrics["samples/trained"] = float(samples_trained)
        metrics["samples/window_start"] = sum(g.params.window_start for g in groups) / len(groups)  # MixGRPO's walk
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
                    "is/ess": float(effective_sample_size(w)),
                    "is/capped_frac": float(capped_fraction(torch.cat(log_ws), self.is_cap)),
                    "train/grad_norm": sum(grad_norms) / len(grad_norms),
                }
            )
        if guard:
            metrics.update(per_step_ratio_metrics(*(torch.cat(parts) for parts in zip(*guard))))
        return metrics


def per_step_ratio_metrics(step: Tensor, raw: Tensor, normalised: Tensor) -> dict[str, float]:
    """The ratio's mean and spread at each denoising step j, before (policy/ratio_step<j>_*) and
    after RatioNorm (policy/ratio_norm_step<j>_*)."""
    out = {}
    step = step.to(raw.device)
    for j in step.unique().tolist():
        at = step == j
        for name, r in (("ratio", raw[at]), ("ratio_norm", normalised[at])):
            out[f"policy/{name}_step{j}_mean"] = float(r.mean())
            out[f"policy/{name}_step{j}_std"] = float(r.std(correction=0))
    return out


def build(policy: Any, s: FlowGRPOSettings, c: Any, shared: dict) -> FlowGRPOLearner:
    """The learner from `algorithm.flow_grpo.*` (c: the Config) and what every learner takes."""
    return FlowGRPOLearner(policy, clip_range=s.clip_range, is_cap=s.is_cap, is_correction=s.is_correction,
                           is_mode=s.is_mode, prox_mode=s.prox_mode, uncond_grad=s.uncond_grad,
                           ratio_norm=s.ratio_norm, dt_weight=s.dt_weight, **shared)
