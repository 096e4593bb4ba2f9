"""DiffusionPolicy: a flow-matching text-to-image model as an RL policy.

The rollout side calls `generate` (denoise a batch, record the stochastic window with its
log-probs and weight versions); the trainer side calls `recompute` on recorded steps (the same
transformer call and the same `algo.sde_step`, now with gradients) and syncs weights through
`trainable_state` / `load_trainable_state`. Everything model-family specific lives in the
adapter (`async_flowgrpo.models`).

Equality of the two sides is the property the whole algorithm rests on: with the same weights,
`recompute` reproduces the recorded log-prob. Both go through `adapter.velocity` (same timestep
arithmetic, same CFG combine) and `algo.sde_step` with `sigma_max=None`, whose default (s' at
the s == 1 step, i.e. s_1 of the schedule) is Flow-GRPO's choice on both sides.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from async_flowgrpo import algo
from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.models import load_adapter
from async_flowgrpo.models.base import FamilyAdapter
from async_flowgrpo.types import Group, SamplingParams


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 weights on accelerators (the SDE step itself runs in fp32 inside algo); fp32 on CPU
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def compile_blocks(transformer: nn.Module, backend: str) -> list[nn.Module]:
    """Each block of the transformer's block lists under torch.compile, in place (regional
    compilation, diffusers' compile_repeated_blocks for every family: SD3's transformer names no
    repeated blocks). Elementwise kernels (modulation, norms, the joint sequence's concatenation) were
    59 % of SD3.5-M's LoRA step on an H200; with its blocks compiled (inductor) the step ran 5.48
    trained images/s against 3.71 eager (docs/gpu.md, run 12). Returns the compiled blocks."""
    import torch._dynamo

    blocks = list(_blocks(transformer))
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no block list to compile")
    # The blocks share one compiled forward per variant (SD3.5's dual-attention and last blocks, with
    # and without grad, adapters on and off for the KL term): past dynamo's default of 8 the rest fell
    # back to eager on the H200
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in blocks:
        block.compile(backend=backend)
    return blocks


def _blocks(module: nn.Module) -> Iterator[nn.Module]:
    """The entries of the block lists (nn.ModuleList) under `module`, not looking inside a block: a
    transformer's, or each expert's of a two-expert model (Wan2.2 A14B's wrapper holds transformers)."""
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            yield from child
        else:
            yield from _blocks(child)


def step_unheld(step: Callable, held: int, v: Tensor, x: Tensor, *args, **kwargs):
    """`step` (algo.sde_step, algo.ode_step or algo.dpm_solver_2m_step) on the latents after their
    first `held` frames (dim 2), which it returns unchanged in front (a conditioning's fixed frames:
    Wan2.2 TI2V-5B's first frame). sde_step's log-prob and mean then cover the sampled frames only."""
    if not held:
        return step(v, x, *args, **kwargs)
    sliced = ("noise", "prev_sample", "prev_velocity")
    kwargs = {k: t[:, :, held:] if k in sliced and t is not None else t for k, t in kwargs.items()}
    out = step(v[:, :, held:], x[:, :, held:], *args, **kwargs)
    if isinstance(out, Tensor):
        return torch.cat([x[:, :, :held], out], 2)
    return (torch.cat([x[:, :, :held], out[0]], 2), *out[1:])


def _own(t: Tensor) -> Tensor:
    """A CPU tensor with its own storage: on CPU, `t[g].cpu()` would be a view of the whole
    batch, and pickling a view (Ray's object store) ships the whole storage with every group."""
    return t.to("cpu", copy=True)


class DiffusionPolicy:
    def __init__(
        self,
        model_path: str | FamilyAdapter,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        autocast_dtype: torch.dtype | None = None,
        lora_rank: int = 32,
        lora_alpha: int = 64,
        lora_init_seed: int = 0,
        reference_copy: bool = False,
        num_frames: int = 0,
        trained_experts: list[str] | None = None,
        guidance_scale_2: float | None = None,
    ):
        """model_path: a model directory, or an adapter already built in memory (benchmarks/gpu.py's
        real-size models with random weights), moved here to device and dtype. autocast_dtype:
        compute in this dtype under torch.autocast while the weights stay in `dtype` (full
        fine-tuning on a GPU: fp32 master weights, bf16 matmuls); bf16 or fp16 weights imply it.
        lora_rank 0 trains every transformer weight. lora_init_seed makes the gaussian LoRA A
        matrices identical in every process that builds the policy (trainers and rollout actors
        start equal without a weight sync). reference_copy keeps a frozen copy of the initial
        transformer for the KL term of full fine-tuning (LoRA needs none: adapters off). num_frames
        > 0: frames per video of a video family (0: the model's own). trained_experts and
        guidance_scale_2: a two-expert model's (Wan2.2 A14B) experts to train (None: all) and its
        low-noise expert's CFG scale (None: the call's), see FamilyAdapter.select_experts."""
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        # Low-precision weights compute under autocast too: the LoRA adapters are fp32 (for Adam),
        # and without autocast peft runs them as fp32 matmuls on fp32 copies of every activation.
        low = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else None
        self.autocast_dtype = autocast_dtype or low
        if isinstance(model_path, FamilyAdapter):
            self.adapter = model_path.to(self.device, self.dtype)
        else:
            self.adapter = load_adapter(model_path, device=self.device, dtype=self.dtype, num_frames=num_frames)
        self.adapter.select_experts(trained_experts, guidance_scale_2=guidance_scale_2)
        self.lora_rank = lora_rank
        self._fused: dict[nn.Module, Tensor] = {}  # LoRA layer -> its base weight, while fused (fuse_lora)
        self._lora_layers: list[nn.Module] = []  # peft's tuner layers, found once (_set_adapters)
        for module in self.adapter.frozen_modules:
            module.requires_grad_(False).eval()
        transformer = self.adapter.transformer.eval()  # eval: no dropout, the rollout's forward is replayed
        if lora_rank > 0:
            self._add_lora(transformer, lora_rank, lora_alpha, lora_init_seed)
        else:
            transformer.requires_grad_(True)
        self._ref_transformer = (
            copy.deepcopy(transformer).requires_grad_(False) if reference_copy and lora_rank == 0 else None
        )

    def _add_lora(self, transformer: nn.Module, rank: int, alpha: int, seed: int) -> None:
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig
        from peft.tuners.tuners_utils import BaseTunerLayer

        transformer.requires_grad_(False)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            transformer.add_adapter(
                LoraConfig(
                    r=rank,
                    lora_alpha=alpha,
                    init_lora_weights="gaussian",  # A ~ N(0, 1/r), B = 0: the policy starts equal to the base
                    target_modules=list(self.adapter.lora_target_modules),
                )
            )
        self._lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
        # Adam updates of bf16 LoRA weights would round away; keep the trainable ones in fp32
        cast_training_params(transformer, dtype=torch.float32)
        if self.autocast_dtype is not None:
            # autocast runs the adapters' matmuls in its dtype anyway: peft's cast of each
            # activation to the adapters' fp32 would only copy it there and back (same values)
            for module in transformer.modules():
                if hasattr(module, "cast_input_dtype_enabled"):
                    module.cast_input_dtype_enabled = False

    def _velocity(self, *args, **kwargs) -> Tensor:
        """adapter.velocity, under autocast when the policy computes in a lower dtype than it stores."""
        if self.autocast_dtype is None:
            return self.adapter.velocity(*args, **kwargs)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.adapter.velocity(*args, **kwargs)

    # ---------------------------------------------------------------- weights

    @property
    def has_reference(self) -> bool:
        return self.lora_rank > 0 or self._ref_transformer is not None

    def transformers(self) -> list[nn.Module]:
        """The trained transformer (or experts) and, for full fine-tuning with a KL term, its frozen reference copy."""
        return [self.adapter.transformer] + ([self._ref_transformer] if self._ref_transformer is not None else [])

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self._trainable_named()]

    def _trainable_named(self) -> list[tuple[str, nn.Parameter]]:
        if self.lora_rank > 0:
            return [(n, p) for n, p in self.adapter.transformer.named_parameters() if "lora_" in n]
        return list(self.adapter.transformer.named_parameters())

    def trainable_state(self) -> dict[str, Tensor]:
        """The weights that training changes, in a fixed order, as detached views of the live
        parameters on the policy's device (no copy: clone to keep a snapshot)."""
        return {n: p.detach() for n, p in self._trainable_named()}

    def publishable(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """`state` (trainable weights) as rollout actors hold them. Full fine-tuning keeps fp32
        master weights here while the actors hold the model dtype (bf16 on GPUs): sending that
        dtype halves the bytes and loads the same values (the actor would round on load)."""
        if self.lora_rank > 0 or self.autocast_dtype is None or self.autocast_dtype == self.dtype:
            return state
        return {k: v.to(self.autocast_dtype) for k, v in state.items()}

    @torch.no_grad()
    def load_trainable_state(self, state: dict[str, Tensor]) -> None:
        named = dict(self._trainable_named())
        if state.keys() != named.keys():
            missing, unexpected = named.keys() - state.keys(), state.keys() - named.keys()
            raise KeyError(
                f"trainable state mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        for name, p in named.items():
            p.copy_(state[name])
        if self._fused:
            self._fold_lora()

    @property
    def lora_fused(self) -> bool:
        return bool(self._fused)

    # A rollout never needs the adapters apart from the base weights (it takes no gradient and no
    # KL reference), and their extra matmuls cost it 15 % on an H200 (docs/gpu.md). Folded, it
    # runs at the base model's cost. Each fold starts from a kept copy of the base weight: adding
    # and subtracting deltas in bf16 would drift by a rounding per weight update.
    def fuse_lora(self) -> None:
        """Compute with the LoRA deltas folded into the base weights (rollout only: the adapters
        stay as parameters, loads keep refolding them); `unfuse_lora` undoes it."""
        from peft.tuners.lora import LoraLayer

        if self.lora_rank == 0 or self._fused:
            return
        transformer = self.adapter.transformer
        self._fused = {m: m.base_layer.weight.detach().clone() for m in transformer.modules() if isinstance(m, LoraLayer)}
        transformer.disable_adapters()
        self._fold_lora()

    @torch.no_grad()
    def unfuse_lora(self) -> None:
        for layer, base in self._fused.items():
            layer.base_layer.weight.copy_(base)
        if self._fused:
            self.adapter.transformer.enable_adapters()
        self._fused = {}

    @torch.no_grad()
    def _fold_lora(self) -> None:
        for layer, base in self._fused.items():
            delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters)  # scaling * B @ A, fp32
            layer.base_layer.weight.copy_(base.float() + delta)  # rounded once, to the weight's dtype

    def _set_adapters(self, enabled: bool) -> None:
        """transformer.enable_adapters() / disable_adapters() (the same per-layer calls) without
        their walk over every module (a disable-enable pair: 1.1 ms against 3.2 ms on the embedded model)."""
        for layer in self._lora_layers:
            layer.enable_adapters(enabled)

    @contextlib.contextmanager
    def _reference_transformer(self) -> Iterator[nn.Module]:
        transformer = self.adapter.transformer
        if self._fused:
            raise ValueError("no KL reference while the LoRA deltas are folded in (fuse_lora is for rollouts)")
        if self.lora_rank > 0:
            self._set_adapters(False)
            try:
                yield transformer
            finally:
                self._set_adapters(True)
        elif self._ref_transformer is not None:
            yield self._ref_transformer
        else:
            raise ValueError(
                "a KL reference (algorithm.beta > 0) with full fine-tuning (model.lora_rank 0) needs "
                "DiffusionPolicy(reference_copy=True)"
            )

    # ---------------------------------------------------------------- rollout

    def sigmas(self, num_steps: int, *, height: int | None = None, width: int | None = None) -> Tensor:
        return self.adapter.sigmas(num_steps, height=height, width=width)

    def generate(
        self,
        prompts: list[str],
        group_size: int,
        *,
        num_steps: int,
        guidance_scale: float,
        noise_level: float,
        sde_type: str,
        window_size: int,
        window_range: tuple[int, int] | None = None,
        shared_initial_noise: bool = False,
        after_window_solver: str = "euler",
        after_window_steps: float = 1.0,
        seed: int,
        height: int | None = None,
        width: int | None = None,
        version_fn: Callable[[], int] | None = None,
        prompt_indices: list[int] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Group]:
        """Denoise len(prompts) * group_size samples as one batch; one Group per prompt.

        The window's steps are stochastic and recorded (Flow-GRPO); window_size 0 samples by ODE
        and records only the final latent, stamped with every step's version (DiffusionNFT).

        One CPU torch.Generator seeded by `seed` draws, in order, the window position, the initial
        noise and each window step's noise, so a seed reproduces the batch on any device.
        shared_initial_noise gives every sample of a group the same initial noise (DanceGRPO's
        init_same_noise): the group then differs only by the window's noise, the part the
        log-probs (and so the policy gradient) can credit, instead of mostly by where it started.
        After the window (MixGRPO-Flash), `after_window_steps` < 1 takes that fraction of the
        remaining steps (algo.schedule_after_window) and `after_window_solver` "dpm2" takes them by
        DPM-Solver++(2M) instead of Euler: the recorded window is sampled and replayed as before,
        the final image comes from fewer transformer calls.
        `version_fn()` is called before every denoising step, outside no_grad, and its value is
        stamped on that step if it is recorded: a rollout actor swaps in new weights there
        (in-flight update). Each group's time_generate_s is its share of the batch's wall time.
        An edit model's input images come in metadata[SOURCE_IMAGES] (`conditioning.with_sources`).
        """
        t0 = time.perf_counter()
        version_fn = version_fn or (lambda: 0)
        prompt_indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if not len(prompts) == len(prompt_indices) == len(metadata):
            raise ValueError("prompts, prompt_indices and metadata must have the same length")
        height = height or self.adapter.resolution
        width = width or self.adapter.resolution
        latent_shape = self.adapter.latent_shape(height, width)
        cfg = guidance_scale > 1.0

        gen = torch.Generator().manual_seed(seed)
        start, end = algo.sde_window(num_steps, window_size, window_range, generator=gen)
        sigmas = self.adapter.sigmas(num_steps, height=height, width=width)  # resolution-dependent shift
        window_sigmas = sigmas[start : end + 1]
        if after_window_solver not in ("euler", "dpm2"):
            raise ValueError(f"after_window_solver must be euler or dpm2, got {after_window_solver!r}")
        if end > start:  # unchanged at after_window_steps 1.0
            sigmas = algo.schedule_after_window(sigmas, end, after_window_steps)
        enc = self._encode(prompts, metadata, cfg)
        per_sample = [t.repeat_interleave(group_size, 0) if t is not None else None for t in
                      (enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled)]
        if shared_initial_noise:
            x = torch.randn((len(prompts), *latent_shape), generator=gen).repeat_interleave(group_size, 0)
        else:
            x = torch.randn((len(prompts) * group_size, *latent_shape), generator=gen)
        held = self.adapter.held_frames(enc.pooled)  # frames the conditioning fixes (an image-to-video first frame)
        x = self.adapter.hold(x.to(self.device), per_sample[1])

        # the window's latents and log-probs stay on the device until the loop ends: a .cpu() per
        # step would synchronise an accelerator every step (each step's tensors are new ones, so
        # keeping references is safe)
        recorded, log_probs, versions, step_versions = [], [], [], []
        previous = {}  # the last step's input and velocity: DPM-Solver++(2M)'s second order after the window
        for i in range(len(sigmas) - 1):
            version = int(version_fn())  # outside no_grad: the hook may copy new weights in
            step_versions.append(version)
            with torch.no_grad():
                v = self._velocity(x, sigmas[i], *per_sample, guidance_scale=guidance_scale)
                x_in = x
                if start <= i < end:
                    if i == start:
                        recorded.append(x)
                    eps = torch.randn(x.shape, generator=gen).to(self.device, non_blocking=True)  # (as the sigma in velocity)
                    x, log_prob, _, _ = step_unheld(
                        algo.sde_step, held, v, x, sigmas[i], sigmas[i + 1], noise_level=noise_level,
                        sde_type=sde_type, noise=eps,
                    )
                    recorded.append(x)
                    log_probs.append(log_prob)
                    versions.append(version)
                elif after_window_solver == "dpm2" and i >= end > start:
                    x = step_unheld(algo.dpm_solver_2m_step, held, v, x, sigmas[i], sigmas[i + 1],
                                    sigma_prev=sigmas[i - 1], **previous)
                else:
                    x = step_unheld(algo.ode_step, held, v, x, sigmas[i], sigmas[i + 1])
                previous = {"prev_velocity": v, "prev_sample": x_in}
        images = self.adapter.decode(x)

        n = group_size
        if end == start:
            # no window: record the final latent (sigma 0), which every denoising step made; it is all
            # DiffusionNFT trains on (and evaluation ignores it)
            recorded, versions, recorded_sigmas = [x], step_versions, sigmas[-1:]
        else:
            recorded_sigmas = window_sigmas
        all_latents = torch.stack(recorded, 1).cpu()
        all_logp = torch.stack(log_probs, 1).cpu() if log_probs else torch.empty(x.shape[0], 0)
        params = SamplingParams(
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            sde_type=sde_type,
            window_start=start,
            window_size=end - start,
            height=height,
            width=width,
        )
        elapsed = (time.perf_counter() - t0) / len(prompts)
        groups = []
        for g, prompt in enumerate(prompts):
            groups.append(
                Group(
                    prompt=prompt,
                    prompt_index=prompt_indices[g],
                    metadata=metadata[g],
                    params=params,
                    latents=all_latents[g * n : (g + 1) * n].clone(),
                    sigmas=recorded_sigmas.clone(),
                    log_probs=all_logp[g * n : (g + 1) * n].clone(),
                    versions=torch.tensor(versions, dtype=torch.long),
                    images=images[g * n : (g + 1) * n].clone(),
                    prompt_embeds=_own(enc.embeds[g]),
                    pooled_prompt_embeds=_own(enc.pooled[g]),
                    # None also under guidance for guidance-distilled models (Flux-dev): no CFG batch
                    negative_prompt_embeds=_own(enc.negative_embeds[g]) if enc.negative_embeds is not None else None,
                    negative_pooled_prompt_embeds=(
                        _own(enc.negative_pooled[g]) if enc.negative_pooled is not None else None
                    ),
                    seed=seed,
                    time_generate_s=elapsed,
                )
            )
        return groups

    def _encode(self, prompts: list[str], metadata: list[dict], cfg: bool):
        """The prompts' conditioning; an edit model's also encodes each prompt's input images
        (metadata[SOURCE_IMAGES]), once for the group, into it (see FluxKontextAdapter); a model
        that may take them (Wan2.2 TI2V-5B's first frame) does when every prompt has them."""
        images = [m.get(SOURCE_IMAGES) for m in metadata]
        given = [i is not None for i in images]
        if self.adapter.image_optional and any(given):
            if not all(given):
                raise ValueError(f"this {self.adapter.family} model takes input images for all prompts of a batch or "
                                 "for none; some prompts carry them, some not")
            return self.adapter.encode_prompts(prompts, cfg=cfg, images=images)
        if not self.adapter.image_conditioned:
            if any(given):
                raise ValueError(f"this {self.adapter.family} model takes no input images; the prompts carry some")
            return self.adapter.encode_prompts(prompts, cfg=cfg)
        if not all(given):
            raise ValueError(f"this {self.adapter.family} model edits images: every prompt needs its input "
                             "image(s) (a JSONL prompt file's \"images\")")
        return self.adapter.encode_prompts(prompts, cfg=cfg, images=images)

    # ---------------------------------------------------------------- training

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        prompt_embeds: Tensor,
        pooled: Tensor,
        *,
        guidance_scale: float = 1.0,
        reference: bool = False,
    ) -> Tensor:
        """Conditional velocity in float32 at per-sample sigma [B], never a CFG combination:
        with gradients through the trained transformer or, with reference=True, the reference's
        (LoRA adapters off, or the frozen copy) without gradient. guidance_scale reaches only
        guidance-distilled models (Flux-dev), where it is an input of the network rather than a
        CFG batch. DiffusionNFT's forward-process loss uses it."""
        x = x.to(self.device, torch.float32)
        guidance = guidance_scale if getattr(self.adapter, "guidance_distilled", False) else 1.0
        if not reference:
            return self._velocity(x, sigma, prompt_embeds, pooled, guidance_scale=guidance)
        with torch.no_grad(), self._reference_transformer() as ref:
            return self._velocity(x, sigma, prompt_embeds, pooled, guidance_scale=guidance, transformer=ref)

    def recompute(
        self,
        latents_j: Tensor,
        latents_next: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        prompt_embeds: Tensor,
        pooled: Tensor,
        neg_embeds: Tensor | None,
        neg_pooled: Tensor | None,
        *,
        guidance_scale: float,
        noise_level: float,
        sde_type: str,
        sigma_max: float | Tensor | None = None,
        with_ref: bool = False,
        uncond_grad: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Score recorded steps x_j -> x_{j+1} of a micro-batch with gradients through the
        transformer: (log_prob [B], mean, std, ref_mean or None). sigma, sigma_next: [B] (each
        sample's own step); embeddings [B, ...]. ref_mean is the reference policy's mean (LoRA
        adapters off, or the frozen copy), without gradient. uncond_grad=False differentiates only
        the conditional half of a guided velocity (same forward, see models.combine_guidance).
        Frames the conditioning holds (adapter.held_frames) are not scored: the log-prob and the
        means cover the sampled frames only."""
        x = latents_j.to(self.device, torch.float32)
        x_next = latents_next.to(self.device, torch.float32)
        cond = (prompt_embeds, pooled, neg_embeds, neg_pooled)
        held = self.adapter.held_frames(pooled)
        step = dict(noise_level=noise_level, sde_type=sde_type, sigma_max=sigma_max, prev_sample=x_next)
        v = self._velocity(x, sigma, *cond, guidance_scale=guidance_scale, uncond_grad=uncond_grad)
        _, log_prob, mean, std = step_unheld(algo.sde_step, held, v, x, sigma, sigma_next, **step)
        ref_mean = None
        if with_ref:
            with torch.no_grad(), self._reference_transformer() as ref:
                v_ref = self._velocity(x, sigma, *cond, guidance_scale=guidance_scale, transformer=ref)
                ref_mean = step_unheld(algo.sde_step, held, v_ref, x, sigma, sigma_next, **step)[2]
        return log_prob, mean, std, ref_mean

    def sampled_elements(self, latent: Tensor, pooled: Tensor) -> int:
        """Entries of one sample's latent [C, F, ...] that are sampled (the log-prob's mean runs over
        them): all but the frames its conditioning `pooled` holds."""
        return latent[:, self.adapter.held_frames(pooled):].numel()
