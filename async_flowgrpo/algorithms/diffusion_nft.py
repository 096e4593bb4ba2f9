"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv 2509.16117). No sampler log-probs: the loss is flow matching on clean final samples
x0, noised afresh by the forward process x_t = (1 - s) x0 + s eps, contrasting two implicit
policies built from the sampling ("old") policy's velocity and the trained one's.

Needs from a rollout only the final clean latent x0 of each sample, its prompt conditioning, its
advantage and the weight version that generated it (an ODE group, `rollout.sampler=ode`). Per
sample the trainer draws `int(num_steps * timestep_fraction)` distinct noise levels of the
sampler's schedule (as the public code does, each with fresh noise), noises x0 by the forward
process, and minimises `nft_loss` between the trained velocity v_theta and the sampling policy's
v_old, plus beta * mean((v_theta - v_ref)^2) to the reference (LoRA adapters off) when
algorithm.beta > 0.

The sampling ("old") policy. As in the public implementation, rollouts do not sample with the
trained weights theta but with a separate copy `old`, soft-updated after every batch:
old <- d old + (1 - d) theta, d = `old_decay`(optimizer steps) (0 at first: old = theta).
`sampling_state()` is what the trainer publishes to the rollout actors.

Stale samples: no weight. The public code is synchronous, so its old copy at training time is the
one that sampled. Here a group may be trained several versions after it was generated, so v_old
must not come from today's old copy: the learner keeps the old copy published at each recent
version (`copies_by_version`, never written in place) and computes v_old of a group with the copy of the
version that generated it: exact, not an approximation. A group whose steps carry several versions
(an in-flight update, sync.update_point between_steps) is scored with its oldest one, the version
its staleness is counted from; config/diffusion_nft.yaml swaps weights between groups, so every
sample comes from one version. Copies are kept for `keep_versions` versions (staleness bound +
publication interval); a group older than that (or one from before a resume) falls back to the
current old copy, the public code's choice, and is counted in nft/old_missing_frac.

Cost: one no-grad forward per trained point for v_old (weights swapped once per distinct version
in the batch, cheap for LoRA) besides the training forward; no CFG batch (CFG-free training).
Points are rows, sample-major: `micro_batch_size` of them go through the transformer in one call,
each at its own noise level and with its own prompt's conditioning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_flowgrpo.algo import Sigma, _mean_per_sample
from async_flowgrpo.algorithms.base import SoftCopyLearner, VersionedCopies, batch_metrics, versions_to_keep
from async_flowgrpo.types import Group

NAME = "diffusion_nft"
SAMPLER = "ode"


@dataclass
class DiffusionNFTSettings:
    """DiffusionNFT's keys (async_flowgrpo/algorithms/diffusion_nft.py), read when algorithm.name is
    diffusion_nft (config/diffusion_nft.yaml)."""
    beta: float = 1.0  # implicit-policy strength: v+- = v_old +- beta (v_theta - v_old) (algorithm.beta is the KL's)
    timestep_fraction: float = 0.99  # trained noise levels per sample: this share of the sampler's
    decay_start: int = 0  # old-policy soft update old <- d old + (1 - d) theta: d = 0 before this update,
    decay_rate: float = 0.001  # then + rate per update,
    decay_max: float = 0.5  # up to this (the public code's defaults)


def validate(s: DiffusionNFTSettings, c: Any, require) -> None:
    key = "algorithm.diffusion_nft"
    require(s.beta > 0, f"{key}.beta", "must be > 0")
    require(0 < s.timestep_fraction <= 1, f"{key}.timestep_fraction", "must be in (0, 1]")
    require(s.decay_start >= 0, f"{key}.decay_start", "must be >= 0")
    require(s.decay_rate >= 0, f"{key}.decay_rate", "must be >= 0")
    require(0 <= s.decay_max < 1, f"{key}.decay_max", "must be in [0, 1) (1 would freeze the sampling policy)")


def sampling(s: DiffusionNFTSettings, sampling: dict, version: int) -> dict:
    return sampling


# ---------------------------------------------------------------- the loss


def nft_optimality(advantages: Tensor, adv_clip: float) -> Tensor:
    """Optimality probability r = 1/2 + clip(A, -c, c) / (2 c) in [0, 1] (c = adv_clip): the
    normalised advantage, as the public implementation maps it (1/2 = no preference)."""
    return 0.5 + advantages.clamp(-adv_clip, adv_clip) / (2 * adv_clip)


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    sigma: Sigma,
    r: Tensor,
    *,
    beta: float,
    min_weight: float = 1e-5,
) -> Tensor:
    """Per-sample DiffusionNFT loss [B]: (r L(v+) + (1 - r) L(v-)) / beta.

    v+ = (1 - beta) v_old + beta v_theta and v- = (1 + beta) v_old - beta v_theta are the implicit
    positive and negative policies; v_old is the sampling policy's velocity (no gradient). L is
    x0-regression with the public code's adaptive weight: x0^ = x_t - s v,
    L(v) = mean((x0^ - x0)^2) / sg(mean|x0^ - x0|), i.e. s * mean((v* - v)^2) / mean|v* - v| with
    the flow-matching target v* = eps - x0. Dividing by beta keeps the gradient finite as beta -> 0:
    d/dv_theta -> -2 s (2r - 1) (x0^_old - x0) / (w_old * numel), plain flow matching toward the
    sample for r = 1, away from it for r = 0, nothing at r = 1/2 while v_theta = v_old.
    Float32 at least (float64 stays float64).
    """
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    v, old = v_theta.to(dtype), v_old.detach().to(dtype)
    x_t, x0 = x_t.to(dtype), x0.to(dtype)
    s = torch.as_tensor(sigma, dtype=dtype, device=v.device).reshape(-1, *([1] * (v.ndim - 1)))

    def weighted_x0_error(velocity: Tensor) -> Tensor:
        err = x_t - s * velocity - x0
        weight = _mean_per_sample(err.detach().abs()).clamp_min(min_weight)
        return _mean_per_sample(err**2) / weight

    positive = weighted_x0_error(beta * v + (1 - beta) * old)
    negative = weighted_x0_error((1 + beta) * old - beta * v)
    r = r.detach().to(dtype)
    return (r * positive + (1 - r) * negative) / beta


def nft_old_decay(update: int, *, start: int, rate: float, max_decay: float) -> float:
    """Decay of the soft update old <- decay * old + (1 - decay) * theta after `update` optimizer
    steps: 0 (old = theta) before `start`, then rising by `rate` per step up to `max_decay`, the
    public code's schedule (its defaults: start 0, rate 0.001, max 0.5)."""
    return 0.0 if update < start else min((update - start) * rate, max_decay)


# ---------------------------------------------------------------- the learner


@dataclass
class _Points:
    """The batch's training points (a sample noised to one level of its sampler's schedule),
    sample-major, as flat tensors on the CPU; the prompt conditioning once per group, on the device."""

    x0: Tensor  # [P, C, H, W] final latent of the point's sample
    x_t: Tensor  # [P, C, H, W] (1 - sigma) x0 + sigma eps
    sigma: Tensor  # [P]
    r: Tensor  # [P] optimality probability
    version: Tensor  # [P] long: weights that generated the sample
    group: Tensor  # [P] long, on the device: an index into embeds and pooled
    embeds: Tensor  # [G, ...]
    pooled: Tensor  # [G, ...]
    starts: list[int]  # point offset of each sample, then P
    held: int = 0  # leading latent frames the conditioning holds (Wan2.2 TI2V-5B's first frame)

    def __len__(self) -> int:
        return self.starts[-1]

    def velocity(self, policy: Any, sel: slice | Tensor, guidance: float, reference: bool = False) -> Tensor:
        """The velocity at points `sel` (a range, or indices), one transformer call for all of them,
        on the sampled frames (`frames`)."""
        group = self.group[sel]
        return self.frames(policy.velocity(self.x_t[sel], self.sigma[sel], self.embeds[group], self.pooled[group],
                                           guidance_scale=guidance, reference=reference))

    def frames(self, t: Tensor) -> Tensor:
        """`t` [B, C, F, ...] (a velocity, x0, x_t, a target) without the held frames, which are not
        sampled: their velocity is unused, so no loss or KL term may count them (dim 2)."""
        return t[:, :, self.held:] if self.held else t


def noised_points(policy: Any, groups: list[Group], levels: Any, r: Any, *, per_group: bool = False,
                  shared_noise: bool = False) -> _Points:
    """Each ODE group's final latents, each noised at the levels of its sampler's schedule that
    `levels(num_steps)` picks (indices; called once per sample, or once per group with `per_group`,
    its samples then in the same level order), fresh noise each (one draw per group and level,
    shared by its samples, with `shared_noise`); `r(group)` is the per-sample weight a point carries
    (NFT's optimality, AWM's and DGPO's advantage). Shared by the likelihood-free algorithms
    (DiffusionNFT, AWM, DGPO: a group's samples compared at the same points). Frames the
    conditioning holds (an image-to-video first frame) are noised here too, but the transformer
    sees them held at timestep 0 (the adapter's forward) and `_Points.frames` leaves them out of
    every loss, as the log-prob leaves them out for Flow-GRPO."""
    if shared_noise and not per_group:
        raise ValueError("shared_noise needs per_group: a shared noise draw is per level")
    parts: dict[str, list[Tensor]] = {k: [] for k in ("x0", "x_t", "sigma", "r", "version", "group")}
    starts = [0]
    held = {policy.adapter.held_frames(g.pooled_prompt_embeds) for g in groups}
    if len(held) != 1:
        raise ValueError("groups in one train_step must all carry a first frame or none")
    for gi, g in enumerate(groups):
        if g.advantages is None:
            raise ValueError(f"group of prompt {g.prompt_index} has no advantages: set them on arrival")
        if g.params.window_size != 0:
            raise ValueError("this algorithm trains on ODE groups (window_size 0, final latent only); "
                             "set rollout.sampler=ode")
        steps = g.params.num_steps
        sigmas = policy.sigmas(steps, height=g.params.height, width=g.params.width)[:steps].float()
        weight = r(g)
        group_s = sigmas[levels(steps)] if per_group else None
        group_eps = torch.randn(len(group_s), *g.latents.shape[2:]) if shared_noise else None
        for k in range(g.size):
            x0 = g.latents[k, -1].float()
            s = group_s if per_group else sigmas[levels(steps)]
            n = len(s)
            eps = group_eps if shared_noise else torch.stack([torch.randn_like(x0) for _ in range(n)])
            s_col = s.reshape(-1, *[1] * x0.ndim)
            parts["x0"].append(x0.expand(n, *x0.shape))
            parts["x_t"].append((1 - s_col) * x0 + s_col * eps)
            parts["sigma"].append(s)
            parts["r"].append(weight[k].expand(n))
            parts["version"].append(torch.full((n,), g.min_version))
            parts["group"].append(torch.full((n,), gi))
            starts.append(starts[-1] + n)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    dev = policy.device
    return _Points(cat["x0"], cat["x_t"], cat["sigma"], cat["r"], cat["version"], cat["group"].to(dev),
                   torch.stack([g.prompt_embeds for g in groups]).to(dev),
                   torch.stack([g.pooled_prompt_embeds for g in groups]).to(dev), starts, held.pop())


def batch_guidance(groups: list[Group]) -> float:
    """Reaches only guidance-distilled models (policy.velocity); one value per batch."""
    values = {g.params.guidance_scale for g in groups}
    if len(values) != 1:
        raise ValueError(f"groups in one train_step must share guidance_scale; got {values}")
    return values.pop()


class NFTLearner(SoftCopyLearner):
    def __init__(
        self,
        policy: Any,
        *,
        lr: float = 3e-4,
        weight_decay: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float = 1.0,
        nft_beta: float = 1.0,
        adv_clip: float = 5.0,
        beta: float = 0.0,
        timestep_fraction: float = 0.99,
        decay_start: int = 0,
        decay_rate: float = 0.001,
        decay_max: float = 0.5,
        keep_versions: int = 2,
        micro_batch_size: int = 8,
        mini_batches: int = 1,
        grad_all_reduce=None,
        lr_schedule=None,
    ):
        if beta > 0 and not policy.has_reference:
            raise ValueError("algorithm.beta > 0 needs a reference: LoRA, or a policy built with reference_copy=True")
        super().__init__(policy, lr=lr, weight_decay=weight_decay, betas=betas, max_grad_norm=max_grad_norm,
                         micro_batch_size=micro_batch_size, mini_batches=mini_batches,
                         grad_all_reduce=grad_all_reduce, lr_schedule=lr_schedule)
        self.nft_beta = nft_beta
        self.adv_clip = adv_clip
        self.beta = beta
        self.timestep_fraction = timestep_fraction
        self.decay = dict(start=decay_start, rate=decay_rate, max_decay=decay_max)
        self.old = {n: p.clone() for n, p in policy.trainable_state().items()}
        self.copies_by_version = VersionedCopies(keep_versions)
        self.updates = 0  # optimizer steps taken: the decay schedule's clock

    def sampling_state(self) -> dict[str, Tensor]:
        """The weights rollout actors sample with: the old copy (replaced, never written in place)."""
        return self.policy.publishable(self.old)

    # ------------------------------------------------------------------ data

    def _points(self, groups: list[Group]) -> _Points:
        # distinct levels drawn uniformly, as the public code does
        return noised_points(self.policy, groups, lambda steps: torch.randperm(steps)[:max(1, int(steps * self.timestep_fraction))],
                             lambda g: nft_optimality(g.advantages.float(), self.adv_clip))

    def _old_velocities(self, points: _Points, guidance: float) -> tuple[Tensor, int]:
        """v_old of every point under the old weights of its sample's version; (velocities [P, ...], missing)."""
        v_old = torch.empty(points.frames(points.x_t).shape, device=self.policy.device)

        def compute(index: Tensor) -> None:
            for call in self._calls(0, len(index)):
                sel = index[call]
                v_old[sel.to(v_old.device)] = points.velocity(self.policy, sel, guidance)

        missing = self.copies_by_version.under_each(self.policy, points.version, self.old, compute)
        return v_old, missing

    # ------------------------------------------------------------------ update

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        """One DiffusionNFT update on `groups`; `version` is the published version (the weights
        held now), whose old copy the rollouts got if this is the first call."""
        self.copies_by_version.copies.setdefault(version, self.old)
        points = self._points(groups)
        minis = self._minis(len(points.starts) - 1)
        guidance = batch_guidance(groups)
        v_old, missing = self._old_velocities(points, guidance)
        dev = self.policy.device

        loss_sum = kl_sum = deviation_sum = torch.zeros((), device=dev)
        grad_norms, points_trained, samples_trained, skipped = [], 0, 0, 0
        for s0, s1 in minis:
            lo, hi = points.starts[s0], points.starts[s1]
            mb_loss = mb_kl = mb_dev = torch.zeros((), device=dev)
            for sel in self._calls(lo, hi):
                v = points.velocity(self.policy, sel, guidance)
                old = v_old[sel]
                x_t, x0 = points.frames(points.x_t[sel]).to(dev), points.frames(points.x0[sel]).to(dev)
                loss = nft_loss(v, old, x_t, x0, points.sigma[sel].to(dev), points.r[sel].to(dev), beta=self.nft_beta)
                total = loss.sum()
                if self.beta > 0:
                    v_ref = points.velocity(self.policy, sel, guidance, reference=True)
                    kl = self.beta * ((v - v_ref) ** 2).flatten(1).mean(1).sum()
                    total = total + kl
                    mb_kl = mb_kl + kl.detach()
                if total.requires_grad:  # (not when every point is a step of an expert left untrained)
                    (total / (hi - lo)).backward()
                mb_loss = mb_loss + loss.detach().sum()
                mb_dev = mb_dev + ((v.detach() - old) ** 2).flatten(1).mean(1).sum()

            grad_norm = self._optimizer_step(mb_loss + mb_kl)  # an expert without points is not stepped
            if grad_norm is None:
                skipped += 1
            else:
                self.updates += 1
                grad_norms.append(grad_norm)
                loss_sum, kl_sum, deviation_sum = loss_sum + mb_loss, kl_sum + mb_kl, deviation_sum + mb_dev
                points_trained += hi - lo
                samples_trained += s1 - s0

        decay = nft_old_decay(self.updates, **self.decay)
        self._move_old(decay)
        self.copies_by_version.publish(version + 1, self.old)

        metrics = batch_metrics(groups, version)
        metrics.update({
            "train/skipped_nonfinite": float(skipped),
            "samples/trained": float(samples_trained),
            "nft/r_mean": float(points.r.mean()),
            "nft/old_decay": decay,
            "nft/old_missing_frac": missing / len(points),
        })
        if points_trained:
            metrics.update({
                "loss/policy": float(loss_sum) / points_trained,
                "loss/kl": float(kl_sum) / points_trained,
                "nft/old_deviation": float(deviation_sum) / points_trained,  # mean (v_theta - v_old)^2
                "train/grad_norm": sum(grad_norms) / len(grad_norms),
            })
        return metrics


def build(policy: Any, s: DiffusionNFTSettings, c: Any, shared: dict) -> NFTLearner:
    # a group is at most max_staleness versions old when admitted and trained up to sync.every - 1
    # updates after a publication
    return NFTLearner(policy, nft_beta=s.beta, timestep_fraction=s.timestep_fraction, decay_start=s.decay_start,
                      decay_rate=s.decay_rate, decay_max=s.decay_max,
                      keep_versions=versions_to_keep(c), **shared)
