"""The Wan text-to-video family on a tiny random twin of Wan2.1, built offline (models/tiny_wan.py).

The twin's rollout has video shapes and finite per-step log-probs; the SDE step on 5-D latents is
the image step frame by frame; recompute reproduces the rollout's log-probs; the adapter's ODE
sampler reproduces WanPipeline; one Learner update moves only LoRA weights; the saved LoRA loads
with WanPipeline.load_lora_weights and changes the video. Video rewards: frames_<image reward>,
temporal_consistency, and an image reward given videos (or the reverse) refused with the fix.
"""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
from async_flowgrpo.models import load_adapter
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir
from async_flowgrpo.models.wan import WanAdapter
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4
PROMPT = "a red circle moving left"
GUIDANCE = 4.0
FRAMES, LATENT_FRAMES = 5, 3  # the twin's VAE: 2x temporal compression, causal first frame


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    path = make_tiny_wan_dir(str(tmp_path_factory.mktemp("wan")))
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    groups = policy.generate([PROMPT], 2, num_steps=STEPS, guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde",
                             window_size=STEPS - 1, seed=0)
    return dict(path=path, policy=policy, groups=groups)


def test_rollout_records_video_groups(wan):
    policy, (g,) = wan["policy"], wan["groups"]
    assert type(policy.adapter) is WanAdapter
    shape = policy.adapter.latent_shape(32, 32)
    assert shape == (16, LATENT_FRAMES, 16, 16)  # [C, F, h, w]
    assert g.latents.shape == (2, STEPS, *shape) and g.log_probs.shape == (2, STEPS - 1)
    assert torch.isfinite(g.log_probs).all()
    assert g.images.shape == (2, FRAMES, 32, 32, 3) and g.images.dtype == torch.uint8  # [n, F, H, W, 3]
    assert g.pooled_prompt_embeds.shape == (0,) and g.negative_prompt_embeds is not None
    assert g.sigmas[0] == 1.0 and len(g.sigmas) == STEPS


def test_lora_on_self_and_cross_attention(wan):
    names = [n for n, _ in wan["policy"].adapter.transformer.named_modules()]
    for attn in ("attn1", "attn2"):
        for target in WanAdapter.lora_target_modules:
            assert any(n.endswith(f"{attn}.{target}.lora_A") for n in names), f"no LoRA on {attn}.{target}"


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sde_step_on_video_latents_is_the_image_step_frame_by_frame(sde_type):
    gen = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(2, 4, 3, 6, 6, generator=gen) for _ in range(3))
    step = dict(noise_level=0.7, sde_type=sde_type)
    prev, logp, mean, std = algo.sde_step(v, x, 0.8, 0.6, noise=eps, **step)
    frame_logps = []
    for f in range(x.shape[2]):
        p_f, l_f, m_f, s_f = algo.sde_step(v[:, :, f], x[:, :, f], 0.8, 0.6, noise=eps[:, :, f], **step)
        torch.testing.assert_close(prev[:, :, f], p_f)
        torch.testing.assert_close(mean[:, :, f], m_f)
        torch.testing.assert_close(torch.as_tensor(std).flatten(), torch.as_tensor(s_f).flatten())
        frame_logps.append(l_f)
    # the log-prob is a mean over every non-batch dim: the mean of equal-sized frames' means
    torch.testing.assert_close(logp, torch.stack(frame_logps, 1).mean(1))


def test_recompute_reproduces_logprobs_on_every_step(wan):
    policy, (g,) = wan["policy"], wan["groups"]
    n = g.size
    cond = [t.unsqueeze(0).expand(n, *t.shape) for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]
    for j in range(g.log_probs.shape[1]):
        with torch.no_grad():
            log_prob, *_ = policy.recompute(g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n),
                                            g.sigmas[j + 1].expand(n), *cond, guidance_scale=GUIDANCE,
                                            noise_level=0.7, sde_type="sde")
        assert (log_prob.cpu() - g.log_probs[:, j]).abs().max() < 1e-5, f"step {j}"


def test_ode_sampler_matches_wan_pipeline(wan):
    """Timestep scale, CFG, the scheduler's shift and the VAE's latent normalisation are WanPipeline's."""
    adapter = load_adapter(wan["path"], device="cpu", dtype=torch.float32)  # without the policy's LoRA
    pipe = adapter.pipeline
    x0 = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    kwargs = dict(prompt=PROMPT, negative_prompt=adapter.negative_prompt, height=32, width=32, num_frames=FRAMES,
                  num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=adapter.max_sequence_length,
                  latents=x0)
    ref_latents = pipe(output_type="latent", **kwargs).frames
    ref_video = pipe(output_type="pt", **kwargs).frames  # [1, F, 3, H, W] in [0, 1]

    enc = adapter.encode_prompts([PROMPT], cfg=True)
    sigmas = adapter.sigmas(STEPS)
    x = x0
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=GUIDANCE)
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    torch.testing.assert_close(x, ref_latents.float(), atol=1e-4, rtol=1e-4)
    video = adapter.decode(x).float() / 255  # [1, F, H, W, 3]
    assert (video - ref_video.permute(0, 1, 3, 4, 2)).abs().max() <= 1.01 / 255


def test_update_changes_only_lora_and_the_saved_lora_loads_into_wan_pipeline(wan, tmp_path):
    from diffusers import WanPipeline

    policy, groups = wan["policy"], wan["groups"]
    for g in groups:
        g.rewards = torch.tensor([0.0, 1.0])
        g.advantages = torch.tensor([-1.0, 1.0])
    transformer = policy.adapter.transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    metrics = Learner(policy, micro_batch_size=2, clip_range=1e-2).train_step(groups, version=0)
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["samples/trained"] == 2
    assert metrics["logp/max_abs_diff"] < 1e-5  # fresh samples: the recomputed logp is the rollout's
    after = transformer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)

    policy.adapter.save_lora(str(tmp_path), policy.trainable_state())  # as the trainer saves LoRA weights
    pipe = WanPipeline.from_pretrained(wan["path"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=PROMPT, height=32, width=32, num_frames=FRAMES, num_inference_steps=2, guidance_scale=1.0,
                  max_sequence_length=8, output_type="latent")
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames
    pipe.load_lora_weights(str(tmp_path))
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames
    assert (tuned - base).abs().max() > 1e-6


def test_num_frames_must_match_the_vae_temporal_factor(tmp_path):
    path = make_tiny_wan_dir(str(tmp_path), num_frames=4)
    with pytest.raises(ValueError, match="temporal factor 2"):
        load_adapter(path, device="cpu", dtype=torch.float32)


def test_config_accepts_the_wan_family_with_video_rewards_only(wan):
    path = f"model.path={wan['path']}"
    cfg = load_config("sync", [path, "model.family=wan", "reward.weights={frames_jpeg_compressibility: 1.0}"])
    assert cfg.model.family == "wan"
    with pytest.raises(ConfigError, match="reward.weights.jpeg_compressibility: scores images .* frames_jpeg_compressibility"):
        load_config("sync", [path, "model.family=wan", "reward.weights={jpeg_compressibility: 1.0}"])
    with pytest.raises(ConfigError, match="reward.weights.temporal_consistency: scores videos"):
        load_config("sync", [path, "model.family=sd3", "reward.weights={temporal_consistency: 1.0}"])


def test_video_rewards(wan):
    (g,) = wan["groups"]
    videos, prompts, meta = g.images, [PROMPT] * g.size, [{}] * g.size
    # frames_<image reward> is the image reward's mean over each video's frames
    per_frame = get_reward("jpeg_compressibility")(videos.flatten(0, 1), [PROMPT] * g.size * FRAMES, [{}] * g.size * FRAMES)
    torch.testing.assert_close(get_reward("frames_jpeg_compressibility")(videos, prompts, meta),
                               per_frame.view(g.size, FRAMES).mean(1))
    still = videos[:, :1].expand_as(videos).clone()
    consistency = get_reward("temporal_consistency")
    assert torch.equal(consistency(still, prompts, meta), torch.ones(g.size))  # a still video is fully consistent
    assert (consistency(videos, prompts, meta) < 1).all()
    total, parts = CombinedReward({"frames_jpeg_compressibility": 1.0, "temporal_consistency": 2.0})(videos, prompts, meta)
    torch.testing.assert_close(total, parts["frames_jpeg_compressibility"] + 2 * parts["temporal_consistency"])
    with pytest.raises(RewardError, match="takes images .* use frames_jpeg_compressibility"):
        CombinedReward({"jpeg_compressibility": 1.0})(videos, prompts, meta)
    with pytest.raises(RewardError, match="takes videos"):
        CombinedReward({"temporal_consistency": 1.0})(videos[:, 0], prompts, meta)


def test_rollout_num_frames_reaches_generation_and_is_validated_at_config_time(wan, tmp_path, capsys):
    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.config import config_or_exit
    from async_flowgrpo.evaluation import evaluate_policy

    path = f"model.path={wan['path']}"
    video = [path, "model.family=wan", "reward.weights={temporal_consistency: 1.0}", "model.lora_rank=4",
             "model.lora_alpha=8"]
    cfg = load_config("sync", [*video, "rollout.num_frames=3"])  # the twin's VAE: (3 - 1) % 2 == 0
    policy = build_policy(cfg)
    assert policy.adapter.num_frames == 3 and policy.adapter.latent_shape(32, 32) == (16, 2, 16, 16)
    (g,) = policy.generate([PROMPT], 2, num_steps=2, guidance_scale=1.0, noise_level=0.7, sde_type="sde",
                           window_size=1, seed=0)
    assert g.images.shape == (2, 3, 32, 32, 3) and g.latents.shape[2:] == (16, 2, 16, 16)
    prompts = tmp_path / "eval.txt"
    prompts.write_text(f"{PROMPT}\n")
    eval_cfg = load_config("sync", [*video, "rollout.num_frames=3", f"eval.prompts={prompts}", "eval.num_steps=2",
                                    "eval.samples_per_prompt=2"])
    result = evaluate_policy(policy, eval_cfg)  # evaluation samples through the same policy: 3 frames
    assert result["images"].shape == (1, 3, 32, 32, 3) and 0 < result["metrics"]["eval/temporal_consistency"] <= 1
    assert build_policy(load_config("sync", video)).adapter.num_frames == FRAMES  # 0: the model's own

    with pytest.raises(ConfigError, match=r"^rollout.num_frames: 4 frames: .* temporal factor 2 \(e.g. 3 or 5\)$"):
        load_config("sync", [*video, "rollout.num_frames=4"])
    with pytest.raises(ConfigError, match="^rollout.num_frames: model.family sd3 makes images"):
        load_config("sync", ["rollout.num_frames=5"])
    capsys.readouterr()  # the loads' progress bars above
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("sync", [*video, "rollout.num_frames=6"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: rollout.num_frames: 6 frames")


def test_the_wan_preset_loads_with_its_video_reward_only(wan):
    """A model file's reward.weights replaces base.yaml's (a merge would keep the image-only shapes
    checker beside the preset's video reward, and validation would refuse the preset)."""
    from async_flowgrpo.config import CONFIG_DIR

    preset = os.path.join(CONFIG_DIR, "model", "wan21_t2v_1_3b.yaml")
    cfg = load_config("fully_async", [preset, f"model.path={wan['path']}",
                                      "rollout.num_frames=33"])
    assert cfg.model.family == "wan" and cfg.reward.weights == {"frames_jpeg_incompressibility": 1.0}
    assert cfg.rollout.num_frames == 33


def test_on_a_cpu_the_vae_decodes_in_fp32_whatever_the_model_dtype(wan):
    """bf16 convolutions have no fast CPU kernel (the twin's VAE decoded 27x slower in bf16): loaded or
    moved in bf16 on a CPU, the transformer takes bf16 and the VAE stays fp32; the video still decodes."""
    adapter = load_adapter(wan["path"], device="cpu", dtype=torch.bfloat16)
    assert adapter.transformer.dtype == torch.bfloat16 and adapter.pipeline.vae.dtype == torch.float32
    adapter.to(torch.device("cpu"), torch.bfloat16)
    assert adapter.pipeline.vae.dtype == torch.float32
    video = adapter.decode(torch.randn(1, *adapter.latent_shape(32, 32)).bfloat16())
    assert video.dtype == torch.uint8 and video.shape == (1, FRAMES, 32, 32, 3)
