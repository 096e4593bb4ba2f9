"""NFTLearner (DiffusionNFT), single process on the tiny SD3: ODE rollout -> reward -> advantages ->
train_step; the update lowers the batch's loss, v_old comes from the generating version's weights."""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.algorithms import diffusion_nft
from async_flowgrpo.config import load_config
from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.algorithms.diffusion_nft import NFTLearner
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
    points = learner._points(groups)
    v_old, _ = learner._old_velocities(points, 1.0)
    with torch.no_grad():
        v = points.velocity(learner.policy, slice(None), 1.0)
        return float(diffusion_nft.nft_loss(v, v_old, points.x_t, points.x0, points.sigma, points.r, beta=learner.nft_beta).mean())


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
    assert learner.copies_by_version.copies.keys() == {0, 1}


def test_v_old_comes_from_the_version_that_generated_the_sample(model_dir):
    learner = make_learner(model_dir, decay_rate=0.0, keep_versions=2)  # decay 0: old = theta after each update
    rollout_policy = DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)
    initial = clone(learner.sampling_state())
    rollout_policy.load_trainable_state(learner.sampling_state())
    stale = rollout(rollout_policy, seed=1, version=0)
    learner.train_step(rollout(rollout_policy, seed=2, version=0), version=0)
    learner.train_step(rollout(rollout_policy, seed=3, version=0), version=1)  # stale by one: still snapshotted
    assert learner.copies_by_version.copies.keys() == {1, 2}  # version 0 is beyond keep_versions now

    # a group of version 1 is scored with the weights published at version 1, not today's
    theta = clone(learner.policy.trainable_state())
    torch.manual_seed(0)
    for g in stale:
        g.versions = torch.full_like(g.versions, 1)
    points = learner._points(stale)
    v_old, missing = learner._old_velocities(points, 1.0)
    assert missing == 0
    rollout_policy.load_trainable_state(learner.copies_by_version.copies[1])
    expected = rollout_policy.velocity(points.x_t, points.sigma, points.embeds[points.group], points.pooled[points.group])
    torch.testing.assert_close(v_old, expected.detach())
    assert all(torch.equal(v, theta[k]) for k, v in learner.policy.trainable_state().items())  # theta restored
    assert not torch.allclose(v_old, points.velocity(learner.policy, slice(None), 1.0).detach())

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
    assert isinstance(learner, NFTLearner) and learner.copies_by_version.keep == 3
    assert learner.nft_beta == cfg.algorithm.diffusion_nft.beta


@pytest.mark.parametrize("args, key", [
    (["algorithm.name=ppo"], "algorithm.name"),
    (["algorithm.name=diffusion_nft", "rollout.sampler=sde"], "rollout.sampler"),
    (["rollout.sampler=ode"], "rollout.sampler"),  # flow_grpo needs the SDE window's log-probs
    (["algorithm.name=diffusion_nft", "algorithm.nft_beta=0"], "algorithm.diffusion_nft.beta"),
    (["algorithm.name=diffusion_nft", "algorithm.nft_decay_max=1"], "algorithm.diffusion_nft.decay_max"),
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


@pytest.mark.parametrize("family", ["embedded", "qwen_image"])
def test_points_in_one_call_equal_one_point_at_a_time(family, tmp_path):
    """Every (sample, noise level) point of a micro-batch in one transformer call: the gradient
    and loss of a point-at-a-time loop, with the KL to the reference, on the embedded SD3 model
    and the tiny Qwen-Image twin (prompts of different lengths)."""
    from async_flowgrpo.config import EMBEDDED_MODEL
    from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir

    path = EMBEDDED_MODEL if family == "embedded" else make_tiny_qwen_image_dir(str(tmp_path / "qwen"))
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # B = 0 at init would make the KL's gradient trivial
        for n, p in policy.adapter.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    got = []
    learner = NFTLearner(policy, beta=0.1, timestep_fraction=0.75, micro_batch_size=64, keep_versions=2,
                         grad_all_reduce=lambda params: got.extend(  # a parameter no backward reached: None
                          torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params))
    groups = policy.generate(["a red circle", "two blue squares below a red circle"], 2, num_steps=STEPS, guidance_scale=1.0,
                             noise_level=0.7, sde_type="sde", window_size=0, seed=1)
    for k, g in enumerate(groups):
        g.advantages = torch.tensor([1.0, -0.5]) * (1 - 2 * k)

    torch.manual_seed(5)
    points = learner._points(groups)
    assert len(points) == 4 * 3 and points.starts == [0, 3, 6, 9, 12]
    sigmas = policy.sigmas(STEPS)[:STEPS]
    for k, g in enumerate(groups):
        for i in range(2):
            rows = slice(points.starts[2 * k + i], points.starts[2 * k + i + 1])
            assert torch.equal(points.x0[rows], g.latents[i, -1].expand(3, *g.latents.shape[2:]))
            assert len(set(points.sigma[rows].tolist())) == 3 and set(points.sigma[rows].tolist()) <= set(sigmas.tolist())
    v_old, _ = learner._old_velocities(points, 1.0)
    params = policy.trainable_parameters()
    total = 0.0
    for i in range(len(points)):  # one point per call
        v = points.velocity(learner.policy, slice(i, i + 1), 1.0)
        loss = diffusion_nft.nft_loss(v, v_old[i : i + 1], points.x_t[i : i + 1], points.x0[i : i + 1], points.sigma[i : i + 1],
                             points.r[i : i + 1], beta=learner.nft_beta).sum()
        loss = loss + 0.1 * ((v - points.velocity(learner.policy, slice(i, i + 1), 1.0, reference=True)) ** 2).mean()
        (loss / len(points)).backward()
        total += float(loss.detach())
    expected = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    torch.manual_seed(5)
    m = learner.train_step(groups, version=0)
    assert m["loss/policy"] + m["loss/kl"] == pytest.approx(total / len(points), rel=1e-5)
    assert sum(float(g.abs().sum()) for g in expected) > 0
    for a, b in zip(got, expected, strict=True):  # fp32 sums in another order: 1e-4 of the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
