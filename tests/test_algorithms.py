"""async_flowgrpo/algorithms/: the registry and config sections, the old flat keys, and the three
added algorithms' math and learners on the tiny SD3: AWM (loss, noise levels, staleness), MixGRPO's
moving window, GRPO-Guard's RatioNorm and 1/dt weights."""

import dataclasses
import math
import os

import pytest
import torch

from async_flowgrpo import algo, algorithms
from async_flowgrpo.algorithms import awm, flow_grpo
from async_flowgrpo.builders import build_learner
from async_flowgrpo.config import CONFIG_DIR, LEGACY_KEYS, AlgorithmConfig, config_or_exit, load_config
from async_flowgrpo.policy import DiffusionPolicy

PROMPTS = ["a red circle", "a blue square"]


# ---------------------------------------------------------------- registry and config


def test_every_registered_algorithm_has_its_module_interface_section_and_file():
    sections = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    for name, module in algorithms.ALGORITHMS.items():
        assert module.NAME == name and module.SAMPLER in ("sde", "ode")
        assert all(callable(getattr(module, f)) for f in ("validate", "sampling", "build"))
        assert name in sections and dataclasses.is_dataclass(getattr(AlgorithmConfig(), name))
        if name != "flow_grpo":  # algorithm.name=<name> merges it
            assert os.path.exists(os.path.join(CONFIG_DIR, f"{name}.yaml"))
    for file in ("awm", "mixgrpo", "grpo_guard", "diffusion_nft"):  # one per algorithm, as in the README
        cfg = load_config("fully_async", [os.path.join(CONFIG_DIR, f"{file}.yaml")])
        assert cfg.algorithm.name in algorithms.ALGORITHMS


def _non_default(new_key):
    """A valid value for `new_key` other than its default, as a string for the dot-list."""
    section, field = new_key.split(".")[1:]
    default = getattr(getattr(AlgorithmConfig(), section), field)
    choices = {"is_correction": "step", "is_mode": "mask", "prox_mode": "bypass"}
    if field in choices:
        return choices[field], choices[field]
    if isinstance(default, bool):
        return "true", True
    if isinstance(default, int):
        return str(default + 3), default + 3
    value = {"decay_max": 0.7, "timestep_fraction": 0.5}.get(field, default * 1.5)
    return repr(value), value


@pytest.mark.parametrize("old, new", sorted(LEGACY_KEYS.items()))
def test_an_old_flat_key_sets_its_new_key_on_the_command_line_and_in_a_file(old, new, tmp_path):
    text, value = _non_default(new)
    name = new.split(".")[1]
    base = [f"algorithm.name={name}"] if name != "flow_grpo" else []
    section, field = new.split(".")[1:]
    by_override = load_config("sync", [*base, f"{old}={text}"])
    assert getattr(getattr(by_override.algorithm, section), field) == value
    yaml = tmp_path / "old.yaml"
    yaml.write_text(f"algorithm:\n  {old.split('.', 1)[1]}: {text}\n")
    by_file = load_config("sync", [*base, str(yaml)])
    assert getattr(getattr(by_file.algorithm, section), field) == value


def test_a_bad_value_under_an_old_key_exits_2_naming_the_new_key(capsys):
    with pytest.raises(SystemExit) as stop:
        config_or_exit("sync", ["algorithm.clip_range=0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "config error: algorithm.flow_grpo.clip_range: must be > 0"


@pytest.mark.parametrize("args, key", [
    (["algorithm.name=awm", "algorithm.awm.weighting=l1"], "algorithm.awm.weighting"),
    (["algorithm.name=awm", "algorithm.awm.old_decay_max=1"], "algorithm.awm.old_decay_max"),
    (["algorithm.name=awm", "rollout.sampler=sde"], "rollout.sampler"),
    (["algorithm.name=awm", "sync.update_point=between_steps"], "sync.update_point"),
    (["algorithm.flow_grpo.ratio_norm=true", "rollout.sde_type=cps"], "algorithm.flow_grpo.ratio_norm"),
    (["algorithm.flow_grpo.ratio_norm=true", "algorithm.flow_grpo.prox_mode=bypass"], "algorithm.flow_grpo.ratio_norm"),
    (["algorithm.flow_grpo.window_shift_every=10", "rollout.sde_window_size=0", "rollout.sde_window_range=null"],
     "rollout.sde_window_size"),
    (["algorithm.flow_grpo.window_shift_every=10", "rollout.sde_window_size=2"], "rollout.sde_window_range"),
])
def test_bad_algorithm_settings_are_one_line_naming_the_key(args, key):
    from async_flowgrpo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("fully_async", args)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


# ---------------------------------------------------------------- MixGRPO


def test_the_moving_window_walks_down_the_schedule_and_rolls_back():
    kw = dict(num_steps=10, window_size=2, every=60)
    starts = [flow_grpo.moving_window(v, stride=1, **kw) for v in (0, 59, 60, 120, 479, 480, 539, 540)]
    # 9 trainable steps (0..8): starts 0..8, the last window cut at step 8, then back to 0
    assert starts == [(0, 2), (0, 2), (1, 3), (2, 4), (7, 9), (8, 9), (8, 9), (0, 2)]
    assert [flow_grpo.moving_window(v * 60, stride=3, **kw)[0] for v in range(4)] == [0, 3, 6, 0]


def test_rollout_sampling_places_the_window_by_the_version_held(tiny_model_dir):
    from async_flowgrpo.sampling import rollout_sampling

    cfg = load_config("sync", [f"model.path={tiny_model_dir}", os.path.join(CONFIG_DIR, "mixgrpo.yaml")])
    base = rollout_sampling(cfg.rollout)
    assert algorithms.rollout_sampling(cfg.algorithm, base, 0)["window_range"] == (0, 2)
    at = algorithms.rollout_sampling(cfg.algorithm, base, 125)
    assert at["window_range"] == (2, 4) and at["window_size"] == 2
    policy = DiffusionPolicy(tiny_model_dir, lora_rank=4, lora_alpha=8)
    group = policy.generate(PROMPTS[:1], 2, seed=0, **at)[0]
    assert (group.params.window_start, group.params.window_size) == (2, 2)  # the SDE steps are 2 and 3
    plain = load_config("sync", [f"model.path={tiny_model_dir}"])
    assert algorithms.rollout_sampling(plain.algorithm, base, 125) is base  # flow_grpo without it: unchanged


def test_flash_samples_the_same_window_with_fewer_transformer_calls(tiny_model_dir):
    """config/mixgrpo_flash.yaml: the window (its latents, log-probs, sigmas) is what MixGRPO samples
    from the same seed, so the trainer replays it as before; the 6 Euler steps after a window ending at
    step 4 become 2 DPM-Solver++(2M) steps (0.4 of them): 6 transformer calls of 10 instead of 10."""
    from async_flowgrpo.sampling import rollout_sampling

    flash_cfg = load_config("sync", [f"model.path={tiny_model_dir}", os.path.join(CONFIG_DIR, "mixgrpo_flash.yaml")])
    flash = {**rollout_sampling(flash_cfg.rollout), "window_range": (2, 4), "window_size": 2}
    plain = {**flash, "after_window_solver": "euler", "after_window_steps": 1.0}
    policy = DiffusionPolicy(tiny_model_dir, lora_rank=4, lora_alpha=8)
    calls = []
    velocity = policy.adapter.velocity
    policy.adapter.velocity = lambda *a, **k: calls.append(a[1]) or velocity(*a, **k)
    a = policy.generate(PROMPTS, 2, seed=3, **plain)
    assert len(calls) == 10
    calls.clear()
    b = policy.generate(PROMPTS, 2, seed=3, **flash)
    assert len(calls) == 4 + 2 and float(calls[-1]) > 0  # steps 0-3, then 2 to sigma 0
    for ga, gb in zip(a, b):
        for field in ("latents", "log_probs", "sigmas", "versions"):
            assert torch.equal(getattr(ga, field), getattr(gb, field)), field
        assert gb.params == ga.params and gb.images.shape == ga.images.shape
        assert not torch.equal(ga.images, gb.images)  # a different ODE made the final image


# ---------------------------------------------------------------- GRPO-Guard


def test_ratio_norm_matches_the_public_form_and_centres_the_ratio_on_one():
    torch.manual_seed(0)
    n, d = 20000, 16
    s = torch.full((n, 1), 0.05)  # a step's std
    prox_mean = torch.randn(n, d)
    mean = prox_mean + 0.02 * torch.randn(n, d)  # the trained policy's mean, moved a little
    x_next = prox_mean + s * torch.randn(n, d)  # sampled by the proximal policy

    def logp(m):
        return (-(x_next - m) ** 2 / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(1)

    guard = flow_grpo.guard_log_ratio(logp(mean), logp(prox_mean), mean, prox_mean, s)
    # Flow-Factory's GRPOGuardTrainer: (log_prob - old) * scale + mse / (2 * scale)
    mse = (mean - prox_mean).pow(2).mean(1)
    torch.testing.assert_close(guard, (logp(mean) - logp(prox_mean)) * s[:, 0] + mse / (2 * s[:, 0]))
    raw = logp(mean) - logp(prox_mean)
    # the plain log-ratio's mean is -KL (the ratio left of 1); RatioNorm's is 0 within its SE
    assert raw.mean() < -5 * raw.std() / math.sqrt(n)
    assert abs(guard.mean()) < 3 * guard.std() / math.sqrt(n)


def test_dt_weight_scales_each_rows_term():
    lp = torch.randn(4, requires_grad=True)
    prox = lp.detach() + 0.01
    adv, weight = torch.tensor([1.0, -1.0, 2.0, 0.5]), torch.tensor([10.0, 5.0, 2.0, 1.0])
    kw = dict(clip_range=0.2, adv_clip=5.0, is_cap=2.0)
    weighted, _ = flow_grpo.policy_loss(lp, prox, prox, adv, row_weight=weight, **kw)
    terms = [flow_grpo.policy_loss(lp[i : i + 1], prox[i : i + 1], prox[i : i + 1], adv[i : i + 1], **kw)[0]
             for i in range(4)]
    torch.testing.assert_close(weighted, sum(w * t for w, t in zip(weight, terms)) / 4)


def _flow_groups(policy, version=0, seed=0):
    groups = policy.generate(PROMPTS, 4, num_steps=5, guidance_scale=4.5, noise_level=0.7, sde_type="sde",
                             window_size=3, window_range=(0, 4), seed=seed, version_fn=lambda: version)
    rewards = torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])
    adv, _ = algo.group_advantages(rewards, torch.arange(2).repeat_interleave(4))
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[4 * k : 4 * k + 4], adv[4 * k : 4 * k + 4]
    return groups


def test_grpo_guard_logs_each_steps_ratio_before_and_after_and_trains(tiny_model_dir):
    policy = DiffusionPolicy(tiny_model_dir, lora_rank=4, lora_alpha=8)
    learner = flow_grpo.FlowGRPOLearner(policy, lr=1e-2, clip_range=1e-3, ratio_norm=True, dt_weight=True,
                                        mini_batches=2, micro_batch_size=6)
    groups = _flow_groups(policy)
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    m = learner.train_step(groups, version=0)
    assert any(not torch.equal(before[k], v) for k, v in policy.trainable_state().items())
    for j in range(3):  # the window's steps 0, 1, 2
        for name in ("ratio", "ratio_norm"):
            assert math.isfinite(m[f"policy/{name}_step{j}_mean"]) and m[f"policy/{name}_step{j}_std"] >= 0
    # the second mini-batch is scored after the first's update: the ratios spread, and RatioNorm
    # multiplies each step's log-ratio by its std (< 1), so its spread is the smaller
    assert any(m[f"policy/ratio_step{j}_std"] > 0 for j in range(3))
    assert all(m[f"policy/ratio_norm_step{j}_std"] <= m[f"policy/ratio_step{j}_std"] for j in range(3))
    assert math.isfinite(m["loss/policy"]) and m["train/skipped_nonfinite"] == 0


# ---------------------------------------------------------------- AWM


def test_stratified_levels_draw_one_level_per_stratum_after_the_first_step():
    torch.manual_seed(0)
    draws = torch.stack([awm.stratified_levels(10, 6, 0.9) for _ in range(500)])
    # strata of [1, 9): [1, 2), [2, 3), [3, 5), [5, 6), [6, 7), [7, 9)
    for k, (lo, hi) in enumerate([(1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]):
        assert set(draws[:, k].tolist()) == set(range(lo, hi))


def test_the_awm_likelihood_is_the_public_ghuber_weighting():
    torch.manual_seed(0)
    v, x0, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    s = torch.tensor([0.2, 0.5, 0.9])
    got = awm.awm_log_likelihood(v, x0, eps, s, weighting="ghuber", power=0.25)
    # compute_log_prob_awm: log_prob = -mean((v - (eps - x0))^2), then ghuber
    log_prob = -((v.double() - (eps.double() - x0.double())) ** 2).mean(dim=(1, 2, 3))
    p = torch.tensor(1e-10, dtype=torch.float64)
    public = -(torch.pow(-log_prob + 1e-10, 0.25) - torch.pow(p, 0.25)) * s.double() / 0.25
    torch.testing.assert_close(got, public)
    torch.testing.assert_close(awm.awm_log_likelihood(v, x0, eps, s, weighting="uniform", power=0.25), log_prob)


def test_on_policy_the_awm_gradient_is_advantage_weighted_matching():
    """u = exp(lp - sg(lp)) = 1: the PPO term's gradient is -A d lp, whatever the clip."""
    lp = torch.randn(5, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 0.0, 0.3, -1.0], dtype=torch.float64)
    terms, ratio = awm.awm_loss(lp, lp.detach(), adv, clip_range=1.0)
    terms.sum().backward()
    assert torch.equal(ratio, torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(lp.grad, -adv)


def _ode_groups(policy, version, seed):
    groups = policy.generate(PROMPTS, 4, num_steps=5, guidance_scale=1.0, noise_level=0.7, sde_type="sde",
                             window_size=0, seed=seed, version_fn=lambda: version)
    rewards = torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])
    adv, _ = algo.group_advantages(rewards, torch.arange(2).repeat_interleave(4))
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[4 * k : 4 * k + 4], adv[4 * k : 4 * k + 4]
    return groups


def _awm_learner(model_dir, *extra):
    cfg = load_config("fully_async", [f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
                                      os.path.join(CONFIG_DIR, "awm.yaml"), "rollout.num_steps=5",
                                      "trainer.lr=1e-2", "trainer.micro_batch_size=16", *extra])
    return build_learner(cfg)


def _weighted_likelihood(learner, groups, seed):
    """sum over points of A * lp under the current weights, on the points `seed` draws."""
    torch.manual_seed(seed)
    points, eps = learner._points(groups)
    with torch.no_grad():
        v = points.velocity(learner.policy, slice(None), 1.0)
        return float((points.r.double() * learner._log_lik(v, points, eps, slice(None))).sum())


def test_an_awm_update_raises_the_advantage_weighted_likelihood(tiny_model_dir):
    learner = _awm_learner(tiny_model_dir, "algorithm.beta=0", "algorithm.awm.old_kl=0")
    assert isinstance(learner, awm.AWMLearner) and learner.timesteps == 6 and learner.weighting == "ghuber"
    groups = _ode_groups(learner.policy, version=0, seed=0)
    before = _weighted_likelihood(learner, groups, seed=5)
    torch.manual_seed(5)
    m = learner.train_step(groups, version=0)
    assert m["policy/ratio_mean"] == 1.0 and m["awm/stale_frac"] == 0.0  # fresh: the public on-policy update
    assert _weighted_likelihood(learner, groups, seed=5) > before


def test_a_stale_awm_sample_is_weighted_against_the_weights_that_generated_it(tiny_model_dir):
    """fully_async: lp_old of a group comes from the copy published at its version (exact), its
    ratio u = exp(lp - lp_old) is clipped at 1 +- clip_range; past the copies kept it falls back to
    the start-of-update weights (u = 1), counted."""
    learner = _awm_learner(tiny_model_dir, "algorithm.max_staleness=1", "sync.every=1")
    assert learner.copies_by_version.keep == 3
    v0 = {k: t.clone() for k, t in learner.policy.trainable_state().items()}
    stale = _ode_groups(learner.policy, version=0, seed=1)
    learner.train_step(_ode_groups(learner.policy, version=0, seed=0), version=0)
    assert set(learner.copies_by_version.copies) == {0, 1}
    for k, t in learner.copies_by_version.copies[0].items():  # version 0's copy is the weights that generated `stale`
        assert torch.equal(t, v0[k])

    torch.manual_seed(7)
    points, eps = learner._points(stale)
    held = {k: t.clone() for k, t in learner.policy.trainable_state().items()}
    learner.policy.load_trainable_state(v0)
    with torch.no_grad():
        expected_old = learner._log_lik(points.velocity(learner.policy, slice(None), 1.0), points, eps, slice(None))
    learner.policy.load_trainable_state(held)
    with torch.no_grad():
        now = learner._log_lik(points.velocity(learner.policy, slice(None), 1.0), points, eps, slice(None))
    u = torch.exp(now - expected_old)
    torch.manual_seed(7)
    m = learner.train_step(stale, version=1)  # one version stale
    assert m["awm/stale_frac"] == 1.0 and m["awm/old_missing_frac"] == 0.0 and m["staleness/max"] == 1
    assert m["policy/ratio_mean"] == pytest.approx(float(u.mean()), rel=1e-7) and abs(m["policy/ratio_mean"] - 1) > 1e-6

    for _ in range(3):  # three more versions: version 0 is no longer kept
        learner.train_step(_ode_groups(learner.policy, version=learner.steps, seed=learner.steps), version=learner.steps)
    assert 0 not in learner.copies_by_version.copies
    m = learner.train_step(stale, version=learner.steps)
    assert m["awm/old_missing_frac"] == 1.0 and m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_awm_checkpoint_round_trip_keeps_the_kl_copy_and_its_clock(tiny_model_dir):
    learner = _awm_learner(tiny_model_dir)
    learner.train_step(_ode_groups(learner.policy, version=0, seed=0), version=0)
    state = learner.state_dict()
    other = _awm_learner(tiny_model_dir)
    other.load_state_dict(state)
    assert other.updates == learner.updates == 1 and other.steps == 1
    for k in learner.old:
        assert torch.equal(other.old[k].cpu(), learner.old[k].cpu())
