"""vllm-omni rollout engine (optional GPU extra; written against vllm-omni 0.30.0, not run here on a GPU).

Same interface as `DiffusersEngine`: ``generate(prompts, n, seed, ...) -> list[Group]``,
``stage_weights`` / ``load_weights`` / ``apply_staged``, ``version``, ``update_point``.

How it works
  * One `vllm_omni.AsyncOmni` per rollout actor serves the checkpoint with OUR pipeline class
    (``custom_pipeline_args={"pipeline_class": ...FlowGRPOSD3Pipeline}``), a subclass of vllm-omni's
    SD3 pipeline whose ``diffuse`` runs the Flow-GRPO loop: `denoise_and_record` below, i.e. the
    same window draw, noise draws and `algo.sde_step` as `DiffusionPolicy.generate`, so one seed
    gives the same sample on either engine (up to kernel numerics). It returns the recorded
    latents, log-probs, sigmas and prompt conditioning in ``DiffusionOutput.trajectory_*``, which
    vllm-omni forwards untouched to ``OmniRequestOutput.trajectory_*``.
  * One request per prompt, ``num_outputs_per_prompt = n``; our parameters travel in
    ``OmniDiffusionSamplingParams.extra_args[EXTRA_KEY]``.
  * Weights: LoRA (model.lora_rank > 0) -> each sync writes a PEFT adapter dir with a new
    ``lora_int_id``; ``collective_rpc("add_lora")`` loads it and ``collective_rpc("list_loras")``
    confirms it (AsyncOmni.add_lora's bool does not: it counts a worker's error as success);
    only then do later requests carry its ``LoRARequest`` and is the previous adapter removed
    (``remove_lora``) and its dir deleted. A failed load leaves the previous adapter in use.
    Full fine-tune -> the transformer state is written to a safetensors file and loaded by our
    worker extension (``collective_rpc("flowgrpo_load_weights", path)``), which feeds it to the
    vllm-omni transformer's ``load_weights`` (diffusers names; q/k/v are fused there).
  * Versions: vllm-omni cannot switch weights inside a request, so every step of a group carries
    the version its request was submitted with (echoed back by the pipeline and checked).
    ``update_point="between_steps"`` (in-flight update) therefore degrades to "between_groups"
    with this engine, with a warning.

All ``vllm_omni`` imports happen inside functions (or on first access of the two worker-side
classes through the module ``__getattr__``), so this module imports, and its pure helpers are
tested, without vllm-omni.

vllm-omni 0.30.0 API used (paths inside the vllm_omni package):
  entrypoints/async_omni.py         AsyncOmni(model, **kwargs), .generate(prompt, sampling_params=,
                                    request_id=), .collective_rpc(method, timeout=, args=) for
                                    add_lora / list_loras / remove_lora and our RPC, .shutdown
  engine/omni_engine_base.py        custom_pipeline_args, worker_extension_cls, dtype -> diffusion stage args
  inputs/data.py                    OmniDiffusionSamplingParams (num_inference_steps, guidance_scale,
                                    height, width, seed, num_outputs_per_prompt, extra_args, lora_request)
  diffusion/models/sd3/pipeline_sd3.py  StableDiffusion3Pipeline.forward(DiffusionRequestBatch) / .diffuse(...)
  diffusion/worker/request_batch.py DiffusionRequestBatch
  diffusion/worker/diffusion_worker.py  CustomPipelineWorkerExtension.re_init_pipeline, add_lora/remove_lora,
                                    WorkerWrapperBase (extension mixed into the worker class)
  diffusion/data.py                 DiffusionOutput.trajectory_{latents,log_probs,timesteps}
  diffusion/output_formatter.py     trajectory_* copied onto OmniRequestOutput
  diffusion/lora/manager.py         PEFT adapter dirs (adapter_config.json + adapter_model.safetensors),
                                    packed to_q/to_k/to_v -> to_qkv handled there
  lora/request.py                   LoRARequest (re-export of vllm.lora.request.LoRARequest)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from async_flowgrpo import algo
from async_flowgrpo.types import Group, SamplingParams

logger = logging.getLogger(__name__)

VLLM_OMNI_VERSION = "0.30.0"  # the version this module was written against (setup.cfg extra "gpu")
INSTALL_HINT = (
    "rollout.engine=vllm_omni needs the optional GPU extra: pip install 'async_flowgrpo[gpu]' "
    f"(vllm-omni=={VLLM_OMNI_VERSION})"
)
EXTRA_KEY = "async_flowgrpo"  # our request spec inside OmniDiffusionSamplingParams.extra_args
PIPELINE_QUALNAME = f"{__name__}.FlowGRPOSD3Pipeline"
EXTENSION_QUALNAME = f"{__name__}.FlowGRPOWorkerExtension"
LOAD_WEIGHTS_RPC = "flowgrpo_load_weights"
UPDATE_POINTS = ("between_steps", "between_groups")
RPC_WAIT_MARGIN_S = 10.0  # our wait on a collective_rpc beyond the timeout it is given


def require_vllm_omni():
    """Import vllm_omni or fail with the install hint."""
    try:
        import vllm_omni
    except ImportError as e:  # missing, or a broken install (e.g. no matching vllm)
        raise ImportError(f"{INSTALL_HINT}: {e}") from e
    return vllm_omni


def resolve_update_point(requested: str) -> str:
    """vllm-omni runs a request's denoising loop without a hook between steps, so weights change
    only between requests: "between_steps" degrades to "between_groups" (with a warning)."""
    if requested not in UPDATE_POINTS:
        raise ValueError(f"sync.update_point must be one of {UPDATE_POINTS}, got {requested!r}")
    if requested == "between_steps":
        warnings.warn(
            "sync.update_point=between_steps (in-flight update) is not possible with "
            "rollout.engine=vllm_omni: a request cannot switch weights mid-denoising. Weights are "
            "swapped between groups instead; every step of a group carries one version.",
            RuntimeWarning,
            stacklevel=2,
        )
    return "between_groups"


# ------------------------------------------------------------------ the denoising loop (worker side, pure torch)


def denoise_and_record(
    velocity_fn: Callable[[Tensor, int], Tensor],
    latent_shape: tuple[int, ...],
    sigmas: Tensor,
    spec: dict,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, dict]:
    """The Flow-GRPO sampling loop of `DiffusionPolicy.generate` for the n samples of one prompt.

    velocity_fn(x [n, *latent_shape] float32, i) -> velocity (float32) at sigmas[i].
    spec: our request spec (see `build_requests`): seed, batch_index, batch_prompts, group_size,
    num_steps, noise_level, sde_type, window_size, window_range, shared_initial_noise. One CPU generator seeded by
    `seed` draws, in order, the window, the initial noise and each window step's noise, for the
    whole batch of batch_prompts * n samples as DiffusionPolicy does; this request keeps the rows
    of its prompt, so it reproduces that prompt's group of a diffusers-engine batch.
    Returns the final latents and {"latents" [n, W+1, ...], "log_probs" [n, W], "sigmas" [W+1],
    "window_start"}.
    """
    n, num_steps = int(spec["group_size"]), int(spec["num_steps"])
    if sigmas.numel() != num_steps + 1:
        raise ValueError(f"expected {num_steps + 1} sigmas for {num_steps} steps, got {sigmas.numel()}")
    sigmas = sigmas.detach().float().cpu()
    window_range = tuple(spec["window_range"]) if spec.get("window_range") else None
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    start, end = algo.sde_window(num_steps, int(spec["window_size"]), window_range, generator=gen)
    full = (int(spec["batch_prompts"]) * n, *latent_shape)
    rows = slice(int(spec["batch_index"]) * n, (int(spec["batch_index"]) + 1) * n)

    if spec.get("shared_initial_noise"):  # one noise per prompt of the batch, as DiffusionPolicy draws it
        per_prompt = torch.randn(int(spec["batch_prompts"]), *latent_shape, generator=gen)
        x = per_prompt[int(spec["batch_index"])].expand(n, *latent_shape).clone()
    else:
        x = torch.randn(full, generator=gen)[rows]
    x = x.to(device)
    recorded, log_probs = [], []
    for i in range(num_steps):
        v = velocity_fn(x, i)
        if start <= i < end:
            if i == start:
                recorded.append(x.cpu())
            eps = torch.randn(full, generator=gen)[rows].to(device)
            x, log_prob, _, _ = algo.sde_step(
                v, x, sigmas[i], sigmas[i + 1], noise_level=float(spec["noise_level"]), sde_type=spec["sde_type"],
                noise=eps,
            )
            recorded.append(x.cpu())
            log_probs.append(log_prob.cpu())
        else:
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    record = {
        "latents": torch.stack(recorded, 1) if recorded else torch.empty(n, 0, *latent_shape),
        "log_probs": torch.stack(log_probs, 1) if log_probs else torch.empty(n, 0),
        "sigmas": sigmas[start : end + 1].clone() if end > start else torch.empty(0),
        "window_start": start,
    }
    return x, record


def trajectory_payload(
    record: dict,
    *,
    spec: dict,
    height: int,
    width: int,
    prompt_embeds: Tensor,
    pooled_prompt_embeds: Tensor,
    negative_prompt_embeds: Tensor | None = None,
    negative_pooled_prompt_embeds: Tensor | None = None,
) -> dict[str, Any]:
    """Fields our pipeline sets on its DiffusionOutput (vllm-omni copies them onto
    OmniRequestOutput): trajectory_latents, trajectory_log_probs, and trajectory_timesteps, which
    vllm-omni types as "Tensor | dict" and we use for the rest of the record. Conditioning is the
    prompt's own (first row: the n rows are copies), on CPU."""

    def row(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[0].detach().cpu()

    return {
        "trajectory_latents": record["latents"],
        "trajectory_log_probs": record["log_probs"],
        "trajectory_timesteps": {
            "sigmas": record["sigmas"],
            "window_start": int(record["window_start"]),
            "version": int(spec["version"]),  # echoed: the output is matched to the weights that made it
            "height": int(height),
            "width": int(width),
            "prompt_embeds": row(prompt_embeds),
            "pooled_prompt_embeds": row(pooled_prompt_embeds),
            "negative_prompt_embeds": row(negative_prompt_embeds),
            "negative_pooled_prompt_embeds": row(negative_pooled_prompt_embeds),
        },
    }


# ------------------------------------------------------------------ requests (client side)


@dataclass
class RolloutRequest:
    """One vllm-omni request: the n samples of one prompt. `sampling` holds the keyword
    arguments of OmniDiffusionSamplingParams (lora_request is filled in at submission)."""

    request_id: str
    prompt: dict  # OmniPromptType: {"prompt": ..., "negative_prompt": ...}
    sampling: dict
    prompt_text: str
    prompt_index: int
    metadata: dict
    version: int
    seed: int

    @property
    def spec(self) -> dict:
        return self.sampling["extra_args"][EXTRA_KEY]


def build_requests(
    prompts: list[str],
    n: int,
    seed: int,
    *,
    num_steps: int,
    guidance_scale: float,
    noise_level: float,
    sde_type: str,
    window_size: int,
    window_range: tuple[int, int] | None = None,
    shared_initial_noise: bool = False,
    height: int | None = None,
    width: int | None = None,
    prompt_indices: list[int] | None = None,
    metadata: list[dict] | None = None,
    version: int = 0,
    max_sequence_length: int | None = None,
) -> list[RolloutRequest]:
    """One request per prompt. Invalid sampling settings fail here, not in a GPU worker."""
    prompt_indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
    metadata = [{} for _ in prompts] if metadata is None else list(metadata)
    if not len(prompts) == len(prompt_indices) == len(metadata):
        raise ValueError("prompts, prompt_indices and metadata must have the same length")
    if n < 1:
        raise ValueError(f"group size n must be >= 1, got {n}")
    if sde_type not in ("sde", "cps"):
        raise ValueError(f"unknown sde_type {sde_type!r}: expected 'sde' or 'cps'")
    if window_size > 0 and sde_type == "sde" and noise_level <= 0:
        raise ValueError("sde_type 'sde' needs noise_level > 0")
    algo.sde_window(num_steps, window_size, window_range)  # validates window_size / window_range
    requests = []
    for g, (text, index, meta) in enumerate(zip(prompts, prompt_indices, metadata)):
        spec = {
            "seed": int(seed),
            "batch_index": g,
            "batch_prompts": len(prompts),
            "group_size": int(n),
            "num_steps": int(num_steps),
            "noise_level": float(noise_level),
            "sde_type": sde_type,
            "window_size": int(window_size),
            "window_range": list(window_range) if window_range is not None else None,
            "shared_initial_noise": bool(shared_initial_noise),
            "version": int(version),
        }
        sampling = {
            "num_inference_steps": int(num_steps),
            "guidance_scale": float(guidance_scale),
            "guidance_scale_provided": True,
            "num_outputs_per_prompt": int(n),
            "seed": int(seed),  # vllm-omni seeds its own generator with it; our noise comes from spec
            "output_type": "pil",
            "extra_args": {EXTRA_KEY: spec},
        }
        if height:
            sampling["height"] = int(height)
        if width:
            sampling["width"] = int(width)
        if max_sequence_length:
            sampling["max_sequence_length"] = int(max_sequence_length)
        requests.append(
            RolloutRequest(
                request_id=f"flowgrpo-v{version}-p{index}-s{seed}-{uuid.uuid4().hex[:8]}",
                prompt={"prompt": text, "negative_prompt": ""},
                sampling=sampling,
                prompt_text=text,
                prompt_index=int(index),
                metadata=meta,
                version=int(version),
                seed=int(seed),
            )
        )
    return requests


def images_to_uint8(images: list) -> Tensor:
    """PIL images (OmniRequestOutput.images) -> uint8 [n, H, W, 3], the layout of Group.images."""
    if not images:
        raise ValueError("vllm-omni output has no images (is the stage's output_type 'latent'?)")
    arrays = [np.asarray(im.convert("RGB") if hasattr(im, "convert") else im, dtype=np.uint8) for im in images]
    return torch.from_numpy(np.stack(arrays))


def normal_tensor(t: Tensor | None) -> Tensor | None:
    """A clone of a tensor made under torch.inference_mode(), else the tensor itself. vllm-omni
    runs the pipeline in inference mode (diffusion_model_runner.py: `grad_context = torch.no_grad()
    if (use_hsdp or use_distributed_offload) else torch.inference_mode()`), and an inline stage
    hands its outputs over in this process; such a tensor refuses autograd and in-place changes
    outside inference mode. A clone made here, outside it, is a normal tensor."""
    return t.clone() if t is not None and t.is_inference() else t


def group_from_output(output: Any, request: RolloutRequest, *, guidance_scale: float, elapsed_s: float = 0.0) -> Group:
    """Convert the final OmniRequestOutput of one request into a Group (all steps stamped with
    the version the request was submitted with; the pipeline's echo must agree)."""
    if getattr(output, "error", None):
        raise RuntimeError(f"vllm-omni request {request.request_id} failed: {output.error}")
    info = getattr(output, "trajectory_timesteps", None)
    latents = getattr(output, "trajectory_latents", None)
    log_probs = getattr(output, "trajectory_log_probs", None)
    if not isinstance(info, dict) or latents is None or log_probs is None:
        raise RuntimeError(
            f"vllm-omni request {request.request_id} returned no trajectory: is the stage serving "
            f"{PIPELINE_QUALNAME} (custom_pipeline_args.pipeline_class)?"
        )
    if int(info["version"]) != request.version:
        raise RuntimeError(
            f"request {request.request_id}: output made with version {info['version']}, expected {request.version}"
        )
    spec, n = request.spec, request.spec["group_size"]
    window = int(log_probs.shape[1])
    if latents.shape[0] != n or log_probs.shape[0] != n or latents.shape[1] != window + (1 if window else 0):
        raise RuntimeError(
            f"request {request.request_id}: trajectory shapes {tuple(latents.shape)} / {tuple(log_probs.shape)} "
            f"do not match group size {n}"
        )
    images = images_to_uint8(list(getattr(output, "images", None) or []))
    if images.shape[0] != n:
        raise RuntimeError(f"request {request.request_id}: {images.shape[0]} images for a group of {n}")
    cfg = guidance_scale > 1.0
    params = SamplingParams(
        num_steps=int(spec["num_steps"]),
        guidance_scale=float(guidance_scale),
        noise_level=float(spec["noise_level"]),
        sde_type=spec["sde_type"],
        window_start=int(info["window_start"]),
        window_size=window,
        height=int(info["height"]),
        width=int(info["width"]),
    )
    return Group(
        prompt=request.prompt_text,
        prompt_index=request.prompt_index,
        metadata=request.metadata,
        params=params,
        latents=normal_tensor(latents.float()),
        sigmas=normal_tensor(info["sigmas"].float()),
        log_probs=normal_tensor(log_probs.float()),
        versions=torch.full((window,), request.version, dtype=torch.long),
        images=images,
        prompt_embeds=normal_tensor(info["prompt_embeds"]),
        pooled_prompt_embeds=normal_tensor(info["pooled_prompt_embeds"]),
        negative_prompt_embeds=normal_tensor(info["negative_prompt_embeds"]) if cfg else None,
        negative_pooled_prompt_embeds=normal_tensor(info["negative_pooled_prompt_embeds"]) if cfg else None,
        seed=request.seed,
        time_generate_s=elapsed_s,
    )


# ------------------------------------------------------------------ LoRA adapters on disk


def peft_key(name: str) -> str:
    """Live peft parameter name -> PEFT checkpoint key (the adapter name dropped, the PeftModel
    prefix added), e.g. blocks.0.attn.to_q.lora_A.default.weight -> base_model.model.blocks.0.attn.to_q.lora_A.weight"""
    if not re.search(r"\.lora_[AB]\.", name):
        raise ValueError(
            f"{name!r} is not a LoRA weight (rollout.engine=vllm_omni with model.lora_rank > 0 syncs LoRA only)"
        )
    name = re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", name)  # drop the adapter name
    return name if name.startswith("base_model.model.") else "base_model.model." + name


@dataclass(frozen=True)
class AdapterRef:
    version: int
    lora_int_id: int
    name: str
    path: str


@dataclass
class LoraAdapterBook:
    """Which adapter the next request uses, and the PEFT dirs behind it. Each write gets a new
    lora_int_id (1, 2, ...; vLLM LoRA ids must be >= 1), also when a version comes again (the
    weight sync sends the current version to every rollout actor when one rejoins): vllm-omni
    refuses an id it holds (DiffusionLoRAManager.add_adapter: "Adapter %d already registered,
    skipping", return False). Version 0 of a LoRA policy needs none: B = 0 at init, so the base
    model is the policy."""

    root: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str = ""
    active: AdapterRef | None = field(default=None)
    next_lora_int_id: int = 1

    def write(self, state: dict[str, Tensor], version: int) -> AdapterRef:
        from safetensors.torch import save_file

        lora_int_id, self.next_lora_int_id = self.next_lora_int_id, self.next_lora_int_id + 1
        name = f"flowgrpo_v{version}_{lora_int_id}"
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        tensors = {peft_key(k): v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": int(self.rank),
            "lora_alpha": self.alpha,
            "target_modules": sorted(self.target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "base_model_name_or_path": self.base_model,
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        return AdapterRef(version=int(version), lora_int_id=lora_int_id, name=name, path=path)

    def activate(self, ref: AdapterRef) -> AdapterRef | None:
        """Make `ref` the adapter of the next requests; returns the one it replaces (to remove)."""
        previous, self.active = self.active, ref
        return previous

    @staticmethod
    def discard(ref: AdapterRef) -> None:
        shutil.rmtree(ref.path, ignore_errors=True)


# ------------------------------------------------------------------ the engine


class _LoopThread:
    """AsyncOmni is asyncio-only; the rollout actor is not. One private event loop thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-omni-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # a call we stop waiting for stops in the loop too (AsyncOmni.generate aborts its request)
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class VllmOmniEngine:
    """Rollout engine backed by vllm-omni (see the module docstring).

    `omni` is an AsyncOmni (or anything with its async generate / add_lora / remove_lora /
    collective_rpc). `make_sampling_params` / `make_lora_request` build vllm-omni's
    OmniDiffusionSamplingParams / LoRARequest from keyword arguments; `from_config` passes the
    real ones, tests pass fakes."""

    def __init__(
        self,
        omni: Any,
        *,
        loop: _LoopThread,
        make_sampling_params: Callable[..., Any],
        make_lora_request: Callable[..., Any],
        lora_rank: int,
        lora_alpha: float,
        lora_target_modules: tuple[str, ...] = (),
        model_path: str = "",
        version: int = 0,
        update_point: str = "between_groups",
        work_dir: str | None = None,
        request_timeout_s: float = 3600.0,
    ):
        self.update_point = resolve_update_point(update_point)
        self.requested_update_point = update_point
        self.omni = omni
        self._loop = loop
        self._make_sampling_params = make_sampling_params
        self._make_lora_request = make_lora_request
        self.lora_rank = lora_rank
        self.request_timeout_s = request_timeout_s
        self._own_work_dir = work_dir is None
        self.work_dir = work_dir or tempfile.mkdtemp(prefix="flowgrpo_vllm_omni_")
        os.makedirs(self.work_dir, exist_ok=True)
        self.adapters = LoraAdapterBook(
            os.path.join(self.work_dir, "adapters"), lora_rank, lora_alpha, tuple(lora_target_modules), model_path
        )
        self._weights_file: str | None = None  # full fine-tune: the file the workers last loaded
        self._state: dict[str, Tensor] | None = None  # last applied weights (digest checks)
        self._version = version
        self._staged: tuple[dict[str, Tensor], int] | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, cfg, *, update_point: str = "between_groups", **omni_kwargs) -> VllmOmniEngine:
        """One AsyncOmni serving cfg.model.path with our pipeline and worker extension. Extra
        keyword arguments go to AsyncOmni (e.g. enforce_eager=True, cfg_parallel_size=2)."""
        require_vllm_omni()
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.lora.request import LoRARequest

        from async_flowgrpo.config import resolve_model_path
        from async_flowgrpo.models.sd3 import SD3Adapter

        model_path = resolve_model_path(cfg.model.path)
        check_model_dir(model_path)
        dtype = {"auto": "bfloat16"}.get(cfg.model.dtype, cfg.model.dtype)
        kwargs = dict(
            custom_pipeline_args={"pipeline_class": PIPELINE_QUALNAME},
            worker_extension_cls=EXTENSION_QUALNAME,
            dtype=dtype,
        )
        kwargs.update(omni_kwargs)
        loop = _LoopThread()

        async def start():
            from vllm_omni import AsyncOmni

            return AsyncOmni(model=model_path, **kwargs)

        try:
            omni = loop.run(start())
        except BaseException:
            loop.stop()
            raise
        return cls(
            omni,
            loop=loop,
            make_sampling_params=OmniDiffusionSamplingParams,
            make_lora_request=LoRARequest,
            lora_rank=cfg.model.lora_rank,
            lora_alpha=cfg.model.lora_alpha,
            lora_target_modules=SD3Adapter.lora_target_modules,
            model_path=model_path,
            update_point=update_point,
            request_timeout_s=cfg.sync.timeout_s,
        )

    def close(self) -> None:
        async def shutdown():  # it cancels the engine's asyncio tasks: safe only on their loop's thread
            self.omni.shutdown()

        try:
            if hasattr(self.omni, "shutdown"):
                self._loop.run(shutdown(), self.request_timeout_s)
        finally:
            self._loop.stop()
            if self._own_work_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    # ---------------------------------------------------------------- weights

    @property
    def version(self) -> int:
        return self._version

    def trainable_state(self) -> dict[str, Tensor]:
        """The weights last applied (CPU copies), for digest checks against the trainer."""
        return dict(self._state or {})

    def stage_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Keep `state` for the next group boundary; a newer staged state replaces an older one."""
        with self._lock:
            self._staged = (state, version)

    def apply_staged(self) -> bool:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.load_weights(*staged)
        return staged is not None

    def load_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Apply now. Only called between requests (generate is synchronous), so no request
        runs on a half-applied update. Takes ownership of `state` (as DiffusersEngine does)."""
        state = {k: v.detach().to("cpu") for k, v in state.items()}
        if self.lora_rank > 0:
            self._swap_adapter(state, version)
        else:
            self._load_full(state, version)
        self._state, self._version = state, version

    def _swap_adapter(self, state: dict[str, Tensor], version: int) -> None:
        """Load the new adapter, confirm it is loaded, and only then make it the one requests use
        and remove the previous one. On a failure the previous adapter stays active and its
        directory stays: with max_cpu_loras 1 (vllm-omni's default) the failed add has already
        evicted it from the workers (DiffusionLoRAManager.add_adapter calls
        `self._evict_for_new_adapter()` before `self._load_adapter(lora_request)`), and the next
        request loads it again from that directory (set_active_adapter: "if adapter_id not in
        self._registered_adapters: ... self.add_adapter(lora_request)")."""
        ref = self.adapters.write(state, version)
        request = self._make_lora_request(lora_name=ref.name, lora_int_id=ref.lora_int_id, lora_path=ref.path)
        try:
            problem = lora_add_problem(ref.lora_int_id, self._rpc("add_lora", request))
            if problem is None:
                problem = lora_listing_problem(ref.lora_int_id, self._rpc("list_loras"))
            if problem is not None:  # a half-registered id is never used again; the LRU evicts it
                raise RuntimeError(f"vllm-omni add_lora failed for {ref.path} (version {version}): {problem}")
        except BaseException:
            self.adapters.discard(ref)
            raise
        previous = self.adapters.activate(ref)
        if previous is not None:
            self._try_remove(previous.lora_int_id)
            self.adapters.discard(previous)

    def _try_remove(self, lora_int_id: int) -> None:
        """remove_lora, best effort. False is normal: the add before it evicted the adapter
        (max_cpu_loras 1; DiffusionLoRAManager.remove_adapter returns False for an id it does not
        hold). A failure leaves an unused adapter in the workers' cache, which its LRU evicts."""
        try:
            results = self._rpc("remove_lora", lora_int_id)
            check_rpc_results("remove_lora", results)
        except Exception as e:  # noqa: BLE001  (nothing depends on it: requests name the new adapter)
            logger.warning("vllm-omni remove_lora(%d) failed: %s", lora_int_id, e)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """AsyncOmni.collective_rpc with a timeout: its `timeout: float | None = None` default
        waits for the workers forever (omni_engine_base.py:collective_rpc hands it to
        `transport.execute(..., timeout=timeout)`), and AsyncOmni.add_lora / remove_lora /
        list_loras pass none. Our own wait allows a little longer, so that vllm-omni's timeout,
        which it reports as an error result, comes first."""
        call = self.omni.collective_rpc(method, timeout=self.request_timeout_s, args=args)
        return self._loop.run(call, self.request_timeout_s + RPC_WAIT_MARGIN_S)

    def _load_full(self, state: dict[str, Tensor], version: int) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.work_dir, f"transformer_v{version}.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, path)
        check_rpc_results(LOAD_WEIGHTS_RPC, self._rpc(LOAD_WEIGHTS_RPC, path))
        if self._weights_file and self._weights_file != path:
            os.remove(self._weights_file)
        self._weights_file = path

    def _lora_request(self):
        ref = self.adapters.active
        if ref is None or self.lora_rank == 0:
            return None
        return self._make_lora_request(lora_name=ref.name, lora_int_id=ref.lora_int_id, lora_path=ref.path)

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        prompts: list[str],
        n: int,
        seed: int,
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
        height: int | None = None,
        width: int | None = None,
        prompt_indices: list[int] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Group]:
        """n samples for each prompt (one vllm-omni request each, run concurrently), one Group per
        prompt, every step stamped with the version the request was submitted with. Every step is
        the engine's own (config.validate refuses MixGRPO-Flash's after_window_* here)."""
        if (after_window_solver, after_window_steps) != ("euler", 1.0):
            raise ValueError("the vllm_omni engine takes every step after the window by Euler")
        self.apply_staged()
        version = self._version
        requests = build_requests(
            prompts,
            n,
            seed,
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            sde_type=sde_type,
            window_size=window_size,
            window_range=window_range,
            shared_initial_noise=shared_initial_noise,
            height=height,
            width=width,
            prompt_indices=prompt_indices,
            metadata=metadata,
            version=version,
        )
        lora_request = self._lora_request()
        t0 = time.perf_counter()
        outputs = self._loop.run(self._run_all(requests, lora_request), self.request_timeout_s)
        elapsed = (time.perf_counter() - t0) / max(len(requests), 1)
        return [
            group_from_output(o, r, guidance_scale=guidance_scale, elapsed_s=elapsed) for o, r in zip(outputs, requests)
        ]

    async def _run_all(self, requests: list[RolloutRequest], lora_request) -> list[Any]:
        return await asyncio.gather(*(self._run_one(r, lora_request) for r in requests))

    async def _run_one(self, request: RolloutRequest, lora_request) -> Any:
        sampling = self._make_sampling_params(**request.sampling, lora_request=lora_request)
        final = None
        async for out in self.omni.generate(request.prompt, sampling_params=sampling, request_id=request.request_id):
            if getattr(out, "finished", True):  # skip lifecycle / streaming partials
                final = out
        if final is None:
            raise RuntimeError(f"vllm-omni request {request.request_id} produced no final output")
        return final


def check_model_dir(path: str) -> None:
    """Our pipeline subclasses vllm-omni's SD3 pipeline, which loads all three text encoders."""
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise ValueError(f"model.path {path!r} is not a diffusers model directory (no model_index.json)")
    with open(index) as f:
        cls_name = json.load(f).get("_class_name")
    if cls_name != "StableDiffusion3Pipeline":
        raise ValueError(
            f"rollout.engine=vllm_omni supports StableDiffusion3Pipeline checkpoints, model.path holds {cls_name}"
        )
    missing = [d for d in ("text_encoder_3", "tokenizer_3") if not os.path.isdir(os.path.join(path, d))]
    if missing:
        raise ValueError(
            f"rollout.engine=vllm_omni needs a full SD3/SD3.5 checkpoint; {path!r} lacks {missing} "
            "(the embedded tiny model runs with rollout.engine=diffusers)"
        )


def check_rpc_results(method: str, results: Any) -> None:
    """Raise on a failed stage in AsyncOmni.collective_rpc's results (one per stage replica,
    lists per worker). vllm-omni returns a worker's exception as a dict, not raised:
    {"error": True, "reason": ...} from a diffusion subprocess
    (stage_diffusion_client.py:_drain_responses), {"supported": False, "error": ...} from
    StagePool.collective_rpc, {"todo": ...} from a stage without the method. These are the
    dicts AsyncOmni's own _engine_core_rpc rejects: `if result.get("error") or
    result.get("todo") or result.get("supported") is False`."""
    items = results if isinstance(results, (list, tuple)) else [results]
    for item in items:
        if isinstance(item, (list, tuple)):
            check_rpc_results(method, item)
        elif isinstance(item, dict) and (item.get("error") or item.get("todo") or item.get("supported") is False):
            raise RuntimeError(f"vllm-omni collective_rpc({method}) failed: {item}")


def lora_add_problem(lora_int_id: int, results: list[Any]) -> str | None:
    """What is wrong with collective_rpc("add_lora")'s results, or None. Each stage answers
    True or a list of True (diffusion/stage_diffusion_proc.py: "return all(results)"); an error
    dict, False (a worker without LoRA, or an id it holds already) or anything else is a failure.
    Not AsyncOmni.add_lora's bool: it reduces each result with `_coerce_stage_bool`, whose
    `return bool(result)` turns an error dict into True."""
    try:
        check_rpc_results("add_lora", results)
    except RuntimeError as e:
        return str(e)

    def loaded(result):
        return all(loaded(r) for r in result) if isinstance(result, (list, tuple)) else result is True

    if not results or not all(loaded(r) for r in results):
        return f"LoRA {lora_int_id} not loaded: collective_rpc(add_lora) returned {results}"
    return None


def lora_listing_problem(lora_int_id: int, results: list[Any]) -> str | None:
    """Whether every stage replica lists the adapter after the add (collective_rpc("list_loras"),
    per replica, not AsyncOmni.list_loras, whose union skips dicts and hides a replica that lacks
    it)."""
    try:
        check_rpc_results("list_loras", results)
    except RuntimeError as e:
        return str(e)

    def ids(result):
        return set().union(*(ids(r) for r in result)) if isinstance(result, (list, tuple)) else {result}

    missing = [i for i, r in enumerate(results) if lora_int_id not in ids(r)]
    if not results or missing:
        return f"add_lora reported success, but list_loras of stage replica(s) {missing} lacks it: {results}"
    return None


# ------------------------------------------------------------------ worker-side classes (need vllm-omni)

_WORKER_CLASSES: dict[str, type] = {}


def _build_worker_classes() -> dict[str, type]:
    """Our SD3 pipeline and worker extension. Built on first access (module __getattr__) because
    they subclass vllm-omni classes; vllm-omni resolves them by qualified name in its workers."""
    if _WORKER_CLASSES:
        return _WORKER_CLASSES
    require_vllm_omni()
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline
    from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    class FlowGRPOSD3Pipeline(StableDiffusion3Pipeline):
        """Upstream forward (prompt encoding, timesteps, VAE decode) with our `diffuse` for
        requests that carry extra_args[EXTRA_KEY]; others (warm-up, plain serving) run upstream."""

        _flowgrpo_spec: dict | None = None
        _flowgrpo_record: dict | None = None

        def forward(self, req):
            batch = req if isinstance(req, DiffusionRequestBatch) else DiffusionRequestBatch(requests=[req])
            outputs = []
            for r in batch.requests:  # one at a time: upstream's batch split drops trajectory_*
                single = DiffusionRequestBatch(requests=[r])
                spec = (r.sampling_params.extra_args or {}).get(EXTRA_KEY)
                if spec is None:
                    outputs.extend(super().forward(single))
                    continue
                self._flowgrpo_spec, self._flowgrpo_record = spec, None
                try:
                    (out,) = super().forward(single)
                finally:
                    self._flowgrpo_spec = None
                outputs.append(dataclasses.replace(out, **self._flowgrpo_record))
            return outputs

        def diffuse(
            self,
            latents,
            timesteps,
            prompt_embeds,
            pooled_prompt_embeds,
            negative_prompt_embeds,
            negative_pooled_prompt_embeds,
            do_true_cfg,
            guidance_scale,
            cfg_normalize=False,
        ):
            spec = self._flowgrpo_spec
            if spec is None:
                return super().diffuse(
                    latents=latents,
                    timesteps=timesteps,
                    prompt_embeds=prompt_embeds,
                    pooled_prompt_embeds=pooled_prompt_embeds,
                    negative_prompt_embeds=negative_prompt_embeds,
                    negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
                    do_true_cfg=do_true_cfg,
                    guidance_scale=guidance_scale,
                    cfg_normalize=cfg_normalize,
                )
            n, dtype = latents.shape[0], self.od_config.dtype

            def per_sample(t):  # upstream encodes the prompt once; the transformer wants n rows
                return t if t is None or t.shape[0] == n else t.repeat_interleave(n // t.shape[0], 0)

            cond = [
                per_sample(t)
                for t in (prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds, negative_pooled_prompt_embeds)
            ]
            sigmas = self.scheduler.sigmas.detach().float().cpu()  # set by upstream prepare_timesteps

            def velocity(x, i):
                # timestep sigma * 1000 in fp32 (not the model dtype): what the trainer's recompute passes
                t = (sigmas[i] * 1000).to(self.device).expand(n)

                def kwargs(embeds, pooled):
                    return dict(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False)

                pos = kwargs(cond[0], cond[1])
                neg = kwargs(cond[2], cond[3]) if do_true_cfg else None
                # upstream's CFG path (CFG-parallel aware); combine_cfg_noise below does it in fp32
                return self.predict_noise_maybe_with_cfg(do_true_cfg, guidance_scale, pos, neg, False).float()

            x, record = denoise_and_record(velocity, tuple(latents.shape[1:]), sigmas, spec, latents.device)
            h, w = (s * self.vae_scale_factor for s in latents.shape[-2:])
            self._flowgrpo_record = trajectory_payload(
                record,
                spec=spec,
                height=h,
                width=w,
                prompt_embeds=prompt_embeds,
                pooled_prompt_embeds=pooled_prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds if do_true_cfg else None,
                negative_pooled_prompt_embeds=negative_pooled_prompt_embeds if do_true_cfg else None,
            )
            return x  # upstream decodes it with the VAE

        def combine_cfg_noise(self, positive_noise_pred, negative_noise_pred, true_cfg_scale, cfg_normalize=False,
                              kwargs=None):
            if self._flowgrpo_spec is not None:  # v_u + g (v_c - v_u) in fp32, as the trainer's recompute
                def up(p):
                    return tuple(t.float() for t in p) if isinstance(p, tuple) else p.float()

                positive_noise_pred, negative_noise_pred = up(positive_noise_pred), up(negative_noise_pred)
            return super().combine_cfg_noise(positive_noise_pred, negative_noise_pred, true_cfg_scale, cfg_normalize,
                                             kwargs)

    class FlowGRPOWorkerExtension(CustomPipelineWorkerExtension):
        """Mixed into vllm-omni's diffusion worker (worker_extension_cls). Subclasses the
        custom-pipeline extension because ours replaces it and re_init_pipeline must stay."""

        def flowgrpo_load_weights(self, path: str) -> int:
            """Full fine-tune sync: diffusers-named transformer weights from a safetensors file."""
            from safetensors.torch import load_file

            transformer = self.model_runner.pipeline.transformer
            return len(transformer.load_weights(load_file(path, device="cpu").items()))

    for cls in (FlowGRPOSD3Pipeline, FlowGRPOWorkerExtension):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        _WORKER_CLASSES[cls.__name__] = cls
    return _WORKER_CLASSES


def __getattr__(name: str):
    if name in ("FlowGRPOSD3Pipeline", "FlowGRPOWorkerExtension"):
        return _build_worker_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
