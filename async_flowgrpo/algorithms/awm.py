"""Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050): policy-gradient RL whose
"log-likelihood" is the flow-matching loss on the policy's own samples.

Needs from a rollout only final clean latents (an ODE group, `rollout.sampler=ode`), as
DiffusionNFT. Each sample's x0 is noised afresh, x_t = (1 - s) x0 + s eps, at `timesteps` noise
levels of its sampler's schedule, and each point's likelihood is

    lp = -ghuber(mean((v_theta(x_t, s) - (eps - x0))^2)) * s,   ghuber(m) = ((m + 1e-10)^p - 1e-10^p) / p

trained with the PPO form of the public code: u = exp(lp - lp_old), loss = mean(max(-A u, -A clip(u,
1 - eps, 1 + eps))), A the group advantage clipped to adv_clip and scaled to advantage_max. On a
fresh sample lp_old is lp under the weights at the start of the update, so u = 1 and the gradient
is -A d lp: advantage-weighted flow matching. Plus beta * mean((v - v_ref)^2) to the reference
(algorithm.beta) and old_kl * mean((v - v_old)^2) to a soft copy old <- d old + (1 - d) theta of
the trained weights, d = min(old_decay_rate * updates, old_decay_max) (the public code's "ema" KL).

The public code's choices, as read in scxue/advantage_weighted_matching (commit be51372),
advantage_weighted_matching/scripts/train_sd3_awm.py and config/dgx_awm.py (geneval_sd3_no_cfg_1node):
- noise levels: `time_type = "discrete_wo_init"` (dgx_awm.py line 88): `train_timesteps = 6` (line 56)
  indices stratified over [1, int(num_steps * timestep_fraction)), `timestep_fraction = 0.9` (line 60),
  one uniform draw per stratum (train_sd3_awm.py lines 1197-1205: `boundaries = torch.linspace(1,
  int(config.sample.num_steps * config.train.timestep_fraction), ...)`, `t_indices = lower_bounds +
  (rand_u * (upper_bounds - lower_bounds)).long()`), fresh noise per level (lines 1216-1220). The
  public draw shares the indices across a training batch; here each sample draws its own.
- weighting: `weighting = 'ghuber'`, `ghuber_power = 0.25` (dgx_awm.py lines 63-64), applied in
  compute_log_prob_awm (train_sd3_awm.py line 249: `-(torch.pow(-log_prob + 1e-10, p) - torch.pow(1e-10, p))
  * timestep / p`).
- ratio and clip: `loss_type = 'exp_first'` (line 61), the ratio per (level, sample)
  (train_sd3_awm.py lines 1305-1308), `clip_range = 1` (line 86) with the PPO max (lines 1318-1327);
  old log-probs on-policy are the first pass's, detached (lines 1282-1284, `off_policy = False`,
  line 69); advantages clipped to `adv_clip_max` then scaled to `advantage_max = 1`
  (lines 1293-1299; dgx_awm.py line 58).
- KL: `beta = 0.001` with `kl_weight = 'Uniform'` (dgx_awm.py lines 55, 57): mean((v - v_ref)^2)
  (train_sd3_awm.py line 1337); `ema_beta = 1`, `kl_ema_weight = 'Uniform'`, `kl_ema_decay = 0.3`,
  `kl_ema_decay_type = 'linear'` (dgx_awm.py lines 65-68): the copy updated after each epoch with
  `decay = min(config.train.kl_ema_decay, 0.001 * global_step)` (train_sd3_awm.py lines 1410-1420).
- sampler: `use_sa_solver = True` (dgx_awm.py line 71), an SA-Solver stochastic for 0.3 <= t <= 0.9
  at noise_level 0.4 (flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py line 296), CFG-free
  (`guidance_scale = 1.0`, dgx_awm.py line 39; `train.cfg = False`). Here: the ODE Euler sampler
  the other likelihood-free algorithm uses (no SA-Solver in diffusers' flow-matching schedulers).
- lr 3e-4 (dgx_awm.py line 62), constant.

Stale samples (fully_async): lp_old of a sample is its likelihood under the weights that generated
it, kept by version (`VersionedCopies`, as DiffusionNFT keeps its old copies), so u is the ratio of
the trained policy to the sampling one and the clip bounds how far a stale sample pushes: at
staleness 0 this is the public code's on-policy update exactly (u = 1), at staleness k the sample
is weighted by u in [1 - clip_range, 1 + clip_range] where the advantage's sign makes the
unclipped side count. A sample older than the copies kept (or from before a resume) is scored
against the weights at the start of the update (u = 1, counted in awm/old_missing_frac).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_flowgrpo.algorithms.base import SoftCopyLearner, VersionedCopies, batch_metrics, versions_to_keep
from async_flowgrpo.algorithms.diffusion_nft import _Points, batch_guidance, nft_old_decay, noised_points
from async_flowgrpo.types import Group

NAME = "awm"
SAMPLER = "ode"
WEIGHTINGS = ("ghuber", "t", "uniform")


@dataclass
class AWMSettings:
    """AWM's keys (async_flowgrpo/algorithms/awm.py), read when algorithm.name is awm
    (config/awm.yaml); the defaults are the public code's."""
    timesteps: int = 6  # noise levels per sample, one per stratum of [1, int(num_steps * timestep_fraction)) of the schedule
    timestep_fraction: float = 0.9  # the share of the sampler's schedule the strata cover
    # each point's likelihood from its flow-matching error m: ghuber = -((m + 1e-10)^p - 1e-10^p) s / p
    # (the public geneval/OCR configs) | t = -m s | uniform = -m
    weighting: str = "ghuber"
    ghuber_power: float = 0.25  # p
    clip_range: float = 1.0  # PPO clip of u = exp(lp - lp_old) (public: 1, so u in [0, 2])
    advantage_max: float = 1.0  # advantages clipped to algorithm.adv_clip, then scaled to at most this
    old_kl: float = 1.0  # coefficient of mean((v - v_old)^2) to the soft copy of the trained weights; 0 = off
    old_decay_rate: float = 0.001  # the copy's update old <- d old + (1 - d) theta, d = min(rate * updates,
    old_decay_max: float = 0.3  # this)


def validate(s: AWMSettings, c: Any, require) -> None:
    key = "algorithm.awm"
    require(s.timesteps >= 1, f"{key}.timesteps", "must be >= 1")
    require(0 < s.timestep_fraction <= 1, f"{key}.timestep_fraction", "must be in (0, 1]")
    require(int(c.rollout.num_steps * s.timestep_fraction) > 1, f"{key}.timestep_fraction",
            f"covers no step after the first of rollout.num_steps={c.rollout.num_steps}; raise it or num_steps")
    require(s.weighting in WEIGHTINGS, f"{key}.weighting", f"must be one of {', '.join(WEIGHTINGS)}, got {s.weighting!r}")
    require(s.ghuber_power > 0, f"{key}.ghuber_power", "must be > 0")
    require(s.clip_range > 0, f"{key}.clip_range", "must be > 0")
    require(s.advantage_max > 0, f"{key}.advantage_max", "must be > 0")
    require(s.old_kl >= 0, f"{key}.old_kl", "must be >= 0 (0 = off)")
    require(s.old_decay_rate >= 0, f"{key}.old_decay_rate", "must be >= 0")
    require(0 <= s.old_decay_max < 1, f"{key}.old_decay_max", "must be in [0, 1)")


def sampling(s: AWMSettings, sampling: dict, version: int) -> dict:
    return sampling


# ---------------------------------------------------------------- the loss


def stratified_levels(num_steps: int, timesteps: int, fraction: float) -> Tensor:
    """Indices into the sampler's schedule, one uniform draw in each of `timesteps` strata of
    [1, int(num_steps * fraction)) (the public "discrete_wo_init"; a stratum narrower than one step
    gives its lower end)."""
    bounds = torch.linspace(1, int(num_steps * fraction), timesteps + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(timesteps) * (upper - lower)).long()


def awm_log_likelihood(v: Tensor, x0: Tensor, eps: Tensor, sigma: Tensor, *, weighting: str, power: float) -> Tensor:
    """Per point [B]: minus the (weighted) flow-matching error of v against the target eps - x0, in
    float64 as the public code computes it."""
    m = (v.double() - (eps.double() - x0.double())).pow(2).flatten(1).mean(1)
    s = sigma.double().reshape(-1)
    if weighting == "uniform":
        return -m
    if weighting == "t":
        return -m * s
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=torch.float64, device=m.device)
        return -((m + 1e-10).pow(power) - floor.pow(power)) * s / power
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def awm_loss(log_lik: Tensor, old_log_lik: Tensor, advantages: Tensor, *, clip_range: float) -> tuple[Tensor, Tensor]:
    """Per point: the PPO term max(-A u, -A clip(u, 1 - eps, 1 + eps)), u = exp(lp - lp_old); and u."""
    ratio = torch.exp(log_lik - old_log_lik.detach())
    adv = advantages.detach().to(ratio.dtype)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)), ratio


# ---------------------------------------------------------------- the learner


class AWMLearner(SoftCopyLearner):
    def __init__(
        self,
        policy: Any,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float,
        adv_clip: float,
        beta: float,
        timesteps: int,
        timestep_fraction: float,
        weighting: str,
        ghuber_power: float,
        clip_range: float,
        advantage_max: float,
        old_kl: float,
        old_decay_rate: float,
        old_decay_max: float,
        keep_versions: int,
        micro_batch_size: int,
        mini_batches: int,
        grad_all_reduce=None,
        lr_schedule=None,
    ):
        if beta > 0 and not policy.has_reference:
            raise ValueError("algorithm.beta > 0 needs a reference: LoRA, or a policy built with reference_copy=True")
        super().__init__(policy, lr=lr, weight_decay=weight_decay, betas=betas, max_grad_norm=max_grad_norm,
                         micro_batch_size=micro_batch_size, mini_batches=mini_batches,
                         grad_all_reduce=grad_all_reduce, lr_schedule=lr_schedule)
        self.adv_clip, self.beta = adv_clip, beta
        self.timesteps, self.timestep_fraction = timesteps, timestep_fraction
        self.weighting, self.ghuber_power = weighting, ghuber_power
        self.clip_range, self.advantage_max = clip_range, advantage_max
        self.old_kl = old_kl
        self.decay = dict(start=0, rate=old_decay_rate, max_decay=old_decay_max)
        self.old = {n: p.clone() for n, p in policy.trainable_state().items()}  # the KL's soft copy
        self.copies_by_version = VersionedCopies(keep_versions)  # the weights each version's rollouts sampled with
        self.updates = 0

    # ------------------------------------------------------------------ data

    def _points(self, groups: list[Group]) -> tuple[_Points, Tensor]:
        """The points and their noise eps (the flow-matching target is eps - x0)."""
        points = noised_points(
            self.policy, groups, lambda steps: stratified_levels(steps, self.timesteps, self.timestep_fraction),
            lambda g: g.advantages.float().clamp(-self.adv_clip, self.adv_clip) / self.adv_clip * self.advantage_max)
        s = points.sigma.reshape(-1, *[1] * (points.x0.ndim - 1))
        return points, points.frames((points.x_t - (1 - s) * points.x0) / s)

    def _log_lik(self, v: Tensor, points: _Points, eps: Tensor, sel) -> Tensor:
        dev = v.device
        return awm_log_likelihood(v, points.frames(points.x0[sel]).to(dev), eps[sel].to(dev), points.sigma[sel].to(dev),
                                  weighting=self.weighting, power=self.ghuber_power)

    @torch.no_grad()
    def _velocities_under(self, weights: dict[str, Tensor], points: _Points, guidance: float) -> Tensor:
        theta = {n: p.clone() for n, p in self.policy.trainable_state().items()}
        out = torch.empty(points.frames(points.x_t).shape, device=self.policy.device)
        try:
            self.policy.load_trainable_state(weights)
            for sel in self._calls(0, len(points)):
                out[sel] = points.velocity(self.policy, sel, guidance)
        finally:
            self.policy.load_trainable_state(theta)
        return out

    # ------------------------------------------------------------------ update

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        self.copies_by_version.copies.setdefault(version, {n: p.clone() for n, p in self.policy.trainable_state().items()})
        points, eps = self._points(groups)
        minis = self._minis(len(points.starts) - 1)
        guidance = batch_guidance(groups)
        dev = self.policy.device
        n = len(points)

        # lp_old: under the weights that sampled each point's sample (stale ones), or at the start of
        # this update (fresh ones: skipped when one mini-batch makes the first forward that very pass)
        old_lp = torch.full((n,), float("nan"), dtype=torch.float64, device=dev)
        stale = points.version != version
        need = torch.ones(n, dtype=torch.bool) if self.mini_batches > 1 else stale
        missing = 0
        if bool(need.any()):
            index_all = need.nonzero().flatten()

            def compute(index: Tensor) -> None:
                for call in self._calls(0, len(index)):
                    sel = index[call]
                    old_lp[sel.to(dev)] = self._log_lik(points.velocity(self.policy, sel, guidance), points, eps, sel)

            start = {n_: p.clone() for n_, p in self.policy.trainable_state().items()}
            missing = self.copies_by_version.under_each(self.policy, points.version[index_all], start,
                                              lambda idx: compute(index_all[idx]))
        v_old = self._velocities_under(self.old, points, guidance) if self.old_kl > 0 else None

        loss_sum = kl_sum = torch.zeros((), device=dev)
        ratios, grad_norms, points_trained, samples_trained, skipped = [], [], 0, 0, 0
        for s0, s1 in minis:
            lo, hi = points.starts[s0], points.starts[s1]
            mb_loss = mb_kl = torch.zeros((), device=dev)
            mb_ratios = []
            for sel in self._calls(lo, hi):
                v = points.velocity(self.policy, sel, guidance)
                lp = self._log_lik(v, points, eps, sel)
                old = torch.where(torch.isnan(old_lp[sel]), lp.detach(), old_lp[sel])
                terms, ratio = awm_loss(lp, old, points.r[sel].to(dev), clip_range=self.clip_range)
                total = terms.sum().float()
                kl = torch.zeros((), device=dev)
                if self.beta > 0:
                    v_ref = points.velocity(self.policy, sel, guidance, reference=True)
                    kl = kl + self.beta * ((v - v_ref) ** 2).flatten(1).mean(1).sum()
                if v_old is not None:
                    kl = kl + self.old_kl * ((v - v_old[sel]) ** 2).flatten(1).mean(1).sum()
                total = total + kl
                if total.requires_grad:  # (not when every point is a step of an expert left untrained)
                    (total / (hi - lo)).backward()
                mb_loss = mb_loss + terms.detach().sum().float()
                mb_kl = mb_kl + kl.detach()
                mb_ratios.append(ratio.detach())

            grad_norm = self._optimizer_step(mb_loss + mb_kl)
            if grad_norm is None:
                skipped += 1
            else:
                self.updates += 1
                grad_norms.append(grad_norm)
                loss_sum, kl_sum = loss_sum + mb_loss, kl_sum + mb_kl
                points_trained += hi - lo
                samples_trained += s1 - s0
                ratios += mb_ratios

        decay = nft_old_decay(self.updates, **self.decay)
        theta = self._move_old(decay)
        self.copies_by_version.publish(version + 1, {k: t.clone() for k, t in theta.items()})

        metrics = batch_metrics(groups, version)
        metrics.update({
            "train/skipped_nonfinite": float(skipped),
            "samples/trained": float(samples_trained),
            "awm/adv_abs_mean": float(points.r.abs().mean()),
            "awm/old_decay": decay,
            "awm/old_missing_frac": missing / n,
            "awm/stale_frac": float(stale.float().mean()),
        })
        if points_trained:
            ratio = torch.cat(ratios)
            metrics.update({
                "loss/policy": float(loss_sum) / points_trained,
                "loss/kl": float(kl_sum) / points_trained,
                "policy/ratio_mean": float(ratio.mean()),
                "policy/clip_frac": float(((ratio - 1).abs() > self.clip_range).float().mean()),
                "train/grad_norm": sum(grad_norms) / len(grad_norms),
            })
        return metrics


def build(policy: Any, s: AWMSettings, c: Any, shared: dict) -> AWMLearner:
    return AWMLearner(policy, timesteps=s.timesteps, timestep_fraction=s.timestep_fraction, weighting=s.weighting,
                      ghuber_power=s.ghuber_power, clip_range=s.clip_range, advantage_max=s.advantage_max,
                      old_kl=s.old_kl, old_decay_rate=s.old_decay_rate, old_decay_max=s.old_decay_max,
                      keep_versions=versions_to_keep(c), **shared)
