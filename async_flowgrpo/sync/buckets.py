"""Packing an ordered state dict into flat uint8 buckets and back. Pure torch, no communication.

Layout rule (greedy, in dict order): tensors are appended to the current bucket at offsets
aligned to ``ALIGN`` bytes (so a slice of a bucket can be viewed as any dtype) while they fit
in ``bucket_bytes``; a tensor bigger than a bucket is never split, it gets a bucket of its own
sized to it. Each bucket is only as long as the bytes it holds, so the last one is short.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import State, tensor_bytes

ALIGN = 64  # >= any element size; also a friendly alignment for GPU copies


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    bucket: int
    offset: int  # byte offset inside the bucket


@dataclass(frozen=True)
class Layout:
    tensors: list[TensorSpec]
    bucket_sizes: list[int]

    def members(self, bucket: int) -> list[int]:
        return [i for i, s in enumerate(self.tensors) if s.bucket == bucket]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(state: State, bucket_bytes: int) -> Layout:
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    used = None  # bytes used in the open bucket; None = no open bucket
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if used is not None and _align(used) + nbytes > bucket_bytes:
            used = None  # does not fit: close the open bucket
        if used is None:
            sizes.append(0)
            used = 0
        offset = _align(used)
        specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), nbytes, len(sizes) - 1, offset))
        used = offset + nbytes
        sizes[-1] = used  # an oversized tensor overfills its bucket, so the next tensor opens a new one
    return Layout(specs, sizes)


def pack_bucket(tensors: list[torch.Tensor], layout: Layout, bucket: int, out: torch.Tensor) -> torch.Tensor:
    """Copy bucket ``bucket``'s tensors (``tensors`` in layout order) into ``out``; returns the used prefix."""
    view = out[: layout.bucket_sizes[bucket]]
    for i in layout.members(bucket):
        s = layout.tensors[i]
        view[s.offset : s.offset + s.nbytes].copy_(tensor_bytes(tensors[i]))
    return view


def unpack(buffers: list[torch.Tensor], layout: Layout) -> State:
    """Tensors as views into ``buffers`` (no copy): the caller must not reuse the buffers."""
    out: State = {}
    for s in layout.tensors:
        raw = buffers[s.bucket][s.offset : s.offset + s.nbytes]
        out[s.name] = raw.view(getattr(torch, s.dtype)).view(s.shape)
    return out
