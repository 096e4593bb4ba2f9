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
  compression, its own latents_mean / latents_std).

Image to video, as diffusers 0.42's WanImageToVideoPipeline does it (pipelines/wan/pipeline_wan_i2v.py):
- The prompt's image (its JSONL "images": one path, the output's size) is VAE-encoded once per
  group with the posterior's mode and the per-channel normalisation, as `prepare_latents` does:
  `latent_condition = retrieve_latents(self.vae.encode(video_condition), sample_mode="argmax")`,
  then `latent_condition = (latent_condition - latents_mean) * latents_std` (latents_std there is
  1 / the VAE's). The latent travels in the group's conditioning as the `pooled` slot (empty in
  text-to-video), flattened, for the CFG batch's two halves alike (the pipeline feeds both the same
  `latent_model_input`): the trainer's replay gathers it with the prompt's embeddings and sees bit
  for bit what the rollout saw.
- TI2V-5B (`expand_timesteps`), the first frame: `prepare_latents` encodes the image alone
  (`if self.config.expand_timesteps: video_condition = image`) and masks the first latent frame
  (`first_frame_mask[:, :, 0] = 0`); `__call__` feeds the transformer `latent_model_input = (1 -
  first_frame_mask) * condition + first_frame_mask * latents` at per-token timesteps `temp_ts =
  (first_frame_mask[0][0][:, ::2, ::2] * t).flatten()` (timestep 0 on the first frame's tokens),
  and after the loop puts the image back: `latents = (1 - first_frame_mask) * condition +
  first_frame_mask * latents`. Here the first latent frame is the image's latent from the initial
  latents on and stays it through every step (`held_frames` = 1): never noised by the SDE, left
  out of the log-prob (it is not sampled), the model's velocity there unused; the frames after it
  see the same input at the same timesteps as in the pipeline, so the sampler is the pipeline's.
  Without an image nothing changes (the T2V path, bit for bit).
- I2V-A14B (no expand_timesteps, transformer in_channels = 2 x latent channels + the VAE's temporal
  factor), channel-concatenated: `prepare_latents` encodes the image followed by num_frames - 1
  black frames (`video_condition = torch.cat([image, image.new_zeros(image.shape[0],
  image.shape[1], num_frames - 1, height, width)], dim=2)`) and builds a mask that is 1 on the
  first latent frame's channels (`mask_lat_size[:, :, list(range(1, num_frames))] = 0`, the first
  frame repeated `self.vae_scale_factor_temporal` times, folded into channels), returning
  `torch.concat([mask_lat_size, latent_condition], dim=1)`; `__call__` feeds `torch.cat([latents,
  condition], dim=1)`. Here the mask is rebuilt per call from the latents' shape (it is constant),
  only the encoded video travels; every latent frame is sampled and scored, as in text-to-video.
  The two experts switch as in T2V-A14B. Its checkpoints are WanImageToVideoPipelines (no image
  encoder in Wan2.2); a prompt without an image is an error there.
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
    condition_channels = 0  # I2V-A14B: channels of the image condition (mask + latent) joined to the latents
    _prompt_encoder = None  # a pipeline whose encode_prompt to use instead of the model's own

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
        config = pipe.transformer.config
        self.condition_channels = config.in_channels - config.out_channels
        if config.image_dim is not None:
            raise ValueError("model.path holds Wan2.1 image-to-video (a CLIP image encoder, image_dim "
                             f"{config.image_dim}): not served; Wan2.2 I2V-A14B and TI2V-5B are")
        # I2V-A14B cannot sample without its image; TI2V-5B holds a first frame when a prompt has one
        self.image_conditioned = self.image_conditioned or bool(self.condition_channels)
        self.image_optional = self.expand_timesteps and not self.image_conditioned
        if self.condition_channels and self.condition_channels != config.out_channels + pipe.vae_scale_factor_temporal:
            raise ValueError(f"model.path: a Wan transformer with in_channels {config.in_channels} and out_channels "
                             f"{config.out_channels}: image-to-video expects in_channels = 2 x out_channels + the "
                             f"VAE's temporal factor {pipe.vae_scale_factor_temporal}")
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
        """[C, F, h, w]: the image layout with the latent frame axis after the channels; C the
        transformer's output channels (I2V-A14B takes the image condition's channels beside them)."""
        _, h, w = super().latent_shape(height, width)
        return self.transformer.config.out_channels, self.latent_frames, h, w

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool, images: list[list[Tensor]] | None = None) -> PromptEmbeds:
        """UMT5 sequence [B, max_sequence_length, D]; `pooled` is empty [B, 0], or with `images` (one
        uint8 [H, W, 3] first frame per prompt) the image condition's latent, flattened (see the
        module docstring)."""
        embeds, neg = (self._prompt_encoder or self.pipeline).encode_prompt(
            prompt=prompts,
            negative_prompt=self.negative_prompt if cfg else None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        pooled = embeds.new_zeros(len(prompts), 0) if images is None else self.encode_images(images).flatten(1)
        return PromptEmbeds(embeds, pooled, neg, pooled.clone() if cfg else None)

    @torch.no_grad()
    def encode_images(self, images: list[list[Tensor]]) -> Tensor:
        """Per prompt its first frame (uint8 [H, W, 3]) -> the normalised latent of the image
        (TI2V-5B: [B, C, 1, h, w]) or of the image followed by black frames (I2V-A14B: [B, C, F, h,
        w]), float32, as WanImageToVideoPipeline.prepare_latents encodes it."""
        if any(len(imgs) != 1 for imgs in images):
            raise ValueError(f"{self.family} image-to-video takes one image per prompt (its first frame), got "
                             f"{sorted({len(imgs) for imgs in images})}")
        vae = self.pipeline.vae
        x = torch.stack([imgs[0] for imgs in images]).movedim(-1, 1)[:, :, None]  # [B, 3, 1, H, W]
        x = x.to(self.device, torch.float32) / 255 * 2 - 1  # VideoProcessor.preprocess's [-1, 1]
        if not self.expand_timesteps:
            x = torch.cat([x, x.new_zeros(x.shape[0], 3, self.num_frames - 1, *x.shape[-2:])], 2)
        z = vae.encode(x.to(vae.dtype)).latent_dist.mode().float()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        return (z - mean) * inv_std

    def held_frames(self, pooled: Tensor) -> int:
        return 1 if self.expand_timesteps and pooled.shape[-1] else 0

    def hold(self, x: Tensor, pooled: Tensor) -> Tensor:
        if not self.held_frames(pooled):
            return x
        return torch.cat([self._condition(pooled, x.shape, 1).to(x), x[:, :, 1:]], 2)

    def _condition(self, pooled: Tensor, shape: torch.Size, frames: int) -> Tensor:
        """The flattened image condition [B, ...] as [B, C, frames, h, w] for latents of `shape` [., C, F, h, w]."""
        b, (c, _, h, w) = pooled.shape[0], shape[-4:]
        if pooled.shape[-1] != c * frames * h * w:
            raise ValueError(f"the prompt's image condition holds {pooled.shape[-1]} values, latents of {tuple(shape)} "
                             f"need {c * frames * h * w}: the image must have the sampled height and width")
        return pooled.to(self.device).view(b, c, frames, h, w)

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        f, h, w = shape[-3:]
        if self.expand_timesteps:  # as WanPipeline: the latent grid subsampled 1 x 2 x 2 (the patch), flattened
            t = t[:, None].expand(-1, f * ((h + 1) // 2) * ((w + 1) // 2))
            if self.held_frames(pooled):  # the first frame: the image's latent at timestep 0
                x = self.hold(x, pooled)
                t = torch.cat([torch.zeros_like(t[:, : t.shape[1] // f]), t[:, t.shape[1] // f :]], 1)
        elif self.condition_channels:  # [latents | mask (1 on the first latent frame) | condition latent]
            mask = x.new_zeros(x.shape[0], self.condition_channels - x.shape[1], f, h, w)
            mask[:, :, 0] = 1
            x = torch.cat([x, mask, self._condition(pooled, shape, f).to(x.dtype)], 1)
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    def _latents_for_vae(self, z):
        return denormalize_latents(self.pipeline.vae, z)


class WanImageToVideoAdapter(WanAdapter):
    """Wan2.2 I2V-A14B checkpoints (WanImageToVideoPipeline; see the module docstring)."""

    pipeline_class = "WanImageToVideoPipeline"
    image_conditioned = True

    def _configure(self, settings: dict) -> None:
        super()._configure(settings)
        from diffusers import WanPipeline

        # diffusers 0.42's pipeline_wan_i2v.basic_clean calls `ftfy.fix_text(text)` unguarded, where
        # pipeline_wan.basic_clean checks `if is_ftfy_available():` first (ftfy is no dependency of
        # ours): the prompts go through WanPipeline's encode_prompt, the same code over the same modules
        pipe = self.pipeline
        self._prompt_encoder = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                           scheduler=pipe.scheduler)
