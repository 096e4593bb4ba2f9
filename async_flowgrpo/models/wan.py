"""Wan text-to-video adapter (diffusers WanPipeline: Wan2.1-T2V-1.3B / 14B and their fine-tunes).

Family conventions, as the pipeline applies them:
- Text: UMT5-XXL's last hidden states, each prompt cut at its own length and padded with zeros to
  `max_sequence_length` (512, the pipeline's default); the transformer sees the zeros (no mask).
  No pooled embedding: an empty [B, 0] tensor fills the PromptEmbeds / Group "pooled" slot, so
  groups and the trainer's batching stay the same for every family.
- Latents: 5-D video latents [C, F, h, w] per sample (AutoencoderKLWan: 16 channels, 8x spatial
  and 4x causal temporal compression: F = (num_frames - 1) / 4 + 1), patchified 1 x 2 x 2 inside
  the transformer. The SDE step and its log-prob (a mean over every non-batch dim) take them as
  they are. `decode` un-normalizes with the VAE's per-channel latents_mean / latents_std.
- Frames: rollout.num_frames, else `num_frames` of async_flowgrpo.json (default 81, the
  pipeline's); num_frames - 1 must be a multiple of the VAE's temporal factor.
- Timestep: sigma * 1000.
- Guidance: CFG batch with the negative prompt of async_flowgrpo.json ("" by default) when
  guidance_scale > 1.
- Sigmas: FlowMatchEulerDiscreteScheduler's set_timesteps with its fixed shift (3.0 at 480p, 5.0
  at 720p). The Wan checkpoints ship a UniPCMultistepScheduler with that shift as `flow_shift`:
  a multistep solver, not the one-step Euler kernel the SDE step and its log-prob are written
  for, so loading replaces it by Euler with the same shift.
- Not served: Wan2.2's two-expert checkpoints (`transformer_2`) and TI2V's per-token timesteps.
"""

from __future__ import annotations

import logging

import torch

from async_flowgrpo.models import WAN_NUM_FRAMES
from async_flowgrpo.models.base import FamilyAdapter
from async_flowgrpo.models.common import PromptEmbeds, denormalize_latents

logger = logging.getLogger(__name__)


class WanAdapter(FamilyAdapter):
    family = "wan"
    pipeline_class = "WanPipeline"
    # self-attention (attn1) and text cross-attention (attn2) of every block, as Flow-GRPO's Wan LoRA
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    default_num_frames = WAN_NUM_FRAMES
    timestep_scale = 1000.0
    resolution_shift = False

    def _configure(self, settings: dict) -> None:
        pipe = self.pipeline
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.expand_timesteps:
            raise ValueError("model.path holds a Wan2.2 two-expert or TI2V pipeline; the wan family serves Wan2.1-style "
                             "single-transformer text-to-video models")
        self.num_frames = settings.get("num_frames", self.default_num_frames)
        k = pipe.vae_scale_factor_temporal
        if (self.num_frames - 1) % k:
            raise ValueError(f"num_frames {self.num_frames} of {self.family} model: num_frames - 1 must be a multiple of "
                             f"the VAE's temporal factor {k} (e.g. {(self.num_frames - 1) // k * k + 1})")
        from diffusers import FlowMatchEulerDiscreteScheduler

        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            shift = pipe.scheduler.config.get("flow_shift", 1.0)
            logger.info("Wan: replacing %s by FlowMatchEulerDiscreteScheduler(shift=%s)", type(pipe.scheduler).__name__, shift)
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)

    @property
    def spatial_factor(self) -> int:
        return self.pipeline.vae_scale_factor_spatial

    def default_resolution(self) -> int:
        return 480  # Wan2.1's 480p (the pipeline's 480 x 832, square here)

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.pipeline.vae_scale_factor_temporal + 1

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """[C, F, h, w]: the image layout with the latent frame axis after the channels."""
        c, h, w = super().latent_shape(height, width)
        return c, self.latent_frames, h, w

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        """UMT5 sequence [B, max_sequence_length, D]; `pooled` is empty [B, 0] (see the module docstring)."""
        embeds, neg = self.pipeline.encode_prompt(
            prompt=prompts,
            negative_prompt=self.negative_prompt if cfg else None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        empty = embeds.new_zeros(len(prompts), 0)
        return PromptEmbeds(embeds, empty, neg, empty.clone() if cfg else None)

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    def _latents_for_vae(self, z):
        return denormalize_latents(self.pipeline.vae, z)
