"""Helpers the family adapters and the tiny builders share; no family imports another family.

- `PromptEmbeds`: a batch's conditioning, in the slots every adapter fills.
- `pack_latents` / `unpack_latents`: the 2 x 2 patch packing of Flux and Qwen-Image.
- `calculate_shift` / `flow_sigmas`: the resolution-dependent sigmas of those pipelines.
- `load_pipeline`: an offline `from_pretrained` onto a device.
- `read_model_settings` / `write_model_settings`: our own settings beside model_index.json.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from async_flowgrpo.models import check_model_dir

# Extra settings of ours that the pipeline does not know about, saved beside model_index.json.
ASYNC_FLOWGRPO_CONFIG = "async_flowgrpo.json"


@dataclass
class PromptEmbeds:
    """Conditioning for a batch of prompts; negatives only when CFG is on. A family without a
    pooled embedding puts what it needs in that slot instead (Qwen-Image: the text mask)."""

    embeds: Tensor  # [B, L, D]
    pooled: Tensor  # [B, P]
    negative_embeds: Tensor | None = None
    negative_pooled: Tensor | None = None


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
    """`cls.from_pretrained(path)` offline, on `device`, with the progress bar off."""
    check_model_dir(path)
    with warnings.catch_warnings():
        # recent diffusers renamed torch_dtype to dtype; older ones (setup.cfg allows them) know only torch_dtype
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        pipe = cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True, **kwargs)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def read_model_settings(path: str) -> dict:
    """Our extra settings for a model directory ({} for models not made by us, e.g. real SD3.5)."""
    file = os.path.join(path, ASYNC_FLOWGRPO_CONFIG)
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def write_model_settings(path: str, family: str, spec, **settings) -> None:
    """Write async_flowgrpo.json for a model we built from `spec` (a dataclass, kept for the record)."""
    with open(os.path.join(path, ASYNC_FLOWGRPO_CONFIG), "w") as f:
        json.dump({"family": family, **settings, "spec": asdict(spec)}, f, indent=2)


def denormalize_latents(vae, z: Tensor) -> Tensor:
    """Per-channel z * latents_std + latents_mean of the Wan-style video VAEs (Wan, Qwen-Image), z [n, C, F, h, w]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return z * std + mean
