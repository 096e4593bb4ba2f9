"""Direct Group Preference Optimization (Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct
Group Preference Optimization", arXiv 2510.08425): DPO between the better and the worse half of a
group, with no policy gradient and no sampler log-probs.

Needs from a rollout only final clean latents (an ODE group, `rollout.sampler=ode`), as DiffusionNFT
and AWM. A group's samples are noised at the same `timesteps` levels of its sampler's schedule, with
one noise draw per level that all of them share, x_t = (1 - s) x0 + s eps, and compared there by
their flow-matching errors e = mean((v(x_t, s) - (eps - x0))^2) under the trained weights and e_ref
under the reference. The advantage A splits the group: A > 0 is the positive set, A < 0 the
negative one, |A| each sample's weight in its set's implicit reward R = -beta_dpo sum |A| (e - e_ref).
Maximising log sigmoid(R(G+) - R(G-)) has the gradient of

    loss = mean over points of  sg(sigmoid(S)) * A * e,     S = beta_dpo / n * sum over the group at that level of A (e - e_ref)

(n the group size, sg no gradient): lower error on the positive samples, higher on the negative,
weighted by how wrong the group's preference still is (S > 0: the positives fit worse than the
reference's, weight -> 1; satisfied, weight -> 0). `dgpo_group_weights` and `dgpo_loss` are that
formula. A PPO-style clip against a soft copy "old" of the trained weights cuts the gradient of a
point whose ratio exp(e_old - e) left 1 +- clip_range in the direction its advantage pushes; plus
algorithm.beta * mean((v - v_ref)^2) to the reference (LoRA adapters off).

The public code's choices, as read in Luo-Yihong/DGPO (commit 01ceb4b), scripts/train_sd3_dgpo.py
and config/dgpo.py (`general_ocr_sd3_4gpu`, the README's default run scripts/single_node/sd3_dgpo_ocr.sh,
built on `compressibility()`):
- the loss: compute_group_dgpo_loss_allreduce (train_sd3_dgpo.py lines 162-193): `ref_dsm_loss =
  (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)`, `delta_diff =
  dsm_loss.detach() - ref_dsm_loss.detach()`, `per_sample_term = advantages * beta_dpo * delta_diff /
  group_size`, summed per group by `scatter_add_` over the prompt's samples, `group_weights =
  torch.sigmoid(global_group_sums)`, `loss = (local_weights.detach() * advantages * dsm_loss).mean()`.
  The split into G+ and G- is the advantage's sign; there is no explicit partition.
- `config.train.beta_dpo = 100` (config/dgpo.py line 32; geneval line 88 the same, pickscore 10).
- advantages: the per-prompt normalised reward (`per_prompt_stat_tracking`, global_std True for OCR,
  line 124), clipped to `adv_clip_max` 5 (train_sd3_dgpo.py lines 1127-1131; config/base.py line 89).
- noise levels: `train_timesteps = [step_index for step_index in range(config.trunc_steps + 1)]`,
  `random.sample(train_timesteps, M)` with `M = config.num_train_timesteps` (lines 1062-1064; generate_shared_sampled_timesteps, lines 52-74):
  `num_train_timesteps = 4`, `trunc_steps = 6 # equals to t_min = shift(0.3)` of `sample.num_steps =
  10` (config/dgpo.py lines 28-29, 103): 4 distinct indices of the 7 noisiest steps of the schedule,
  one draw per epoch shared by the whole batch. Here `timestep_fraction` 0.6 (6 of 10) says the same
  for any rollout.num_steps, and each group draws its own (the comparison is within a group).
- shared noise: `use_shared_noise = True` (line 30); generate_shared_noise_for_groups (lines 76-108)
  gives every sample of a prompt the same noise, drawn afresh for each level (line 1103, inside the
  level loop). `target_v = noise_diffuse - x0` (line 1107).
- reference: `ref_old_v` under `transformer.module.disable_adapter()` (lines 1110-1115), the frozen
  base, without CFG (`config.kl_cfg = 1.0`, config/base.py line 29); `use_ema_ref = False` (line 30;
  True in config/dgpo_wocfg_emaref.py makes the old copy the reference: `ref_dgpo_v = old_v`, line
  1124) -> `reference: frozen | old` here.
- clip: `ratio = torch.exp(-dsm_loss + old_dsm_loss)`, `should_clip = torch.where(advantages > 0,
  ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)`, `dsm_loss = torch.where(should_clip,
  dsm_loss.detach(), dsm_loss)` (lines 1133-1144); `config.clip_range = 1e-2` (line 107), `clip_dsm =
  True`, `clip_kl = False` (lines 39-40; not an option here: the KL is never clipped).
- old copy: `ema_ref = EMAModuleWrapper(..., decay=0.3, update_step_interval=1)` (line 629), stepped
  after every optimizer step with `ema_ref_decay = min(0.3, 0.001 * global_step)` (lines 1175-1177),
  DiffusionNFT's and AWM's soft update (`nft_old_decay`). Rollouts sample with it once `global_step >
  config.switch_ema_ref` (lines 799-800; `switch_ema_ref = 200`, config/dgpo.py line 31), before with
  the trained weights -> `sample_old_after`.
- KL: `kl_loss = (model_v - ref_old_v).square()...mean(dim=1)`, `loss = dgpo_loss + config.train.beta
  * kl_loss` (lines 1150-1156); `config.train.beta = 0.02` (line 115) -> algorithm.beta.
- training without CFG: `model_v = predict_v(..., cfg = False)` (line 1120) takes the conditional branch only;
  here `policy.velocity`, CFG-free too. Rollouts with CFG 4.5 (`sample.guidance_scale`, line 105).
- sampler: `DPMSolverMultistepScheduler` with `flow_shift` 3 (lines 557-559) at `noise_level = 0`:
  an ODE. Here the ODE Euler sampler the other likelihood-free algorithms use.
- lr 3e-4 (config/base.py line 68); one optimizer step per epoch (`gradient_accumulation_steps =
  train.gradient_accumulation_steps * num_train_timesteps`, line 537, with `train.gradient_accumulation_steps
  = config.sample.num_batches_per_epoch`).
Flow-Factory's port (X-GenGroup/Flow-Factory, src/flow_factory/trainers/dgpo.py,
DGPOTrainer._compute_group_dgpo_loss) computes the same `group_weights =
torch.sigmoid(global_sums)[local_group_indices].detach()` and `(group_weights * advantages *
dsm_loss).mean()`; its _make_shared_noise keeps one noise per group for all levels ("The noise is
**timestep-invariant** — all training timesteps within an epoch share the same per-group noise"),
where the original draws one per level (followed here).

Where our structure differs: the group sum S needs every sample of the group before any backward,
and a transformer call holds `micro_batch_size` points, not whole groups; so the errors e entering S
come from a no-grad pass under the weights at the start of the update (one more forward per point).
With trainer.mini_batches 1 (one optimizer step per batch, as the public epoch) they are the
public's values; with more, later mini-batches weigh by the start-of-update weights. A data-parallel
trainer holds whole groups (driver/batch.py deals groups round-robin), so S needs no all-reduce, where
the public code splits a group across ranks and all-reduces its sums.

Stale samples (fully_async). Three parts, none needing the sampler's likelihood: (1) the reference
is the frozen base, the same for every version; (2) the group weight sigmoid(S) is computed with the
weights now, so a stale group whose preference has since been learnt weighs little (its S < 0);
(3) e_old of a point comes from the old copy published at the version that generated its sample
(`VersionedCopies`, as DiffusionNFT's v_old): at staleness 0 it is the public code's (the old copy
at training time), at staleness k the clip cuts the points on which the trained weights already
moved past 1 +- clip_range from the copy that was current when the sample was made. A sample older
than the copies kept (or from before a resume) is scored with the current old copy, counted in
dgpo/old_missing_frac. With reference=old the same versioned copy is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_flowgrpo.algorithms.base import SoftCopyLearner, VersionedCopies, batch_metrics, versions_to_keep
from async_flowgrpo.algorithms.diffusion_nft import _Points, batch_guidance, nft_old_decay, noised_points
from async_flowgrpo.types import Group

NAME = "dgpo"
SAMPLER = "ode"
REFERENCES = ("frozen", "old")


@dataclass
class DGPOSettings:
    """DGPO's keys (async_flowgrpo/algorithms/dgpo.py), read when algorithm.name is dgpo
    (config/dgpo.yaml); the defaults are the public code's OCR run."""
    beta_dpo: float = 100.0  # DPO beta: a group's weight is sigmoid(beta_dpo / n * sum A (e - e_ref))
    timesteps: int = 4  # noise levels per group, distinct, drawn from the schedule's indices 0..int(num_steps * timestep_fraction)
    timestep_fraction: float = 0.6  # public trunc_steps 6 of 10 steps: the noisiest part of the schedule
    shared_noise: bool = True  # one noise per group and level, shared by its samples (false: one per sample)
    clip_range: float = 0.01  # PPO-style clip of exp(e_old - e) against the old copy; 0 = off
    reference: str = "frozen"  # e_ref's weights: frozen (the base, LoRA off) | old (the soft copy, public use_ema_ref)
    old_decay_rate: float = 0.001  # the old copy's update old <- d old + (1 - d) theta, d = min(rate * updates,
    old_decay_max: float = 0.3  # this)
    sample_old_after: int = 200  # rollouts sample with the old copy after this many updates (public switch_ema_ref)


def validate(s: DGPOSettings, c: Any, require) -> None:
    key = "algorithm.dgpo"
    require(s.beta_dpo > 0, f"{key}.beta_dpo", "must be > 0")
    require(s.timesteps >= 1, f"{key}.timesteps", "must be >= 1")
    require(0 <= s.timestep_fraction <= 1, f"{key}.timestep_fraction", "must be in [0, 1]")
    candidates = min(int(c.rollout.num_steps * s.timestep_fraction), c.rollout.num_steps - 1) + 1
    require(candidates >= s.timesteps, f"{key}.timesteps",
            f"{s.timesteps} distinct levels but timestep_fraction={s.timestep_fraction:g} of rollout.num_steps="
            f"{c.rollout.num_steps} leaves {candidates}; lower timesteps or raise timestep_fraction")
    require(s.clip_range >= 0, f"{key}.clip_range", "must be >= 0 (0 = off)")
    require(s.reference in REFERENCES, f"{key}.reference", f"must be one of {', '.join(REFERENCES)}, got {s.reference!r}")
    require(s.reference != "frozen" or c.model.lora_rank > 0, f"{key}.reference",
            "frozen is the base with the LoRA adapters off: needs model.lora_rank > 0; or use old")
    require(s.old_decay_rate >= 0, f"{key}.old_decay_rate", "must be >= 0")
    require(0 <= s.old_decay_max < 1, f"{key}.old_decay_max", "must be in [0, 1)")
    require(s.sample_old_after >= 0, f"{key}.sample_old_after", "must be >= 0")


def sampling(s: DGPOSettings, sampling: dict, version: int) -> dict:
    return sampling


# ---------------------------------------------------------------- the loss


def flow_matching_error(v: Tensor, target: Tensor) -> Tensor:
    """Per point [B]: mean((v - target)^2), target = eps - x0 (the public dsm_loss)."""
    return (v.float() - target.float()).pow(2).flatten(1).mean(1)


def dgpo_group_weights(err: Tensor, ref_err: Tensor, advantages: Tensor, comparison: Tensor, group_size: Tensor,
                       *, beta_dpo: float) -> Tensor:
    """Per point: sigmoid(S) of its comparison (a group's samples at one level and noise), S =
    sum over the comparison of A * beta_dpo * (e - e_ref) / n. No gradient."""
    term = (advantages * beta_dpo * (err - ref_err) / group_size).detach().double()
    sums = torch.zeros(int(comparison.max()) + 1, dtype=term.dtype, device=term.device)
    sums.scatter_add_(0, comparison, term)
    return torch.sigmoid(sums)[comparison].to(err.dtype)


def dgpo_loss(err: Tensor, weight: Tensor, advantages: Tensor, old_err: Tensor | None = None,
              clip_range: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per point: weight * A * e, e without gradient where the ratio exp(e_old - e) left 1 +- clip_range
    on the side A pushes it (A > 0 lowers e: the ratio rises; A < 0 raises it); and that mask."""
    adv = advantages.detach().to(err.dtype)
    clipped = torch.zeros_like(err, dtype=torch.bool)
    if old_err is not None and clip_range > 0:
        ratio = torch.exp(old_err.detach().to(err.dtype) - err.detach())
        clipped = torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
        err = torch.where(clipped, err.detach(), err)
    return weight.detach().to(err.dtype) * adv * err, clipped


# ---------------------------------------------------------------- the learner


class DGPOLearner(SoftCopyLearner):
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
        beta_dpo: float,
        timesteps: int,
        timestep_fraction: float,
        shared_noise: bool,
        clip_range: float,
        reference: str,
        old_decay_rate: float,
        old_decay_max: float,
        sample_old_after: int,
        keep_versions: int,
        micro_batch_size: int,
        mini_batches: int,
        grad_all_reduce=None,
        lr_schedule=None,
    ):
        if (beta > 0 or reference == "frozen") and not policy.has_reference:
            raise ValueError("algorithm.beta > 0 and algorithm.dgpo.reference=frozen need a reference: LoRA, "
                             "or a policy built with reference_copy=True")
        super().__init__(policy, lr=lr, weight_decay=weight_decay, betas=betas, max_grad_norm=max_grad_norm,
                         micro_batch_size=micro_batch_size, mini_batches=mini_batches,
                         grad_all_reduce=grad_all_reduce, lr_schedule=lr_schedule)
        self.adv_clip, self.beta, self.beta_dpo = adv_clip, beta, beta_dpo
        self.timesteps, self.timestep_fraction, self.shared_noise = timesteps, timestep_fraction, shared_noise
        self.clip_range, self.reference = clip_range, reference
        self.decay = dict(start=0, rate=old_decay_rate, max_decay=old_decay_max)
        self.sample_old_after = sample_old_after
        self.old = {n: p.clone() for n, p in policy.trainable_state().items()}  # the clip's soft copy
        self.copies_by_version = VersionedCopies(keep_versions)  # the old copy current at each version
        self.updates = 0

    def sampling_state(self) -> dict[str, Tensor]:
        """The trained weights, then the old copy once `sample_old_after` updates have passed."""
        return self.policy.publishable(self.old if self.updates > self.sample_old_after else self.policy.trainable_state())

    # ------------------------------------------------------------------ data

    def _levels(self, steps: int) -> Tensor:
        """`timesteps` distinct indices of the schedule's 0..int(steps * timestep_fraction)."""
        top = min(int(steps * self.timestep_fraction), steps - 1)
        return torch.randperm(top + 1)[:self.timesteps]

    def _points(self, groups: list[Group]) -> tuple[_Points, Tensor, Tensor, Tensor]:
        """The points, their flow-matching targets eps - x0, each point's comparison index (its
        group and level) and its group's size."""
        points = noised_points(self.policy, groups, self._levels,
                               lambda g: g.advantages.float().clamp(-self.adv_clip, self.adv_clip),
                               per_group=True, shared_noise=self.shared_noise)
        s = points.sigma.reshape(-1, *[1] * (points.x0.ndim - 1))
        target = points.frames((points.x_t - points.x0) / s)  # = eps - x0 (s > 0: the schedule's last level 0 is never drawn)
        starts = torch.tensor(points.starts)
        level = torch.arange(len(points)) - starts[:-1].repeat_interleave(starts.diff())  # position in its sample
        group = points.group.cpu()
        comparison = group * self.timesteps + level
        sizes = torch.tensor([float(g.size) for g in groups])[group]
        return points, target, comparison, sizes

    @torch.no_grad()
    def _errors(self, points: _Points, target: Tensor, guidance: float, index: Tensor | None = None,
                reference: bool = False, out: Tensor | None = None, v_out: Tensor | None = None) -> Tensor:
        """e of the points `index` (all by default) under the weights the policy holds (or the
        reference), written into `out` (and their velocities into `v_out`)."""
        index = torch.arange(len(points)) if index is None else index
        dev = self.policy.device
        out = torch.empty(len(points), device=dev) if out is None else out
        for call in self._calls(0, len(index)):
            sel = index[call]
            v = points.velocity(self.policy, sel, guidance, reference=reference)
            out[sel.to(dev)] = flow_matching_error(v, target[sel].to(dev))
            if v_out is not None:
                v_out[sel.to(dev)] = v
        return out

    def _old_errors(self, points: _Points, target: Tensor, guidance: float) -> tuple[Tensor, int]:
        """e_old of every point under the old copy of its sample's version; (errors [P], missing)."""
        out = torch.empty(len(points), device=self.policy.device)
        missing = self.copies_by_version.under_each(self.policy, points.version, self.old,
                                             lambda index: self._errors(points, target, guidance, index, out=out))
        return out, missing

    # ------------------------------------------------------------------ update

    def _train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        self.copies_by_version.copies.setdefault(version, self.old)
        points, target, comparison, sizes = self._points(groups)
        minis = self._minis(len(points.starts) - 1)
        guidance = batch_guidance(groups)
        dev = self.policy.device
        n = len(points)

        # no grad, before any step: e now (the group sums need whole groups), e_ref, e_old
        err_now = self._errors(points, target, guidance)
        v_ref = torch.empty(points.frames(points.x_t).shape, device=dev) if self.beta > 0 else None
        err_ref = (self._errors(points, target, guidance, reference=True, v_out=v_ref)
                   if self.beta > 0 or self.reference == "frozen" else None)
        err_old, missing = (self._old_errors(points, target, guidance)
                            if self.clip_range > 0 or self.reference == "old" else (None, 0))
        adv = points.r.to(dev)
        weight = dgpo_group_weights(err_now, err_old if self.reference == "old" else err_ref, adv,
                                    comparison.to(dev), sizes.to(dev), beta_dpo=self.beta_dpo)

        loss_sum = kl_sum = torch.zeros((), device=dev)
        clipped_all, grad_norms, points_trained, samples_trained, skipped = [], [], 0, 0, 0
        for s0, s1 in minis:
            lo, hi = points.starts[s0], points.starts[s1]
            mb_loss = mb_kl = torch.zeros((), device=dev)
            mb_clipped = []
            for sel in self._calls(lo, hi):
                v = points.velocity(self.policy, sel, guidance)
                err = flow_matching_error(v, target[sel].to(dev))
                terms, clipped = dgpo_loss(err, weight[sel], adv[sel], None if err_old is None else err_old[sel],
                                           self.clip_range)
                total = terms.sum()
                kl = torch.zeros((), device=dev)
                if v_ref is not None:
                    kl = self.beta * ((v - v_ref[sel]) ** 2).flatten(1).mean(1).sum()
                    total = total + kl
                if total.requires_grad:  # (not when every point is a step of an expert left untrained)
                    (total / (hi - lo)).backward()
                mb_loss = mb_loss + terms.detach().sum()
                mb_kl = mb_kl + kl.detach()
                mb_clipped.append(clipped)

            grad_norm = self._optimizer_step(mb_loss + mb_kl)
            if grad_norm is None:
                skipped += 1
            else:
                self.updates += 1
                grad_norms.append(grad_norm)
                loss_sum, kl_sum = loss_sum + mb_loss, kl_sum + mb_kl
                points_trained += hi - lo
                samples_trained += s1 - s0
                clipped_all += mb_clipped

        decay = nft_old_decay(self.updates, **self.decay)
        self._move_old(decay)
        self.copies_by_version.publish(version + 1, self.old)

        stale = points.version != version
        metrics = batch_metrics(groups, version)
        metrics.update({
            "train/skipped_nonfinite": float(skipped),
            "samples/trained": float(samples_trained),
            "dgpo/weight_mean": float(weight.mean()),  # sigmoid(S): 1/2 at the reference, -> 0 once preferred
            "dgpo/err_gap": float((adv * (err_now - (err_old if self.reference == "old" else err_ref))).mean()),
            "dgpo/old_decay": decay,
            "dgpo/old_missing_frac": missing / n,
            "dgpo/stale_frac": float(stale.float().mean()),
            "dgpo/sampling_old": float(self.updates > self.sample_old_after),
        })
        if points_trained:
            metrics.update({
                "loss/policy": float(loss_sum) / points_trained,
                "loss/kl": float(kl_sum) / points_trained,
                "policy/clip_frac": float(torch.cat(clipped_all).float().mean()),
                "train/grad_norm": sum(grad_norms) / len(grad_norms),
            })
        return metrics


def build(policy: Any, s: DGPOSettings, c: Any, shared: dict) -> DGPOLearner:
    return DGPOLearner(policy, beta_dpo=s.beta_dpo, timesteps=s.timesteps, timestep_fraction=s.timestep_fraction,
                       shared_noise=s.shared_noise, clip_range=s.clip_range, reference=s.reference,
                       old_decay_rate=s.old_decay_rate, old_decay_max=s.old_decay_max,
                       sample_old_after=s.sample_old_after,
                       keep_versions=versions_to_keep(c), **shared)
