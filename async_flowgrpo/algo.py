"""Sampler math every algorithm shares: the stochastic denoising step with its log-prob, the ODE
steps (Euler; DPM-Solver++(2M) after the window), the SDE window, the KL of two steps, group
advantages and the lr schedule. Pure torch; no Ray, no diffusers. The algorithms' losses are in
async_flowgrpo/algorithms/.

Conventions (DESIGN.md section 2). Flow matching x_t = (1 - s) x0 + s noise, the model predicts the
velocity v; sampler sigmas go 1 = s_0 > s_1 > ... > s_N = 0 and step i maps x at s = s_i to x' at
s' = s_{i+1}, dt = s' - s < 0. `std` returned by `sde_step` is the std of x' given x:
  "sde": noise_level * sqrt(s / (1 - s)) * sqrt(-dt)       "cps": s' * sin(noise_level * pi / 2)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Sigma = float | Tensor  # python float, 0-dim tensor, or per-sample tensor [B]


def _col(sigma: Sigma, ndim: int, device: torch.device) -> Tensor:
    """sigma as float32 of shape [B or 1, 1, ..., 1] so it broadcasts over the non-batch dims."""
    t = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    return t.reshape(-1, *([1] * (ndim - 1)))


def _mean_per_sample(x: Tensor) -> Tensor:
    # flatten(1) rather than mean(dim=tuple(1..)): an empty dim tuple would reduce everything
    return x.flatten(1).mean(1)


def sde_step(
    velocity: Tensor,
    sample: Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    noise_level: float,
    sde_type: str = "sde",
    sigma_max: Sigma | None = None,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One stochastic denoising step; returns (prev_sample, log_prob [B], mean, std).

    Computed in float32 whatever the model dtype: bf16 log-probs are too coarse for a PPO ratio
    clipped at 1e-4. If `prev_sample` is given it is scored rather than sampled (the trainer's
    recompute); otherwise x' = mean + std * noise, with noise drawn (from `generator`) when None.
    The log-prob is taken against prev_sample.detach(): gradients reach the model only via `mean`.
    """
    x = sample.float()
    v = velocity.float()
    s = _col(sigma, x.ndim, x.device)
    s_next = _col(sigma_next, x.ndim, x.device)
    dt = s_next - s

    if sde_type == "sde":
        if noise_level <= 0:
            raise ValueError("sde_step with sde_type='sde' needs noise_level > 0; use ode_step for noise_level 0")
        s_max = s_next if sigma_max is None else _col(sigma_max, x.ndim, x.device)
        # sqrt(s / (1 - s)) is infinite at s == 1, so there Flow-GRPO uses 1 - s_1 instead;
        # the clamp only guards an exact zero (sigma_max == 1 is a caller error).
        denom = (1 - torch.where(s == 1, s_max, s)).clamp_min(torch.finfo(torch.float32).tiny)
        std_t = noise_level * torch.sqrt(s / denom)
        # Euler step of the reverse SDE whose marginals match the ODE's (Flow-GRPO eq. 9)
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        # coefficients-preserving sampling: re-noise the x0 estimate with a mix of the predicted
        # noise and fresh noise whose variances sum to s'^2. std = 0 at s' = 0 (no NaN).
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = x0 * (1 - s_next) + x1 * torch.sqrt((s_next**2 - std**2).clamp_min(0))
    else:
        raise ValueError(f"unknown sde_type {sde_type!r}: expected 'sde' or 'cps'")

    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        prev_sample = mean + std * noise.float()
    else:
        prev_sample = prev_sample.float()

    diff2 = (prev_sample.detach() - mean) ** 2
    if sde_type == "sde":
        log_prob = -diff2 / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    else:
        # Flow-GRPO's cps "log-prob" drops the 1/(2 std^2) scale and constants: it is only ever
        # used in differences (ratios), and std is the same for theta and the old policy.
        log_prob = -diff2
    return prev_sample, _mean_per_sample(log_prob), mean, std


def ode_step(velocity: Tensor, sample: Tensor, sigma: Sigma, sigma_next: Sigma) -> Tensor:
    """Deterministic Euler step x' = x + (s' - s) v, in float32 (evaluation, steps outside the window)."""
    x = sample.float()
    dt = _col(sigma_next, x.ndim, x.device) - _col(sigma, x.ndim, x.device)
    return x + dt * velocity.float()


def dpm_solver_2m_step(
    velocity: Tensor,
    sample: Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev_velocity: Tensor | None = None,
    prev_sample: Tensor | None = None,
    sigma_prev: float | None = None,
) -> Tensor:
    """One deterministic DPM-Solver++(2M) step (Lu et al. 2022, the multistep midpoint form that
    diffusers' DPMSolverMultistepScheduler takes for flow prediction), in float32: MixGRPO-Flash's
    ODE after the window. In data prediction x0 = x - s v with alpha = 1 - s and lambda = log(alpha / s),
    h = lambda' - lambda, r = (lambda - lambda_prev) / h:
        x' = (s' / s) x - alpha' (e^-h - 1) [x0 + (x0 - x0_prev) / (2 r)]
    First order (exactly an Euler step) without the previous step's (prev_velocity, prev_sample at
    sigma_prev), from s_prev = 1 (lambda = -inf), and into s' = 0, as the scheduler's lower_order_final."""
    if prev_velocity is None or sigma_prev is None or float(sigma_prev) >= 1.0 or float(sigma_next) <= 0.0:
        return ode_step(velocity, sample, sigma, sigma_next)
    s_prev, s, s_next = float(sigma_prev), float(sigma), float(sigma_next)
    x, v = sample.float(), velocity.float()
    x0 = x - s * v
    x0_prev = prev_sample.float() - s_prev * prev_velocity.float()
    lam = lambda t: math.log(1.0 - t) - math.log(t)  # noqa: E731
    h = lam(s_next) - lam(s)
    r = (lam(s) - lam(s_prev)) / h
    phi = math.expm1(-h)  # e^-h - 1
    return (s_next / s) * x - (1.0 - s_next) * phi * (x0 + (x0 - x0_prev) / (2.0 * r))


def schedule_after_window(sigmas: Tensor, end: int, steps_fraction: float) -> Tensor:
    """MixGRPO-Flash's shorter ODE after the window: sigmas[:end + 1] kept (the window and the steps
    before it, as sampled and replayed), then max(1, round(steps_fraction * (N - end))) steps from
    sigmas[end] down to 0 instead of N - end, on the same schedule (linear in the step index between
    the family's own sigmas, which is linear in the unshifted time the shift maps). The public code
    (Tencent-Hunyuan/MixGRPO, fastvideo/utils/sampling_utils.py, run_sample_step) re-shifts
    `torch.linspace(post_time_step, 0, num_post_steps)` with num_post_steps =
    int(max((N + 1 - 1 - last_sde_index) * dpm_post_compress_ratio, 1)) points."""
    n = len(sigmas) - 1
    if not 0 < steps_fraction <= 1:
        raise ValueError(f"steps_fraction must be in (0, 1], got {steps_fraction}")
    steps = max(1, round(steps_fraction * (n - end)))
    if steps >= n - end:
        return sigmas
    tail = sigmas[end:].double()
    at = torch.linspace(0, n - end, steps + 1, dtype=torch.float64)
    lo = at.floor().long().clamp(max=n - end - 1)
    post = tail[lo] + (at - lo) * (tail[lo + 1] - tail[lo])
    return torch.cat([sigmas[:end], post.to(sigmas.dtype)])


def kl_std(std: Tensor, sigma: Sigma, sigma_next: Sigma, sde_type: str) -> Tensor:
    """Divisor of the KL term. "sde": noise_level*sqrt(s/(1-s)) without the sqrt(-dt) factor, as
    Flow-GRPO does (so std / sqrt(-dt)); "cps": the step's std itself."""
    if sde_type == "cps":
        return std
    if sde_type != "sde":
        raise ValueError(f"unknown sde_type {sde_type!r}: expected 'sde' or 'cps'")
    dt = _col(sigma_next, std.ndim, std.device) - _col(sigma, std.ndim, std.device)
    return std / torch.sqrt(-dt)


def kl_penalty(mean: Tensor, ref_mean: Tensor, kl_std: Tensor) -> Tensor:
    """Per-sample KL between Gaussians of equal std: mean over non-batch dims of
    (mean - ref_mean)^2 / (2 kl_std^2), shape [B]. Not yet multiplied by beta."""
    return _mean_per_sample((mean - ref_mean) ** 2 / (2 * kl_std**2))


def sde_window(
    num_steps: int,
    window_size: int,
    window_range: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Steps [start, end) that are stochastic and recorded; the others are ODE steps.

    The window is drawn uniformly among the positions that keep it inside `window_range`
    (half-open, default (0, num_steps - 1)). The last step (s' = 0) is never in a window.
    window_size 0 gives (0, 0), a pure ODE sample; num_steps - 1 gives original Flow-GRPO.
    """
    if window_size == 0:
        return 0, 0
    lo, hi = window_range if window_range is not None else (0, num_steps - 1)
    if not 0 <= lo <= hi <= num_steps - 1:
        raise ValueError(
            f"sde window_range ({lo}, {hi}) must satisfy 0 <= lo <= hi <= num_steps - 1 = {num_steps - 1} "
            "(the last denoising step is never trained)"
        )
    if not 0 < window_size <= hi - lo:
        raise ValueError(f"sde window_size {window_size} does not fit in window_range ({lo}, {hi}) of {hi - lo} steps")
    start = lo + int(torch.randint(0, hi - lo - window_size + 1, (1,), generator=generator))
    return start, start + window_size


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = True,
    mean_only: bool = False,
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """A = (r - group mean) / (std + eps) per sample; returns (advantages [N], zero_std_mask [N]).

    std is the population std (correction=0) over samples, of the sample's group or of the whole
    batch (global_std). mean_only skips the division. zero_std_mask flags samples of groups whose
    rewards are all equal (singletons included): they get advantage exactly 0 in every mode.
    """
    r = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    gmean = torch.zeros_like(count).index_add_(0, inv, r) / count
    centered = r - gmean[inv]
    gmax = torch.full_like(count, -math.inf).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full_like(count, math.inf).scatter_reduce(0, inv, r, "amin")
    zero_std = (gmax == gmin)[inv]

    if mean_only:
        adv = centered
    elif global_std:
        adv = centered / (r.std(correction=0) + eps)
    else:
        gvar = torch.zeros_like(count).index_add_(0, inv, centered**2) / count
        adv = centered / (gvar.sqrt()[inv] + eps)
    adv = torch.where(zero_std, torch.zeros_like(adv), adv)  # exact 0, not a rounding residue
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(out_dtype), zero_std


def zero_std_fraction(rewards: Tensor, group_ids: Tensor) -> float:
    """Fraction of groups (not samples) whose rewards are all equal: they carry no signal."""
    _, zero_std = group_advantages(rewards, group_ids, mean_only=True)
    ids, inv = torch.unique(group_ids, return_inverse=True)
    per_group = torch.zeros(len(ids), dtype=torch.bool, device=zero_std.device).scatter_(0, inv, zero_std)
    return float(per_group.float().mean()) if len(ids) else 0.0


# ------------------------------------------------------------------ learning-rate schedule

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, *, schedule: str = "constant", total_steps: int = 1, warmup_steps: int = 0,
              min_ratio: float = 0.0, decay_steps: int = 0) -> float:
    """The multiplier of the base lr at trainer step `step` (0-based): a linear warm-up over the first
    `warmup_steps`, then constant, or a cosine or linear decay that reaches `min_ratio` at `total_steps`
    (or at `decay_steps` when set and sooner, and held there: a decay whose pace does not stretch with
    a longer run).

    Why a decay: with a few prompts per step an update is mostly noise (on the embedded default the
    gradients of independent batches have a cosine of about 0.0001, benchmarks/grad_signal.py), so at a constant lr
    the adapter keeps random-walking after the signal is used and the held-out gain drifts back;
    a decaying lr lets the late updates average out instead (docs/results.md, "Learning").
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    end = min(decay_steps, total_steps) if decay_steps else total_steps
    progress = min(1.0, (step - warmup_steps) / max(1, end - warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * decay
