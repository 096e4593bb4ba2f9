"""SD3 / SD3.5 adapter (diffusers StableDiffusion3Pipeline).

Family conventions, as the pipeline applies them:
- Text: two CLIP encoders (token sequences and pooled outputs concatenated) and T5-XXL's tokens
  padded to `max_sequence_length`; without T5 (the embedded model) the pipeline pads zeros.
- Latents: AutoencoderKL's channels [C, H/8, W/8], patchified 2 x 2 inside the transformer.
- Timestep: sigma * 1000.
- Guidance: CFG batch with the empty negative prompt when guidance_scale > 1.
- Sigmas: the scheduler's own set_timesteps with its fixed shift (3.0 for SD3.5).
"""

from __future__ import annotations

import os

import torch

from async_flowgrpo.models.base import FamilyAdapter
from async_flowgrpo.models.common import PromptEmbeds


class SD3Adapter(FamilyAdapter):
    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    frozen_names = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    default_max_sequence_length = 256  # T5 tokens for real SD3/3.5 checkpoints (the pipeline's default)
    timestep_scale = 1000.0
    resolution_shift = False

    @classmethod
    def _load_kwargs(cls, path: str) -> dict:
        if not os.path.isdir(os.path.join(path, "text_encoder_3")):
            # SD3 runs without T5 (the pipeline pads zeros); from_pretrained needs to be told.
            return {"text_encoder_3": None, "tokenizer_3": None}
        return {}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        embeds, neg, pooled, neg_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=cfg,
            negative_prompt=self.negative_prompt if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds, pooled, neg, neg_pooled)

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                           pooled_projections=pooled.to(self.device, self.dtype), return_dict=False)[0]
