"""Build a tiny StableDiffusion3Pipeline with the real SD3 architecture and random weights.

Used two ways: tests build one in seconds (random weights), and `scripts`-style pretraining of the
embedded "shapes" model starts from one. Either way the result is saved with `save_pretrained` and
loaded back through the ordinary `from_pretrained` path, like any real model.

Facts that shape the sizes (measured on a prototype):
- joint_attention_dim must be 2 x the CLIP hidden size: SD3 concatenates the two CLIP outputs
  along features; a smaller value silently drops the second encoder.
- The pipeline pads T5 tokens (zeros without a T5 encoder) of length max_sequence_length onto
  the CLIP tokens; we keep that length tiny and store it in `model_index`-adjacent config.
- CLIP's tokenizers are word-level stand-ins (`models.tiny.build_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from async_flowgrpo.models.tiny import build_tokenizer, save_tiny, tiny_autoencoder_kl


@dataclass
class TinySD3Spec:
    vocab: tuple[str, ...] = ()  # words the tokenizer knows, besides the special tokens
    resolution: int = 32  # image side in pixels
    text_hidden: int = 32  # each CLIP encoder's width; joint_attention_dim = 2 * text_hidden
    text_layers: int = 2
    text_max_length: int = 12  # CLIP tokens per prompt (incl. bos/eos)
    t5_max_length: int = 1  # zero "T5" tokens appended by the pipeline (no T5 encoder)
    vae_channels: tuple[int, ...] = (16, 32)  # len 2 -> latents at resolution / 2
    latent_channels: int = 4
    layers: int = 4
    heads: int = 4
    head_dim: int = 16
    pooled_dim: int = 64  # = 2 * CLIP projection dim
    shift: float = 1.0  # scheduler shift (SD3.5 uses 3.0; tiny 32px images need little)
    seed: int = 0


def _text_encoder(spec: TinySD3Spec, vocab_size: int) -> CLIPTextModelWithProjection:
    cfg = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=spec.text_hidden,
        intermediate_size=2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=2,
        max_position_embeddings=spec.text_max_length,
        projection_dim=spec.pooled_dim // 2,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,  # CLIP pools the hidden state at the first eos token
    )
    return CLIPTextModelWithProjection(cfg)


def build_tiny_sd3(spec: TinySD3Spec) -> StableDiffusion3Pipeline:
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec.vocab, spec.text_max_length)
    n_vocab = len(tokenizer)
    latent_size = spec.resolution // 2 ** (len(spec.vae_channels) - 1)
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=2,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=2 * spec.text_hidden,
        caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=spec.pooled_dim,
        pos_embed_max_size=max(latent_size // 2, 8),
    )
    vae = tiny_autoencoder_kl(spec.vae_channels, spec.latent_channels, spec.resolution,
                              scaling_factor=1.0, shift_factor=0.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=_text_encoder(spec, n_vocab),
        tokenizer=tokenizer,
        text_encoder_2=_text_encoder(spec, n_vocab),
        tokenizer_2=build_tokenizer(spec.vocab, spec.text_max_length),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def save_pipeline(pipe: StableDiffusion3Pipeline, path: str, spec: TinySD3Spec, **extra) -> None:
    """save_pretrained plus our own settings (sequence length, resolution) in async_flowgrpo.json."""
    save_tiny(pipe, path, "sd3", spec, resolution=spec.resolution, max_sequence_length=spec.t5_max_length, **extra)


def make_tiny_model_dir(path: str, vocab: tuple[str, ...] = ("a", "red", "blue", "circle", "square"), **spec_kw) -> str:
    """Build, save and return a tiny random SD3 model directory (for tests; takes ~1 s)."""
    spec = TinySD3Spec(vocab=tuple(vocab), **spec_kw)
    save_pipeline(build_tiny_sd3(spec), path, spec)
    return path
