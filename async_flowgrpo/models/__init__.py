"""Model-family adapters. `load_adapter` picks the family from the directory's model_index.json."""

from __future__ import annotations

import importlib
import json
import os

from collections.abc import Callable

import torch

# diffusers pipeline class -> (ModelConfig.family, module, adapter class), one per family; imported
# lazily so that reading a config does not pull in every family's dependencies.
_FAMILIES = {
    "StableDiffusion3Pipeline": ("sd3", "async_flowgrpo.models.sd3", "SD3Adapter"),
    "FluxPipeline": ("flux", "async_flowgrpo.models.flux", "FluxAdapter"),
    "QwenImagePipeline": ("qwen_image", "async_flowgrpo.models.qwen_image", "QwenImageAdapter"),
    "WanPipeline": ("wan", "async_flowgrpo.models.wan", "WanAdapter"),
    "FluxKontextPipeline": ("flux_kontext", "async_flowgrpo.models.flux_kontext", "FluxKontextAdapter"),
    "QwenImageEditPipeline": ("qwen_image_edit", "async_flowgrpo.models.qwen_image_edit", "QwenImageEditAdapter"),
    "QwenImageEditPlusPipeline": ("qwen_image_edit_plus", "async_flowgrpo.models.qwen_image_edit", "QwenImageEditPlusAdapter"),
    "WanImageToVideoPipeline": ("wan", "async_flowgrpo.models.wan", "WanImageToVideoAdapter"),
}
FAMILIES = tuple(dict.fromkeys(family for family, _, _ in _FAMILIES.values()))  # the choices of model.family
VIDEO_FAMILIES = ("wan",)  # families whose samples are videos [n, F, H, W, 3], not images
# families whose prompts carry input images (edit models)
IMAGE_FAMILIES = ("flux_kontext", "qwen_image_edit", "qwen_image_edit_plus")
# WanPipeline's own defaults, for checkpoints that do not say: 81 frames per video, and a VAE
# compressing 4 frames into one latent frame (after the causal first frame)
WAN_NUM_FRAMES = 81
WAN_TEMPORAL_FACTOR = 4


class TransformerPlacement:
    """`device` and `dtype` of the adapter's transformer, looked up once (mixin for the adapters).

    diffusers' ModelMixin.device / .dtype walk every submodule on each access (group-offloading
    and layerwise-casting hooks): about 3 ms per access on the LoRA-wrapped embedded model, paid
    four or five times per velocity call, 10-15% of a CPU rollout or train step. The policy never
    moves or casts its transformer after loading (FSDP shards it in place: same device, same
    master dtype), so the first answer stays right; a different transformer object (a pipeline
    whose transformer was replaced) is looked up afresh."""

    _placement: tuple | None = None

    def _placed(self) -> tuple:
        transformer = self.transformer
        if self._placement is None or self._placement[0] is not transformer:
            self._placement = (transformer, transformer.device, transformer.dtype)
        return self._placement

    @property
    def device(self) -> torch.device:
        return self._placed()[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._placed()[2]


def guided_velocity(forward: Callable[..., torch.Tensor], cond: tuple, uncond: tuple, guidance_scale: float, *,
                    uncond_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Classifier-free guidance, v_u + g (v_c - v_u); returns (guided velocity, v_c).

    `forward(*inputs)` runs the transformer on a batch; `cond` and `uncond` are its inputs for the
    conditional and unconditional halves (tensors batched along dim 0). Usually both halves go
    through one forward, batched. uncond_grad=False stops the gradient through the unconditional
    half (flow_grpo's trainer does not differentiate it either): with a shared LoRA it enters with
    weight 1 - g (-3.5 at g = 4.5), and its gradient was measured to drive the collapse of the
    training reward at lr 1e-3 on the embedded model (shared/notes/learning.md). When gradients
    are on, that half then runs on its own under no_grad, so that backward covers the conditional
    half only: flow_grpo batches both and detaches one, and pays a backward over both."""
    if torch.is_grad_enabled() and not uncond_grad:
        with torch.no_grad():
            v_uncond = forward(*uncond)
        v_cond = forward(*cond)
    else:
        v_uncond, v_cond = forward(*(torch.cat([u, c]) for u, c in zip(uncond, cond))).chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond), v_cond


def check_model_dir(path: str) -> None:
    """Fail early, with the config key in the message, on a path that is not a diffusers model."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.path {path!r} does not exist or is not a directory")
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise ValueError(f"model.path {path!r} is not a diffusers model directory (no model_index.json)")


def video_frames(path: str, num_frames: int = 0) -> tuple[int, int]:
    """(frames per video, the VAE's temporal factor) of the Wan-style video model at `path`, read
    from its JSON files without loading it (config validation): `num_frames`, else the model's own
    (async_flowgrpo.json), else WanPipeline's default."""
    frames = num_frames or _read_json(path, "async_flowgrpo.json").get("num_frames", WAN_NUM_FRAMES)
    return frames, _read_json(path, "vae", "config.json").get("scale_factor_temporal", WAN_TEMPORAL_FACTOR)


def _read_json(path: str, *parts: str) -> dict:
    """The JSON file path/parts..., {} when the model has none."""
    file = os.path.join(path, *parts)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def model_experts(path: str) -> tuple[str, ...]:
    """The denoising transformers of the diffusers model at `path`, read from its model_index.json
    without loading it (config validation): ("transformer",), or Wan2.2 A14B's two experts
    ("transformer", "transformer_2"). A component saved as None is listed as [null, null]."""
    file = os.path.join(path, "model_index.json")
    if not os.path.isfile(file):
        return ("transformer",)
    with open(file) as f:
        index = json.load(f)
    return tuple(name for name in ("transformer", "transformer_2") if (index.get(name) or [None])[0] is not None) \
        or ("transformer",)


def image_inputs(path: str, family: str) -> str:
    """Whether the prompts of the model at `path` carry input images: "required" (an edit model,
    Wan image-to-video with the condition in the transformer's channels), "optional" (Wan2.2
    TI2V-5B: a first frame, or text to video) or "none"; read from its JSON files without loading
    it (config validation)."""
    if family in IMAGE_FAMILIES:
        return "required"
    if family not in VIDEO_FAMILIES:
        return "none"
    index, transformer = _read_json(path, "model_index.json"), _read_json(path, "transformer", "config.json")
    channels = transformer.get("in_channels", 0) != transformer.get("out_channels", 0)
    if index.get("_class_name") == "WanImageToVideoPipeline" or channels:
        return "required"
    return "optional" if index.get("expand_timesteps") else "none"


def transformer_heads(path: str) -> int:
    """The attention heads of the model's transformer, read from its config.json without loading it."""
    with open(os.path.join(path, "transformer", "config.json")) as f:
        return json.load(f)["num_attention_heads"]


def adapter_class(family: str):
    """The adapter class of a model.family (imported on first use)."""
    for fam, module, cls in _FAMILIES.values():
        if fam == family:
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def pipeline_adapter_class(pipeline_class: str):
    """The adapter class serving a diffusers pipeline class (by name): a family may have several
    (wan: WanPipeline, WanImageToVideoPipeline)."""
    if pipeline_class not in _FAMILIES:
        raise ValueError(f"a {pipeline_class} is not served; supported: {sorted(_FAMILIES)}")
    _, module, name = _FAMILIES[pipeline_class]
    return getattr(importlib.import_module(module), name)


def load_adapter(path: str, *, device: torch.device | str, dtype: torch.dtype, num_frames: int = 0):
    """Load the model directory at `path` (offline) behind its family's adapter; num_frames > 0
    overrides a video model's frames per video (rollout.num_frames)."""
    check_model_dir(path)
    with open(os.path.join(path, "model_index.json")) as f:
        cls_name = json.load(f).get("_class_name")
    if cls_name not in _FAMILIES:
        raise ValueError(f"model.path {path!r} holds a {cls_name}; supported: {sorted(_FAMILIES)}")
    return pipeline_adapter_class(cls_name).load(path, device=torch.device(device), dtype=dtype, num_frames=num_frames)
