"""LAION aesthetic predictor: unit-norm CLIP image embedding -> MLP -> score (about 1..10).

The MLP mirrors the public improved-aesthetic-predictor (`sac+logos+ava1-l14-linearMSE.pth`, built
for CLIP ViT-L/14): Linear(d,1024) Dropout Linear(1024,128) Dropout Linear(128,64) Dropout
Linear(64,16) Linear(16,1), with d = the CLIP projection dim (768 for ViT-L/14), so that state dict
loads unchanged (keys layers.0/2/4/6/7.{weight,bias}).

Keyword options (`reward.options.aesthetic`):
    path            the predictor's state-dict file (.pth/.pt, or .safetensors) (or $ASYNC_FLOWGRPO_AESTHETIC_PATH)
    clip_path       the CLIPModel directory (or $ASYNC_FLOWGRPO_AESTHETIC_CLIP_PATH)
    processor_path, device, dtype, batch_size, preprocess: as for clip_score
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
from torch import nn

from async_flowgrpo.rewards.clip_score import clear_cache as clear_clip_cache
from async_flowgrpo.rewards.clip_score import _check_inputs, _first_line, default_device, load_clip_encoder, resolve_local_path

ENV_PREDICTOR = "ASYNC_FLOWGRPO_AESTHETIC_PATH"
ENV_CLIP = "ASYNC_FLOWGRPO_AESTHETIC_CLIP_PATH"

_PREDICTORS: dict[tuple, "AestheticMLP"] = {}
_LOCK = threading.Lock()


class AestheticMLP(nn.Module):
    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


def _read_state_dict(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise TypeError(f"expected a state dict, got {type(sd).__name__}")
    return {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in sd.items()}


def load_predictor(path: str, device: Optional[str] = None) -> AestheticMLP:
    """The MLP from a state-dict file, cached per process; its input dim comes from the file."""
    device = str(torch.device(device or default_device()))
    key = (os.path.realpath(path), device)
    with _LOCK:
        mlp = _PREDICTORS.get(key)
        if mlp is None:
            try:
                sd = _read_state_dict(path)
                mlp = AestheticMLP(int(sd["layers.0.weight"].shape[1]))
                mlp.load_state_dict(sd)
            except Exception as e:
                raise RuntimeError(f"aesthetic: could not load the predictor state dict '{path}': {_first_line(e)}") from e
            mlp = _PREDICTORS[key] = mlp.to(device).eval().requires_grad_(False)
    return mlp


def clear_cache() -> None:
    """Drop every cached predictor and CLIP encoder in this process (tests; freeing GPU memory)."""
    with _LOCK:
        _PREDICTORS.clear()
    clear_clip_cache()


@torch.no_grad()
def aesthetic(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    path: Optional[str] = None,
    clip_path: Optional[str] = None,
    processor_path: Optional[str] = None,
    device: Optional[str] = None,
    dtype: str = "float32",
    batch_size: int = 32,
    preprocess: str = "processor",
) -> torch.Tensor:
    """The predictor's output for each image (prompts are ignored)."""
    if int(batch_size) < 1:
        raise ValueError(f"aesthetic: batch_size must be >= 1, got {batch_size}")
    _check_inputs("aesthetic", images, prompts)
    path = resolve_local_path(path, ENV_PREDICTOR, "aesthetic")
    clip_path = resolve_local_path(clip_path, ENV_CLIP, "aesthetic", key="clip_path")
    if processor_path:
        processor_path = resolve_local_path(processor_path, ENV_CLIP, "aesthetic", key="processor_path")
    enc = load_clip_encoder(clip_path, processor_path, device, dtype, preprocess, "aesthetic")
    mlp = load_predictor(path, str(enc.device))
    if mlp.input_dim != enc.projection_dim:
        raise ValueError(
            f"aesthetic: predictor '{path}' takes {mlp.input_dim}-d embeddings but the CLIP model "
            f"'{clip_path}' projects to {enc.projection_dim}"
        )
    if images.shape[0] == 0:
        return torch.zeros(0)
    emb = enc.embed_images(images, int(batch_size))
    return mlp(emb).squeeze(-1).float().cpu()
