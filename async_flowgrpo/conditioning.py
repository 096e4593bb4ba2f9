"""Input images of image-conditioned prompts (edit models): checking, loading, handing them on.

A JSONL prompt row may carry "images": a path or a list of paths, relative to the prompt file's
folder (or absolute). `load_prompts` checks each one as it reads the file (`check_images`): a
missing, unreadable or wrong-size image is a ValueError naming the file and line, so config
validation turns it into one line and exit 2 before any actor starts.

The rollout worker loads a prompt's images once per group (`source_images`): the adapter encodes
them once for the whole group (FluxKontextAdapter.encode_images), and the reward receives them as
uint8 [H, W, 3] tensors in metadata["source_images"], beside the generated images.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

SOURCE_IMAGES = "source_images"  # the metadata key a reward finds a prompt's input images under


def check_images(value, base_dir: str, where: str, size: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The JSONL "images" value `value` as resolved paths, each checked to exist, decode and
    (when `size` = (height, width) is given) have that size. `where` ("file:line") starts every error."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise ValueError(f"{where}: \"images\" must be a path or a non-empty list of paths, got {value!r}")
    resolved = []
    for path in paths:
        full = os.path.normpath(os.path.join(base_dir, path))
        if not os.path.isfile(full):
            raise ValueError(f"{where}: image {path!r} not found ({full})")
        try:
            with Image.open(full) as im:
                im.verify()  # reads the whole file: a truncated or corrupt image fails here, not in an actor
            with Image.open(full) as im:
                width, height = im.size
        except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, OSError)
            raise ValueError(f"{where}: image {path!r} is not a readable image ({type(e).__name__}: {e})") from None
        if size is not None and (height, width) != tuple(size):
            raise ValueError(f"{where}: image {path!r} is {width}x{height}, the model samples {size[1]}x{size[0]}; "
                             "resize it (or set rollout.resolution to its size)")
        resolved.append(full)
    return tuple(resolved)


def load_image(path: str) -> torch.Tensor:
    """RGB uint8 [H, W, 3]."""
    with Image.open(path) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.uint8).copy())


def source_images(paths: tuple[str, ...]) -> list[torch.Tensor]:
    return [load_image(p) for p in paths]


def with_sources(prompt) -> dict:
    """A prompt's metadata with its input images loaded under SOURCE_IMAGES (a new dict; the prompt's
    own metadata stays free of pixels), or its metadata as is when it has none. `generate` encodes
    them and the reward reads them from there."""
    if not prompt.images:
        return prompt.metadata
    return {**prompt.metadata, SOURCE_IMAGES: source_images(prompt.images)}


def side_by_side(results: torch.Tensor, sources: list[list[torch.Tensor]], captions: list[str],
                 pairs_per_row: int = 4) -> dict:
    """An edit's grid tiles: each prompt's input image(s), then its result, the instruction under the
    first input; {"images", "captions", "nrow"} for `RunLogger.log_images` (nrow keeps pairs on one row).
    A video result [F, H, W, 3] (image to video) has its source as a still beside it, every frame."""
    tiles, tile_captions = [], []
    for result, inputs, caption in zip(results, sources, captions):
        if result.ndim == 4:
            inputs = [img.expand(result.shape[0], *img.shape) for img in inputs]
        tiles += [*inputs, result]
        tile_captions += [caption] + [""] * (len(inputs) - 1) + ["-> result"]
    return {"images": torch.stack(tiles), "captions": tile_captions, "nrow": (len(sources[0]) + 1) * pairs_per_row}
