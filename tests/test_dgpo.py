"""async_flowgrpo/algorithms/dgpo.py: the group-preference loss against hand-computed values and the
public clip, its gradient's sign on a toy velocity model, the learner on the tiny SD3 (shared levels
and noise within a group, an update that prefers the better samples, stale samples scored against
their version's old copy, the sampling switch to the old copy), and its config keys."""

import math
import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.algorithms import dgpo
from async_flowgrpo.builders import build_learner
from async_flowgrpo.config import CONFIG_DIR, ConfigError, config_or_exit, load_config

PROMPTS = ["a red circle", "a blue square"]


# ---------------------------------------------------------------- the loss


def test_group_weights_and_loss_match_a_hand_computed_example():
    err = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([1.2, 1.8, 0.5, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    comparison, size = torch.tensor([0, 0, 1, 1]), torch.full((4,), 2.0, dtype=torch.float64)
    weight = dgpo.dgpo_group_weights(err, ref, adv, comparison, size, beta_dpo=10.0)
    # S0 = 10/2 (1 (1 - 1.2) - (2 - 1.8)) = -2, S1 = 10/2 (2 (0.5 - 0.5) - 2 (1.5 - 1)) = -5
    s0, s1 = 1 / (1 + math.exp(2.0)), 1 / (1 + math.exp(5.0))
    torch.testing.assert_close(weight, torch.tensor([s0, s0, s1, s1], dtype=torch.float64))
    assert not weight.requires_grad
    terms, clipped = dgpo.dgpo_loss(err, weight, adv)
    torch.testing.assert_close(terms, torch.tensor([s0 * 1.0, -s0 * 2.0, s1 * 2 * 0.5, -s1 * 2 * 1.5],
                                                   dtype=torch.float64))
    terms.sum().backward()
    torch.testing.assert_close(err.grad, weight * adv)  # positives pushed down, negatives up
    assert not clipped.any()


def test_the_clip_cuts_a_point_only_past_the_range_on_its_advantages_side():
    """public: ratio = exp(-dsm + old_dsm); clipped where A > 0 and ratio > 1 + c, or A < 0 and
    ratio < 1 - c; a clipped point's dsm is detached."""
    err = torch.ones(5, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([1.5, 0.5, 1.0, 1.0, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    terms, clipped = dgpo.dgpo_loss(err, torch.full((5,), 0.5, dtype=torch.float64), adv, old, clip_range=0.1)
    assert clipped.tolist() == [True, True, False, False, False]  # the last: ratio 0.61 < 0.9 but A > 0
    terms.sum().backward()
    assert err.grad.tolist() == [0.0, 0.0, 0.5, -0.5, 0.5]
    _, off = dgpo.dgpo_loss(err, torch.ones(5), adv, old, clip_range=0.0)
    assert not off.any()


def test_a_step_on_the_loss_lowers_the_better_samples_error_and_raises_the_worse():
    """A toy velocity model v = W x_t at one level: starting at the reference each group weight is
    1/2, and one gradient step moves the two samples' flow-matching errors apart."""
    torch.manual_seed(0)
    dim, s = 64, 0.5
    x0 = torch.randn(2, dim)
    eps = torch.randn(1, dim).expand(2, dim)  # shared by the group
    x_t, target = (1 - s) * x0 + s * eps, eps - x0
    w = torch.nn.Parameter(0.1 * torch.randn(dim, dim))
    w_ref = w.detach().clone()
    adv = torch.tensor([1.0, -1.0])
    comparison, size = torch.zeros(2, dtype=torch.long), torch.full((2,), 2.0)

    def errors(weights):
        return dgpo.flow_matching_error(x_t @ weights.T, target)

    before = errors(w).detach()
    weight = dgpo.dgpo_group_weights(errors(w), errors(w_ref), adv, comparison, size, beta_dpo=100.0)
    assert weight.tolist() == [0.5, 0.5]
    terms, _ = dgpo.dgpo_loss(errors(w), weight, adv)
    terms.mean().backward()
    with torch.no_grad():
        w -= 0.05 * w.grad
    after = errors(w).detach()
    assert after[0] < before[0] and after[1] > before[1]
    weight = dgpo.dgpo_group_weights(after, errors(w_ref), adv, comparison, size, beta_dpo=100.0)
    assert float(weight[0]) < 0.5  # the preference is being met: the group weighs less


# ---------------------------------------------------------------- the learner


def _ode_groups(policy, version, seed):
    groups = policy.generate(PROMPTS, 4, num_steps=5, guidance_scale=4.5, noise_level=0.7, sde_type="sde",
                             window_size=0, seed=seed, version_fn=lambda: version)
    rewards = torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])
    adv, _ = algo.group_advantages(rewards, torch.arange(2).repeat_interleave(4))
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[4 * k : 4 * k + 4], adv[4 * k : 4 * k + 4]
    return groups


def _learner(model_dir, *extra):
    cfg = load_config("fully_async", [f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
                                      os.path.join(CONFIG_DIR, "dgpo.yaml"), "rollout.num_steps=5",
                                      "trainer.lr=1e-2", "trainer.micro_batch_size=16", *extra])
    return build_learner(cfg)


def _preference(learner, groups, seed):
    """sum over points of A * e under the current weights, on the points `seed` draws."""
    torch.manual_seed(seed)
    points, target, _, _ = learner._points(groups)
    return float((points.r * learner._errors(points, target, 4.5).cpu()).sum())


def test_a_group_is_compared_at_shared_levels_and_noise_and_an_update_prefers_its_better_samples(tiny_model_dir):
    learner = _learner(tiny_model_dir, "algorithm.beta=0", "algorithm.dgpo.clip_range=0")
    assert isinstance(learner, dgpo.DGPOLearner) and learner.beta_dpo == 100 and learner.timesteps == 4
    groups = _ode_groups(learner.policy, version=0, seed=0)
    torch.manual_seed(3)
    points, target, comparison, sizes = learner._points(groups)
    assert len(points) == 2 * 4 * 4 and sizes.tolist() == [4.0] * 32
    sigma, eps = points.sigma.reshape(2, 4, 4), (target + points.x0).reshape(2, 4, 4, -1)
    for g in range(2):  # every sample of a group: the same 4 distinct levels, of indices 0..3, and noise
        assert (sigma[g] == sigma[g, 0]).all() and len(set(sigma[g, 0].tolist())) == 4
        torch.testing.assert_close(eps[g], eps[g, :1].expand_as(eps[g]), atol=1e-5, rtol=1e-5)
    assert comparison.reshape(2, 4, 4)[1, 2].tolist() == [4, 5, 6, 7]
    sigmas = learner.policy.sigmas(5, height=groups[0].params.height, width=groups[0].params.width)
    assert set(points.sigma.tolist()) <= set(sigmas[:4].tolist())

    before = _preference(learner, groups, seed=5)
    torch.manual_seed(5)
    m = learner.train_step(groups, version=0)
    assert m["dgpo/weight_mean"] == 0.5  # LoRA B = 0: the policy is the reference, every S = 0
    assert m["dgpo/stale_frac"] == 0.0 and m["policy/clip_frac"] == 0.0 and math.isfinite(m["loss/policy"])
    assert _preference(learner, groups, seed=5) < before


def test_a_stale_sample_is_clipped_against_the_old_copy_of_its_version(tiny_model_dir):
    """fully_async: e_old of a group comes from the old copy published at its version (exact), the
    clip mask is computed against it; past the copies kept it falls back to the current copy, counted."""
    learner = _learner(tiny_model_dir, "algorithm.max_staleness=1", "sync.every=1", "algorithm.dgpo.clip_range=1e-4")
    assert learner.copies_by_version.keep == 3
    v0 = {k: t.clone() for k, t in learner.policy.trainable_state().items()}
    stale, fresh = _ode_groups(learner.policy, version=0, seed=1), _ode_groups(learner.policy, version=0, seed=0)
    learner.train_step(fresh, version=0)
    assert set(learner.copies_by_version.copies) == {0, 1}
    for k, t in learner.copies_by_version.copies[0].items():  # version 0's old copy: the weights before any update
        assert torch.equal(t, v0[k])

    torch.manual_seed(7)
    points, target, _, _ = learner._points(stale)
    held = {k: t.clone() for k, t in learner.policy.trainable_state().items()}
    learner.policy.load_trainable_state(v0)
    expected_old = learner._errors(points, target, 4.5)
    learner.policy.load_trainable_state(learner.old)
    current_old = learner._errors(points, target, 4.5)
    learner.policy.load_trainable_state(held)
    got, missing = learner._old_errors(points, target, 4.5)
    assert missing == 0 and torch.equal(got, expected_old) and not torch.allclose(got, current_old)
    now = learner._errors(points, target, 4.5)
    ratio, adv = torch.exp(expected_old - now), points.r
    mask = torch.where(adv > 0, ratio > 1 + 1e-4, ratio < 1 - 1e-4)
    torch.manual_seed(7)
    m = learner.train_step(stale, version=1)  # one version stale
    assert m["dgpo/stale_frac"] == 1.0 and m["dgpo/old_missing_frac"] == 0.0 and m["staleness/max"] == 1
    assert m["policy/clip_frac"] == pytest.approx(float(mask.float().mean())) and 0 < m["policy/clip_frac"] < 1

    for _ in range(3):  # three more versions: version 0 is no longer kept
        learner.train_step(fresh, version=learner.steps)
    assert 0 not in learner.copies_by_version.copies
    m = learner.train_step(stale, version=learner.steps)
    assert m["dgpo/old_missing_frac"] == 1.0


def test_rollouts_switch_to_the_old_copy_and_a_checkpoint_keeps_it(tiny_model_dir):
    learner = _learner(tiny_model_dir, "algorithm.dgpo.sample_old_after=1")
    groups = _ode_groups(learner.policy, version=0, seed=0)
    learner.train_step(groups, version=0)  # 1 update: not yet past sample_old_after
    state, theta = learner.sampling_state(), learner.policy.trainable_state()
    assert all(torch.equal(state[k], theta[k]) for k in theta) and not all(torch.equal(state[k], learner.old[k]) for k in theta)
    m = learner.train_step(groups, version=1)
    assert m["dgpo/sampling_old"] == 1.0 and learner.sampling_state() is learner.old
    other = _learner(tiny_model_dir)
    other.load_state_dict(learner.state_dict())
    assert other.updates == 2 and all(torch.equal(other.old[k], learner.old[k]) for k in learner.old)


# ---------------------------------------------------------------- config


def test_the_config_file_loads_with_the_public_values():
    cfg = load_config("fully_async", [os.path.join(CONFIG_DIR, "dgpo.yaml")])
    s = cfg.algorithm.dgpo
    assert cfg.algorithm.name == "dgpo" and cfg.rollout.sampler == "ode" and cfg.algorithm.beta == 0.02
    assert (s.beta_dpo, s.timesteps, s.timestep_fraction, s.clip_range, s.reference) == (100, 4, 0.6, 0.01, "frozen")
    assert load_config("sync", ["algorithm.name=dgpo"]).algorithm.dgpo == s  # the name alone merges the file


@pytest.mark.parametrize("args, key", [
    (["algorithm.dgpo.timesteps=8"], "algorithm.dgpo.timesteps"),  # 0.6 of 10 steps leaves 7 levels
    (["algorithm.dgpo.reference=ema"], "algorithm.dgpo.reference"),
    (["algorithm.dgpo.reference=frozen", "model.lora_rank=0", "algorithm.beta=0"], "algorithm.dgpo.reference"),
    (["algorithm.dgpo.beta_dpo=0"], "algorithm.dgpo.beta_dpo"),
    (["algorithm.dgpo.old_decay_max=1"], "algorithm.dgpo.old_decay_max"),
])
def test_bad_dgpo_settings_are_one_line_naming_the_key(args, key):
    with pytest.raises(ConfigError) as err:
        load_config("fully_async", ["algorithm.name=dgpo", *args])
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


def test_a_bad_dgpo_setting_exits_2(capsys):
    with pytest.raises(SystemExit) as stop:
        config_or_exit("sync", ["algorithm.name=dgpo", "algorithm.dgpo.clip_range=-1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "config error: algorithm.dgpo.clip_range: must be >= 0 (0 = off)"
