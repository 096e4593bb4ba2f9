"""Build a tiny WanPipeline (real Wan architecture, random weights) offline, for tests and CPU runs.

Parts: WanTransformer3DModel (self-attention, text cross-attention, 3-D RoPE), AutoencoderKLWan
(the causal 3-D video VAE, 16 latent channels) with one spatial and one temporal 2x downsampling,
a UMT5EncoderModel with a word-level stand-in for its tokenizer, and a FlowMatchEulerDiscreteScheduler
with Wan2.1's 480p shift. Saved with save_pretrained and loaded back through from_pretrained
like a real checkpoint; a rollout of a few frames at 32 x 32 takes well under a second on a CPU.

Variants (`VARIANTS`, --variant): wan21 (the above); wan22_a14b, Wan2.2 A14B's layout: two
experts (`transformer_2` for low noise) switched at boundary_ratio 0.875 with A14B's shift 12, so
that a 4-step schedule runs two steps on each; wan22_ti2v_5b, TI2V-5B's: one transformer with
per-token timesteps (expand_timesteps) over the Wan2.2 VAE's layout (48 latent channels, 2 x 2
pixel patches before a residual encoder: 4x spatial compression here, 16x in the real one, and
per-channel latents_mean / latents_std drawn at random so that the normalisation is exercised);
wan22_i2v_a14b, I2V-A14B's: A14B's two experts in a WanImageToVideoPipeline (no image encoder)
whose transformers take the image condition beside the latents, in_channels = 2 x 16 latent
channels + the VAE's temporal factor (2 here, 4 in the real one) for the first-frame mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline,
                       WanTransformer3DModel)
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
    boundary_ratio: float | None = None  # set: two experts (Wan2.2 A14B), transformer_2 below it
    wan22_vae: bool = False  # Wan2.2's VAE layout and per-token timesteps (TI2V-5B); latent_channels 48
    image_to_video: bool = False  # a WanImageToVideoPipeline, the image condition joined channel-wise (I2V-A14B)
    seed: int = 0


VARIANTS = {
    "wan21": {},
    "wan22_a14b": dict(boundary_ratio=0.875, shift=12.0),  # Wan2.2 T2V-A14B's boundary and sample_shift
    "wan22_ti2v_5b": dict(wan22_vae=True, latent_channels=48, shift=5.0),  # TI2V-5B's sample_shift
    # I2V-A14B's boundary and sample_shift (Wan2.2's wan/configs/wan_i2v_A14B.py: boundary 0.900, sample_shift
    # 5.0): a 4-step schedule runs two steps on each expert
    "wan22_i2v_a14b": dict(boundary_ratio=0.9, shift=5.0, image_to_video=True),
}
TEMPORAL_FACTOR = 2  # the twins' VAE: one 2x temporal stage (the real ones: 4)


def _transformer(spec: TinyWanSpec) -> WanTransformer3DModel:
    # image to video: [latents | first-frame mask, a channel per frame of a temporal block | image condition]
    condition = spec.latent_channels + TEMPORAL_FACTOR if spec.image_to_video else 0
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=spec.latent_channels + condition,
        out_channels=spec.latent_channels,
        text_dim=spec.text_hidden,
        freq_dim=32,
        ffn_dim=2 * spec.heads * spec.head_dim,
        num_layers=spec.layers,
        rope_max_seq_len=32,
    )


def _vae(spec: TinyWanSpec) -> AutoencoderKLWan:
    if not spec.wan22_vae:  # one 2x stage in space and time; the factors the pipeline reads must agree
        return AutoencoderKLWan(base_dim=spec.vae_base_dim, z_dim=spec.latent_channels, dim_mult=[1, 2],
                                num_res_blocks=1, temperal_downsample=[True], scale_factor_spatial=2,
                                scale_factor_temporal=TEMPORAL_FACTOR)
    # on the CPU whatever the default device (a GPU benchmark builds the pipeline under one)
    gen = torch.Generator().manual_seed(spec.seed)
    mean = (0.2 * torch.randn(spec.latent_channels, generator=gen, device="cpu")).tolist()
    std = (0.5 + torch.rand(spec.latent_channels, generator=gen, device="cpu")).tolist()
    # Wan2.2's: 2 x 2 pixel patches (12 input channels), residual down/up blocks whose last stage
    # keeps its width (the shortcut's channel folding needs it), here one 2x stage in space and time
    return AutoencoderKLWan(base_dim=spec.vae_base_dim, decoder_base_dim=spec.vae_base_dim, z_dim=spec.latent_channels,
                            dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True], is_residual=True,
                            patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=4,
                            scale_factor_temporal=TEMPORAL_FACTOR, latents_mean=mean, latents_std=std)


def build_tiny_wan(spec: TinyWanSpec) -> WanPipeline | WanImageToVideoPipeline:
    torch.manual_seed(spec.seed)
    tokenizer = build_t5_tokenizer(spec.vocab, spec.max_sequence_length)
    text_encoder = UMT5EncoderModel(UMT5Config(**t5_config(len(tokenizer), spec.text_hidden)))
    transformer = _transformer(spec)
    transformer_2 = _transformer(spec) if spec.boundary_ratio is not None else None
    vae = _vae(spec)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=spec.shift)
    pipeline = WanImageToVideoPipeline if spec.image_to_video else WanPipeline
    return pipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                    scheduler=scheduler, transformer_2=transformer_2, boundary_ratio=spec.boundary_ratio,
                    expand_timesteps=spec.wan22_vae)


def make_tiny_wan_dir(path: str, variant: str = "wan21", **spec_kw) -> str:
    """Build, save and return a tiny random Wan model directory of a `VARIANTS` layout (for tests;
    about a second)."""
    spec = TinyWanSpec(**{**VARIANTS[variant], **spec_kw})
    return save_tiny(build_tiny_wan(spec), path, "wan", spec, resolution=spec.resolution,
                     max_sequence_length=spec.max_sequence_length, num_frames=spec.num_frames)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from async_flowgrpo.checkpoint import output_dir_arg

    ap = argparse.ArgumentParser(description="Write a tiny random Wan twin (5 frames of 32 x 32) to a "
                                             "directory, for CPU runs: model.family=wan model.path=DIR")
    ap.add_argument("out", type=output_dir_arg, help="directory to write (created)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="wan21",
                    help="wan21 (default); wan22_a14b: two experts; wan22_ti2v_5b: per-token timesteps, Wan2.2 VAE; "
                         "wan22_i2v_a14b: two experts, image to video")
    args = ap.parse_args(argv)
    print(make_tiny_wan_dir(args.out, args.variant))


if __name__ == "__main__":
    main()
