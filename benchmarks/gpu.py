#!/usr/bin/env python
"""GPU smoke and speed: real-size model shapes with random weights, in one process.

No download: each shape's transformer and VAE are built from the public checkpoint's config with
random weights. `--shape` picks SD3.5-Medium (default), FLUX.1-dev (12 B), Qwen-Image (20 B),
Wan2.1-T2V-1.3B, Wan2.2-T2V-A14B (two 14 B experts) or Wan2.2-TI2V-5B (the videos: 33 frames at
480 x 480), and the image-conditioned ones: FLUX.1-Kontext-dev (1024 px), Qwen-Image-Edit and
Wan2.2-I2V-A14B, each given one source image per prompt, which our rollout receives as a run's
does (a JSONL prompt file's "images", loaded into the prompt's metadata) and the plain pipeline
call as its `image`. Text encoders are stand-ins of one or two layers at the
width the transformer takes (SD3's two CLIPs at full size; T5 left out, as in the embedded model,
so the pipeline pads its 256 tokens with zeros; Qwen2.5-VL's 7 B, Qwen-Image's and Qwen-Image-Edit's
text encoder, one layer at its width, with a one-block vision tower of its patch and merge sizes
for Edit, so that a 1024 x 1024 source image is its 1,369 tokens of the text sequence): the
transformer sees real-size inputs, and text
encoding, once per batch, is cheaper than with the real encoders. Settings are the family's
config/model/*.yaml (512 px, 10 steps, CFG, SDE window, LoRA rank 32, bf16) on a smaller batch.
Measured, in this order:

1. the bf16 matmul ceiling of this device (8192^3, the MFU denominator beside the datasheet's);
2. a plain diffusers pipeline call (same model, steps, CFG and batch) against our rollout
   (`DiffusionPolicy.generate`, LoRA attached): images/s, their ratio, FLOPs and MFU; then ours
   with the adapters off, and with the LoRA deltas folded in (`rollout.fuse_lora`, what rollout
   actors do on GPUs) with how far the trainer's recompute is from its log-probs;
3. the trainer step (`Learner.train_step`): LoRA at micro-batch 4 with gradient checkpointing, 4
   without, 16 without (the config's; `--train-rows` picks others); full fine-tuning (fp32 master weights, bf16 autocast) at
   micro-batch 4 with checkpointing: trained images/s, MFU, peak memory;
4. the checkpoint engine on this one GPU: NCCL group of one rank (NCCL refuses two ranks on one
   device), GPU packing into buckets and unpacking, checked bit for bit;
5. the pynvml monitor (`perf/gpu_util`, `perf/gpu_mem_gb`) over the rollout;
6. the embedded default (the shapes model, its config) in one process, sync update, on this
   device and on its CPU: samples/s.

Alone, with `--reward-model`: a rollout worker generating while PickScore's CLIP ViT-H/14 (random
weights) scores its groups on the same device, `reward.overlap` on and off (`section_reward`).
`--rollout-compile` adds the rollout with its blocks compiled to section 2.

FLOPs are counted by torch's FlopCounterMode over one call (matmuls, attention, convolutions),
model FLOPs only: with gradient checkpointing off; a rollout's or pipeline's counted call is its
warm-up. Each section's result, or its error, is
written to the JSON as soon as it is known, so a failure loses nothing measured before it.

    python benchmarks/gpu.py                                   # SD3.5-Medium on a GPU (~4 min on an H200)
    python benchmarks/gpu.py --shape flux_dev --skip-embedded  # another family (no full fine-tuning at 12 B)
    python benchmarks/gpu.py --shape wan21_1_3b --skip-embedded --prompts 1 --group-size 4   # video: 190 s did not finish batch 16
    python benchmarks/gpu.py --shape flux_kontext --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --repeats 1 --train-rows 1c
    CUDA_LAUNCH_BLOCKING=1 python benchmarks/gpu.py --shape flux_dev --train-only --train-rows 4c,4,8   # trainer rows alone
    python benchmarks/gpu.py --shape tiny --device cpu --repeats 1 --skip-embedded   # the same code, tiny (tests)
    python benchmarks/gpu.py --prompts 1 --group-size 8 --repeats 2 --reward-model clip_h --reward-groups 4   # a reward model beside

Writes benchmarks/results/gpu/<shape>_<device name>.json (or --out).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository on sys.path, sets the offline environment)
from common import RESULTS, log, set_group_advantages, write_json  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from async_flowgrpo.builders import build_learner  # noqa: E402
from async_flowgrpo.conditioning import SOURCE_IMAGES, with_sources  # noqa: E402
from async_flowgrpo.config import load_config  # noqa: E402
from async_flowgrpo.models import pipeline_adapter_class  # noqa: E402
from async_flowgrpo.models.common import PromptEmbeds  # noqa: E402
from async_flowgrpo.policy import compile_blocks  # noqa: E402
from async_flowgrpo.prompts import load_prompts  # noqa: E402
from async_flowgrpo.sampling import rollout_sampling  # noqa: E402

# Dense bf16 peaks from the vendors' datasheets (TFLOP/s, SXM parts); MFU is also given against
# the matmul rate measured on the device, which is what a kernel can reach.
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}

def _tiny(config: dict, **sizes) -> dict:
    return {**config, **sizes}


# Real-size shapes (the public checkpoints' transformer configs) and tiny twins of each for the
# tests. `text`: the stand-in text encoders' widths (they must match the transformer's inputs; their
# depth is 1-2 layers, except SD3's CLIP pair at full size); `vae`: real-size VAE unless given.
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                   qk_norm="rms_norm")
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
WAN21_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                  text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan2.2 T2V-A14B: two experts of this shape (transformer, transformer_2); TI2V-5B: one, over the Wan2.2 VAE
WAN22_A14B = _tiny(WAN21_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN22_TI2V_5B = _tiny(WAN21_1_3B, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336)
# Wan2.2 I2V-A14B: A14B's experts taking [latents | first-frame mask (the VAE's 4 temporal frames) | image latents]
WAN22_I2V_A14B = _tiny(WAN22_A14B, in_channels=16 + 4 + 16)
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                 scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


SHAPES = {
    "sd35_medium": dict(family="sd3", config="sd35_medium", transformer=SD35_MEDIUM, clip=((768, 12, 12), (1280, 32, 20)),
                        vae=dict(block_out_channels=(128, 256, 512, 512)), text_tokens=256, resolution=512),
    # full fine-tuning needs 16 bytes a parameter (fp32 weights, gradients, Adam): 190 and 320 GB here
    "flux_dev": dict(family="flux", config="flux_dev", transformer=FLUX_DEV, text_tokens=512, resolution=512,
                     full_fine_tuning=False),
    "qwen_image": dict(family="qwen_image", config="qwen_image", transformer=QWEN_IMAGE, text_tokens=512, resolution=512,
                       full_fine_tuning=False),
    "wan21_1_3b": dict(family="wan", config="wan21_t2v_1_3b", transformer=WAN21_1_3B, text_tokens=512, resolution=480,
                       num_frames=33),
    # `variant`: the tiny_wan layout (validation model, experts, per-token timesteps); 2 x 14 B in bf16
    "wan22_a14b": dict(family="wan", variant="wan22_a14b", config="wan22_t2v_a14b", transformer=WAN22_A14B,
                       text_tokens=512, resolution=480, num_frames=33, full_fine_tuning=False),
    "wan22_ti2v_5b": dict(family="wan", variant="wan22_ti2v_5b", config="wan22_ti2v_5b", transformer=WAN22_TI2V_5B,
                          vae=WAN22_VAE, text_tokens=512, resolution=480, num_frames=33),
    # image-conditioned (`source_images` per prompt): FLUX.1-Kontext-dev's transformer is FLUX.1-dev's, Qwen-Image-Edit's
    # Qwen-Image's (its source image resized to 1024 x 1024 for the VAE and the text encoder, as the pipeline does,
    # whatever the output size: 4,096 image tokens and 1,369 vision tokens beside the 1,024 noisy ones)
    "flux_kontext": dict(family="flux_kontext", config="flux_kontext_dev", transformer=FLUX_DEV, text_tokens=512,
                         resolution=1024, source_images=1, full_fine_tuning=False),
    "qwen_image_edit": dict(family="qwen_image_edit", config="qwen_image_edit", transformer=QWEN_IMAGE, text_tokens=1536,
                            resolution=512, source_images=1, full_fine_tuning=False),
    "wan22_i2v_a14b": dict(family="wan", variant="wan22_i2v_a14b", config="wan22_i2v_a14b", transformer=WAN22_I2V_A14B,
                           text_tokens=512, resolution=480, num_frames=33, source_images=1, full_fine_tuning=False),
    # TI2V-5B given a first frame: against WanImageToVideoPipeline with expand_timesteps (no image encoder)
    "wan22_ti2v_5b_image": dict(family="wan", variant="wan22_ti2v_5b", config="wan22_ti2v_5b", transformer=WAN22_TI2V_5B,
                                vae=WAN22_VAE, text_tokens=512, resolution=480, num_frames=33, source_images=1),
    # tiny twins: the same code on CPU in seconds (tests); the image-conditioned ones are CPU checks by hand (Kontext's
    # and I2V's about 9 s, Qwen-Image-Edit's minutes: its pipeline resizes every source to 1024 x 1024)
    "tiny": dict(family="sd3", config="sd35_medium", clip=((32, 1, 2), (32, 1, 2)), text_tokens=4, resolution=64,
                 transformer=_tiny(SD35_MEDIUM, sample_size=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
                                   pos_embed_max_size=16, dual_attention_layers=(0,)),
                 vae=dict(block_out_channels=(32, 32, 32, 32))),
    "tiny_flux": dict(family="flux", config="flux_dev", text_tokens=8, resolution=64,
                      transformer=_tiny(FLUX_DEV, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                        axes_dims_rope=(4, 6, 6)),
                      vae=dict(block_out_channels=(32, 32, 32, 32))),
    "tiny_qwen_image": dict(family="qwen_image", config="qwen_image", text_tokens=16, resolution=64,
                            transformer=_tiny(QWEN_IMAGE, num_layers=1, attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
                            vae=dict(base_dim=8)),
    "tiny_wan": dict(family="wan", config="wan21_t2v_1_3b", text_tokens=8, resolution=64, num_frames=5,
                     transformer=_tiny(WAN21_1_3B, num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32,
                                       ffn_dim=48, num_layers=1, rope_max_seq_len=32),
                     vae=dict(base_dim=8)),
    "tiny_wan22_a14b": dict(family="wan", variant="wan22_a14b", config="wan22_t2v_a14b", text_tokens=8, resolution=64,
                            num_frames=5, transformer=_tiny(WAN22_A14B, num_attention_heads=2, attention_head_dim=12,
                                                            text_dim=32, freq_dim=32, ffn_dim=48, num_layers=1,
                                                            rope_max_seq_len=32),
                            vae=dict(base_dim=8), full_fine_tuning=False),
    "tiny_flux_kontext": dict(family="flux_kontext", config="flux_kontext_dev", text_tokens=8, resolution=64, source_images=1,
                              full_fine_tuning=False,
                              transformer=_tiny(FLUX_DEV, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                                axes_dims_rope=(4, 6, 6)),
                              vae=dict(block_out_channels=(32, 32, 32, 32))),
    "tiny_qwen_image_edit": dict(family="qwen_image_edit", config="qwen_image_edit", text_tokens=1536, resolution=64,
                                 source_images=1, vae=dict(base_dim=8),
                                 transformer=_tiny(QWEN_IMAGE, num_layers=1, attention_head_dim=16, num_attention_heads=2,
                                                   joint_attention_dim=32, axes_dims_rope=(4, 6, 6))),
    "tiny_wan22_i2v_a14b": dict(family="wan", variant="wan22_i2v_a14b", config="wan22_i2v_a14b", text_tokens=8,
                                resolution=64, num_frames=5, source_images=1,
                                transformer=_tiny(WAN22_I2V_A14B, num_attention_heads=2, attention_head_dim=12,
                                                  text_dim=32, freq_dim=32, ffn_dim=48, num_layers=1, rope_max_seq_len=32),
                                vae=dict(base_dim=8), full_fine_tuning=False),
    "tiny_wan22_ti2v_5b_image": dict(family="wan", variant="wan22_ti2v_5b", config="wan22_ti2v_5b", text_tokens=8,
                                     resolution=64, num_frames=5, source_images=1,
                                     transformer=_tiny(WAN22_TI2V_5B, num_attention_heads=2, attention_head_dim=12,
                                                       text_dim=32, freq_dim=32, ffn_dim=48, num_layers=1,
                                                       rope_max_seq_len=32),
                                     # tiny_wan's Wan2.2 layout: 2 x 2 pixel patches, one 2x stage in space and time
                                     vae=dict(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1], num_res_blocks=1,
                                              temperal_downsample=[True], is_residual=True, patch_size=2, in_channels=12,
                                              out_channels=12, scale_factor_spatial=4, scale_factor_temporal=2,
                                              latents_mean=[0.0] * 48, latents_std=[1.0] * 48)),
}
PROMPTS = ["a red circle left of a blue square", "two green triangles", "a yellow star above a purple circle",
           "three blue squares"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="sd35_medium")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=8, help="images per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (after one warm-up)")
    ap.add_argument("--frames", type=int, default=None, help="video shapes: frames per clip (default the shape's)")
    ap.add_argument("--train-rows", default="4c,4,16",
                    help="LoRA trainer rows, comma-separated micro-batch sizes, 'c' = gradient checkpointing on, "
                         "'b' = computed in bf16 without autocast, the adapters in bf16 too (a speed bound: "
                         "Adam's updates of bf16 adapters round away), 'k' = the transformer's blocks compiled (FLOPs are counted on the first row: "
                         "put a 'k' row after another)")
    ap.add_argument("--reward-model", choices=sorted(REWARD_CLIPS),
                    help="only the reward section: a rollout worker generating while this reward model (PickScore's "
                         "CLIP ViT-H/14, random weights) scores on the same device, reward.overlap on and off")
    ap.add_argument("--reward-groups", type=int, default=4, help="groups per timed call of the reward section")
    ap.add_argument("--rollout-compile", action="store_true",
                    help="also time the rollout with its blocks compiled (rollout.compile), after the adapters-off row")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the 'k' trainer rows and --rollout-compile (the tests use aot_eager: no C++ build)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every section, repeatable (--set algorithm.name=awm: AWM's "
                         "config file and its rollout, ODE samples, with it)")
    ap.add_argument("--skip-fused", action="store_true", help="no folded-LoRA rollout measurement")
    ap.add_argument("--train-only", action="store_true", help="only the LoRA trainer rows, on one generated batch")
    ap.add_argument("--profile", action="store_true",
                    help="profile one train step of each trainer row: device-busy vs wall time, time by kernel class")
    ap.add_argument("--skip-full", action="store_true", help="no full fine-tuning measurement")
    ap.add_argument("--autocast-ab", action="store_true", help="only: the LoRA policy with and without autocast, interleaved")
    ap.add_argument("--skip-embedded", action="store_true", help="no embedded-default loop")
    ap.add_argument("--embedded-steps", type=int, default=6, help="timed sync steps of the embedded default per device")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu/<shape>_<device>.json)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- model

@contextlib.contextmanager
def building(device: torch.device, dtype: torch.dtype):
    """Parameters created on `device` in `dtype` (a 20 B model never exists in fp32 on the CPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def text_width(shape: dict) -> int:
    t = shape["transformer"]
    return t.get("joint_attention_dim") or t["text_dim"]


def build_pipeline(shape: dict):
    """The family's diffusers pipeline at `shape`, random weights, on the current default device
    and dtype. Text encoders and tokenizers are the tiny models' stand-ins at the transformer's
    input widths (SD3's two CLIPs at full size); transformer and VAE from their real configs."""
    import diffusers

    from async_flowgrpo.models.tiny import build_tokenizer

    torch.manual_seed(0)
    family, vocab = shape["family"], tuple(sorted({w for p in PROMPTS for w in p.split()}))
    if family == "sd3":
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        tokenizers = [build_tokenizer(vocab, 77) for _ in shape["clip"]]

        def clip(hidden, layers, heads):
            return CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(tokenizers[0]), hidden_size=hidden, intermediate_size=4 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77, projection_dim=hidden,
                hidden_act="gelu", pad_token_id=0, bos_token_id=2, eos_token_id=3))

        return diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(**shape["transformer"]),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=sd3_style_vae(shape, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=clip(*shape["clip"][0]), tokenizer=tokenizers[0],
            text_encoder_2=clip(*shape["clip"][1]), tokenizer_2=tokenizers[1], text_encoder_3=None, tokenizer_3=None)
    # the tiny builders make the text side and scheduler; transformer and VAE are replaced (a
    # pipeline's __init__ derives its scale factors from the VAE, so it is built anew)
    if family in ("flux", "flux_kontext"):
        from async_flowgrpo.models.tiny_flux import TinyFluxSpec, build_tiny_flux
        from async_flowgrpo.models.tiny_kontext import build_tiny_kontext

        t = shape["transformer"]
        spec = TinyFluxSpec(vocab=vocab, resolution=shape["resolution"], clip_hidden=t["pooled_projection_dim"],
                            t5_hidden=t["joint_attention_dim"], t5_max_length=shape["text_tokens"])
        pipe = build_tiny_flux(spec) if family == "flux" else build_tiny_kontext(spec)
        parts = dict(transformer=diffusers.FluxTransformer2DModel(**t),
                     vae=sd3_style_vae(shape, scaling_factor=0.3611, shift_factor=0.1159))
    elif family in ("qwen_image", "qwen_image_edit"):
        from async_flowgrpo.models.tiny_qwen_image import TinyQwenImageSpec, build_tiny_qwen_image
        from async_flowgrpo.models.tiny_qwen_image_edit import build_tiny_qwen_image_edit

        width = text_width(shape)
        spec = TinyQwenImageSpec(vocab=vocab, text_hidden=width, text_layers=1, text_heads=max(2, width // 128),
                                 max_sequence_length=shape["text_tokens"],
                                 text_kv_heads=max(2, width // 128))  # torch's FLOP counter takes no GQA
        pipe = build_tiny_qwen_image(spec) if family == "qwen_image" else build_tiny_qwen_image_edit(spec)
        parts = dict(transformer=diffusers.QwenImageTransformer2DModel(**shape["transformer"]),
                     vae=diffusers.AutoencoderKLQwenImage(**shape.get("vae", {})))
        if family == "qwen_image_edit":
            parts["processor"] = qwen_vl_processor(pipe.tokenizer)
    elif family == "wan":
        from async_flowgrpo.models.tiny_wan import VARIANTS, TinyWanSpec, build_tiny_wan

        pipe = build_tiny_wan(TinyWanSpec(vocab=vocab, text_hidden=text_width(shape), max_sequence_length=shape["text_tokens"],
                                          **VARIANTS[shape.get("variant", "wan21")]))
        parts = dict(transformer=diffusers.WanTransformer3DModel(**shape["transformer"]),
                     vae=diffusers.AutoencoderKLWan(**shape.get("vae", {})),
                     boundary_ratio=pipe.config.boundary_ratio, expand_timesteps=pipe.config.expand_timesteps)
        if pipe.transformer_2 is not None:
            parts["transformer_2"] = diffusers.WanTransformer3DModel(**shape["transformer"])
    else:
        raise ValueError(f"unknown family {family!r}")
    return type(pipe)(**{**pipe.components, **parts})


def qwen_vl_processor(tokenizer):
    """Qwen2.5-VL's image processor settings (14 px patches merged 2 x 2: 28 px per vision token,
    its pixel bounds) over the stand-in tokenizer, built without torchvision as the adapter's `load` does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from async_flowgrpo.models.qwen_image_edit import images_only_processor

    with tempfile.TemporaryDirectory(prefix="qwen_vl_processor_") as folder:
        Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                                 max_pixels=28 * 28 * 16384).save_pretrained(folder)
        return images_only_processor(folder, tokenizer)


def sd3_style_vae(shape: dict, **constants):
    """SD3's and Flux's AutoencoderKL: 16 latent channels, no quant convs, 8x down (4 blocks)."""
    from diffusers import AutoencoderKL

    channels = shape["vae"]["block_out_channels"] if "vae" in shape else (128, 256, 512, 512)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(channels),
                         up_block_types=("UpDecoderBlock2D",) * len(channels), block_out_channels=channels,
                         layers_per_block=2, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                         **constants)


def make_adapter(shape: dict, device: torch.device, dtype: torch.dtype):
    with building(device, dtype):
        pipe = build_pipeline(shape)
    settings = {"max_sequence_length": shape["text_tokens"], "resolution": shape["resolution"]}
    if "num_frames" in shape:
        settings["num_frames"] = shape["num_frames"]
    return pipeline_adapter_class(type(pipe).__name__).from_pipeline(pipe, settings)


def bench_config(args, shape: dict, validation_dir: str, *overrides: str):
    """The family's config/model/<file>.yaml on this benchmark's batch. model.path names a tiny
    model of the family only to satisfy validation: the model itself is built in memory."""
    frames = [f"rollout.num_frames={shape['num_frames']}"] if "num_frames" in shape else []
    sources = [f"rollout.prompts={args.prompt_file}", f"eval.prompts={args.prompt_file}"] if args.prompt_file else []
    return load_config("sync", [
        f"config/model/{shape['config']}.yaml", f"model.path={validation_dir}",
        f"rollout.groups_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
        f"rollout.resolution={shape['resolution']}", *frames, *sources, *args.overrides, *overrides,
    ])


def validation_model(shape: dict, workdir: str) -> str:
    """A tiny model directory of the shape's family (what config validation reads)."""
    from async_flowgrpo.models import tiny_flux, tiny_kontext, tiny_qwen_image, tiny_qwen_image_edit, tiny_sd3, tiny_wan

    make = {"sd3": tiny_sd3.make_tiny_model_dir, "flux": tiny_flux.make_tiny_flux_dir,
            "qwen_image": tiny_qwen_image.make_tiny_qwen_image_dir, "wan": tiny_wan.make_tiny_wan_dir,
            "flux_kontext": tiny_kontext.make_tiny_kontext_dir,
            "qwen_image_edit": tiny_qwen_image_edit.make_tiny_qwen_image_edit_dir}[shape["family"]]
    variant = {"variant": shape["variant"]} if "variant" in shape else {}
    return make(os.path.join(workdir, shape["family"]), **variant)


def source_prompts(shape: dict, workdir: str, count: int) -> str | None:
    """An image-conditioned shape's prompt file: JSONL rows of PROMPTS whose "images" are source
    images of the sampled size (random pixels: the cost does not depend on them), as a run's
    rollout.prompts holds them; None for the other shapes."""
    if not shape.get("source_images"):
        return None
    from PIL import Image

    res, gen = shape["resolution"], torch.Generator().manual_seed(0)
    rows = []
    for i, text in enumerate(PROMPTS[:count]):
        names = [f"source_{i}_{k}.png" for k in range(shape["source_images"])]
        for name in names:
            pixels = torch.randint(0, 256, (res, res, 3), generator=gen, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(os.path.join(workdir, name))
        rows.append(json.dumps({"prompt": text, "images": names}))
    path = os.path.join(workdir, "sources.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")
    return path


def batch_prompts(args, cfg) -> tuple[list[str], list[dict] | None]:
    """The batch's prompts and their metadata: PROMPTS; for an image-conditioned shape the rows of
    its prompt file with their source images loaded into the metadata, as a rollout worker hands
    them to `generate` (`conditioning.with_sources`)."""
    if not args.prompt_file:
        return PROMPTS[: args.prompts], None
    rows = load_prompts(cfg.rollout.prompts)[: args.prompts]
    return [p.text for p in rows], [with_sources(p) for p in rows]


def generate(policy, batch, args, sampling: dict, seed: int):
    prompts, metadata = batch
    return policy.generate(prompts, args.group_size, **sampling, seed=seed, metadata=metadata)


def pipeline_calls(shape: dict, enc, metadata: list[dict] | None, group_size: int, sampling: dict,
                   guidance_scale_2: float | None = None) -> list[dict]:
    """The plain pipeline calls that make our rollout's batch: one call, or with source images one
    per prompt, given its image (the pipelines take one image for a whole call)."""
    if metadata is None:
        return [pipeline_kwargs(shape, enc, group_size, sampling, guidance_scale_2)]
    from PIL import Image

    def rows(i):
        return PromptEmbeds(*(t[i : i + 1] if t is not None else None for t in
                              (enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled)))

    return [pipeline_kwargs(shape, rows(i), group_size, sampling, guidance_scale_2,
                            image=Image.fromarray(m[SOURCE_IMAGES][0].numpy())) for i, m in enumerate(metadata)]


def fp32_latents_at_the_end(pipe, i: int, t, tensors: dict) -> dict:
    """A pipeline callback: the last step's latents in fp32, for a VAE in fp32 beside a bf16
    transformer (diffusers' SD3, Flux and Kontext pipelines decode the latents uncast)."""
    return {"latents": tensors["latents"].float()} if i == len(pipe.scheduler.timesteps) - 1 else {}


def pipeline_kwargs(shape: dict, enc, group_size: int, sampling: dict, guidance_scale_2: float | None = None,
                    image=None) -> dict:
    """A plain pipeline call's arguments for the batch our rollout generates: the same
    conditioning (embeddings given, repeated per image: the pipelines do not repeat given ones),
    steps, guidance and size; `image` (PIL) an image-conditioned pipeline's source image."""
    def rep(t):
        return t.repeat_interleave(group_size, 0) if t is not None else None

    res, g = shape["resolution"], sampling["guidance_scale"]
    out = dict(num_inference_steps=sampling["num_steps"], height=res, width=res, output_type="np")
    if image is not None:
        out["image"] = image
    family = shape["family"]
    if family == "sd3":
        return dict(prompt_embeds=rep(enc.embeds), pooled_prompt_embeds=rep(enc.pooled), guidance_scale=g,
                    negative_prompt_embeds=rep(enc.negative_embeds), negative_pooled_prompt_embeds=rep(enc.negative_pooled),
                    **out)
    if family == "flux":  # guidance-distilled: g is the guidance embedding's input, no CFG batch
        return dict(prompt_embeds=rep(enc.embeds), pooled_prompt_embeds=rep(enc.pooled), guidance_scale=g, **out)
    if family == "flux_kontext":  # Flux's, the `pooled` slot [CLIP pooled | image tokens] cut to CLIP's; the
        # source at the output's size, not moved to a preferred Kontext size nor the output to max_area
        pooled = enc.pooled[:, : shape["transformer"]["pooled_projection_dim"]].to(enc.embeds.dtype)  # (kept in fp32 there)
        return dict(prompt_embeds=rep(enc.embeds), pooled_prompt_embeds=rep(pooled), guidance_scale=g, max_area=res * res,
                    _auto_resize=False, **out)
    if family in ("qwen_image", "qwen_image_edit"):
        # the adapter's `pooled` slot starts with the text mask (Edit: then the image tokens); trim the
        # shared padding as the adapter does
        mask, neg_mask = (t[:, : shape["text_tokens"]] for t in (enc.pooled, enc.negative_pooled))
        length = int(torch.cat([mask, neg_mask]).bool().any(0).nonzero().max()) + 1
        return dict(prompt_embeds=rep(enc.embeds[:, :length]), prompt_embeds_mask=rep(mask[:, :length].long()),
                    negative_prompt_embeds=rep(enc.negative_embeds[:, :length]),
                    negative_prompt_embeds_mask=rep(neg_mask[:, :length].long()), true_cfg_scale=g, **out)
    two = {"guidance_scale_2": guidance_scale_2} if guidance_scale_2 is not None else {}  # A14B's low-noise expert
    return dict(prompt_embeds=rep(enc.embeds), negative_prompt_embeds=rep(enc.negative_embeds), guidance_scale=g,
                num_frames=shape["num_frames"], **two, **out)


# ---------------------------------------------------------------- measuring

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warm_up: bool = True) -> list[float]:
    """Seconds per call of fn(), `repeats` calls after one warm-up."""
    if warm_up:
        fn()
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def per_second(n: int, secs: list[float]) -> float:
    """Items per second of the mean call."""
    return round(n / (sum(secs) / len(secs)), 3)


def count_flops(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def counted_and_timed(fn, device: torch.device, repeats: int) -> tuple[float, list[float]]:
    """Model FLOPs of one call of fn(), then `timed` without another warm-up: the counted call is
    one (FlopCounterMode dispatches the same kernels), which saves a call of a large model."""
    flops = count_flops(fn)
    return flops, timed(fn, device, repeats, warm_up=False)


def rate(flops: float, seconds: list[float], peaks: dict) -> dict:
    """Achieved TFLOP/s of the mean call and its share of each peak (MFU)."""
    achieved = flops / (sum(seconds) / len(seconds)) / 1e12
    return {"tflops": round(achieved, 1), **{f"mfu_vs_{k}": round(achieved / v, 3) for k, v in peaks.items() if v}}


def peak_memory_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def matmul_ceiling(device: torch.device) -> float | None:
    """bf16 TFLOP/s of an 8192^3 matmul on random data (mean of 10 after 3 warm-ups)."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return round(2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)


def random_rewards(groups, cfg) -> None:
    """Rewards that give every group a spread (the trainer's cost does not depend on their values)."""
    gen = torch.Generator().manual_seed(0)
    for g in groups:
        g.rewards = torch.rand(g.size, generator=gen)
    set_group_advantages(groups, cfg.algorithm)


# ---------------------------------------------------------------- sections

def section_rollout(args, shape, device, peaks, result, save):
    """Plain pipeline call, then our rollout, on the same model and batch; then the LoRA trainer."""
    from async_flowgrpo.gpu_monitor import GpuMonitor

    cfg = bench_config(args, shape, args.validation_dir)
    sampling = rollout_sampling(cfg.rollout)
    n = args.prompts * args.group_size
    batch = batch_prompts(args, cfg)
    prompts, metadata = batch

    reset_memory(device)
    adapter = make_adapter(shape, device, torch.bfloat16)  # config/model/*.yaml's model.dtype
    images = {} if metadata is None else {"images": [m[SOURCE_IMAGES] for m in metadata]}
    enc = adapter.encode_prompts(prompts, cfg=True, **images)
    calls = pipeline_calls(shape, enc, metadata, args.group_size, sampling, cfg.model.guidance_scale_2)
    pipe = adapter.pipeline
    if metadata is not None and type(pipe).__name__ == "WanPipeline":
        # TI2V-5B given a first frame: its checkpoint is a WanPipeline, which takes no image; diffusers'
        # image-to-video pipeline over the same modules does (its expand_timesteps branch: the image's
        # latent as the first frame, at timestep 0), which is what our adapter reproduces
        from diffusers import WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(**pipe.components, boundary_ratio=pipe.config.boundary_ratio,
                                       expand_timesteps=pipe.config.expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    if device.type == "cpu":  # the adapter keeps the VAE in fp32 there (FamilyAdapter._vae_in_fp32_on_cpu)
        calls = [dict(call, callback_on_step_end=fp32_latents_at_the_end) for call in calls]

    def pipeline_call():
        return [pipe(**call)[0] for call in calls]

    flops, secs = counted_and_timed(pipeline_call, device, args.repeats)
    result["pipeline"] = {"images": n, "seconds": secs, "images_per_s": per_second(n, secs),
                          "flops_per_image": flops / n, **rate(flops, secs, peaks), "peak_memory_gb": peak_memory_gb(device)}
    log(f"plain diffusers pipeline: {result['pipeline']['images_per_s']} images/s, {result['pipeline']['tflops']} TFLOP/s")
    save()

    # our rollout: the trainer's policy (LoRA attached) generating, as a rollout actor does
    reset_memory(device)
    learner = build_learner(cfg, device=device, adapter=adapter)
    policy = learner.policy
    monitor = GpuMonitor(interval_s=0.2) if device.type == "cuda" else None
    if monitor is not None:
        monitor.start()
    groups = []

    def rollout():
        with rollout_attention():
            groups[:] = generate(policy, batch, args, sampling, seed=len(groups))

    flops, secs = counted_and_timed(rollout, device, args.repeats)
    if monitor is not None:
        result["gpu_monitor"] = monitor.read()
        monitor.stop()
    r = result["rollout"] = {"images": n, "seconds": secs, "images_per_s": per_second(n, secs),
                             "flops_per_image": flops / n, **rate(flops, secs, peaks),
                             "peak_memory_gb": peak_memory_gb(device)}
    r["vs_pipeline"] = round(r["images_per_s"] / result["pipeline"]["images_per_s"], 3)
    log(f"rollout (LoRA attached): {r['images_per_s']} images/s = {r['vs_pipeline']} x the pipeline; "
        f"monitor {result.get('gpu_monitor')}")
    policy.adapter.transformer.disable_adapters()  # what the adapters cost, apart from our sampling loop
    flops, secs = counted_and_timed(rollout, device, args.repeats)
    policy.adapter.transformer.enable_adapters()
    result["rollout_adapters_off"] = {"seconds": secs, "images_per_s": per_second(n, secs), "flops_per_image": flops / n}
    log(f"rollout, adapters off: {result['rollout_adapters_off']['images_per_s']} images/s")
    save()
    if args.rollout_compile:  # rollout.compile, the adapters attached (a warm-up call compiles)
        with compiled_blocks(policy.adapter.transformer, args.compile_backend):
            secs = timed(rollout, device, args.repeats)
        c = result["rollout_compiled"] = {"seconds": secs, "images_per_s": per_second(n, secs)}
        c["vs_pipeline"] = round(c["images_per_s"] / result["pipeline"]["images_per_s"], 3)
        log(f"rollout, blocks compiled: {c['images_per_s']} images/s = {c['vs_pipeline']} x the pipeline")
        save()
    if not args.skip_fused:
        result["rollout_fused"] = {}
        fused_rollout(args, learner, cfg, batch, sampling, device, rollout, result["rollout_fused"], save)
        log(f"rollout, LoRA folded in (rollout.fuse_lora): {result['rollout_fused']}")
        save()

    random_rewards(groups, cfg)
    measure_train_rows(args, learner, groups, device, peaks, result, save)

    section_engine(learner, device, result, save)
    del learner, policy, adapter, pipe, enc, calls, groups
    return result


def measure_train_rows(args, learner, groups, device, peaks, result, save) -> None:
    """The LoRA trainer rows of --train-rows on `groups`. A failure other than running out of
    memory is re-raised with the last nn.Linear the transformer entered (its input shape, dtype and
    strides): under CUDA_LAUNCH_BLOCKING=1 that names the layer a failing kernel belongs to."""
    transformer = learner.policy.adapter.transformer
    model_flops = None
    for row in train_rows(args.train_rows):
        key = row.key
        try:
            if row.checkpointing:
                transformer.enable_gradient_checkpointing()
            else:
                transformer.disable_gradient_checkpointing()
            learner.micro_batch_size = row.micro
            # the profile too runs in the row's setting (run 10 profiled its bf16 row under autocast)
            with (pure_bf16(learner) if row.bf16 else contextlib.nullcontext(),
                  compiled_blocks(transformer, args.compile_backend) if row.compiled else contextlib.nullcontext()):
                measure_train_row(args, learner, groups, device, peaks, result, save, key, model_flops)
            model_flops = result[key]["model_flops_per_step"]
        except torch.OutOfMemoryError as e:
            result[key] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        save()


def measure_train_row(args, learner, groups, device, peaks, result, save, key, model_flops) -> None:
    """One trainer row into result[key], saved, then (--profile) one profiled step."""
    tracing = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"  # (the hooks cost host time: off when timing)
    with linear_trace(learner.policy.adapter.transformer) if tracing else contextlib.nullcontext({}) as last:
        try:
            result[key] = measure_train(args, learner, groups, device, peaks, model_flops)
        except torch.OutOfMemoryError:
            raise
        except Exception:
            result[key] = {"error": traceback.format_exc(limit=4), "last_linear": dict(last)}
            save()
            raise
    log(f"{key}: {result[key]['images_per_s']} trained images/s, {result[key].get('tflops')} TFLOP/s, "
        f"peak {result[key]['peak_memory_gb']} GB")
    save()  # before the profile, which can outlast a caller's time limit
    if args.profile:
        try:
            result[key]["profile"] = profile_step(lambda: learner.train_step(groups, version=0), device)
            log(f"{key} profile: {result[key]['profile']['summary']}")
        except Exception as e:  # noqa: BLE001  (a profiler failure must not cost the rows after it)
            result[key]["profile"] = {"error": f"{type(e).__name__}: {e}"}


# Kernel classes for the profile, matched on lower-cased kernel names (first match wins).
KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention", "sdpa", "mha", "softmax")),
                  ("gemm", ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "wgmma")),
                  ("norm", ("norm",)),
                  ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "cat", "index", "reduce")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def profile_step(fn, device: torch.device, top: int = 15) -> dict:
    """One profiled call of fn: wall time, time the device spent in kernels (the rest is host
    gaps: launches, Python, syncs), that kernel time by class, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    # kernels only on a GPU: with host events too, one step's tens of thousands of launches took
    # the profiler over 45 s to process on an H200
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_class: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        us = e.device_time  # microseconds (device_time_total would double-count nested events)
        by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    busy = sum(by_class.values()) / 1e6
    top_kernels = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    out = {"wall_s": round(wall, 3), "kernel_s": round(busy, 3), "kernels": len(kernels),
           "kernel_share_of_wall": round(busy / wall, 3) if wall else None,
           "by_class_s": {k: round(v / 1e6, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
           "top_kernels_s": [[name[:120], round(us / 1e6, 4)] for name, us in top_kernels]}
    out["summary"] = (f"wall {out['wall_s']} s, kernels {out['kernel_s']} s ({out['kernel_share_of_wall']}), "
                      f"{out['by_class_s']}")
    return out


@contextlib.contextmanager
def linear_trace(module: torch.nn.Module):
    """Yields a dict that holds, at any moment, the last nn.Linear under `module` entered and its input."""
    last: dict = {}

    def record(name, layer, inputs):
        x = inputs[0]
        last.update(name=name, input=list(x.shape), input_dtype=str(x.dtype), input_stride=list(x.stride()),
                    weight=list(layer.weight.shape), weight_dtype=str(layer.weight.dtype))

    handles = [m.register_forward_pre_hook(functools.partial(record, name))
               for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield last
    finally:
        for h in handles:
            h.remove()


def section_train_only(args, shape, device, peaks, result, save):
    """Only the trainer rows (no pipeline or rollout timing): one generated batch, then --train-rows."""
    cfg = bench_config(args, shape, args.validation_dir)
    learner = build_learner(cfg, device=device, adapter=make_adapter(shape, device, torch.bfloat16))
    groups = generate(learner.policy, batch_prompts(args, cfg), args, rollout_sampling(cfg.rollout), seed=0)
    random_rewards(groups, cfg)
    measure_train_rows(args, learner, groups, device, peaks, result, save)
    del learner, groups


class TrainRow(NamedTuple):
    checkpointing: bool
    micro: int
    bf16: bool = False  # computed in bf16 without autocast (pure_bf16)
    compiled: bool = False  # the transformer's blocks under torch.compile (compiled_blocks)

    @property
    def key(self) -> str:
        """The row's name in the result JSON, e.g. train_lora_micro16_checkpointing."""
        return (f"train_lora_micro{self.micro}" + ("_checkpointing" if self.checkpointing else "")
                + ("_bf16" if self.bf16 else "") + ("_compiled" if self.compiled else ""))


def train_rows(spec: str) -> list[TrainRow]:
    """'4c,16,16bk' -> rows of micro-batch 4 with gradient checkpointing, 16, and 16 in bf16 without
    autocast with its blocks compiled."""
    return [TrainRow("c" in row, int(row.rstrip("cbk")), "b" in row, "k" in row) for row in spec.split(",") if row]


@contextlib.contextmanager
def compiled_blocks(transformer: torch.nn.Module, backend: str):
    """The transformer's blocks compiled as trainer.compile compiles them (policy.compile_blocks),
    undone after; the timed calls come after the warm-up that compiles."""
    blocks = compile_blocks(transformer, backend)
    try:
        yield
    finally:
        for block in blocks:
            block._compiled_call_impl = None  # what nn.Module.compile set


@contextlib.contextmanager
def pure_bf16(learner):
    """The learner computing as the plain pipeline does, everything in bf16 and no autocast: the
    adapters cast to bf16 and the optimizer's state set aside (restored after). What a trainer with
    bf16 adapters and fp32 master copies in the optimizer would run its forward and backward at
    (run 10: 13 % faster than autocast at SD3.5-M's shape). The row trains the adapters in bf16: the
    rows after it start from those weights, which changes their cost in nothing."""
    policy = learner.policy
    params = policy.trainable_parameters()
    autocast, state = policy.autocast_dtype, learner.optimizer.state
    learner.optimizer.state = collections.defaultdict(dict)
    policy.autocast_dtype = None
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for p in params:
            p.data, p.grad = p.data.float(), None
        policy.autocast_dtype, learner.optimizer.state = autocast, state


@contextlib.contextmanager
def rollout_attention():
    """Attention backends as a rollout actor has them, the pipeline's: build_learner turns cuDNN's
    fused attention off for the whole process (its backward failed on the H200), which a rollout
    actor never does, and this process timed the pipeline before building the learner. Runs 1-13
    timed our rollout without cuDNN's kernel, so their ratios may hold an attention-kernel gap, the
    larger the more attention a shape has (Kontext's and Qwen-Image-Edit's doubled sequences)."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def fused_rollout(args, learner, cfg, batch, sampling, device, rollout, out: dict, save) -> None:
    """The rollout with the LoRA deltas folded into the base weights (what rollout actors do on a
    GPU): its speed, and, on adapters moved off zero (B = 0 at init would fold nothing), how far
    the trainer's recompute (logp/max_abs_diff) is from its log-probs, and from the adapters'. Into
    `out`, saved once the speeds are in (run 12's cap ended Kontext's row in the trainer's steps)."""
    policy = learner.policy
    n = args.prompts * args.group_size
    start = {k: v.clone() for k, v in policy.trainable_state().items()}
    rng = torch.Generator().manual_seed(0)
    moved = {k: v + 2e-3 * torch.randn(v.shape, generator=rng).to(v.device) if "lora_B" in k else v for k, v in start.items()}
    policy.load_trainable_state(moved)
    policy.fuse_lora()
    secs = timed(rollout, device, args.repeats)
    out.update(seconds=secs, images_per_s=per_second(n, secs))
    fused = generate(policy, batch, args, sampling, seed=99)
    # Folded, every weight the rollout touches is bf16, so it could compute as the plain pipeline
    # does, without autocast (which runs LayerNorm and softmax in fp32): a candidate for the rest
    # of the gap to the pipeline, at the price of a larger mismatch with the trainer (under autocast).
    on, policy.autocast_dtype = policy.autocast_dtype, None
    secs = timed(rollout, device, args.repeats)
    out["no_autocast"] = {"seconds": secs, "images_per_s": per_second(n, secs)}
    save()
    plain = generate(policy, batch, args, sampling, seed=99)
    policy.autocast_dtype = on
    policy.unfuse_lora()
    separate = generate(policy, batch, args, sampling, seed=99)
    # (the rollouts' own log-probs agree whatever the weights: each scores its own noise)
    for name, groups in (("fused", fused), ("fused_no_autocast", plain), ("adapters", separate)):  # one update each, undone after
        random_rewards(groups, cfg)
        out[f"trainer_logp_max_abs_diff_{name}"] = learner.train_step(groups, version=0).get("logp/max_abs_diff")
        policy.load_trainable_state(moved)
    policy.load_trainable_state(start)


def section_autocast_ab(args, shape, device, result, save):
    """The LoRA policy with and without autocast, interleaved on one model: rollout and train step
    (micro-batch 4, no checkpointing) seconds per call."""
    cfg = bench_config(args, shape, args.validation_dir)
    sampling = rollout_sampling(cfg.rollout)
    learner = build_learner(cfg, device=device, adapter=make_adapter(shape, device, torch.bfloat16))
    policy = learner.policy
    policy.adapter.transformer.disable_gradient_checkpointing()
    learner.micro_batch_size = 4
    batch = batch_prompts(args, cfg)
    groups = generate(policy, batch, args, sampling, seed=0)
    random_rewards(groups, cfg)
    out, on = {}, policy.autocast_dtype
    lora_layers = [m for m in policy.adapter.transformer.modules() if hasattr(m, "cast_input_dtype_enabled")]
    for _ in range(args.repeats):
        for autocast in (on, None):
            policy.autocast_dtype = autocast
            for m in lora_layers:  # without autocast peft must cast the activations to the adapters' fp32
                m.cast_input_dtype_enabled = autocast is None
            row = out.setdefault(str(autocast), {"rollout_s": [], "train_s": []})
            row["rollout_s"] += timed(lambda: generate(policy, batch, args, sampling, seed=1), device, 1)
            row["train_s"] += timed(lambda: learner.train_step(groups, version=0), device, 1)
    policy.autocast_dtype = on
    for m in lora_layers:
        m.cast_input_dtype_enabled = False
    result["autocast_ab"] = out
    log(f"autocast A/B: {out}")
    save()


def measure_train(args, learner, groups, device, peaks, model_flops: float | None) -> dict:
    """Seconds per train_step on `groups`; model FLOPs counted with checkpointing off (counted here
    when model_flops is None, by switching it off for the one counted step)."""
    n = sum(g.size for g in groups)
    reset_memory(device)
    secs = timed(lambda: learner.train_step(groups, version=0), device, args.repeats)
    out = {"images": n, "seconds": secs, "images_per_s": per_second(n, secs),
           "peak_memory_gb": peak_memory_gb(device)}
    if model_flops is None:
        transformer = learner.policy.adapter.transformer
        was = transformer.is_gradient_checkpointing
        transformer.disable_gradient_checkpointing()
        model_flops = count_flops(lambda: learner.train_step(groups, version=0))
        if was:
            transformer.enable_gradient_checkpointing()
    out.update(model_flops_per_step=model_flops, model_flops_per_image=model_flops / n, **rate(model_flops, secs, peaks))
    return out


def section_engine(learner, device, result, save):
    """The checkpoint engine on this device: bucket packing and unpacking of the trainable state
    (bit for bit), and a send over a one-rank group (NCCL on a GPU)."""
    from async_flowgrpo.sync.buckets import pack_bucket, plan, unpack
    from async_flowgrpo.sync.engine import WeightSender

    state = learner.policy.trainable_state()
    layout = plan(state, 64 * 2**20)
    tensors = list(state.values())
    sync(device)
    t0 = time.perf_counter()
    buffers = [pack_bucket(tensors, layout, k, torch.empty(size, dtype=torch.uint8, device=device))
               for k, size in enumerate(layout.bucket_sizes)]
    back = unpack(buffers, layout)
    sync(device)
    pack_s = time.perf_counter() - t0
    exact = all(torch.equal(back[k], v) for k, v in state.items())
    out = {"tensors": len(state), "bytes": layout.nbytes, "buckets": len(layout.bucket_sizes),
           "pack_unpack_s": round(pack_s, 4), "bit_exact": exact, "buffer_device": str(buffers[0].device)}
    sender = WeightSender(device=str(device))
    try:
        sender.connect(sender.new_address(), world_size=1)
        sender.send(state, version=0)  # warm-up: buffers, communicator
        stats = sender.send(state, version=1).stats
        out.update(backend=sender.group.pg.name(), send_s=round(stats.seconds, 4),
                   send_gb_per_s=round(stats.bytes / stats.seconds / 1e9, 2))
    finally:
        sender.close()
    result["engine"] = out
    log(f"checkpoint engine: {out}")
    save()


def section_full(args, shape, device, peaks, result, save):
    """Full fine-tuning: fp32 master weights (and optimizer state), bf16 compute under autocast."""
    cfg = bench_config(args, shape, args.validation_dir, "model.lora_rank=0", "algorithm.beta=0", "trainer.lr=1e-5",
                       "trainer.micro_batch_size=4", "model.gradient_checkpointing=true")
    reset_memory(device)
    learner = build_learner(cfg, device=device, adapter=make_adapter(shape, device, torch.float32))
    policy = learner.policy
    groups = generate(policy, batch_prompts(args, cfg), args, rollout_sampling(cfg.rollout), seed=0)
    random_rewards(groups, cfg)
    before = {k: v.clone() for k, v in list(policy.trainable_state().items())[:4]}
    try:
        out = measure_train(args, learner, groups, device, peaks, model_flops=None)
        out["master_dtype"] = str(next(iter(policy.trainable_state().values())).dtype)
        out["autocast_dtype"] = str(policy.autocast_dtype)
        out["weights_changed"] = any(not torch.equal(v, policy.trainable_state()[k]) for k, v in before.items())
    except torch.OutOfMemoryError as e:
        out = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    result["train_full"] = out
    log(f"train_full: {out.get('images_per_s')} trained images/s, {out.get('tflops')} TFLOP/s, "
        f"peak {out.get('peak_memory_gb')} GB {out.get('error', '')}")
    save()
    del learner, policy, groups


def section_embedded(args, device, result, save):
    """The embedded default (its config, its shapes reward) as a sync loop in one process."""
    from async_flowgrpo.rewards import CombinedReward

    out = {}
    for dev in dict.fromkeys([device.type, "cpu"]):
        cfg = load_config("sync", [])
        threads = torch.get_num_threads()
        if dev == "cpu":
            torch.set_num_threads(2)  # the 2-core machines every other number in the README comes from
        try:
            out[dev] = embedded_loop(cfg, torch.device(dev), args.embedded_steps, load_prompts, CombinedReward)
        finally:
            torch.set_num_threads(threads)
        log(f"embedded default, sync loop on {dev}: {out[dev]['samples_per_s']} samples/s")
    result["embedded"] = out
    save()


def embedded_loop(cfg, device: torch.device, steps: int, load_prompts, CombinedReward) -> dict:
    learner = build_learner(cfg, device=device)
    r = cfg.rollout
    rows = load_prompts(r.prompts)[: r.groups_per_step]
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    sampling = rollout_sampling(r)
    times = []
    for step in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        groups = learner.policy.generate([p.text for p in rows], r.group_size, **sampling, seed=step,
                                         metadata=[p.metadata for p in rows])
        for g, p in zip(groups, rows):
            g.rewards = reward(g.images, [p.text] * g.size, [p.metadata] * g.size)[0]
        set_group_advantages(groups, cfg.algorithm)
        learner.train_step(groups, version=step)
        sync(device)
        if step:  # step 0 is the warm-up
            times.append(time.perf_counter() - t0)
    n = r.groups_per_step * r.group_size
    return {"samples_per_step": n, "steps": steps, "seconds_per_step": [round(t, 3) for t in times],
            "samples_per_s": round(n * len(times) / sum(times), 2), "device": str(learner.policy.device)}


# ---------------------------------------------------------------- a reward model beside the rollout

# PickScore's model, CLIP ViT-H/14 (986 M parameters; flow_grpo's SD3.5 reward), and a tiny stand-in for CPU tests
REWARD_CLIPS = {
    "clip_h": dict(text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                   vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                               image_size=224, patch_size=14), projection_dim=1024),
    "tiny": dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
                 vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             image_size=24, patch_size=8), projection_dim=16),
}


def reward_clip_dir(name: str, workdir: str, device: torch.device) -> str:
    """A random CLIPModel of REWARD_CLIPS[name] saved as a local PickScore directory (bf16 weights,
    a word-level tokenizer, CLIP's image processor at the model's size): the `pickscore` reward's
    own code loads and runs it."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from async_flowgrpo.models.tiny import build_tokenizer

    spec, path = REWARD_CLIPS[name], os.path.join(workdir, f"reward_{name}")
    tokenizer = build_tokenizer(tuple(sorted({w for p in PROMPTS for w in p.split()})), 77)
    config = CLIPConfig(text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=77, pad_token_id=0,
                                         bos_token_id=2, eos_token_id=3, **spec["text"]),
                        vision_config=spec["vision"], projection_dim=spec["projection_dim"])
    torch.manual_seed(0)
    with building(device, torch.bfloat16):  # initialised where it runs: 986 M parameters
        CLIPModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    size = spec["vision"]["image_size"]
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(path)
    return path


def section_reward(args, shape, device, result, save):
    """A rollout worker (`RolloutWorker`, as a rollout actor runs it, without Ray) generating groups
    while PickScore's model (random weights, `--reward-model`) scores them on the same device, with
    reward.overlap on and off, interleaved: samples/s over --reward-groups groups per call, and the
    seconds a group takes to generate and to score alone (the faster of two calls each)."""
    from async_flowgrpo.builders import build_policy, should_fuse_lora
    from async_flowgrpo.rewards import CombinedReward
    from async_flowgrpo.rollout.engine import DiffusersEngine
    from async_flowgrpo.rollout.worker import RolloutWorker

    clip = reward_clip_dir(args.reward_model, os.path.dirname(args.validation_dir), device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    options = f"reward.options={{pickscore: {{path: {clip}, device: {device}, dtype: {dtype}, preprocess: torch}}}}"
    cfg = bench_config(args, shape, args.validation_dir, "reward.weights={pickscore: 1.0}", options)
    policy = build_policy(cfg, adapter=make_adapter(shape, device, torch.bfloat16), device=device)
    if should_fuse_lora(cfg, policy.autocast_dtype is not None):
        policy.fuse_lora()  # as a rollout actor on a GPU
    engine = DiffusersEngine(policy, update_point="between_groups")
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    n, tickets = args.reward_groups, iter(range(10**6))
    out = result["reward_overlap"] = {"reward_model": args.reward_model, "groups_per_call": n,
                                      "group_size": args.group_size, "samples_per_s": {"on": [], "off": []}}

    def call(overlap: bool) -> float:
        cfg.reward.overlap = overlap
        worker = RolloutWorker(cfg, engine=engine, reward=reward)
        sync(device)
        t0 = time.perf_counter()
        groups = worker.generate([next(tickets) for _ in range(n)])
        sync(device)
        secs = time.perf_counter() - t0
        if any(g is None for g in groups):
            raise RuntimeError(f"reward failures: {worker.stats().get('rewards/errors')}")
        return n * args.group_size / secs

    call(True)  # warm-up: the reward model loads on its first call
    for _ in range(args.repeats):
        for overlap in (True, False):
            out["samples_per_s"]["on" if overlap else "off"].append(round(call(overlap), 3))
            save()
    images = torch.randint(0, 256, (args.group_size, shape["resolution"], shape["resolution"], 3), dtype=torch.uint8)
    prompt = [PROMPTS[0]] * args.group_size
    out["reward_s_per_group"] = round(min(timed(lambda: reward(images, prompt, [{}] * args.group_size), device, 2)), 3)
    out["generate_s_per_group"] = round(min(timed(lambda: engine.generate(
        [PROMPTS[0]], args.group_size, seed=0, **rollout_sampling(cfg.rollout)), device, 2)), 3)
    on, off = (sum(v) / len(v) for v in out["samples_per_s"].values())
    out["overlap_speedup"] = round(on / off, 3)
    log(f"rollout worker with {args.reward_model} on {device}: {on:.3f} samples/s with reward.overlap, {off:.3f} without "
        f"({out['overlap_speedup']}x); a group generates in {out['generate_s_per_group']} s, scores in {out['reward_s_per_group']} s")
    save()


# ---------------------------------------------------------------- main

def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_gb=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                    cuda=torch.version.cuda)
    return info


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    if args.frames is not None and "num_frames" in shape:
        shape = {**shape, "num_frames": args.frames}
    info = device_info(device)
    name = info.get("name", device.type).replace(" ", "_")
    path = args.out or os.path.join(RESULTS, "gpu", f"{args.shape}_{name}.json")
    result = {"shape": args.shape, "machine": info, "batch": {"prompts": args.prompts, "group_size": args.group_size},
              "repeats": args.repeats, "overrides": args.overrides, "errors": {}}

    def save():
        write_json(path, result)

    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in info.get("name", "")), None)
    result["matmul_bf16_tflops"] = matmul_ceiling(device)
    peaks = {"datasheet": datasheet, "measured_matmul": result["matmul_bf16_tflops"]}
    log(f"{info}; bf16 matmul {result['matmul_bf16_tflops']} TFLOP/s (datasheet {datasheet})")
    sections = [("rollout_and_lora", lambda: section_rollout(args, shape, device, peaks, result, save))]
    if args.autocast_ab:
        sections = [("autocast_ab", lambda: section_autocast_ab(args, shape, device, result, save))]
    elif args.train_only:
        sections = [("train_only", lambda: section_train_only(args, shape, device, peaks, result, save))]
    if not (args.skip_full or args.autocast_ab or args.train_only) and shape.get("full_fine_tuning", True):
        sections.append(("full", lambda: section_full(args, shape, device, peaks, result, save)))
    if not (args.skip_embedded or args.autocast_ab or args.train_only):
        sections.append(("embedded", lambda: section_embedded(args, device, result, save)))
    if args.reward_model:
        sections = [("reward", lambda: section_reward(args, shape, device, result, save))]
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as workdir:
        args.validation_dir = validation_model(shape, workdir)
        args.prompt_file = source_prompts(shape, workdir, args.prompts)
        for key, run in sections:
            t0 = time.perf_counter()
            try:
                run()
            except Exception as e:  # noqa: BLE001  (a smoke test: record what broke, go on to the next section)
                result["errors"][key] = traceback.format_exc(limit=8)
                log(f"section {key} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            result.setdefault("section_seconds", {})[key] = round(time.perf_counter() - t0, 1)
            save()
            try:
                reset_memory(device)
            except Exception as e:  # noqa: BLE001  (an illegal memory access poisons the CUDA context for good)
                result["errors"]["cuda_context"] = f"{type(e).__name__}: {str(e).splitlines()[0]}; later sections not run"
                save()
                log(f"the device is unusable after {key} ({type(e).__name__}); later sections not run")
                break
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
