"""Qwen-Image-Edit and Qwen-Image-Edit-2509 ("Plus") on tiny random twins (the Qwen2.5-VL text
encoder with its vision tower running): the adapter's sampler reproduces the diffusers pipelines,
the recorded log-probs replay within 1e-4 with one and with two input images, the input image
conditions both the text encoding and the transformer, a trained LoRA loads into the pipeline, and
Edit given two images per prompt is one config error."""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from async_flowgrpo import algo
from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.models.common import pack_latents
from async_flowgrpo.models.qwen_image_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
from async_flowgrpo.models.tiny_qwen_image_edit import make_tiny_qwen_image_edit_dir
from async_flowgrpo.policy import DiffusionPolicy

torch.set_num_threads(1)
PROMPT = "make the red square blue"
VOCAB = ("make", "the", "red", "blue", "square", "remove")
STEPS = 3
GUIDANCE = 4.0
VARIANTS = {"edit": (False, 1, QwenImageEditAdapter), "plus": (True, 2, QwenImageEditPlusAdapter)}  # plus, images


def _image(color, corner=8):
    img = torch.full((32, 32, 3), 255, dtype=torch.uint8)
    img[corner:corner + 8, corner:corner + 8] = torch.tensor(color, dtype=torch.uint8)
    return img


RED, BLUE = _image((220, 30, 30)), _image((35, 70, 225), corner=16)


@pytest.fixture(scope="module", params=list(VARIANTS))
def twin(request, tmp_path_factory):
    plus, count, cls = VARIANTS[request.param]
    path = make_tiny_qwen_image_edit_dir(str(tmp_path_factory.mktemp(request.param)), plus=plus, vocab=VOCAB)
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # move the LoRA off zero so that the adapters count in every pass
        for p in policy.trainable_parameters():
            p.normal_(0, 0.05)
    return dict(name=request.param, path=path, policy=policy, images=[RED, BLUE][:count], cls=cls)


def test_loads_as_its_family(twin):
    adapter = twin["policy"].adapter
    assert type(adapter) is twin["cls"] and adapter.pipeline.processor is not None
    assert adapter.pipeline.prompt_template_encode_start_idx == 64


def test_sampler_matches_the_diffusers_pipeline(twin, monkeypatch):
    """Resizes, the prompt encoded with its image(s), the image tokens after the noisy ones with their
    img_shapes, the cut before true CFG and its rescale, the sigmas: the pipeline's own call, with its
    target areas set to the twin's (32 x 32)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit, pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: (32, 32, None))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 32 * 32)
    adapter = twin["policy"].adapter
    x0 = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    pil = [Image.fromarray(img.numpy()) for img in twin["images"]]
    ref = adapter.pipeline(image=pil if twin["name"] == "plus" else pil[0], prompt=PROMPT, height=32, width=32,
                           num_inference_steps=STEPS, true_cfg_scale=GUIDANCE, negative_prompt=adapter.negative_prompt,
                           latents=pack_latents(x0), output_type="latent").images
    enc = adapter.encode_prompts([PROMPT], cfg=True, images=[twin["images"]])
    sigmas, x = adapter.sigmas(STEPS), x0
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=GUIDANCE)
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    torch.testing.assert_close(pack_latents(x), ref.float(), atol=1e-4, rtol=1e-4)


def test_rollout_replays_within_1e4_and_trains_with_finite_gradients(twin):
    from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner

    policy = twin["policy"]
    (g,) = policy.generate([PROMPT], 2, num_steps=STEPS, guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde",
                           window_size=2, seed=3, metadata=[{SOURCE_IMAGES: twin["images"]}])
    n, worst = g.size, 0.0
    for j in range(g.params.window_size):
        logp, *_ = policy.recompute(
            g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n), g.sigmas[j + 1].expand(n),
            g.prompt_embeds.expand(n, -1, -1), g.pooled_prompt_embeds.expand(n, -1),
            g.negative_prompt_embeds.expand(n, -1, -1), g.negative_pooled_prompt_embeds.expand(n, -1),
            guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde")
        worst = max(worst, (logp.detach() - g.log_probs[:, j]).abs().max().item())
    assert worst < 1e-4
    g.advantages = torch.tensor([1.0, -1.0])
    metrics = FlowGRPOLearner(policy, micro_batch_size=2).train_step([g], version=0)
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    assert metrics["logp/max_abs_diff"] < 1e-4


def test_the_input_image_conditions_the_text_and_the_transformer(twin):
    policy, count = twin["policy"], len(twin["images"])
    red, blue = ([img] * count for img in (RED, BLUE))
    enc_red, enc_blue = (policy._encode([PROMPT], [{SOURCE_IMAGES: imgs}], cfg=False) for imgs in (red, blue))
    length = policy.adapter.max_sequence_length
    assert (enc_red.embeds - enc_blue.embeds).abs().max() > 1e-3  # the text encoder saw the image
    assert torch.equal(enc_red.pooled[:, :length], enc_blue.pooled[:, :length])  # same text mask
    x = torch.randn(1, *policy.adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same text embeddings, the image tokens swapped: the transformer reads them
        v_red = policy.velocity(x, torch.tensor([0.7]), enc_red.embeds, enc_red.pooled)
        v_blue = policy.velocity(x, torch.tensor([0.7]), enc_red.embeds, enc_blue.pooled)
        v_again = policy.velocity(x, torch.tensor([0.7]), enc_red.embeds, enc_red.pooled)
    assert torch.equal(v_red, v_again)
    assert (v_red - v_blue).abs().max() > 1e-5  # (a random tiny model attends weakly: about 1e-3, not rounding)


def test_a_trained_lora_loads_into_the_pipeline(twin, tmp_path):
    import diffusers

    policy = twin["policy"]
    state = {k: torch.randn_like(v) for k, v in policy.trainable_state().items()}
    policy.adapter.save_lora(str(tmp_path / "lora"), state)
    pipe = getattr(diffusers, twin["cls"].pipeline_class).from_pretrained(twin["path"], processor=None)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    name = next(k for k in state if "lora_B" in k)
    module = name.split(".lora_B.")[0]
    loaded = [p for n, p in pipe.transformer.named_parameters() if n.startswith(module + ".lora_B.")]
    assert len(loaded) == 1 and torch.equal(loaded[0], state[name])


def _prompt_file(folder, images_per_row):
    for name, img in (("a.png", RED), ("b.png", BLUE)):
        Image.fromarray(img.numpy()).save(os.path.join(folder, name))
    path = os.path.join(folder, "edits.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": PROMPT, "images": ["a.png", "b.png"][:images_per_row]}) + "\n")
    return path


def test_edit_given_two_images_is_one_config_error_plus_takes_them(twin, tmp_path):
    from async_flowgrpo.config import ConfigError, load_config

    family = twin["cls"].family
    overrides = [f"model.path={twin['path']}", f"model.family={family}", f"rollout.prompts={_prompt_file(tmp_path, 2)}",
                 f"eval.prompts={_prompt_file(tmp_path, 2)}", "rollout.prompt_mix=null", "algorithm.beta=0"]
    if twin["name"] == "plus":
        assert load_config("sync", overrides).model.family == "qwen_image_edit_plus"
        return
    with pytest.raises(ConfigError) as err:
        load_config("sync", overrides)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("rollout.prompts: model.family qwen_image_edit takes 1 input image per prompt, got 2")
    with pytest.raises(ValueError, match="takes 1 input image per prompt, got 2"):  # and in the adapter itself
        twin["policy"].adapter.encode_prompts([PROMPT], cfg=False, images=[[RED, BLUE]])
    one = overrides[:2] + [f"rollout.prompts={_prompt_file(tmp_path, 1)}", f"eval.prompts={_prompt_file(tmp_path, 1)}"]
    assert load_config("sync", one + overrides[4:]).model.family == "qwen_image_edit"


def test_plus_trains_fully_async_on_ray_with_two_images_per_prompt(ray_cluster, tmp_path):
    """The whole pipeline once (the one Ray run of the edit families): a prompt file with two images
    per row, fully_async with in-flight weight updates, the image tokens carried in the queued
    groups; every step trains, the fresh samples replay exactly, every publication is verified."""
    from test_run import read_metrics, small_config

    from async_flowgrpo.modes import run

    model = make_tiny_qwen_image_edit_dir(str(tmp_path / "plus"), plus=True, vocab=VOCAB)
    prompts = _prompt_file(str(tmp_path), 2)
    out = str(tmp_path / "out")
    cfg = small_config("fully_async", model, prompts, out, "model.family=qwen_image_edit_plus", "trainer.total_steps=2",
                       "rollout.num_steps=3", "rollout.guidance_scale=2.0", "algorithm.beta=0",
                       "reward.weights={jpeg_incompressibility: 1.0}", "reward.options={}")
    assert cfg.sync.verify  # each publication: the rollout actors' weight digest must equal the trainer's
    run(cfg)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["sync/bytes"] > 0 for r in rows)
    assert all(math.isfinite(r["loss/policy"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert rows[0]["logp/max_abs_diff"] < 1e-4
    assert rows[-1]["samples/consumed"] == 2 * 4
