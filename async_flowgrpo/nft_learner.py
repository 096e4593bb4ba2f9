"""NFTLearner: one DiffusionNFT update from a batch of groups, behind the `Learner` interface.

DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) needs from a rollout only the final clean
latent x0 of each sample, its prompt conditioning, its advantage and the weight version that
generated it (an ODE group, window_size 0). Per sample the trainer draws
`int(num_steps * timestep_fraction)` distinct noise levels of the sampler's schedule (as the public
code does, each with fresh noise), noises x0 by the forward process x_t = (1 - s) x0 + s eps, and
minimises `algo.nft_loss` between the trained velocity v_theta and the sampling policy's v_old,
plus beta * mean((v_theta - v_ref)^2) to the reference (LoRA adapters off) when beta > 0.

The sampling ("old") policy. As in the public implementation, rollouts do not sample with the
trained weights theta but with a separate copy `old`, soft-updated after every batch:
old <- d old + (1 - d) theta, d = algo.nft_old_decay(optimizer steps) (0 at first: old = theta).
`sampling_state()` is what the trainer publishes to the rollout actors. The public code is
synchronous, so its old copy at training time is the one that sampled. Here a group may be
trained several versions after it was generated, so v_old must not come from today's old copy:
the learner keeps the old copy published at each recent version (`snapshots`, one dict per
version, never written in place) and computes v_old of a group with the snapshot of the version
that generated it: exact, not an approximation. A group whose steps carry several versions (an
in-flight update, sync.update_point between_steps) is scored with its oldest one, the version its
staleness is counted from; config/diffusion_nft.yaml swaps weights between groups, so every
sample comes from one version. Snapshots are kept for `keep_versions` versions (staleness bound +
publication interval); a group older than that (or one from before a resume) falls back to the
current old copy, the public code's choice, and is counted in nft/old_missing_frac.

Cost: one no-grad forward per trained point for v_old (weights swapped once per distinct version
in the batch, cheap for LoRA) besides the training forward; no CFG batch (CFG-free training).
Points are rows, sample-major: `micro_batch_size` of them go through the transformer in one call,
each at its own noise level and with its own prompt's conditioning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from async_flowgrpo import algo
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.learner import Learner, _cpu_copy, reduce_grads, set_lr
from async_flowgrpo.types import Group


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

    def __len__(self) -> int:
        return self.starts[-1]


class NFTLearner:
    def __init__(
        self,
        policy: DiffusionPolicy,
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
        grad_all_reduce: Callable[[list[nn.Parameter]], None] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
    ):
        if micro_batch_size < 1 or mini_batches < 1 or keep_versions < 1:
            raise ValueError("micro_batch_size, mini_batches and keep_versions must be >= 1")
        if beta > 0 and not policy.has_reference:
            raise ValueError("algorithm.beta > 0 needs a reference: LoRA, or a policy built with reference_copy=True")
        self.policy = policy
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.nft_beta = nft_beta
        self.adv_clip = adv_clip
        self.beta = beta
        self.timestep_fraction = timestep_fraction
        self.decay = dict(start=decay_start, rate=decay_rate, max_decay=decay_max)
        self.keep_versions = keep_versions
        self.micro_batch_size = micro_batch_size
        self.mini_batches = mini_batches
        self.grad_all_reduce = grad_all_reduce
        self.old = {n: p.clone() for n, p in policy.trainable_state().items()}
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.updates = 0  # optimizer steps taken: the decay schedule's clock
        self.base_lr = lr
        self.lr_schedule = lr_schedule or (lambda step: 1.0)
        self.steps = 0  # train_step calls: the lr schedule's clock

    def sampling_state(self) -> dict[str, Tensor]:
        """The weights rollout actors sample with: the old copy (replaced, never written in place)."""
        return self.policy.publishable(self.old)

    # ------------------------------------------------------------------ data

    def _points(self, groups: list[Group]) -> _Points:
        parts: dict[str, list[Tensor]] = {k: [] for k in ("x0", "x_t", "sigma", "r", "version", "group")}
        starts = [0]
        for gi, g in enumerate(groups):
            if g.advantages is None:
                raise ValueError(f"group of prompt {g.prompt_index} has no advantages: set them on arrival")
            if g.params.window_size != 0:
                raise ValueError("diffusion_nft trains on ODE groups (window_size 0, final latent only); "
                                 "set rollout.sampler=ode")
            steps = g.params.num_steps
            sigmas = self.policy.sigmas(steps, height=g.params.height, width=g.params.width)[:steps].float()
            per_sample = max(1, int(steps * self.timestep_fraction))
            r = algo.nft_optimality(g.advantages.float(), self.adv_clip)
            for k in range(g.size):
                x0 = g.latents[k, -1].float()
                s = sigmas[torch.randperm(steps)[:per_sample]]
                eps = torch.stack([torch.randn_like(x0) for _ in range(per_sample)])
                s_col = s.reshape(-1, *[1] * x0.ndim)
                parts["x0"].append(x0.expand(per_sample, *x0.shape))
                parts["x_t"].append((1 - s_col) * x0 + s_col * eps)
                parts["sigma"].append(s)
                parts["r"].append(r[k].expand(per_sample))
                starts.append(starts[-1] + per_sample)
            parts["version"].append(torch.full((g.size * per_sample,), g.min_version))
            parts["group"].append(torch.full((g.size * per_sample,), gi))
        cat = {k: torch.cat(v) for k, v in parts.items()}
        dev = self.policy.device
        return _Points(cat["x0"], cat["x_t"], cat["sigma"], cat["r"], cat["version"], cat["group"].to(dev),
                       torch.stack([g.prompt_embeds for g in groups]).to(dev),
                       torch.stack([g.pooled_prompt_embeds for g in groups]).to(dev), starts)

    @staticmethod
    def _guidance(groups: list[Group]) -> float:
        """Reaches only guidance-distilled models (policy.velocity); one value per batch."""
        values = {g.params.guidance_scale for g in groups}
        if len(values) != 1:
            raise ValueError(f"groups in one train_step must share guidance_scale; got {values}")
        return values.pop()

    def _velocity(self, points: _Points, sel: slice | Tensor, guidance: float, reference: bool = False) -> Tensor:
        """The velocity at points `sel` (a range, or indices): one transformer call for all of them."""
        group = points.group[sel]
        return self.policy.velocity(points.x_t[sel], points.sigma[sel], points.embeds[group], points.pooled[group],
                                    guidance_scale=guidance, reference=reference)

    def _calls(self, lo: int, hi: int) -> list[slice]:
        """Points [lo, hi) as the ranges of successive transformer calls, micro_batch_size each."""
        return [slice(a, min(a + self.micro_batch_size, hi)) for a in range(lo, hi, self.micro_batch_size)]

    @torch.no_grad()
    def _old_velocities(self, points: _Points, guidance: float) -> tuple[Tensor, int]:
        """v_old of every point under the old weights of its sample's version; (velocities [P, ...], missing)."""
        theta = {n: p.clone() for n, p in self.policy.trainable_state().items()}
        v_old = torch.empty(points.x_t.shape, device=self.policy.device)
        missing = 0
        try:
            for version in points.version.unique().tolist():
                index = (points.version == version).nonzero().flatten()
                weights = self.snapshots.get(version)
                if weights is None:
                    missing += len(index)
                    weights = self.old
                self.policy.load_trainable_state(weights)
                for call in self._calls(0, len(index)):
                    sel = index[call]
                    v_old[sel.to(v_old.device)] = self._velocity(points, sel, guidance)
        finally:
            self.policy.load_trainable_state(theta)
        return v_old, missing

    # ------------------------------------------------------------------ update

    def train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        """One DiffusionNFT update on `groups`; `version` is the published version (the weights
        held now), whose old copy the rollouts got if this is the first call."""
        t0 = time.perf_counter()
        lr = self.base_lr * self.lr_schedule(self.steps)
        set_lr(self.optimizer, lr)
        self.steps += 1
        self.snapshots.setdefault(version, self.old)
        points = self._points(groups)
        n_samples = len(points.starts) - 1
        if n_samples < self.mini_batches:
            raise ValueError(f"{n_samples} samples cannot fill {self.mini_batches} mini-batches")
        guidance = self._guidance(groups)
        v_old, missing = self._old_velocities(points, guidance)
        dev = self.policy.device
        # a mini-batch: a contiguous range of samples, so of points
        minis = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n_samples).tensor_split(self.mini_batches)]

        loss_sum = kl_sum = deviation_sum = torch.zeros((), device=dev)
        grad_norms, points_trained, samples_trained, skipped = [], 0, 0, 0
        for s0, s1 in minis:
            lo, hi = points.starts[s0], points.starts[s1]
            mb_loss = mb_kl = mb_dev = torch.zeros((), device=dev)
            for sel in self._calls(lo, hi):
                v = self._velocity(points, sel, guidance)
                old = v_old[sel]
                loss = algo.nft_loss(v, old, points.x_t[sel].to(dev), points.x0[sel].to(dev), points.sigma[sel].to(dev),
                                     points.r[sel].to(dev), beta=self.nft_beta)
                total = loss.sum()
                if self.beta > 0:
                    v_ref = self._velocity(points, sel, guidance, reference=True)
                    kl = self.beta * ((v - v_ref) ** 2).flatten(1).mean(1).sum()
                    total = total + kl
                    mb_kl = mb_kl + kl.detach()
                if total.requires_grad:  # (not when every point is a step of an expert left untrained)
                    (total / (hi - lo)).backward()
                mb_loss = mb_loss + loss.detach().sum()
                mb_dev = mb_dev + ((v.detach() - old) ** 2).flatten(1).mean(1).sum()

            reduce_grads(self.params, self.grad_all_reduce)  # an expert without points is not stepped
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            if not (math.isfinite(grad_norm) and bool(torch.isfinite(mb_loss + mb_kl))):
                skipped += 1  # a NaN/inf update would poison the weights for good: drop it
            else:
                self.optimizer.step()
                self.updates += 1
                grad_norms.append(grad_norm)
                loss_sum, kl_sum, deviation_sum = loss_sum + mb_loss, kl_sum + mb_kl, deviation_sum + mb_dev
                points_trained += hi - lo
                samples_trained += s1 - s0
            self.optimizer.zero_grad(set_to_none=True)

        decay = algo.nft_old_decay(self.updates, **self.decay)
        with torch.no_grad():  # a new dict: published and snapshotted copies stay as they were
            theta = self.policy.trainable_state()
            self.old = {n: decay * self.old[n] + (1 - decay) * theta[n] for n in theta}
        self.snapshots[version + 1] = self.old
        for v in [v for v in self.snapshots if v <= version + 1 - self.keep_versions]:
            del self.snapshots[v]

        metrics = Learner._batch_metrics(groups, version)
        metrics.update({
            "train/skipped_nonfinite": float(skipped),
            "train/lr": lr,
            "samples/trained": float(samples_trained),
            "train/time_s": time.perf_counter() - t0,
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

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """A CPU snapshot: trained weights, optimizer, the old copy and the decay clock. Per-version
        snapshots are not kept: after a resume the rollouts regenerate from the published old copy."""
        return _cpu_copy({
            "trainable": self.policy.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "old": self.old,
            "updates": self.updates,
            "steps": self.steps,
        })

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_trainable_state(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        device = self.policy.device
        self.old = {n: t.to(device) for n, t in state["old"].items()}
        self.updates = state["updates"]
        self.steps = state.get("steps", 0)  # checkpoints from before the lr schedule: its start
        self.snapshots = {}
