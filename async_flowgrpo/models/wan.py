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
- Wan2.2 A14B: two experts, `transformer` for high noise and `transformer_2` for low noise. Each
  step goes to `transformer` where its timestep >= boundary_ratio * num_train_timesteps (the
  pipeline's config), else to `transformer_2`, whose CFG scale is model.guidance_scale_2 (default:
  the call's). The expert is a function of the step's sigma, so the trainer's replay of a recorded
  step runs the expert that made it; a batch whose rows straddle the boundary (the trainer's
  batched replay) runs each expert on its rows. LoRA goes on the trained experts
  (model.trained_experts, default both); `transformer` is then one module holding them under their
  pipeline names, and the frozen one denoises as it is. Saved LoRA weights: `transformer`'s in
  the output directory, `transformer_2`'s in its transformer_2/ subdirectory, loaded by
  `pipe.load_lora_weights(dir)` and `pipe.load_lora_weights(dir + "/transformer_2",
  load_into_transformer_2=True)`.
- Wan2.2 TI2V-5B (`expand_timesteps`): one timestep per latent token, [B, F (h/2) (w/2)], as the
  pipeline passes it (all equal in text-to-video), over the Wan2.2 VAE (48 channels, 16x spatial
  compression, its own latents_mean / latents_std). Image-to-video (a first frame held at
  timestep 0) is not served.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from torch import Tensor, nn

from async_flowgrpo.models import WAN_NUM_FRAMES
from async_flowgrpo.models.base import FamilyAdapter, save_peft_lora
from async_flowgrpo.models.common import PromptEmbeds, denormalize_latents

logger = logging.getLogger(__name__)

EXPERTS = ("transformer", "transformer_2")  # WanPipeline's high-noise and low-noise experts


class Experts(nn.Module):
    """The trained experts as one module, each under its pipeline name ("transformer.blocks...",
    "transformer_2.blocks..."): what the policy trains, syncs and checkpoints. The diffusers
    methods the policy and builders call go to each expert."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)

    @property
    def _first(self) -> nn.Module:
        return next(iter(self.children()))

    @property
    def config(self):
        return self._first.config

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    def add_adapter(self, config) -> None:
        for module in self.children():
            module.add_adapter(copy.copy(config))

    def disable_adapters(self) -> None:
        for module in self.children():
            module.disable_adapters()

    def enable_adapters(self) -> None:
        for module in self.children():
            module.enable_adapters()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return all(module.is_gradient_checkpointing for module in self.children())

    def enable_gradient_checkpointing(self) -> None:
        for module in self.children():
            module.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for module in self.children():
            module.disable_gradient_checkpointing()


class WanAdapter(FamilyAdapter):
    family = "wan"
    pipeline_class = "WanPipeline"
    # self-attention (attn1) and text cross-attention (attn2) of every block, as Flow-GRPO's Wan LoRA
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    default_num_frames = WAN_NUM_FRAMES
    timestep_scale = 1000.0
    resolution_shift = False

    boundary: float | None = None  # timestep where transformer_2 takes over (two experts)
    guidance_scale_2: float | None = None  # transformer_2's CFG scale; None: the call's
    expand_timesteps = False  # TI2V: a timestep per latent token

    def _configure(self, settings: dict) -> None:
        pipe = self.pipeline
        if pipe.transformer is None:
            raise ValueError("model.path holds a WanPipeline without `transformer`; the wan family needs it")
        if getattr(pipe, "transformer_2", None) is not None:
            if pipe.config.boundary_ratio is None:
                raise ValueError("model.path holds two Wan experts but no boundary_ratio in model_index.json: "
                                 "WanPipeline would never run transformer_2")
            self.experts = EXPERTS
        self.expand_timesteps = bool(pipe.config.expand_timesteps)
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
        if len(self.experts) > 1:
            self.boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        self.select_experts()

    # ---------------------------------------------------------------- experts

    def select_experts(self, trained: list[str] | None = None, *, guidance_scale_2: float | None = None) -> None:
        if len(self.experts) == 1:
            return super().select_experts(trained, guidance_scale_2=guidance_scale_2)
        unknown = [n for n in trained or () if n not in self.experts]
        if unknown or (trained is not None and not trained):
            raise ValueError(f"model.trained_experts {list(trained)}: choose from {', '.join(self.experts)} "
                             "(null: both)")
        self.trained = tuple(n for n in self.experts if trained is None or n in trained)
        self.guidance_scale_2 = guidance_scale_2
        self._experts = Experts({n: getattr(self.pipeline, n) for n in self.trained})

    @property
    def transformer(self) -> nn.Module:
        return self._experts if len(self.experts) > 1 else self.pipeline.transformer

    @property
    def frozen_modules(self) -> list[nn.Module]:
        frozen = [getattr(self.pipeline, n) for n in self.experts if len(self.experts) > 1 and n not in self.trained]
        return super().frozen_modules + frozen

    def trained_components(self) -> dict[str, nn.Module]:
        if len(self.experts) == 1:
            return super().trained_components()
        return {n: getattr(self.pipeline, n) for n in self.trained}

    def save_lora(self, path: str, state: dict[str, Tensor]) -> None:
        """One directory per trained expert: `transformer`'s at `path`, as a Wan2.1 LoRA, and
        `transformer_2`'s at path/transformer_2 (load it with load_into_transformer_2=True)."""
        if len(self.experts) == 1:
            return super().save_lora(path, state)
        for name in self.trained:
            prefix = f"{name}."
            own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            out = path if name == "transformer" else os.path.join(path, name)
            save_peft_lora(type(self.pipeline), out, getattr(self.pipeline, name), own)

    def velocity(self, latents: Tensor, sigma: Tensor, *cond: Tensor | None, guidance_scale: float,
                 transformer: nn.Module | None = None, **kwargs) -> Tensor:
        """FamilyAdapter.velocity through the expert of each row's step: `transformer` where
        sigma * 1000 >= boundary, else `transformer_2` with guidance_scale_2 (where the call is
        guided at all, as WanPipeline's do_classifier_free_guidance reads only the first scale).
        `transformer`: the trained experts' module to use (a frozen reference copy)."""
        if len(self.experts) == 1:
            return super().velocity(latents, sigma, *cond, guidance_scale=guidance_scale, transformer=transformer,
                                    **kwargs)
        trained = transformer if transformer is not None else self.transformer
        n = latents.shape[0]
        t = sigma.to(torch.float32).expand(n) * self.timestep_scale  # the pipeline's timestep, same arithmetic
        high = (t >= self.boundary).cpu()
        low_scale = self.guidance_scale_2 if guidance_scale > 1.0 and self.guidance_scale_2 is not None else guidance_scale

        def run(name: str, scale: float, rows: Tensor | None) -> Tensor:
            expert = trained._modules.get(name)
            expert = expert if expert is not None else getattr(self.pipeline, name)  # a frozen expert is not in `trained`
            if rows is None:
                return super(WanAdapter, self).velocity(latents, sigma, *cond, guidance_scale=scale, transformer=expert,
                                                        **kwargs)
            part = [c[rows.to(c.device)] if c is not None else None for c in cond]
            return super(WanAdapter, self).velocity(latents[rows.to(latents.device)], sigma.expand(n)[rows.to(sigma.device)],
                                                    *part, guidance_scale=scale, transformer=expert, **kwargs)

        if high.all():
            return run("transformer", guidance_scale, None)
        if not high.any():
            return run("transformer_2", low_scale, None)
        rows_high, rows_low = high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)
        v = torch.cat([run("transformer", guidance_scale, rows_high), run("transformer_2", low_scale, rows_low)])
        order = torch.cat([rows_high, rows_low]).argsort()  # back to the batch's row order
        return v[order.to(v.device)]

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
        if self.expand_timesteps:  # as WanPipeline: the latent grid subsampled 1 x 2 x 2 (the patch), flattened
            f, h, w = shape[-3:]
            t = t[:, None].expand(-1, f * ((h + 1) // 2) * ((w + 1) // 2))
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    def _latents_for_vae(self, z):
        return denormalize_latents(self.pipeline.vae, z)
