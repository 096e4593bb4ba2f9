"""Build a tiny FluxPipeline (real Flux architecture, random weights) offline, for tests.

Parts: FluxTransformer2DModel (double- and single-stream blocks, guidance embedding as in
FLUX.1-dev), AutoencoderKL with 16 latent channels and no quant convs (as Flux's VAE), CLIPTextModel
(pooled output) and T5EncoderModel, each with a word-level tokenizer, and a
FlowMatchEulerDiscreteScheduler with dynamic shifting (FLUX.1-dev's scheduler config).
Saved with save_pretrained and loaded back through from_pretrained like a real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from async_flowgrpo.models.tiny import build_t5_tokenizer, build_tokenizer, save_tiny, t5_config, tiny_autoencoder_kl

DEFAULT_VOCAB = ("a", "red", "blue", "green", "circle", "square", "triangle")


@dataclass
class TinyFluxSpec:
    vocab: tuple[str, ...] = DEFAULT_VOCAB
    resolution: int = 32  # image side in pixels
    clip_hidden: int = 32  # = pooled_projection_dim
    clip_max_length: int = 8  # CLIP tokens (tokenizer.model_max_length)
    t5_hidden: int = 32  # = joint_attention_dim
    t5_max_length: int = 8  # T5 tokens (max_sequence_length)
    vae_channels: tuple[int, ...] = (16, 32)  # len 2 -> latents at resolution / 2
    latent_channels: int = 16  # Flux's VAE; the transformer sees 4 x 16 = 64 packed channels
    layers: int = 1  # double-stream blocks
    single_layers: int = 1  # single-stream blocks
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    guidance_embeds: bool = True  # FLUX.1-dev style (schnell: False)
    dynamic_shifting: bool = True
    seed: int = 0


def build_tiny_flux(spec: TinyFluxSpec) -> FluxPipeline:
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec.vocab, spec.clip_max_length)
    tokenizer_2 = build_t5_tokenizer(spec.vocab, spec.t5_max_length)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.clip_hidden,
            intermediate_size=2 * spec.clip_hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=spec.clip_max_length,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
        )
    )
    t5 = T5EncoderModel(T5Config(**t5_config(len(tokenizer_2), spec.t5_hidden)))
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * spec.latent_channels,
        num_layers=spec.layers,
        num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_hidden,
        pooled_projection_dim=spec.clip_hidden,
        guidance_embeds=spec.guidance_embeds,
        axes_dims_rope=spec.axes_dims_rope,
    )
    vae = tiny_autoencoder_kl(  # FLUX.1's VAE constants, no quant convs
        spec.vae_channels, spec.latent_channels, spec.resolution, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=spec.dynamic_shifting,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def make_tiny_flux_dir(path: str, **spec_kw) -> str:
    """Build, save and return a tiny random Flux model directory (for tests; about a second)."""
    spec = TinyFluxSpec(**spec_kw)
    return save_tiny(build_tiny_flux(spec), path, "flux", spec, resolution=spec.resolution,
                     max_sequence_length=spec.t5_max_length)
