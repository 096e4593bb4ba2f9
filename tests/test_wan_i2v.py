"""Wan2.2 image to video on tiny random twins (models/tiny_wan.py): TI2V-5B with a first frame (the
image's latent held at timestep 0, never noised, not scored) and I2V-A14B (the image condition
joined channel-wise, two experts).

Each twin's ODE sampler with an image reproduces diffusers' WanImageToVideoPipeline, also with a
trained LoRA loaded into it; the rollout's recorded log-probs equal the trainer's recomputed ones;
an update is finite; TI2V-5B without an image samples exactly as the text-to-video path; the prompt
file's images are validated at config time; grids put the source frame beside the video.
"""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from async_flowgrpo import algo
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
from async_flowgrpo.conditioning import SOURCE_IMAGES, side_by_side
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.models import load_adapter
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir
from async_flowgrpo.policy import DiffusionPolicy, step_unheld

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4  # the I2V twin: sigmas * 1000 = 1000, 910 (transformer) | 717, 24 (transformer_2)
PROMPTS = ["a red circle moving left", "a blue square moving right"]
GUIDANCE, GUIDANCE_2 = 4.0, 3.0
FRAMES, SIZE = 5, 32
VARIANTS = ("wan22_ti2v_5b", "wan22_i2v_a14b")


def first_frame(color) -> torch.Tensor:
    img = np.full((SIZE, SIZE, 3), 240, dtype=np.uint8)
    img[8:20, 6:18] = color
    return torch.from_numpy(img)


SOURCES = [first_frame((220, 30, 30)), first_frame((35, 70, 225))]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return {v: make_tiny_wan_dir(str(tmp_path_factory.mktemp(v)), v) for v in VARIANTS}


def policy_kw(variant):
    return dict(guidance_scale_2=GUIDANCE_2) if variant == "wan22_i2v_a14b" else {}


def rollout(policy, images=SOURCES, seed=0, window=STEPS - 1):
    metadata = None if images is None else [{SOURCE_IMAGES: [img]} for img in images]
    return policy.generate(PROMPTS, 2, num_steps=STEPS, guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde",
                           window_size=window, seed=seed, metadata=metadata)


@pytest.fixture(scope="module")
def rolled(twins):
    """Per variant: a LoRA policy and its rollout of both prompts with their first frames."""
    out = {}
    for v in VARIANTS:
        policy = DiffusionPolicy(twins[v], lora_rank=4, lora_alpha=8, **policy_kw(v))
        out[v] = policy, rollout(policy)
    return out


def cond_of(g, n=None):
    n = n or g.size
    return [t.unsqueeze(0).expand(n, *t.shape) if t is not None else None for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_recorded_log_probs_equal_recomputed_ones(rolled, variant):
    """Every window step of both groups, and one batch whose rows are different steps (on the I2V
    twin: both experts in one call), each row with its own group's image condition."""
    policy, groups = rolled[variant]
    step = dict(guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde")
    for g in groups:
        n, cond = g.size, cond_of(g)
        assert g.log_probs.shape == (2, STEPS - 1) and torch.isfinite(g.log_probs).all()
        for j in range(g.log_probs.shape[1]):
            with torch.no_grad():
                log_prob, *_ = policy.recompute(g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n),
                                                g.sigmas[j + 1].expand(n), *cond, **step)
            assert (log_prob.cpu() - g.log_probs[:, j]).abs().max() < 1e-4, f"step {j}"
    g = groups[1]
    rows = [(0, 0), (1, 2), (0, 1)]
    pick = lambda t, off=0: torch.stack([t[i, j + off] for i, j in rows])  # noqa: E731
    sig = lambda off: torch.stack([g.sigmas[j + off] for _, j in rows])  # noqa: E731
    with torch.no_grad():
        log_prob, *_ = policy.recompute(pick(g.latents), pick(g.latents, 1), sig(0), sig(1), *cond_of(g, 3), **step)
    assert (log_prob.cpu() - torch.stack([g.log_probs[i, j] for i, j in rows])).abs().max() < 1e-4
    # the groups' conditions differ: the other group's image gives other log-probs
    with torch.no_grad():
        other, *_ = policy.recompute(pick(g.latents), pick(g.latents, 1), sig(0), sig(1), *cond_of(groups[0], 3), **step)
    assert (other.cpu() - log_prob.cpu()).abs().max() > 1e-4


def test_ti2v_first_frame_is_the_image_latent_held_and_left_out_of_the_log_prob(rolled):
    policy, groups = rolled["wan22_ti2v_5b"]
    adapter = policy.adapter
    g = groups[0]
    latent = adapter.encode_images([[SOURCES[0]]])  # [1, 48, 1, 8, 8] (alone, not batched with the other image)
    assert latent.shape == (1, 48, 1, 8, 8)
    torch.testing.assert_close(g.pooled_prompt_embeds, latent.flatten(), atol=1e-5, rtol=0)
    assert g.latents.shape == (2, STEPS, 48, 3, 8, 8)
    held = g.pooled_prompt_embeds.view(1, 48, 1, 8, 8).expand(2, -1, -1, -1, -1)
    for j in range(STEPS):  # the initial latents and every recorded step hold it exactly
        assert torch.equal(g.latents[:, j, :, :1], held), f"latent {j}"
    # the recorded log-prob scores the sampled frames 1.. only
    n, cond, j = g.size, cond_of(g), 1
    x, x_next = g.latents[:, j], g.latents[:, j + 1]
    with torch.no_grad():
        v = adapter.velocity(x, g.sigmas[j].expand(n), *cond, guidance_scale=GUIDANCE)
    score = lambda v, x, y: algo.sde_step(v, x, g.sigmas[j], g.sigmas[j + 1], noise_level=0.7, prev_sample=y)[1]  # noqa: E731
    torch.testing.assert_close(score(v[:, :, 1:], x[:, :, 1:], x_next[:, :, 1:]), g.log_probs[:, j], atol=1e-5, rtol=0)
    assert (score(v, x, x_next) - g.log_probs[:, j]).abs().min() > 1e-3  # (not the mean over every frame)
    assert policy.sampled_elements(x[0], g.pooled_prompt_embeds) == 48 * 2 * 8 * 8


def test_ti2v_without_an_image_samples_exactly_as_text_to_video(twins):
    """The T2V path, written out with the plain SDE step (what generate did before image to video):
    the same latents, log-probs and decoded frames, bit for bit, and an empty pooled slot."""
    policy = DiffusionPolicy(twins["wan22_ti2v_5b"], lora_rank=4, lora_alpha=8)
    groups = rollout(policy, images=None, seed=3)
    adapter = policy.adapter
    gen = torch.Generator().manual_seed(3)
    start, end = algo.sde_window(STEPS, STEPS - 1, None, generator=gen)
    enc = adapter.encode_prompts(PROMPTS, cfg=True)
    cond = [t.repeat_interleave(2, 0) for t in (enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled)]
    x = torch.randn((4, *adapter.latent_shape(SIZE, SIZE)), generator=gen)
    sigmas, trajectory, log_probs = adapter.sigmas(STEPS), [x], []
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], *cond, guidance_scale=GUIDANCE)
            if start <= i < end:
                eps = torch.randn(x.shape, generator=gen)
                x, log_prob, _, _ = algo.sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=0.7, noise=eps)
                trajectory.append(x)
                log_probs.append(log_prob)
            else:
                x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    assert (start, end) == (0, STEPS - 1)
    assert torch.equal(torch.cat([g.latents for g in groups]), torch.stack(trajectory, 1))
    assert torch.equal(torch.cat([g.log_probs for g in groups]), torch.stack(log_probs, 1))
    assert torch.equal(torch.cat([g.images for g in groups]), adapter.decode(x))
    assert groups[0].pooled_prompt_embeds.shape == (0,)


def ode_sample(adapter, x, images, guidance_scale=GUIDANCE):
    """Our ODE sampler (the adapter's velocity and the policy's held-frame step), one prompt."""
    enc = adapter.encode_prompts(PROMPTS[:1], cfg=True, images=images)
    held = adapter.held_frames(enc.pooled)
    x = adapter.hold(x, enc.pooled)
    sigmas = adapter.sigmas(STEPS)
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=guidance_scale)
            x = step_unheld(algo.ode_step, held, v, x, sigmas[i], sigmas[i + 1])
    return x, enc


def image_to_video_pipeline(path, variant):
    """diffusers' WanImageToVideoPipeline over the twin (TI2V-5B's ships as a WanPipeline: the same
    components, expand_timesteps)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    if variant == "wan22_i2v_a14b":
        pipe = WanImageToVideoPipeline.from_pretrained(path, local_files_only=True)
    else:
        base = WanPipeline.from_pretrained(path, local_files_only=True)
        pipe = WanImageToVideoPipeline(**base.components, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_latents(pipe, enc, x0, image):
    """The pipeline's final latents for x0 and the first frame (the prompt embeddings given: diffusers
    0.42's i2v prompt cleaning needs ftfy)."""
    extra = {"guidance_scale_2": GUIDANCE_2} if pipe.transformer_2 is not None else {}
    return pipe(image=Image.fromarray(image.numpy()), prompt_embeds=enc.embeds, negative_prompt_embeds=enc.negative_embeds,
                height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                latents=x0, output_type="latent", **extra).frames.float()


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_update_is_finite_and_the_lora_samples_as_in_wan_image_to_video_pipeline(twins, variant, tmp_path):
    policy = DiffusionPolicy(twins[variant], lora_rank=4, lora_alpha=8, **policy_kw(variant))
    groups = rollout(policy, seed=1)
    for g in groups:
        g.advantages = torch.tensor([-1.0, 1.0])
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = Learner(policy, micro_batch_size=3, clip_range=1e-2, lr=1e-2, beta=0.04).train_step(groups, version=0)
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["logp/max_abs_diff"] < 1e-4
    assert all(torch.isfinite(p.grad).all() for p in policy.trainable_parameters() if p.grad is not None)
    after = policy.trainable_state()
    changed = {k.split(".")[0] for k in before if "lora_B" in k and not torch.equal(before[k], after[k])}
    assert changed == {"transformer", "transformer_2"} if variant == "wan22_i2v_a14b" else changed == {"blocks"}

    policy.adapter.save_lora(str(tmp_path), after)  # as the trainer saves weights
    pipe = image_to_video_pipeline(twins[variant], variant)
    pipe.load_lora_weights(str(tmp_path))
    if variant == "wan22_i2v_a14b":
        pipe.load_lora_weights(str(tmp_path / "transformer_2"), load_into_transformer_2=True)
    x0 = torch.randn((1, *policy.adapter.latent_shape(SIZE, SIZE)), generator=torch.Generator().manual_seed(2))
    ours, enc = ode_sample(policy.adapter, x0, [[SOURCES[0]]])
    ref = pipeline_latents(pipe, enc, x0, SOURCES[0])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    base, _ = ode_sample(load_adapter(twins[variant], device="cpu", dtype=torch.float32), x0, [[SOURCES[0]]])
    assert (ours - base).abs().max() > 1e-4  # the trained LoRA changed the video
    if variant == "wan22_ti2v_5b":  # the pipeline puts the image's latent back as the first frame; ours never left it
        assert torch.equal(ours[:, :, :1], enc.pooled.view(1, 48, 1, 8, 8))


def _png(path, img):
    Image.fromarray(img.numpy()).save(path)


def test_prompt_file_images_are_validated_for_the_model(twins, tmp_path, capsys):
    from async_flowgrpo.config import config_or_exit

    (tmp_path / "frames").mkdir()
    _png(tmp_path / "frames" / "red.png", SOURCES[0])
    _png(tmp_path / "frames" / "big.png", torch.zeros(64, 64, 3, dtype=torch.uint8))
    rows = [{"prompt": PROMPTS[0], "images": "frames/red.png"}]
    framed = tmp_path / "frames.jsonl"
    framed.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": PROMPTS[0], "images": "frames/big.png"}) + "\n")
    text = tmp_path / "text.txt"
    text.write_text(PROMPTS[0] + "\n")
    video = ["model.family=wan", "reward.weights={temporal_consistency: 1.0}", "rollout.prompt_mix=null"]

    def overrides(variant, prompts, *extra):
        return [f"model.path={twins[variant]}", *video, f"rollout.prompts={prompts}", f"eval.prompts={prompts}", *extra]

    # TI2V-5B: with or without first frames; I2V-A14B: only with them
    assert load_config("sync", overrides("wan22_ti2v_5b", framed)).rollout.prompts == str(framed)
    assert load_config("sync", overrides("wan22_ti2v_5b", text)).rollout.prompts == str(text)
    assert load_config("sync", overrides("wan22_i2v_a14b", framed)).model.family == "wan"
    with pytest.raises(ConfigError, match=r"^rollout.prompts: the model makes videos from images"):
        load_config("sync", overrides("wan22_i2v_a14b", text))
    wan21 = make_tiny_wan_dir(str(tmp_path / "wan21"))
    with pytest.raises(ConfigError, match=r"^rollout.prompts: its rows carry \"images\", but model.family wan takes none"):
        load_config("sync", [f"model.path={wan21}", *video, f"rollout.prompts={framed}", f"eval.prompts={text}"])
    # every algorithm takes a first frame (the likelihood-free ones' losses leave it out: below)
    assert load_config("sync", overrides("wan22_ti2v_5b", framed, "algorithm.name=diffusion_nft")).algorithm.name == "diffusion_nft"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("sync", overrides("wan22_i2v_a14b", bad))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"config error: rollout.prompts: {bad}:1: image 'frames/big.png' is 64x64")


def test_the_preset_loads(twins, tmp_path):
    from async_flowgrpo.config import CONFIG_DIR

    _png(tmp_path / "red.png", torch.from_numpy(np.zeros((720, 720, 3), dtype=np.uint8)))
    prompts = tmp_path / "frames.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0], "images": "red.png"}) + "\n")
    preset = os.path.join(CONFIG_DIR, "model", "wan22_i2v_a14b.yaml")
    cfg = load_config("fully_async", [preset, f"model.path={twins['wan22_i2v_a14b']}", f"rollout.prompts={prompts}",
                                      f"eval.prompts={prompts}"])
    assert (cfg.model.guidance_scale_2, cfg.rollout.guidance_scale, cfg.rollout.num_frames) == (3.5, 3.5, 81)


def test_more_than_one_image_or_a_mixed_batch_fails_in_generate(rolled):
    policy, _ = rolled["wan22_ti2v_5b"]
    kw = dict(num_steps=2, guidance_scale=1.0, noise_level=0.7, sde_type="sde", window_size=1, seed=0)
    with pytest.raises(ValueError, match="one image per prompt"):
        policy.generate(PROMPTS[:1], 1, metadata=[{SOURCE_IMAGES: SOURCES}], **kw)
    with pytest.raises(ValueError, match="for all prompts of a batch or for none"):
        policy.generate(PROMPTS, 1, metadata=[{SOURCE_IMAGES: SOURCES[:1]}, {}], **kw)
    policy_i2v, _ = rolled["wan22_i2v_a14b"]
    with pytest.raises(ValueError, match="every prompt needs its input image"):
        policy_i2v.generate(PROMPTS[:1], 1, **kw)


def test_a_video_grid_shows_the_source_frame_beside_each_result(rolled):
    _, groups = rolled["wan22_ti2v_5b"]
    videos = torch.cat([g.images[:1] for g in groups])  # [2, F, H, W, 3]
    grid = side_by_side(videos, [[s] for s in SOURCES], PROMPTS)
    assert grid["images"].shape == (4, FRAMES, SIZE, SIZE, 3) and grid["nrow"] == 8
    assert all(torch.equal(grid["images"][0, f], SOURCES[0]) for f in range(FRAMES))  # a still, every frame
    assert torch.equal(grid["images"][1], videos[0]) and grid["captions"] == [PROMPTS[0], "-> result", PROMPTS[1], "-> result"]


def test_diffusion_nft_trains_on_i2v_groups(twins):
    """I2V-A14B samples every frame, so DiffusionNFT's forward-process loss (on noised final latents)
    applies as in text to video, with the image condition from the groups' conditioning."""
    import math

    from async_flowgrpo.algorithms.diffusion_nft import NFTLearner

    policy = DiffusionPolicy(twins["wan22_i2v_a14b"], lora_rank=4, lora_alpha=8, **policy_kw("wan22_i2v_a14b"))
    groups = rollout(policy, window=0)
    for g in groups:
        g.advantages = torch.tensor([1.0, -1.0])
    metrics = NFTLearner(policy, micro_batch_size=4).train_step(groups, version=0)
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0


@pytest.mark.parametrize("name", ["diffusion_nft", "awm", "dgpo"])
def test_likelihood_free_losses_leave_the_held_first_frame_out(twins, name):
    """TI2V-5B with a first frame: DiffusionNFT, AWM and DGPO noise the final latents afresh, and the
    model's velocity on the held frame is unused (the sampler never moves it), so making it larger
    changes neither the loss nor the update; the update is finite and moves the LoRA."""
    import math

    from async_flowgrpo.builders import build_learner
    from async_flowgrpo.config import CONFIG_DIR

    def update(bump_held_frame: bool) -> dict:
        torch.manual_seed(0)
        cfg = load_config("sync", [f"model.path={twins['wan22_ti2v_5b']}", "model.family=wan",
                                   "reward.weights={temporal_consistency: 1.0}", "rollout.prompt_mix=null",
                                   os.path.join(CONFIG_DIR, f"{name}.yaml"), "model.lora_rank=4", "model.lora_alpha=8",
                                   f"rollout.num_steps={STEPS}", "trainer.micro_batch_size=8",
                                   *(["algorithm.dgpo.timesteps=3"] if name == "dgpo" else [])])
        learner = build_learner(cfg)
        groups = rollout(learner.policy, window=0)
        for g in groups:
            g.rewards, g.advantages = torch.tensor([1.0, 0.0]), torch.tensor([1.0, -1.0])
        if bump_held_frame:
            velocity = learner.policy.velocity

            def bumped(*args, **kwargs):
                v = velocity(*args, **kwargs)
                return torch.cat([11 * v[:, :, :1], v[:, :, 1:]], 2)

            learner.policy.velocity = bumped
        torch.manual_seed(1)
        return learner.train_step(groups, version=0)

    plain, bumped = update(False), update(True)
    assert math.isfinite(plain["train/grad_norm"]) and plain["train/grad_norm"] > 0
    for key in ("loss/policy", "train/grad_norm"):
        assert bumped[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-12), key
