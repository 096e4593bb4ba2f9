"""async_flowgrpo.algo against float64 evaluations of the Flow-GRPO formulas written out here."""

from __future__ import annotations

import math

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.algorithms import diffusion_nft, flow_grpo

SHAPE = (4, 3, 5, 6)  # [B, C, H, W]
B = SHAPE[0]


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def col64(sigma):
    return torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, 1, 1, 1)


# ---- reference formulas (float64, written independently of the module) ----


def ref_sde(v, x, s, s_next, noise_level, eps, s_max):
    s, s_next, s_max = col64(s), col64(s_next), col64(s_max)
    dt = s_next - s
    s_den = torch.where(s == 1, s_max, s)
    std_t = noise_level * torch.sqrt(s / (1 - s_den))
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    sd = std_t * torch.sqrt(-dt)
    xp = mean + sd * eps
    lp = -((xp - mean) ** 2) / (2 * sd**2) - torch.log(sd) - math.log(math.sqrt(2 * math.pi))
    return xp, lp.mean(dim=(1, 2, 3)), mean, sd, std_t


def ref_cps(v, x, s, s_next, noise_level, eps):
    s, s_next = col64(s), col64(s_next)
    sd = s_next * math.sin(noise_level * math.pi / 2)
    x0 = x - s * v
    x1 = x + (1 - s) * v
    mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - sd**2)
    xp = mean + sd * eps
    lp = -((xp - mean) ** 2)
    return xp, lp.mean(dim=(1, 2, 3)), mean, sd


def close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a.double(), b.double().expand_as(a.double()), rtol=rtol, atol=atol)


SIGMAS = [
    (0.7, 0.6, None),  # floats
    (torch.tensor([0.9, 0.5, 0.3, 0.15]), torch.tensor([0.8, 0.4, 0.2, 0.05]), None),  # per sample
]


# ---- sampler steps ----


@pytest.mark.parametrize("s,s_next,_", SIGMAS)
def test_sde_step_sampled_matches_reference(s, s_next, _):
    v, x, eps = rand(*SHAPE, seed=1), rand(*SHAPE, seed=2), rand(*SHAPE, seed=3)
    xp, lp, mean, std = algo.sde_step(v, x, s, s_next, noise_level=0.7, noise=eps)
    rxp, rlp, rmean, rsd, _ = ref_sde(v, x, s, s_next, 0.7, eps, s_next)
    assert xp.dtype == torch.float32 and lp.shape == (B,)
    close(xp, rxp)
    close(mean, rmean)
    close(lp, rlp, rtol=1e-4, atol=1e-4)
    close(std, rsd)


@pytest.mark.parametrize("s,s_next,_", SIGMAS)
def test_sde_step_scores_given_prev_sample(s, s_next, _):
    v, x = rand(*SHAPE, seed=4), rand(*SHAPE, seed=5)
    target = rand(*SHAPE, seed=6) * 0.3 + x  # an arbitrary x', not produced by the step
    xp, lp, mean, std = algo.sde_step(v, x, s, s_next, noise_level=0.8, prev_sample=target)
    _, _, rmean, rsd, _ = ref_sde(v, x, s, s_next, 0.8, torch.zeros_like(x), s_next)
    rlp = (-((target - rmean) ** 2) / (2 * rsd**2) - torch.log(rsd) - math.log(math.sqrt(2 * math.pi))).mean(
        dim=(1, 2, 3)
    )
    close(xp, target.float())
    close(lp, rlp, rtol=1e-4, atol=1e-4)


def test_sde_step_at_sigma_one_uses_sigma_max():
    v, x, eps = rand(*SHAPE, seed=7), rand(*SHAPE, seed=8), rand(*SHAPE, seed=9)
    s = torch.tensor([1.0, 1.0, 0.9, 0.5])
    s_next = torch.tensor([0.95, 0.95, 0.8, 0.4])
    # default: sigma_max = sigma_next
    xp, lp, mean, std = algo.sde_step(v, x, s, s_next, noise_level=0.7, noise=eps)
    rxp, rlp, rmean, rsd, _ = ref_sde(v, x, s, s_next, 0.7, eps, s_next)
    assert torch.isfinite(xp).all() and torch.isfinite(lp).all()
    close(xp, rxp)
    close(lp, rlp, rtol=1e-4, atol=1e-4)
    # explicit sigma_max (float) only changes the samples at s == 1
    xp2, _, _, std2 = algo.sde_step(v, x, s, s_next, noise_level=0.7, noise=eps, sigma_max=0.9)
    rxp2, _, _, rsd2, _ = ref_sde(v, x, s, s_next, 0.7, eps, 0.9)
    close(xp2, rxp2)
    close(std2, rsd2)
    assert not torch.allclose(std2[:2], std[:2]) and torch.equal(std2[2:], std[2:])


@pytest.mark.parametrize("s,s_next,_", SIGMAS)
def test_cps_step_sampled_and_scored(s, s_next, _):
    v, x, eps = rand(*SHAPE, seed=10), rand(*SHAPE, seed=11), rand(*SHAPE, seed=12)
    xp, lp, mean, std = algo.sde_step(v, x, s, s_next, noise_level=0.6, sde_type="cps", noise=eps)
    rxp, rlp, rmean, rsd = ref_cps(v, x, s, s_next, 0.6, eps)
    close(xp, rxp)
    close(mean, rmean)
    close(lp, rlp)
    close(std, rsd)
    target = rand(*SHAPE, seed=13)
    _, lp2, _, _ = algo.sde_step(v, x, s, s_next, noise_level=0.6, sde_type="cps", prev_sample=target)
    close(lp2, (-((target - rmean) ** 2)).mean(dim=(1, 2, 3)))


def test_cps_last_step_has_no_nan():
    v = rand(*SHAPE, seed=14).requires_grad_()
    x = rand(*SHAPE, seed=15)
    xp, lp, mean, std = algo.sde_step(v, x, 0.1, 0.0, noise_level=0.7, sde_type="cps")
    assert torch.all(std == 0) and torch.isfinite(xp).all() and torch.isfinite(lp).all()
    close(xp, x - 0.1 * v.detach())  # s' = 0: x' = x0 estimate
    lp.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_sde_last_step_is_finite():
    v, x = rand(*SHAPE, seed=16), rand(*SHAPE, seed=17)
    xp, lp, _, _ = algo.sde_step(v, x, 0.1, 0.0, noise_level=0.7)
    assert torch.isfinite(xp).all() and torch.isfinite(lp).all()


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sampled_log_prob_equals_rescoring(sde_type):
    v, x = rand(*SHAPE, seed=18).float(), rand(*SHAPE, seed=19).float()
    s = torch.tensor([1.0, 0.8, 0.5, 0.2])
    s_next = torch.tensor([0.9, 0.7, 0.4, 0.1])
    g = torch.Generator().manual_seed(0)
    xp, lp, _, _ = algo.sde_step(v, x, s, s_next, noise_level=0.7, sde_type=sde_type, generator=g)
    _, lp2, _, _ = algo.sde_step(v, x, s, s_next, noise_level=0.7, sde_type=sde_type, prev_sample=xp)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-6)
    # and a different velocity scores it differently (the test can fail)
    _, lp3, _, _ = algo.sde_step(v + 0.1, x, s, s_next, noise_level=0.7, sde_type=sde_type, prev_sample=xp)
    assert (lp3 - lp).abs().max() > 1e-4


def test_sde_step_computes_in_float32_from_bf16():
    v, x = rand(*SHAPE, seed=20).bfloat16(), rand(*SHAPE, seed=21).bfloat16()
    xp, lp, mean, std = algo.sde_step(v, x, 0.5, 0.4, noise_level=0.7)
    assert xp.dtype == lp.dtype == mean.dtype == torch.float32


def test_sde_step_gradient_flows_to_velocity_only_through_mean():
    v = rand(*SHAPE, seed=22).requires_grad_()
    x = rand(*SHAPE, seed=23)
    xp, lp, _, _ = algo.sde_step(v, x, 0.5, 0.4, noise_level=0.7)
    lp.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_bad_sde_type_and_zero_noise_raise():
    v, x = rand(*SHAPE, seed=24), rand(*SHAPE, seed=25)
    with pytest.raises(ValueError, match="sde_type"):
        algo.sde_step(v, x, 0.5, 0.4, noise_level=0.7, sde_type="ddim")
    with pytest.raises(ValueError, match="noise_level"):
        algo.sde_step(v, x, 0.5, 0.4, noise_level=0.0)


@pytest.mark.parametrize("s,s_next,_", SIGMAS)
def test_ode_step(s, s_next, _):
    v, x = rand(*SHAPE, seed=26), rand(*SHAPE, seed=27)
    out = algo.ode_step(v, x, s, s_next)
    assert out.dtype == torch.float32
    close(out, x + (col64(s_next) - col64(s)) * v)


def test_dpm_solver_2m_steps_as_diffusers_multistep_scheduler_does_for_flow_prediction():
    """MixGRPO-Flash's solver against diffusers' DPMSolverMultistepScheduler (DPM-Solver++, order 2,
    midpoint, flow prediction, shifted flow sigmas) stepping the same velocity field from the same
    latents: first order at the first and the last step, second order between."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0, algorithm_type="dpmsolver++",
        solver_order=2, solver_type="midpoint", lower_order_final=True, final_sigmas_type="zero")
    scheduler.set_timesteps(8)
    sigmas = scheduler.sigmas.tolist()

    def velocity(x, s):  # nonlinear in x and s, so a second-order step differs from a first-order one
        return torch.sin(3 * x) * (1 + s) - 0.5 * x

    ours = theirs = rand(*SHAPE, seed=28).float()
    previous, euler = {}, ours
    for i, t in enumerate(scheduler.timesteps):
        theirs = scheduler.step(velocity(theirs, sigmas[i]), t, theirs).prev_sample
        v = velocity(ours, sigmas[i])
        ours, previous = algo.dpm_solver_2m_step(v, ours, sigmas[i], sigmas[i + 1], sigma_prev=sigmas[i - 1] if i else None,
                                                 **previous), {"prev_velocity": v, "prev_sample": ours}
        euler = algo.ode_step(velocity(euler, sigmas[i]), euler, sigmas[i], sigmas[i + 1])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - euler).abs().max() > 1e-2  # not Euler in disguise


def test_schedule_after_window_keeps_the_window_and_takes_fewer_steps_to_zero():
    sigmas = torch.tensor([1.0, 0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.0])
    flash = algo.schedule_after_window(sigmas, 2, 0.4)  # 8 steps after a window ending at step 2: 3
    assert torch.equal(flash[:3], sigmas[:3]) and len(flash) == 3 + 3 and flash[-1] == 0
    assert (flash[1:] < flash[:-1]).all()
    assert torch.allclose(flash[3:5], torch.tensor([0.3 + (0.4 - 0.3) / 3, 0.1 - (0.1 - 0.05) / 3]))
    assert torch.equal(algo.schedule_after_window(sigmas, 9, 0.4), sigmas)  # one step left: kept
    assert len(algo.schedule_after_window(sigmas, 2, 0.01)) == 3 + 1  # at least one step
    with pytest.raises(ValueError, match="steps_fraction"):
        algo.schedule_after_window(sigmas, 2, 0.0)


# ---- KL ----


@pytest.mark.parametrize("s,s_next,_", SIGMAS)
def test_kl_std_and_penalty(s, s_next, _):
    v, x = rand(*SHAPE, seed=28), rand(*SHAPE, seed=29)
    ref_v = v + 0.05 * rand(*SHAPE, seed=30)
    # sde: divisor is noise_level * sqrt(s / (1 - s)) without sqrt(-dt)
    _, _, mean, std = algo.sde_step(v, x, s, s_next, noise_level=0.7)
    _, _, ref_mean, _ = algo.sde_step(ref_v, x, s, s_next, noise_level=0.7)
    ks = algo.kl_std(std, s, s_next, "sde")
    _, _, rmean, _, rstd_t = ref_sde(v, x, s, s_next, 0.7, torch.zeros_like(x), s_next)
    _, _, rref_mean, _, _ = ref_sde(ref_v, x, s, s_next, 0.7, torch.zeros_like(x), s_next)
    close(ks, rstd_t)
    kl = algo.kl_penalty(mean, ref_mean, ks)
    assert kl.shape == (B,)
    close(kl, ((rmean - rref_mean) ** 2 / (2 * rstd_t**2)).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-7)
    assert torch.all(algo.kl_penalty(mean, mean, ks) == 0)
    # cps: divisor is the step's std
    _, _, cmean, cstd = algo.sde_step(v, x, s, s_next, noise_level=0.7, sde_type="cps")
    _, _, cref, _ = algo.sde_step(ref_v, x, s, s_next, noise_level=0.7, sde_type="cps")
    ck = algo.kl_std(cstd, s, s_next, "cps")
    _, _, rcm, rcs = ref_cps(v, x, s, s_next, 0.7, torch.zeros_like(x))
    _, _, rcr, _ = ref_cps(ref_v, x, s, s_next, 0.7, torch.zeros_like(x))
    close(ck, rcs)
    close(algo.kl_penalty(cmean, cref, ck), ((rcm - rcr) ** 2 / (2 * rcs**2)).mean(dim=(1, 2, 3)), rtol=1e-4)


# ---- SDE window ----


def test_window_within_range_and_never_last_step():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        start, end = algo.sde_window(10, 3, (2, 8), generator=g)
        assert end - start == 3 and 2 <= start and end <= 8
    for _ in range(200):
        start, end = algo.sde_window(10, 4, generator=g)
        assert end - start == 4 and start >= 0 and end <= 9  # step 9 (s' = 0) excluded


def test_window_special_sizes():
    assert algo.sde_window(10, 9) == (0, 9)  # all but the last: original Flow-GRPO
    assert algo.sde_window(10, 0) == (0, 0)  # pure ODE


@pytest.mark.parametrize(
    "num_steps,size,rng",
    [(10, 10, None), (10, 4, (2, 5)), (10, 2, (0, 10)), (10, -1, None), (10, 2, (5, 3))],
)
def test_window_impossible_raises(num_steps, size, rng):
    with pytest.raises(ValueError, match="window"):
        algo.sde_window(num_steps, size, rng)


def test_window_covers_all_valid_starts_uniformly():
    g = torch.Generator().manual_seed(1)
    starts = [algo.sde_window(10, 2, (1, 7), generator=g)[0] for _ in range(1000)]
    counts = torch.bincount(torch.tensor(starts), minlength=10)
    assert set(starts) == {1, 2, 3, 4, 5}
    assert counts[1:6].min() > 140  # 200 expected each


def test_window_generator_is_reproducible():
    a = [algo.sde_window(20, 3, generator=torch.Generator().manual_seed(5)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


# ---- advantages ----


REWARDS = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.5, 0.5, 3.0, -1.0, 0.0, 7.0])
GROUPS = torch.tensor([5, 5, 5, 9, 9, 9, 2, 2, 2, 11])  # arbitrary ids; group 9 all equal; 11 singleton


def ref_advantages(r, gid, global_std, mean_only, eps=1e-4):
    r = r.double().tolist()
    gid = gid.tolist()
    n = len(r)
    mu = sum(r) / n
    batch_std = math.sqrt(sum((x - mu) ** 2 for x in r) / n)
    out = []
    for i in range(n):
        grp = [r[j] for j in range(n) if gid[j] == gid[i]]
        m = sum(grp) / len(grp)
        if len(grp) == 1 or max(grp) == min(grp):
            out.append(0.0)
            continue
        gstd = math.sqrt(sum((x - m) ** 2 for x in grp) / len(grp))
        if mean_only:
            out.append(r[i] - m)
        else:
            out.append((r[i] - m) / ((batch_std if global_std else gstd) + eps))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("global_std,mean_only", [(True, False), (False, False), (True, True), (False, True)])
def test_group_advantages(global_std, mean_only):
    adv, zero = algo.group_advantages(REWARDS, GROUPS, global_std=global_std, mean_only=mean_only)
    close(adv, ref_advantages(REWARDS, GROUPS, global_std, mean_only), rtol=1e-6, atol=1e-6)
    assert zero.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True]
    assert torch.all(adv[3:6] == 0) and adv[9] == 0  # exactly zero


def test_group_vs_global_std_differ():
    a_global, _ = algo.group_advantages(REWARDS, GROUPS, global_std=True)
    a_group, _ = algo.group_advantages(REWARDS, GROUPS, global_std=False)
    assert not torch.allclose(a_global, a_group)
    # within-group standardisation: each non-degenerate group has unit population std
    for gid in (5, 2):
        m = GROUPS == gid
        assert abs(a_group[m].std(correction=0).item() - 1) < 1e-3 and abs(a_group[m].mean().item()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_group_exactly_zero_with_awkward_values(dtype):
    # in float64, (0.1 + 0.1 + 0.1) / 3 != 0.1: r - mean leaves a ~1e-17 residue unless masked
    r = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7], dtype=dtype)
    gid = torch.tensor([0, 0, 0, 1, 1])
    for gs in (True, False):
        adv, zero = algo.group_advantages(r, gid, global_std=gs)
        assert adv.dtype == dtype
        assert torch.all(adv[:3] == 0) and zero[:3].all() and not zero[3:].any()


def test_zero_std_fraction():
    assert algo.zero_std_fraction(REWARDS, GROUPS) == pytest.approx(2 / 4)
    assert algo.zero_std_fraction(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])) == 0.0


# ---- policy loss ----


def ref_policy_loss(lp, prox, behav, adv, clip_range, adv_clip, is_cap):
    lp, prox, behav = lp.double(), prox.double(), behav.double()
    adv = adv.double().clamp(-adv_clip, adv_clip)
    while adv.ndim < lp.ndim:
        adv = adv.unsqueeze(-1)
    u = torch.exp(lp - prox)
    w = torch.clamp(torch.exp(prox - behav), max=is_cap)
    terms = w * torch.maximum(-adv * u, -adv * torch.clamp(u, 1 - clip_range, 1 + clip_range))
    return terms.mean(), u, w


def test_policy_loss_matches_reference():
    lp = rand(6, 3, seed=40).float() * 0.01
    prox = lp + rand(6, 3, seed=41).float() * 0.01
    behav = prox + rand(6, 3, seed=42).float() * 0.5
    adv = rand(6, seed=43).float() * 4  # some beyond adv_clip
    loss, m = flow_grpo.policy_loss(lp, prox, behav, adv, clip_range=0.005, adv_clip=5.0, is_cap=1.5)
    rloss, u, w = ref_policy_loss(lp, prox, behav, adv, 0.005, 5.0, 1.5)
    close(loss, rloss, rtol=1e-5, atol=1e-7)
    close(m["policy/clip_frac"], ((u - 1).abs() > 0.005).double().mean())
    close(m["policy/ratio_mean"], u.mean())
    close(m["is/weight_mean"], w.mean())
    close(m["is/weight_max"], w.max())
    assert m["is/weight_max"] <= 1.5
    close(m["is/ess"], w.sum() ** 2 / (w.numel() * (w**2).sum()))
    assert all(not t.requires_grad and t.ndim == 0 for t in m.values())


def test_policy_loss_gradient_sign():
    prox = torch.zeros(4)
    lp = torch.zeros(4, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.0])
    loss, _ = flow_grpo.policy_loss(lp, prox, prox, adv, clip_range=0.2, adv_clip=5.0, is_cap=2.0)
    loss.backward()
    # minimising the loss moves logp along -grad: up for positive advantage, down for negative
    assert lp.grad[0] < 0 and lp.grad[2] < lp.grad[0] and lp.grad[1] > 0 and lp.grad[3] == 0


def test_policy_loss_clipping_zeroes_gradient_outside_trust_region():
    prox = torch.zeros(4)
    # ratios 1.5 (A>0, beyond 1+eps: clipped), 0.5 (A<0, below 1-eps: clipped),
    # 0.5 (A>0: not clipped, pessimistic branch keeps the gradient), 1.05 (inside)
    lp = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.05])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, m = flow_grpo.policy_loss(lp, prox, prox, adv, clip_range=0.2, adv_clip=5.0, is_cap=2.0)
    loss.backward()
    assert lp.grad[0] == 0 and lp.grad[1] == 0
    assert lp.grad[2] != 0 and lp.grad[3] != 0
    assert m["policy/clip_frac"].item() == pytest.approx(3 / 4)


def test_bypass_mode_weights_are_one_and_is_cap_truncates():
    lp = rand(8, seed=50).float()
    behav = lp + 0.3 * rand(8, seed=51).float()
    _, m = flow_grpo.policy_loss(lp, behav, behav, torch.ones(8), clip_range=0.2, adv_clip=5.0, is_cap=2.0)
    assert m["is/weight_mean"] == 1 and m["is/weight_max"] == 1 and m["is/ess"] == pytest.approx(1.0)
    w = flow_grpo.importance_weights(torch.tensor([0.0, 2.0, -1.0]), torch.zeros(3), is_cap=3.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 3.0, math.exp(-1.0)]))
    assert torch.equal(flow_grpo.importance_weights(torch.tensor([2.0]), torch.zeros(1), None), torch.tensor([math.exp(2.0)]))


def test_step_correction_is_the_summed_log_ratio_capped_or_masked():
    """is_correction=step: log w = D (prox - behav), the density ratio of the step's whole latent
    when the log-probs are per-element means; above is_cap truncate clamps it, mask zeroes it."""
    d = 256
    prox = torch.tensor([0.0, 0.5, -1.0, 2.0]) / d
    behav = torch.zeros(4)
    log_w = flow_grpo.log_importance_weights(prox, behav, correction="step", elements=d)
    torch.testing.assert_close(log_w, torch.tensor([0.0, 0.5, -1.0, 2.0]))
    raw = torch.exp(log_w)
    trunc = flow_grpo.importance_weights(prox, behav, 1.5, correction="step", elements=d, mode="truncate")
    mask = flow_grpo.importance_weights(prox, behav, 1.5, correction="step", elements=d, mode="mask")
    torch.testing.assert_close(trunc, torch.tensor([1.0, 1.5, raw[2].item(), 1.5]))
    torch.testing.assert_close(mask, torch.tensor([1.0, 0.0, raw[2].item(), 0.0]))
    # element_mean (the default) is the D-th root: the same log-probs give weights within 1%
    assert (flow_grpo.importance_weights(prox, behav, 1.5) - 1).abs().max() < 0.01
    # a ratio far beyond float range is capped, not inf (the cap is applied in log space)
    huge = flow_grpo.importance_weights(torch.tensor([1.0]), torch.zeros(1), 2.0, correction="step", elements=10**4)
    assert huge.item() == 2.0
    assert flow_grpo.capped_fraction(log_w, 1.5).item() == 0.5 and flow_grpo.capped_fraction(log_w, None).item() == 0.0
    with pytest.raises(ValueError, match="is_correction"):
        flow_grpo.log_importance_weights(prox, behav, correction="sum")
    with pytest.raises(ValueError, match="is_mode"):
        flow_grpo.importance_weights(prox, behav, 2.0, mode="clip")


def test_policy_loss_correction_none_and_mask():
    """none: w = 1 exactly, so a stale batch's loss is the fresh batch's (same clipped objective
    against prox); mask: pairs above the cap leave the loss but still count in its mean."""
    lp = (rand(6, 3, seed=60) * 0.01).float().requires_grad_()
    prox = lp.detach() + (rand(6, 3, seed=61) * 0.01).float()
    behav = prox + (rand(6, 3, seed=62) * 0.01).float()  # stale: behav != prox
    adv = rand(6, seed=63).float()
    kw = dict(clip_range=0.005, adv_clip=5.0, is_cap=2.0, elements=100)
    off, m = flow_grpo.policy_loss(lp, prox, behav, adv, is_correction="none", **kw)
    fresh, _ = flow_grpo.policy_loss(lp, prox, prox, adv, **kw)
    assert torch.equal(off, fresh)
    assert m["is/weight_mean"] == 1 and m["is/weight_max"] == 1 and m["is/capped_frac"] == 0
    masked, m = flow_grpo.policy_loss(lp, prox, behav, adv, is_correction="step", is_mode="mask", **kw)
    log_w = 100 * (prox.double() - behav.double())
    keep = log_w <= math.log(2.0)
    assert 0 < keep.sum() < keep.numel()
    a = adv.double().clamp(-5, 5).unsqueeze(-1)
    u = torch.exp(lp.detach().double() - prox.double())
    terms = torch.maximum(-a * u, -a * u.clamp(1 - 0.005, 1 + 0.005))
    close(masked, (torch.where(keep, log_w.exp(), 0.0) * terms).mean(), rtol=1e-5, atol=1e-7)
    close(m["is/capped_frac"], (~keep).double().mean())
    masked.backward()
    grad = lp.grad.clone()
    assert (grad[~keep] == 0).all() and (grad[keep] != 0).any()


def test_effective_sample_size():
    assert flow_grpo.effective_sample_size(torch.full((10,), 0.3)).item() == pytest.approx(1.0)
    w = torch.tensor([1.0, 0.1, 0.1, 0.1])
    ess = flow_grpo.effective_sample_size(w).item()
    assert 0 < ess < 1 and ess == pytest.approx(1.3**2 / (4 * 1.03))


def test_policy_loss_detaches_prox_and_behav():
    lp = torch.zeros(3, requires_grad=True)
    prox = torch.zeros(3, requires_grad=True)
    behav = torch.zeros(3, requires_grad=True)
    loss, _ = flow_grpo.policy_loss(lp, prox, behav, torch.ones(3), clip_range=0.2, adv_clip=5.0, is_cap=2.0)
    loss.backward()
    assert lp.grad is not None and prox.grad is None and behav.grad is None


# ---- DiffusionNFT (arXiv 2509.16117; NVlabs/DiffusionNFT scripts/train_nft_sd3.py) ----


def ref_nft(v_theta, v_old, x0, eps, s, r, beta):
    """The paper's loss written in velocity space, float64: with the flow-matching target
    v* = eps - x0, x0^ - x0 = s (v* - v), so the adaptive-weighted x0 error of a velocity v is
    s * mean((v* - v)^2) / mean|v* - v|, for v+ = (1 - beta) v_old + beta v_theta and
    v- = (1 + beta) v_old - beta v_theta; loss = (r L+ + (1 - r) L-) / beta per sample."""
    target = eps - x0
    s = torch.as_tensor(s, dtype=torch.float64)

    def weighted(v):
        d = (target - v).flatten(1)
        return s * (d**2).mean(1) / d.abs().mean(1)

    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    return (r * weighted(v_pos) + (1 - r) * weighted(v_neg)) / beta


def nft_inputs(seed=0):
    x0, eps, v_old = rand(*SHAPE, seed=seed), rand(*SHAPE, seed=seed + 1), rand(*SHAPE, seed=seed + 2)
    v_theta = v_old + 0.3 * rand(*SHAPE, seed=seed + 3)
    s = torch.tensor([1.0, 0.8, 0.45, 0.1], dtype=torch.float64)
    x_t = (1 - col64(s)) * x0 + col64(s) * eps
    return v_theta, v_old, x_t, x0, eps, s


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_matches_float64_formula(beta):
    v_theta, v_old, x_t, x0, eps, s = nft_inputs()
    r = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    got = diffusion_nft.nft_loss(v_theta.float(), v_old.float(), x_t.float(), x0.float(), s.float(), r.float(), beta=beta)
    assert got.dtype == torch.float32 and got.shape == (B,)
    torch.testing.assert_close(got.double(), ref_nft(v_theta, v_old, x0, eps, s, r, beta), rtol=1e-5, atol=1e-5)
    # float64 in, float64 out (and exact)
    exact = diffusion_nft.nft_loss(v_theta, v_old, x_t, x0, s, r, beta=beta)
    torch.testing.assert_close(exact, ref_nft(v_theta, v_old, x0, eps, s, r, beta), rtol=1e-12, atol=1e-12)


def _nft_grad(v_theta, v_old, x_t, x0, s, r, beta):
    v = v_theta.clone().requires_grad_(True)
    diffusion_nft.nft_loss(v, v_old, x_t, x0, s, r, beta=beta).sum().backward()
    return v.grad


def test_nft_reward_all_one_is_flow_matching_toward_the_sample_all_zero_away():
    v_theta, v_old, x_t, x0, eps, s = nft_inputs(seed=5)
    ones, zeros = torch.ones(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    # r = 1, beta = 1: v+ = v_theta, the loss is the (adaptive-weighted) flow-matching loss of v_theta alone
    fm = ref_nft(v_theta, v_theta, x0, eps, s, ones, 1.0)
    torch.testing.assert_close(diffusion_nft.nft_loss(v_theta, v_old, x_t, x0, s, ones, beta=1.0), fm, rtol=1e-12, atol=0)
    # r = 0, beta = 1: only the negative policy 2 v_old - v_theta is fitted
    neg = ref_nft(2 * v_old - v_theta, 2 * v_old - v_theta, x0, eps, s, ones, 1.0)
    torch.testing.assert_close(diffusion_nft.nft_loss(v_theta, v_old, x_t, x0, s, zeros, beta=1.0), neg, rtol=1e-12, atol=0)
    # from v_theta = v_old, a small gradient step moves v_theta toward the target for r = 1, away for r = 0
    target = eps - x0
    for r, closer in ((ones, True), (zeros, False)):
        for beta in (1.0, 0.1):
            step = v_old - 1e-3 * _nft_grad(v_old, v_old, x_t, x0, s, r, beta)
            before = ((v_old - target) ** 2).flatten(1).sum(1)
            after = ((step - target) ** 2).flatten(1).sum(1)
            assert bool(((after < before) if closer else (after > before)).all()), (r[0], beta)


def test_nft_neutral_reward_gives_no_gradient_at_the_old_policy():
    v_theta, v_old, x_t, x0, eps, s = nft_inputs(seed=7)
    half = torch.full((B,), 0.5, dtype=torch.float64)
    for beta in (1.0, 0.1, 1e-3):
        assert _nft_grad(v_old, v_old, x_t, x0, s, half, beta).abs().max() < 1e-12


def test_nft_beta_to_zero_gradient_has_the_derived_limit():
    """d loss / d v_theta -> -2 s (2r - 1) (x0^_old - x0) / (w_old * numel) as beta -> 0 (per sample)."""
    v_theta, v_old, x_t, x0, eps, s = nft_inputs(seed=11)
    r = torch.tensor([0.0, 0.2, 0.7, 1.0], dtype=torch.float64)
    err_old = x_t - col64(s) * v_old - x0
    w_old = err_old.abs().flatten(1).mean(1)
    numel = err_old[0].numel()
    limit = -2 * col64(s) * col64(2 * r - 1) * err_old / (col64(w_old) * numel)
    gaps = [float((_nft_grad(v_theta, v_old, x_t, x0, s, r, beta) - limit).abs().max()) for beta in (1e-2, 1e-4, 1e-6)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-6 * float(limit.abs().max())
    # the loss value itself stays finite for small beta (it grows like 1/beta)
    assert torch.isfinite(diffusion_nft.nft_loss(v_theta, v_old, x_t, x0, s, r, beta=1e-6)).all()


def test_nft_optimality_and_old_decay():
    adv = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])
    torch.testing.assert_close(diffusion_nft.nft_optimality(adv, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    decay = dict(start=75, rate=0.0075, max_decay=0.999)  # the public code's decay_type 2
    assert diffusion_nft.nft_old_decay(0, **decay) == 0.0 and diffusion_nft.nft_old_decay(74, **decay) == 0.0
    assert diffusion_nft.nft_old_decay(175, **decay) == pytest.approx(0.75) and diffusion_nft.nft_old_decay(10_000, **decay) == 0.999


def test_lr_factor_warmup_then_decay():
    cos = dict(schedule="cosine", total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert [algo.lr_factor(s, **cos) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # linear warm-up, full at its end
    assert algo.lr_factor(10, **cos) == 1.0  # the decay starts from the peak
    assert algo.lr_factor(60, **cos) == pytest.approx(0.55)  # half-way: (1 + 0.1) / 2
    assert algo.lr_factor(110, **cos) == pytest.approx(0.1) and algo.lr_factor(500, **cos) == pytest.approx(0.1)
    values = [algo.lr_factor(s, **cos) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone after the warm-up
    assert algo.lr_factor(55, schedule="linear", total_steps=100) == pytest.approx(0.45)
    assert {algo.lr_factor(s, schedule="constant", total_steps=100) for s in range(100)} == {1.0}
    # a fixed decay horizon: the 110-step cosine's pace in a 600-step run, then held at its floor
    fixed = dict(cos, total_steps=600, decay_steps=110)
    assert [algo.lr_factor(s, **fixed) for s in range(0, 111)] == [algo.lr_factor(s, **cos) for s in range(0, 111)]
    assert all(algo.lr_factor(s, **fixed) == pytest.approx(0.1) for s in range(110, 600))
    # a run shorter than the horizon decays over its own length, as without one
    assert [algo.lr_factor(s, **dict(cos, decay_steps=300)) for s in range(111)] == [algo.lr_factor(s, **cos) for s in range(111)]
    with pytest.raises(ValueError, match="lr schedule"):
        algo.lr_factor(0, schedule="step")
