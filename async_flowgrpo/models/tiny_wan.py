"""Build a tiny WanPipeline (real Wan2.1 architecture, random weights) offline, for tests and CPU runs.

Parts: WanTransformer3DModel (self-attention, text cross-attention, 3-D RoPE), AutoencoderKLWan
(the causal 3-D video VAE, 16 latent channels) with one spatial and one temporal 2x downsampling,
a UMT5EncoderModel with a word-level stand-in for its tokenizer, and a FlowMatchEulerDiscreteScheduler
with Wan2.1's 480p shift. Saved with save_pretrained and loaded back through from_pretrained
like a real checkpoint; a rollout of a few frames at 32 x 32 takes well under a second on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from async_flowgrpo.models.tiny import build_t5_tokenizer, save_tiny, t5_config

DEFAULT_VOCAB = ("a", "red", "blue", "green", "circle", "square", "triangle", "moving", "left", "right")


@dataclass
class TinyWanSpec:
    vocab: tuple[str, ...] = DEFAULT_VOCAB
    resolution: int = 32  # frame side in pixels
    num_frames: int = 5  # frames per video: (5 - 1) / 2 + 1 = 3 latent frames
    text_hidden: int = 32  # UMT5 width = the transformer's text_dim
    max_sequence_length: int = 8  # UMT5 tokens (embeddings padded to it)
    vae_base_dim: int = 8
    latent_channels: int = 16  # Wan's z_dim
    layers: int = 2
    heads: int = 2
    head_dim: int = 12  # RoPE splits it over (frames, height, width): 4 + 4 + 4
    shift: float = 3.0  # Wan2.1 480p's flow_shift
    seed: int = 0


def build_tiny_wan(spec: TinyWanSpec) -> WanPipeline:
    torch.manual_seed(spec.seed)
    tokenizer = build_t5_tokenizer(spec.vocab, spec.max_sequence_length)
    text_encoder = UMT5EncoderModel(UMT5Config(**t5_config(len(tokenizer), spec.text_hidden)))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        text_dim=spec.text_hidden,
        freq_dim=32,
        ffn_dim=2 * spec.heads * spec.head_dim,
        num_layers=spec.layers,
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(  # one 2x stage in space and time; the factors the pipeline reads must agree
        base_dim=spec.vae_base_dim,
        z_dim=spec.latent_channels,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[True],
        scale_factor_spatial=2,
        scale_factor_temporal=2,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)


def make_tiny_wan_dir(path: str, **spec_kw) -> str:
    """Build, save and return a tiny random Wan model directory (for tests; about a second)."""
    spec = TinyWanSpec(**spec_kw)
    return save_tiny(build_tiny_wan(spec), path, "wan", spec, resolution=spec.resolution,
                     max_sequence_length=spec.max_sequence_length, num_frames=spec.num_frames)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write the tiny random Wan2.1 twin (5 frames of 32 x 32) to a "
                                             "directory, for CPU runs: model.family=wan model.path=DIR")
    ap.add_argument("out", help="directory to write (created)")
    print(make_tiny_wan_dir(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
