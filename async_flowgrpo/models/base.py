"""`FamilyAdapter`: what every model-family adapter shares, so that a family adds only what differs.

The base owns loading (offline `from_pretrained` plus our async_flowgrpo.json settings), the
trained and frozen modules, the latent layout, the sampler's sigmas, the velocity template
(device and dtype, timestep scale, 2 x 2 packing, classifier-free guidance) and decoding to uint8.
A family declares class attributes and writes `encode_prompts` and `_forward` (the transformer's
call convention), plus the hooks it needs:

- `_load_kwargs(path)`: extra `from_pretrained` arguments (SD3 without T5).
- `_configure(settings)`: family settings applied after loading (Qwen-Image's template prefix).
- `_cfg_batch()`: whether guidance_scale > 1 means a CFG batch (not for Flux-dev's guidance embedding).
- `_after_cfg(v, v_cond)`: a rescale after the CFG combine (Qwen-Image).
- `_latents_for_vae(z)` / `_from_vae(x)`: the VAE's latent normalisation and frame axis.

The interface `DiffusionPolicy` uses: load, select_experts, transformer, frozen_modules,
lora_target_modules, device, dtype, resolution, max_sequence_length, negative_prompt, latent_shape,
sigmas, encode_prompts, held_frames, hold, velocity, decode; the trainer's saving uses trained_components and save_lora.

`transformer` is the one module that trains. A model with several denoising transformers (Wan2.2
A14B's two experts) returns a module holding the trained ones under their pipeline names, so the
trainable state, its sync and digest, the optimizer and checkpoints cover them all unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from async_flowgrpo.models import TransformerPlacement, guided_velocity
from async_flowgrpo.models.common import (
    PromptEmbeds,
    flow_sigmas,
    load_pipeline,
    pack_latents,
    read_model_settings,
    unpack_latents,
)

# peft target modules: the attention projections of every joint-attention block, image and text
# streams (Flow-GRPO's SD3, Flux and Qwen-Image LoRA). Blocks without some of them (SD3's last,
# context_pre_only block has no to_add_out; Flux's single-stream blocks have no add_*) are skipped by peft.
ATTENTION_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)


class FamilyAdapter(TransformerPlacement):
    family: str  # ModelConfig.family
    pipeline_class: str  # the diffusers pipeline's class name (imported on load)
    frozen_names: tuple[str, ...] = ("vae", "text_encoder")  # pipeline components that never train
    lora_target_modules: tuple[str, ...] = ATTENTION_LORA_TARGETS
    default_max_sequence_length = 512  # text tokens, unless async_flowgrpo.json says otherwise
    default_negative_prompt = ""
    packed = False  # the transformer takes 2 x 2 packed latents (stored unpacked, packed per call)
    timestep_scale = 1.0  # the transformer's timestep is sigma * timestep_scale
    # True: linspace(1, 1/N, N) with a shift that grows with the image's token count, as the Flux
    # and Qwen-Image pipelines pass it; False: the scheduler's own set_timesteps with its fixed shift.
    resolution_shift = True
    # a family that trims its text padding per batch (Qwen-Image) keeps the text tokens a multiple of
    # this: sequence parallelism splits them over its ranks (set to trainer.sequence_parallel)
    token_multiple = 1
    # prompts carry input images (an edit model): encode_prompts then takes images=[[uint8 [H, W, 3], ...], ...]
    image_conditioned = False
    image_optional = False  # prompts may carry them or not (Wan2.2 TI2V-5B: a first frame, or text to video)

    def __init__(self, pipeline, *, max_sequence_length: int, resolution: int, negative_prompt: str | None = None):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        self.resolution = resolution
        self.negative_prompt = self.default_negative_prompt if negative_prompt is None else negative_prompt

    @classmethod
    def load(cls, path: str, *, device: torch.device, dtype: torch.dtype, num_frames: int = 0) -> FamilyAdapter:
        """num_frames > 0 replaces async_flowgrpo.json's frames per video (video families only)."""
        import diffusers

        pipe = load_pipeline(getattr(diffusers, cls.pipeline_class), path, device=device, dtype=dtype,
                             **cls._load_kwargs(path))
        settings = read_model_settings(path)
        if num_frames:
            settings["num_frames"] = num_frames
        return cls.from_pipeline(pipe, settings)

    @classmethod
    def from_pipeline(cls, pipeline, settings: dict | None = None) -> FamilyAdapter:
        """The adapter over a pipeline already built (in memory: benchmarks/gpu.py's real-size
        random models); `settings` as a model's async_flowgrpo.json holds them."""
        settings = settings or {}
        adapter = cls(pipeline,
                      max_sequence_length=settings.get("max_sequence_length", cls.default_max_sequence_length),
                      resolution=settings.get("resolution", 0), negative_prompt=settings.get("negative_prompt"))
        adapter.resolution = adapter.resolution or adapter.default_resolution()
        adapter._configure(settings)
        adapter._vae_in_fp32_on_cpu()
        return adapter

    @classmethod
    def _load_kwargs(cls, path: str) -> dict:
        return {}

    def _configure(self, settings: dict) -> None:
        pass

    def to(self, device: torch.device, dtype: torch.dtype) -> FamilyAdapter:
        """Move and cast the whole pipeline (an adapter built in memory, not loaded)."""
        self.pipeline.to(device, dtype)
        self._placement = None  # look device and dtype up afresh
        self._vae_in_fp32_on_cpu()
        return self

    def _vae_in_fp32_on_cpu(self) -> None:
        """On a CPU the VAE computes in fp32 whatever the model's dtype: a CPU without bf16 kernels
        runs its bf16 convolutions 27x slower (a tiny Wan VAE's decode: 8.5 s against 0.31 s)."""
        vae = getattr(self.pipeline, "vae", None)
        if vae is not None and vae.device.type == "cpu" and vae.dtype in (torch.bfloat16, torch.float16):
            vae.float()

    # ---------------------------------------------------------------- modules

    experts: tuple[str, ...] = ("transformer",)  # the pipeline's denoising transformers

    def select_experts(self, trained: list[str] | None = None, *, guidance_scale_2: float | None = None) -> None:
        """Which of `experts` train (None: all; model.trained_experts) and the low-noise expert's
        CFG scale (model.guidance_scale_2): options of models with two experts only."""
        if trained is not None and list(trained) != list(self.experts):
            raise ValueError(f"model.trained_experts {list(trained)}: this model has one transformer; use null")
        if guidance_scale_2 is not None:
            raise ValueError("model.guidance_scale_2: this model has one transformer; use null")

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def trained_components(self) -> dict[str, nn.Module]:
        """The trained transformers by pipeline component name (what a full fine-tune saves)."""
        return {"transformer": self.pipeline.transformer}

    def save_lora(self, path: str, state: dict[str, Tensor]) -> None:
        """The LoRA weights of `state` (trainable_state's names) in the family pipeline's own
        format, loadable by `pipe.load_lora_weights(path)`."""
        save_peft_lora(type(self.pipeline), path, self.transformer, state)

    @property
    def frozen_modules(self) -> list[nn.Module]:
        modules = (getattr(self.pipeline, name, None) for name in self.frozen_names)
        return [m for m in modules if m is not None]

    # ---------------------------------------------------------------- latents and sigmas

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent cell along height and width."""
        return self.pipeline.vae_scale_factor

    def default_resolution(self) -> int:
        return self.pipeline.default_sample_size * self.spatial_factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One sample's latent shape, as stored and stepped (unpacked): [C, h, w]."""
        f = self.spatial_factor
        if height % (f * 2) or width % (f * 2):  # the transformer patchifies (or we pack) latents 2 x 2
            raise ValueError(f"height and width must be multiples of {2 * f}, got {height}x{width}")
        channels = self.transformer.config.in_channels
        return channels // 4 if self.packed else channels, height // f, width // f

    def sigmas(self, num_steps: int, *, height: int | None = None, width: int | None = None) -> Tensor:
        """s_0 = 1 > ... > s_{N-1} > s_N = 0 as float32 on CPU, length num_steps + 1, as the
        family's pipeline sets them for an image of height x width (default: the model's
        resolution; ignored without resolution_shift). With a fixed shift of 1 this is
        linspace(1, 1/1000, N) then 0: the scheduler's timesteps run from 1000 down to 1, not to 0."""
        scheduler = self.pipeline.scheduler
        if not self.resolution_shift:
            scheduler.set_timesteps(num_steps, device="cpu")
            return scheduler.sigmas.detach().to(torch.float32).clone()
        h, w = self.latent_shape(height or self.resolution, width or self.resolution)[-2:]
        return flow_sigmas(scheduler, num_steps, (h // 2) * (w // 2))

    def held_frames(self, pooled: Tensor) -> int:
        """Leading latent frames (dim 2 of a batch) that the conditioning `pooled` holds fixed: never
        noised, not sampled, left out of the log-prob (Wan2.2 TI2V-5B's first frame). 0: all sampled."""
        return 0

    def hold(self, x: Tensor, pooled: Tensor) -> Tensor:
        """Latents x [B, ...] with their `held_frames` set to the conditioning's values."""
        return x

    # ---------------------------------------------------------------- velocity

    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        raise NotImplementedError

    def _forward(self, transformer: nn.Module, x: Tensor, t: Tensor, embeds: Tensor, pooled: Tensor, *,
                 shape: torch.Size, guidance_scale: float) -> Tensor:
        """The transformer on a batch: x as the transformer takes it (packed when `packed`), t its
        timestep [B], embeds on the device in the model dtype, pooled as encode_prompts made it,
        `shape` the unpacked latents' shape."""
        raise NotImplementedError

    def _cfg_batch(self) -> bool:
        return True

    def _after_cfg(self, v: Tensor, v_cond: Tensor) -> Tensor:
        return v

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
        """Velocity in float32, shaped like `latents`, at per-sample sigma [B].

        With guidance_scale > 1 (and a CFG batch) the unconditional and conditional halves combine
        as v_u + g (v_c - v_u) (see `guided_velocity`). `transformer` substitutes a frozen
        reference copy (full fine-tuning); by default the pipeline's own is used.
        """
        transformer = transformer if transformer is not None else self.transformer
        dt, shape = self.dtype, latents.shape
        x = latents.to(self.device, dt)
        if self.packed:
            x = pack_latents(x)
        # non_blocking: a host tensor's copy is staged at once, without waiting for the GPU's queue to
        # drain (a blocking copy per denoising step left the GPU idle while the next step's kernels launched)
        t = sigma.to(self.device, torch.float32, non_blocking=True).expand(shape[0]) * self.timestep_scale

        def forward(x, t, embeds, pooled):
            return self._forward(transformer, x, t, embeds.to(self.device, dt), pooled, shape=shape,
                                 guidance_scale=guidance_scale).float()

        if guidance_scale > 1.0 and self._cfg_batch():
            if negative_embeds is None or negative_pooled is None:
                raise ValueError("guidance_scale > 1 needs negative (unconditional) prompt embeddings")
            v, v_cond = guided_velocity(forward, (x, t, embeds, pooled), (x, t, negative_embeds, negative_pooled),
                                        guidance_scale, uncond_grad=uncond_grad)
            v = self._after_cfg(v, v_cond)
        else:
            v = forward(x, t, embeds, pooled)
        return unpack_latents(v, *shape[-2:]) if self.packed else v

    # ---------------------------------------------------------------- decoding

    def _latents_for_vae(self, z: Tensor) -> Tensor:
        """Stored latents -> the VAE decoder's input (default: the scale and shift of AutoencoderKL)."""
        config = self.pipeline.vae.config
        return z / config.scaling_factor + config.shift_factor

    def _from_vae(self, x: Tensor) -> Tensor:
        """The VAE decoder's output -> pixels in [-1, 1], channels at dim 1."""
        return x

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> uint8 pixels on CPU, channels last: images [n, H, W, 3] (a video: [n, F, H, W, 3])."""
        vae = self.pipeline.vae
        x = self._from_vae(vae.decode(self._latents_for_vae(latents.to(self.device, vae.dtype)), return_dict=False)[0])
        return ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).movedim(1, -1).cpu()


def save_peft_lora(pipeline_class, path: str, transformer: nn.Module, state: dict[str, Tensor]) -> None:
    """`transformer`'s LoRA weights from `state` with its LoraConfig as the file's metadata: without
    it the loader takes lora_alpha = rank, and a pipeline would run the adapters at r / alpha of
    their trained scale."""
    from peft.utils import get_peft_model_state_dict

    lora = get_peft_model_state_dict(transformer, state_dict=state)
    metadata = transformer.peft_config["default"].to_dict()
    pipeline_class.save_lora_weights(path, transformer_lora_layers=lora, transformer_lora_adapter_metadata=metadata)
