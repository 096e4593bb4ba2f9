"""CLIP-score and PickScore rewards: a `transformers.CLIPModel` loaded from a LOCAL directory.

score = logit_scale.exp() * cos(image_emb, text_emb)   (mode="logit", the PickScore convention)
score = cos(image_emb, text_emb)                       (mode="cosine", plain CLIP similarity)

Registry entries are plain functions taking keyword options (`reward.options.<name>` in the config):

    path            directory of a CLIPModel saved with save_pretrained (required; or the env var)
    processor_path  directory with the tokenizer + preprocessor_config.json (default: `path`; PickScore
                    ships its processor separately, e.g. a local copy of CLIP-ViT-H-14-laion2B)
    mode            "logit" | "cosine"
    device          default "cuda" when available, else "cpu"
    dtype           "float32" (default) | "float16" | "bfloat16"
    batch_size      images per forward pass (default 32)
    preprocess      "processor" (the saved CLIPImageProcessor, on CPU) | "torch" (the same resize,
                    center-crop and normalization done with torch on `device`; bicubic + antialias)

Weights are never downloaded (local_files_only=True). A loaded encoder is cached per process and
shared by every reward that names the same path, device, dtype and preprocessing.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ENV_CLIP = "ASYNC_FLOWGRPO_CLIP_PATH"
ENV_PICKSCORE = "ASYNC_FLOWGRPO_PICKSCORE_PATH"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MODES = ("logit", "cosine")
_PREPROCESS = ("processor", "torch")

_CACHE: dict[tuple, "ClipEncoder"] = {}
_LOCK = threading.Lock()


def resolve_local_path(path: Optional[str], env: str, reward: str, key: str = "path") -> str:
    """The local path from the option or else the env var; a one-line error when absent/missing."""
    path = path or os.environ.get(env)
    if not path:
        raise FileNotFoundError(f"{reward}: no local path given: set reward.options.{reward}.{key} or ${env}")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{reward}: path '{path}' does not exist (from reward.options.{reward}.{key} or ${env}; nothing is downloaded)"
        )
    return path


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def pil_image_processor() -> type:
    """The CLIP image processor that works on PIL images, the preprocessing CLIP and PickScore were
    trained with, under every transformers we support: AutoImageProcessor picks a torchvision one
    where torchvision is installed, and in transformers 5.14 (the `gpu` extra's) refuses to load without it."""
    try:
        from transformers import CLIPImageProcessorPil  # transformers 5: a class per backend

        return CLIPImageProcessorPil
    except ImportError:
        from transformers import CLIPImageProcessor  # transformers 4: the PIL one

        return CLIPImageProcessor


class ClipEncoder:
    """A CLIP model + tokenizer + image processor that turns uint8 images / prompts into unit embeddings."""

    def __init__(
        self,
        path: str,
        processor_path: Optional[str] = None,
        device: Optional[str] = None,
        dtype: str = "float32",
        preprocess: str = "processor",
        reward: str = "clip",
        build_model: Optional[Callable[[], "torch.nn.Module"]] = None,
    ):
        """build_model: makes the CLIPModel instead of from_pretrained(path) (HPSv2's open_clip checkpoint)."""
        from transformers import AutoTokenizer, CLIPModel

        if dtype not in _DTYPES:
            raise ValueError(f"{reward}: dtype must be one of {', '.join(_DTYPES)}, got '{dtype}'")
        if preprocess not in _PREPROCESS:
            raise ValueError(f"{reward}: preprocess must be one of {', '.join(_PREPROCESS)}, got '{preprocess}'")
        processor_path = processor_path or path
        self.device = torch.device(device or default_device())
        self.dtype = _DTYPES[dtype]
        self.preprocess = preprocess
        try:
            model = build_model() if build_model is not None else CLIPModel.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise RuntimeError(f"{reward}: could not load a CLIPModel from '{path}': {_first_line(e)}") from e
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor_path, local_files_only=True)
            self.image_processor = pil_image_processor().from_pretrained(processor_path, local_files_only=True)
        except Exception as e:
            raise RuntimeError(
                f"{reward}: could not load the tokenizer/image processor from '{processor_path}': {_first_line(e)}"
            ) from e
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.projection_dim = int(self.model.config.projection_dim)
        text_max = int(self.model.config.text_config.max_position_embeddings)
        tok_max = getattr(self.tokenizer, "model_max_length", None) or text_max
        self.max_length = min(int(tok_max), text_max)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())

    # -- images -----------------------------------------------------------------------------------
    def pixel_values(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> normalized float [n, 3, h, w] on the encoder's device."""
        if self.preprocess == "processor":
            arrays = list(images.detach().cpu().numpy())
            pixels = self.image_processor(images=arrays, return_tensors="pt")["pixel_values"]
            return pixels.to(self.device, self.dtype)
        return self._torch_preprocess(images).to(self.dtype)

    def _torch_preprocess(self, images: torch.Tensor) -> torch.Tensor:
        p = self.image_processor
        x = images.to(self.device).permute(0, 3, 1, 2).float()
        h, w = x.shape[-2:]
        size = dict(getattr(p, "size", None) or {})
        if getattr(p, "do_resize", True) and size:
            if "shortest_edge" in size:
                short, long = (h, w) if h <= w else (w, h)
                new_short = int(size["shortest_edge"])
                new_long = int(new_short * long / short)
                new_h, new_w = (new_short, new_long) if h <= w else (new_long, new_short)
            else:
                new_h, new_w = int(size["height"]), int(size["width"])
            if (new_h, new_w) != (h, w):
                x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
                x = x.clamp(0, 255)
        crop = dict(getattr(p, "crop_size", None) or {})
        if getattr(p, "do_center_crop", False) and crop:
            ch, cw = int(crop["height"]), int(crop["width"])
            h, w = x.shape[-2:]
            if h < ch or w < cw:  # the processor pads; resizing first makes this rare
                x = F.pad(x, ((max(cw - w, 0) + 1) // 2, max(cw - w, 0) // 2, (max(ch - h, 0) + 1) // 2, max(ch - h, 0) // 2))
                h, w = x.shape[-2:]
            top, left = (h - ch) // 2, (w - cw) // 2
            x = x[..., top : top + ch, left : left + cw]
        if getattr(p, "do_rescale", True):
            x = x * float(getattr(p, "rescale_factor", 1 / 255))
        if getattr(p, "do_normalize", True):
            mean = torch.tensor(p.image_mean, device=x.device).view(1, -1, 1, 1)
            std = torch.tensor(p.image_std, device=x.device).view(1, -1, 1, 1)
            x = (x - mean) / std
        return x

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
        """Unit-norm image embeddings, float32 [n, projection_dim] on the encoder's device."""
        out = []
        for i in range(0, images.shape[0], batch_size):
            pixels = self.pixel_values(images[i : i + batch_size])
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output
            out.append(self.model.visual_projection(pooled).float())
        emb = torch.cat(out) if out else torch.zeros(0, self.projection_dim, device=self.device)
        return F.normalize(emb, dim=-1)

    @torch.no_grad()
    def embed_texts(self, prompts: list[str], batch_size: int = 32) -> torch.Tensor:
        """Unit-norm text embeddings, float32 [n, projection_dim] on the encoder's device."""
        out = []
        for i in range(0, len(prompts), batch_size):
            tokens = self.tokenizer(
                list(prompts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            pooled = self.model.text_model(
                input_ids=tokens["input_ids"].to(self.device),
                attention_mask=tokens["attention_mask"].to(self.device),
            ).pooler_output
            out.append(self.model.text_projection(pooled).float())
        emb = torch.cat(out) if out else torch.zeros(0, self.projection_dim, device=self.device)
        return F.normalize(emb, dim=-1)


def load_clip_encoder(
    path: str,
    processor_path: Optional[str] = None,
    device: Optional[str] = None,
    dtype: str = "float32",
    preprocess: str = "processor",
    reward: str = "clip",
    build_model: Optional[Callable[[], "torch.nn.Module"]] = None,
) -> ClipEncoder:
    """A process-wide cached ClipEncoder (paths must already be resolved)."""
    device = str(torch.device(device or default_device()))
    key = (os.path.realpath(path), os.path.realpath(processor_path or path), device, dtype, preprocess)
    with _LOCK:
        enc = _CACHE.get(key)
        if enc is None:
            enc = _CACHE[key] = ClipEncoder(path, processor_path, device, dtype, preprocess, reward, build_model)
    return enc


def clear_cache() -> None:
    """Drop every cached CLIP encoder in this process (tests; freeing GPU memory)."""
    with _LOCK:
        _CACHE.clear()


def _check_inputs(reward: str, images: torch.Tensor, prompts: list) -> None:
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"{reward}: images must be [n, H, W, 3], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{reward}: {len(prompts)} prompts for {images.shape[0]} images")


def _clip_reward(
    reward: str,
    env: str,
    images: torch.Tensor,
    prompts: list,
    path: Optional[str],
    processor_path: Optional[str],
    mode: str,
    device: Optional[str],
    dtype: str,
    batch_size: int,
    preprocess: str,
) -> torch.Tensor:
    if mode not in _MODES:
        raise ValueError(f"{reward}: mode must be one of {', '.join(_MODES)}, got '{mode}'")
    if int(batch_size) < 1:
        raise ValueError(f"{reward}: batch_size must be >= 1, got {batch_size}")
    _check_inputs(reward, images, prompts)
    path = resolve_local_path(path, env, reward)
    if processor_path:
        processor_path = resolve_local_path(processor_path, env, reward, key="processor_path")
    enc = load_clip_encoder(path, processor_path, device, dtype, preprocess, reward)
    if images.shape[0] == 0:
        return torch.zeros(0)
    img = enc.embed_images(images, int(batch_size))
    txt = enc.embed_texts([str(p) for p in prompts], int(batch_size))
    score = (img * txt).sum(-1)
    if mode == "logit":
        score = enc.logit_scale * score
    return score.cpu()


def clip_score(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    path: Optional[str] = None,
    processor_path: Optional[str] = None,
    mode: str = "cosine",
    device: Optional[str] = None,
    dtype: str = "float32",
    batch_size: int = 32,
    preprocess: str = "processor",
) -> torch.Tensor:
    """Cosine similarity between CLIP image and prompt embeddings (path: option or $ASYNC_FLOWGRPO_CLIP_PATH)."""
    return _clip_reward("clip_score", ENV_CLIP, images, prompts, path, processor_path, mode, device, dtype, batch_size, preprocess)


def pickscore(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    path: Optional[str] = None,
    processor_path: Optional[str] = None,
    mode: str = "logit",
    device: Optional[str] = None,
    dtype: str = "float32",
    batch_size: int = 32,
    preprocess: str = "processor",
) -> torch.Tensor:
    """PickScore: logit_scale * cosine (path: option or $ASYNC_FLOWGRPO_PICKSCORE_PATH).

    FlowGRPO divides PickScore by 26; do that with the reward weight (e.g. weights.pickscore: 0.0385).
    """
    return _clip_reward("pickscore", ENV_PICKSCORE, images, prompts, path, processor_path, mode, device, dtype, batch_size, preprocess)
