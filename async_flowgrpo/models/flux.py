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

import warnings

import numpy as np
import torch
from torch import Tensor, nn

from async_flowgrpo.models import TransformerPlacement, check_model_dir, guided_velocity
from async_flowgrpo.models.sd3 import PromptEmbeds
from async_flowgrpo.models.tiny_sd3 import read_model_settings

# The joint-attention projections of the double-stream blocks (image and text streams); the
# single-stream blocks have to_q/to_k/to_v too (their output projection is fused with the MLP in
# proj_out and is left alone, as in Flow-GRPO's Flux runs).
FLUX_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # the pipeline's default (schnell users often pick 256)


def pack_latents(x: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C], the 2 x 2 patch order of Flux and Qwen-Image."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: Tensor, height: int, width: int) -> Tensor:
    """Inverse of `pack_latents` for latents of spatial size height x width."""
    b, _, d = x.shape
    x = x.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def calculate_shift(image_seq_len: int, scheduler_config) -> float:
    """The pipelines' resolution-dependent shift mu (linear in the packed image sequence length)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + base_shift - m * base_len


def flow_sigmas(scheduler, num_steps: int, image_seq_len: int) -> Tensor:
    """s_0 = 1 > ... > s_N = 0 (float32, CPU) as FluxPipeline / QwenImagePipeline set them."""
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    if scheduler.config.get("use_flow_sigmas", False):
        sigmas = None
    mu = calculate_shift(image_seq_len, scheduler.config)
    if sigmas is None:
        scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=mu)
    return scheduler.sigmas.detach().to(torch.float32).clone()


def load_pipeline(cls, path: str, *, device: torch.device, dtype: torch.dtype, **kwargs):
    check_model_dir(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        pipe = cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True, **kwargs)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class FluxAdapter(TransformerPlacement):
    family = "flux"
    lora_target_modules = FLUX_LORA_TARGETS

    def __init__(self, pipeline, *, max_sequence_length: int, resolution: int, negative_prompt: str = ""):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        self.resolution = resolution
        self.negative_prompt = negative_prompt

    @classmethod
    def load(cls, path: str, *, device: torch.device, dtype: torch.dtype) -> FluxAdapter:
        from diffusers import FluxPipeline

        pipe = load_pipeline(FluxPipeline, path, device=device, dtype=dtype)
        settings = read_model_settings(path)
        return cls(
            pipe,
            max_sequence_length=settings.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH),
            resolution=settings.get("resolution", pipe.default_sample_size * pipe.vae_scale_factor),
            negative_prompt=settings.get("negative_prompt", ""),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @property
    def frozen_modules(self) -> list[nn.Module]:
        p = self.pipeline
        return [m for m in (p.vae, p.text_encoder, p.text_encoder_2) if m is not None]

    @property
    def guidance_distilled(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    def sigmas(self, num_steps: int, *, height: int | None = None, width: int | None = None) -> Tensor:
        """Length num_steps + 1, with the (dynamic) shift for an image of height x width
        (default: the model's resolution)."""
        _, h, w = self.latent_shape(height or self.resolution, width or self.resolution)
        return flow_sigmas(self.pipeline.scheduler, num_steps, (h // 2) * (w // 2))

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.pipeline.vae_scale_factor
        if height % (f * 2) or width % (f * 2):  # latents are packed 2 x 2
            raise ValueError(f"height and width must be multiples of {2 * f}, got {height}x{width}")
        return self.transformer.config.in_channels // 4, height // f, width // f

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
        """Velocity in float32, unpacked like `latents` [B, C, H, W], at per-sample sigma [B]."""
        transformer = transformer if transformer is not None else self.transformer
        dt = self.dtype
        b, _, h, w = latents.shape
        x = pack_latents(latents.to(self.device, dt))
        t = sigma.to(self.device, torch.float32).expand(b)  # the transformer multiplies by 1000
        img_ids = self.pipeline._prepare_latent_image_ids(None, h // 2, w // 2, self.device, dt)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=dt)

        def forward(x, t, embeds, pooled):
            guidance = None
            if self.guidance_distilled:
                guidance = torch.full((x.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32)
            return transformer(hidden_states=x, timestep=t, guidance=guidance, pooled_projections=pooled.to(self.device, dt),
                               encoder_hidden_states=embeds.to(self.device, dt), txt_ids=txt_ids, img_ids=img_ids,
                               return_dict=False)[0].float()

        if guidance_scale > 1.0 and not self.guidance_distilled:  # true CFG
            if negative_embeds is None or negative_pooled is None:
                raise ValueError("guidance_scale > 1 needs negative (unconditional) prompt embeddings")
            v, _ = guided_velocity(forward, (x, t, embeds, pooled), (x, t, negative_embeds, negative_pooled), guidance_scale,
                                   uncond_grad=uncond_grad)
        else:
            v = forward(x, t, embeds, pooled)
        return unpack_latents(v, h, w)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpacked latents [n, C, h, w] -> uint8 images [n, H, W, 3] on CPU."""
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(z, return_dict=False)[0]
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu()

