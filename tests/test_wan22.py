"""Wan2.2 in the wan family, on tiny random twins (models/tiny_wan.py VARIANTS): A14B's two experts
(transformer for high noise, transformer_2 for low, switched at boundary_ratio) and TI2V-5B's
per-token timesteps over the Wan2.2 VAE layout.

The adapter's ODE sampler reproduces WanPipeline (expert switch, both guidance scales, per-token
timesteps, the 48-channel latent normalisation); the trainer's recompute reproduces the rollout's
log-probs at every step, also on a batch whose rows straddle the boundary; LoRA goes on the trained
experts only (model.trained_experts); one update trains both experts, and the saved adapters load
into a real WanPipeline (load_into_transformer_2) and sample what our policy samples.
"""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.learner import Learner
from async_flowgrpo.models import load_adapter
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir
from async_flowgrpo.policy import DiffusionPolicy

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4  # the A14B twin's sigmas * 1000: 1000, 961 (transformer) | 861, 126 (transformer_2)
PROMPT = "a red circle moving left"
GUIDANCE, GUIDANCE_2 = 4.0, 3.0  # A14B's high-noise and low-noise scales
FRAMES = 5


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return {v: make_tiny_wan_dir(str(tmp_path_factory.mktemp(v)), v) for v in ("wan22_a14b", "wan22_ti2v_5b")}


def cond_of(g):
    n = g.size
    return [t.unsqueeze(0).expand(n, *t.shape) if t is not None else None for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]


def ode_sample(adapter, x, guidance_scale, lora_scale=None):
    enc = adapter.encode_prompts([PROMPT], cfg=True)
    sigmas = adapter.sigmas(STEPS)
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=guidance_scale)
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    return x


def pipe_kwargs(adapter, x0, **kw):
    return dict(prompt=PROMPT, negative_prompt=adapter.negative_prompt, height=32, width=32, num_frames=FRAMES,
                num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=adapter.max_sequence_length,
                latents=x0, **kw)


@pytest.mark.parametrize("variant", ["wan22_a14b", "wan22_ti2v_5b"])
def test_ode_sampler_matches_wan_pipeline(twins, variant):
    adapter = load_adapter(twins[variant], device="cpu", dtype=torch.float32)
    two = variant == "wan22_a14b"
    if two:
        adapter.select_experts(guidance_scale_2=GUIDANCE_2)
        t = adapter.sigmas(STEPS)[:-1] * 1000
        assert (t >= adapter.boundary).sum() == 2 and (t < adapter.boundary).sum() == 2  # both experts denoise
    else:
        assert adapter.expand_timesteps and adapter.latent_shape(32, 32) == (48, 3, 8, 8)  # Wan2.2 VAE: 4x here
    pipe = adapter.pipeline
    x0 = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    kwargs = pipe_kwargs(adapter, x0, **({"guidance_scale_2": GUIDANCE_2} if two else {}))
    ref_latents = pipe(output_type="latent", **kwargs).frames
    ref_video = pipe(output_type="pt", **kwargs).frames  # [1, F, 3, H, W] in [0, 1]
    x = ode_sample(adapter, x0, GUIDANCE)
    torch.testing.assert_close(x, ref_latents.float(), atol=1e-4, rtol=1e-4)
    video = adapter.decode(x).float() / 255  # [1, F, H, W, 3], through latents_mean / latents_std
    assert video.shape == (1, FRAMES, 32, 32, 3)
    assert (video - ref_video.permute(0, 1, 3, 4, 2)).abs().max() <= 1.01 / 255
    if two:  # the second scale matters: with guidance_scale_2 = guidance_scale the result differs
        adapter.select_experts()
        assert (ode_sample(adapter, x0, GUIDANCE) - x).abs().max() > 1e-4
