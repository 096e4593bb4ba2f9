"""Flux adapter (diffusers FluxPipeline: FLUX.1-dev, FLUX.1-schnell and their fine-tunes).

Family conventions, as the pipeline applies them:
- Text: CLIP-L's pooled output (`pooled_projections`) + T5-XXL's token sequence padded to
  `max_sequence_length` (`encoder_hidden_states`); text position ids are zeros [L, 3].
- Latents: the VAE's 16 channels, packed by the transformer into 2 x 2 patches ([seq, 4 C]) with
  image position ids (0, row, col). We store and step latents UNPACKED ([C, H/8, W/8], like SD3);
  `velocity` packs its input and unpacks its output (pure reshapes, so the SDE step and its
  log-prob are unchanged) and `decode` needs no image size.
- Timestep: sigma in 0..1 (the pipeline passes t/1000 and the transformer multiplies by 1000).
- Guidance: guidance-distilled models (FLUX.1-dev, `transformer.config.guidance_embeds`) take
  guidance_scale as the `guidance` input; there is no CFG batch and no negative prompt. Models
  without a guidance embedding (schnell) get true CFG (`true_cfg_scale` in the pipeline) with the
  negative prompt of `async_flowgrpo.json` ("" by default) when guidance_scale > 1.
- Sigmas: linspace(1, 1/N, N) then the scheduler's shift; with use_dynamic_shifting (dev) the
  shift is exp(mu), mu = calculate_shift(image sequence length) as in the pipeline.
"""

from __future__ import annotations

import torch

from async_flowgrpo.models.base import FamilyAdapter
from async_flowgrpo.models.common import PromptEmbeds


class FluxAdapter(FamilyAdapter):
    family = "flux"
    pipeline_class = "FluxPipeline"
    frozen_names = ("vae", "text_encoder", "text_encoder_2")
    # LoRA: the default attention targets. The single-stream blocks have to_q/to_k/to_v too; their
    # output projection is fused with the MLP in proj_out and is left alone, as in Flow-GRPO's Flux runs.
    default_max_sequence_length = 512  # the pipeline's default (schnell users often pick 256)
    packed = True

    @property
    def guidance_distilled(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    def _cfg_batch(self) -> bool:
        return not self.guidance_distilled

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        """T5 sequence [B, L, D] and CLIP pooled [B, P]. Negatives only for true CFG (a model
        without a guidance embedding and cfg): guidance-distilled models never need them."""
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        if not cfg or self.guidance_distilled:
            return PromptEmbeds(embeds, pooled)
        neg, neg_pooled, _ = self.pipeline.encode_prompt(
            prompt=[self.negative_prompt] * len(prompts),
            prompt_2=None,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeds(embeds, pooled, neg, neg_pooled)

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        dt, (h, w) = self.dtype, shape[-2:]
        img_ids = self.pipeline._prepare_latent_image_ids(None, h // 2, w // 2, self.device, dt)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=dt)
        guidance = None
        if self.guidance_distilled:
            guidance = torch.full((x.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32)
        return transformer(hidden_states=x, timestep=t, guidance=guidance, pooled_projections=pooled.to(self.device, dt),
                           encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
