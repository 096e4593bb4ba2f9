"""NFTLearner (DiffusionNFT), single process on the tiny SD3: ODE rollout -> reward -> advantages ->
train_step; the update lowers the batch's loss, v_old comes from the generating version's weights."""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import load_config
from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.nft_learner import NFTLearner
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.sampling import rollout_sampling
from async_flowgrpo.builders import build_learner

# 2 shared cores: OpenMP threads spinning against other jobs make tiny matmuls ~20x slower
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red circle", "a blue square"]
STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3")))


def make_learner(model_dir, **kw):
    kw = {"lr": 1e-3, "timestep_fraction": 0.5, "micro_batch_size": 8, **kw}
    return NFTLearner(DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8), **kw)


def rollout(policy, *, seed=0, version=0):
    """2 ODE groups of 4 (DiffusionNFT's groups), rewarded by mean brightness."""
    groups = policy.generate(PROMPTS, 4, num_steps=STEPS, guidance_scale=1.0, noise_level=0.7, sde_type="sde",
                             window_size=0, seed=seed, version_fn=lambda: version)
    rewards = torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])
    adv, _ = algo.group_advantages(rewards, torch.arange(2).repeat_interleave(4))
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[4 * k : 4 * k + 4], adv[4 * k : 4 * k + 4]
    return groups


def clone(state):
    return {k: v.detach().clone() for k, v in state.items()}


def batch_loss(learner, groups, seed):
    """The NFT loss on the batch's points drawn from `seed` (train_step draws the same ones)."""
    torch.manual_seed(seed)
    points, _ = learner._points(groups)
    v_old, _ = learner._old_velocities(points, 1.0)
    with torch.no_grad():
        v = learner._velocity(points, list(range(len(points))), 1.0)
        return float(algo.nft_loss(v, torch.stack(v_old), torch.stack([p.x_t for p in points]),
                                   torch.stack([p.x0 for p in points]), torch.stack([p.sigma for p in points]),
                                   torch.stack([p.r for p in points]), beta=learner.nft_beta).mean())


def test_train_step_lowers_the_batch_loss_and_publishes_the_old_copy(model_dir):
    learner = make_learner(model_dir)
    groups = rollout(learner.policy)
    assert groups[0].latents.shape[1] == 1 and groups[0].log_probs.shape[1] == 0
    before_weights = clone(learner.policy.trainable_state())
    before = batch_loss(learner, groups, seed=3)
    torch.manual_seed(3)
    m = learner.train_step(groups, version=0)
    after = batch_loss(learner, groups, seed=3)
    assert before - after > 1e-6, (before, after)  # ~100 float32 ulps of the loss: not rounding
    assert {"loss/policy", "loss/kl", "nft/r_mean", "nft/old_deviation", "train/grad_norm", "staleness/max",
            "reward/mean", "samples/trained"} <= m.keys()
    assert m["loss/policy"] == pytest.approx(before, rel=1e-4)  # the step's loss is the loss at its start
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert m["samples/trained"] == 8 and m["nft/old_missing_frac"] == 0.0 and 0 < m["nft/r_mean"] < 1
    # Flow-GRPO's metrics mean nothing here and are left out
    assert not {"policy/clip_frac", "policy/ratio_mean", "is/weight_mean"} & m.keys()
    theta = learner.policy.trainable_state()
    assert any(not torch.equal(theta[k], before_weights[k]) for k in theta)
    # decay 0.001 after 1 update: the published old copy is 0.001 old + 0.999 theta
    for k in theta:
        torch.testing.assert_close(learner.sampling_state()[k], 0.001 * before_weights[k] + 0.999 * theta[k])
    assert learner.snapshots.keys() == {0, 1}


def test_v_old_comes_from_the_version_that_generated_the_sample(model_dir):
    learner = make_learner(model_dir, decay_rate=0.0, keep_versions=2)  # decay 0: old = theta after each update
    rollout_policy = DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)
    initial = clone(learner.sampling_state())
    rollout_policy.load_trainable_state(learner.sampling_state())
    stale = rollout(rollout_policy, seed=1, version=0)
    learner.train_step(rollout(rollout_policy, seed=2, version=0), version=0)
    learner.train_step(rollout(rollout_policy, seed=3, version=0), version=1)  # stale by one: still snapshotted
    assert learner.snapshots.keys() == {1, 2}  # version 0 is beyond keep_versions now

    # a group of version 1 is scored with the weights published at version 1, not today's
    theta = clone(learner.policy.trainable_state())
    torch.manual_seed(0)
    for g in stale:
        g.versions = torch.full_like(g.versions, 1)
    points, _ = learner._points(stale)
    v_old, missing = learner._old_velocities(points, 1.0)
    assert missing == 0
    rollout_policy.load_trainable_state(learner.snapshots[1])
    expected = rollout_policy.velocity(torch.stack([p.x_t for p in points]), torch.stack([p.sigma for p in points]),
                                       torch.stack([p.embeds for p in points]), torch.stack([p.pooled for p in points]))
    torch.testing.assert_close(torch.stack(v_old), expected.detach())
    assert all(torch.equal(v, theta[k]) for k, v in learner.policy.trainable_state().items())  # theta restored
    assert not torch.allclose(torch.stack(v_old), learner._velocity(points, list(range(len(points))), 1.0).detach())

    # a group older than the snapshots kept falls back to the current old copy, counted
    for g in stale:
        g.versions = torch.zeros_like(g.versions)
    m = learner.train_step(stale, version=2)
    assert m["nft/old_missing_frac"] == 1.0 and m["staleness/max"] == 2
    assert any(not torch.equal(learner.sampling_state()[k], initial[k]) for k in initial)


def test_state_dict_round_trip_and_flow_grpo_groups_rejected(model_dir):
    learner = make_learner(model_dir, decay_rate=0.5)
    groups = rollout(learner.policy, seed=4)
    learner.train_step(groups, version=0)
    state = learner.state_dict()
    other = make_learner(model_dir, decay_rate=0.5)
    other.load_state_dict(state)
    assert other.updates == 1
    for k, v in learner.sampling_state().items():
        assert torch.equal(other.sampling_state()[k], v)
        assert torch.equal(other.policy.trainable_state()[k], learner.policy.trainable_state()[k])
    window = learner.policy.generate(PROMPTS[:1], 2, num_steps=STEPS, guidance_scale=1.0, noise_level=0.7,
                                     sde_type="sde", window_size=2, seed=0)
    window[0].advantages = torch.zeros(2)
    with pytest.raises(ValueError, match="rollout.sampler=ode"):
        learner.train_step(window, version=1)


def test_config_selects_nft_in_every_mode(model_dir):
    for mode in ("sync", "one_step_off", "fully_async"):
        cfg = load_config(mode, [f"model.path={model_dir}", "algorithm.name=diffusion_nft", "model.lora_rank=4"])
        assert rollout_sampling(cfg.rollout)["window_size"] == 0 and cfg.rollout.guidance_scale == 1.0
    learner = build_learner(cfg)
    assert isinstance(learner, NFTLearner) and learner.keep_versions == 3
    assert learner.nft_beta == cfg.algorithm.nft_beta


@pytest.mark.parametrize("args, key", [
    (["algorithm.name=ppo"], "algorithm.name"),
    (["algorithm.name=diffusion_nft", "rollout.sampler=sde"], "rollout.sampler"),
    (["rollout.sampler=ode"], "rollout.sampler"),  # flow_grpo needs the SDE window's log-probs
    (["algorithm.name=diffusion_nft", "algorithm.nft_beta=0"], "algorithm.nft_beta"),
    (["algorithm.name=diffusion_nft", "algorithm.nft_decay_max=1"], "algorithm.nft_decay_max"),
    (["algorithm.name=diffusion_nft", "rollout.shared_initial_noise=true"], "rollout.shared_initial_noise"),
])
def test_bad_nft_config_is_one_line_naming_the_key(args, key):
    from async_flowgrpo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("fully_async", args)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


def test_the_yaml_file_and_the_name_select_the_same_config():
    from async_flowgrpo.config import CONFIG_DIR

    by_file = load_config("one_step_off", [os.path.join(CONFIG_DIR, "diffusion_nft.yaml"), "rollout.guidance_scale=2.0"])
    by_name = load_config("one_step_off", ["algorithm.name=diffusion_nft", "rollout.guidance_scale=2.0"])
    assert by_file == by_name and by_name.rollout.guidance_scale == 2.0  # explicit overrides win
