"""JPEG (in)compressibility as DDPO defines them: the size in kB of a quality-95 JPEG."""

from __future__ import annotations

import io

import torch
from PIL import Image


def jpeg_size_kb(images: torch.Tensor) -> torch.Tensor:
    sizes = []
    for img in images.cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(images: torch.Tensor, prompts: list, metadata: list) -> torch.Tensor:
    return -jpeg_size_kb(images)


def jpeg_incompressibility(images: torch.Tensor, prompts: list, metadata: list) -> torch.Tensor:
    return jpeg_size_kb(images)
