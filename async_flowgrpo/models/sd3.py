"""SD3 / SD3.5 adapter: what is specific to the family (text encoding, the transformer's call
convention, latent layout, VAE decoding, the sampler's sigmas) behind the interface that
`DiffusionPolicy` uses. Flux and Qwen-Image get their own adapter with the same methods.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from async_flowgrpo.models import TransformerPlacement, check_model_dir, guided_velocity
from async_flowgrpo.models.tiny_sd3 import read_model_settings

# peft target modules: the joint-attention projections of every MMDiT block (image and text
# streams). The last SD3 block is "context_pre_only" and has no to_add_out; peft skips it.
SD3_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 256  # T5 tokens for real SD3/3.5 checkpoints (the pipeline's default)


@dataclass
class PromptEmbeds:
    """Conditioning for a batch of prompts; negatives (the empty prompt) only when CFG is on."""

    embeds: Tensor  # [B, L, D]
    pooled: Tensor  # [B, P]
    negative_embeds: Tensor | None = None
    negative_pooled: Tensor | None = None


class SD3Adapter(TransformerPlacement):
    family = "sd3"
    lora_target_modules = SD3_LORA_TARGETS

    def __init__(self, pipeline, *, max_sequence_length: int, resolution: int):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        self.resolution = resolution

    @classmethod
    def load(cls, path: str, *, device: torch.device, dtype: torch.dtype) -> SD3Adapter:
        from diffusers import StableDiffusion3Pipeline

        check_model_dir(path)
        kwargs = {}
        if not os.path.isdir(os.path.join(path, "text_encoder_3")):
            # SD3 runs without T5 (the pipeline pads zeros); from_pretrained needs to be told.
            kwargs = {"text_encoder_3": None, "tokenizer_3": None}
        with warnings.catch_warnings():
            # recent diffusers renamed torch_dtype to dtype; older ones (setup.cfg allows them) know only torch_dtype
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=dtype, local_files_only=True, **kwargs)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        settings = read_model_settings(path)
        resolution = settings.get("resolution", pipe.default_sample_size * pipe.vae_scale_factor)
        return cls(
            pipe,
            max_sequence_length=settings.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH),
            resolution=resolution,
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @property
    def frozen_modules(self) -> list[nn.Module]:
        p = self.pipeline
        return [m for m in (p.vae, p.text_encoder, p.text_encoder_2, p.text_encoder_3) if m is not None]

    def sigmas(self, num_steps: int, *, height: int | None = None, width: int | None = None) -> Tensor:
        """s_0 = 1 > ... > s_{N-1} > s_N = 0 as float32 on CPU, length num_steps + 1, with the
        scheduler's configured shift. For shift 1 this is linspace(1, 1/1000, N) then 0: the
        FlowMatchEulerDiscreteScheduler's timesteps run from 1000 down to 1, not to 0. SD3's shift
        is fixed: height and width (Flux and Qwen-Image shift by image size) are ignored."""
        scheduler = self.pipeline.scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.detach().to(torch.float32).clone()

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.pipeline.vae_scale_factor
        if height % (f * 2) or width % (f * 2):  # the transformer patchifies latents 2 x 2
            raise ValueError(f"height and width must be multiples of {2 * f}, got {height}x{width}")
        return self.transformer.config.in_channels, height // f, width // f

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        embeds, neg, pooled, neg_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=cfg,
            negative_prompt="" if cfg else None,
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
        """Velocity prediction in float32 for latents at per-sample sigma [B].

        SD3's timestep is sigma * 1000. With guidance_scale > 1 the unconditional and conditional
        halves combine as v_u + g (v_c - v_u) (see `guided_velocity`). `transformer` substitutes a
        frozen reference copy (full fine-tuning); by default the pipeline's own is used.
        """
        transformer = transformer if transformer is not None else self.transformer
        dt = self.dtype
        x = latents.to(self.device, dt)
        t = sigma.to(self.device, torch.float32).expand(x.shape[0]) * 1000

        def forward(x, t, embeds, pooled):
            return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(self.device, dt),
                               pooled_projections=pooled.to(self.device, dt), return_dict=False)[0].float()

        if guidance_scale <= 1.0:
            return forward(x, t, embeds, pooled)
        if negative_embeds is None or negative_pooled is None:
            raise ValueError("guidance_scale > 1 needs negative (unconditional) prompt embeddings")
        v, _ = guided_velocity(forward, (x, t, embeds, pooled), (x, t, negative_embeds, negative_pooled), guidance_scale,
                               uncond_grad=uncond_grad)
        return v

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> uint8 images [n, H, W, 3] on CPU."""
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(z, return_dict=False)[0]
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu()
