"""Qwen-Image adapter (diffusers QwenImagePipeline).

Family conventions, as the pipeline applies them:
- Text: Qwen2.5-VL's last hidden states of the prompt wrapped in the pipeline's chat template,
  with the template's prefix tokens dropped (`pipeline.encode_prompt` does both) and a padding
  mask (`prompt_embeds_mask`). No pooled embedding: the PromptEmbeds / Group "pooled" slot
  carries the float 0/1 mask [B, L] instead (negative_pooled: the negative prompt's mask).
  Embeddings are padded with zeros (mask 0) to the fixed `max_sequence_length` of
  async_flowgrpo.json (default 512, the pipeline's) so groups from different batches stack in
  the trainer; `velocity` trims the batch back to its longest prompt before the transformer
  (masked keys do not change the image tokens: the text RoPE does not depend on the length).
- Latents: 16 channels from AutoencoderKLQwenImage (a video VAE: 5-D latents with a frame axis),
  packed 2 x 2 for the transformer. Stored UNPACKED [C, H/8, W/8] without the frame axis;
  `velocity` packs/unpacks, `decode` adds the frame axis and un-normalizes with the VAE's
  per-channel latents_mean / latents_std.
- Timestep: sigma in 0..1 (the pipeline passes t/1000; the transformer's projection scales by 1000).
- Guidance: true CFG when guidance_scale > 1 (`true_cfg_scale`), with the negative prompt of
  async_flowgrpo.json (" " by default, as Qwen-Image's examples use), followed by the pipeline's
  norm-preserving rescale: v = v_cfg * |v_cond| / |v_cfg|, norms over the packed channel axis of
  each 2 x 2 patch token. Both halves run as one batch.
- Sigmas: linspace(1, 1/N, N), then the scheduler's dynamic shift exp(mu) with
  mu = calculate_shift(image sequence length) (and its shift_terminal stretch where configured).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from async_flowgrpo.models import TransformerPlacement, guided_velocity
from async_flowgrpo.models.flux import flow_sigmas, load_pipeline, pack_latents, unpack_latents
from async_flowgrpo.models.sd3 import PromptEmbeds
from async_flowgrpo.models.tiny_sd3 import read_model_settings

# Attention projections of every dual-stream block, image and text streams (Flow-GRPO's Qwen-Image
# LoRA targets the same names).
QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # the pipeline's default
DEFAULT_NEGATIVE_PROMPT = " "


class QwenImageAdapter(TransformerPlacement):
    family = "qwen_image"
    lora_target_modules = QWEN_IMAGE_LORA_TARGETS

    def __init__(
        self, pipeline, *, max_sequence_length: int, resolution: int, negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    ):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        self.resolution = resolution
        self.negative_prompt = negative_prompt

    @classmethod
    def load(cls, path: str, *, device: torch.device, dtype: torch.dtype) -> QwenImageAdapter:
        from diffusers import QwenImagePipeline

        pipe = load_pipeline(QwenImagePipeline, path, device=device, dtype=dtype)
        settings = read_model_settings(path)
        if "prompt_template_encode_start_idx" in settings:  # tokens of the template's prefix (34 for Qwen2.5-VL)
            pipe.prompt_template_encode_start_idx = settings["prompt_template_encode_start_idx"]
        return cls(
            pipe,
            max_sequence_length=settings.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH),
            resolution=settings.get("resolution", pipe.default_sample_size * pipe.vae_scale_factor),
            negative_prompt=settings.get("negative_prompt", DEFAULT_NEGATIVE_PROMPT),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @property
    def frozen_modules(self) -> list[nn.Module]:
        p = self.pipeline
        return [m for m in (p.vae, p.text_encoder) if m is not None]

    def sigmas(self, num_steps: int, *, height: int | None = None, width: int | None = None) -> Tensor:
        """Length num_steps + 1, with the dynamic shift for an image of height x width (default:
        the model's resolution)."""
        _, h, w = self.latent_shape(height or self.resolution, width or self.resolution)
        return flow_sigmas(self.pipeline.scheduler, num_steps, (h // 2) * (w // 2))

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.pipeline.vae_scale_factor
        if height % (f * 2) or width % (f * 2):  # latents are packed 2 x 2
            raise ValueError(f"height and width must be multiples of {2 * f}, got {height}x{width}")
        return self.transformer.config.in_channels // 4, height // f, width // f

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        b, n, d = embeds.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, n, device=embeds.device)
        pad = self.max_sequence_length - n
        embeds = torch.cat([embeds, embeds.new_zeros(b, pad, d)], 1)
        mask = torch.cat([mask.to(embeds.dtype), mask.new_zeros(b, pad).to(embeds.dtype)], 1)
        return embeds, mask

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        """embeds [B, max_sequence_length, D]; `pooled` is the float mask [B, max_sequence_length]."""
        embeds, mask = self._encode(prompts)
        if not cfg:
            return PromptEmbeds(embeds, mask)
        neg, neg_mask = self._encode([self.negative_prompt] * len(prompts))
        return PromptEmbeds(embeds, mask, neg, neg_mask)

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor,
        embeds: Tensor,
        pooled: Tensor,
        negative_embeds: Tensor | None = None,
        negative_pooled: Tensor | None = None,
        *,
        guidance_scale: float,
        uncond_grad: bool = True,
        transformer: nn.Module | None = None,
    ) -> Tensor:
        """Velocity in float32, unpacked like `latents` [B, C, H, W], at per-sample sigma [B].
        `pooled` / `negative_pooled` are the text masks (see the module docstring)."""
        transformer = transformer if transformer is not None else self.transformer
        dt = self.dtype
        b, _, h, w = latents.shape
        x = pack_latents(latents.to(self.device, dt))
        t = sigma.to(self.device, torch.float32).expand(b)

        def forward(x, t, embeds, mask):
            mask = mask.to(self.device) > 0.5
            # trim the shared padding: up to the batch's last valid token
            valid = mask.any(0).nonzero()
            length = int(valid.max()) + 1 if len(valid) else 1
            mask = mask[:, :length]
            return transformer(
                hidden_states=x,
                timestep=t,
                encoder_hidden_states=embeds[:, :length].to(self.device, dt),
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
                return_dict=False,
            )[0].float()

        if guidance_scale <= 1.0:
            v = forward(x, t, embeds, pooled)
        else:
            if negative_embeds is None or negative_pooled is None:
                raise ValueError("guidance_scale > 1 needs negative (unconditional) prompt embeddings")
            v, v_cond = guided_velocity(forward, (x, t, embeds, pooled), (x, t, negative_embeds, negative_pooled),
                                        guidance_scale, uncond_grad=uncond_grad)
            v = v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        return unpack_latents(v, h, w)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpacked latents [n, C, h, w] -> uint8 images [n, H, W, 3] on CPU."""
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)[:, :, None]  # frame axis: [n, C, 1, h, w]
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        images = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu()
