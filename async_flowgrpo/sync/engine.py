"""Collective transport: trainer rank 0 broadcasts bucketed weights to every rollout actor.

One sync, as seen on the wire (all broadcasts from rank 0 over a ``WeightSyncGroup``):
  1. an int64 [1] tensor: length L of the metadata;
  2. a uint8 [L] tensor: UTF-8 JSON {version, digest, layout} (names, dtypes as strings, shapes,
     offsets, bucket sizes), so receivers need no prior knowledge of the model. JSON, not pickle:
     unpickling bytes from a socket would run whatever code they name (see `decode_meta`);
  3. one uint8 tensor per bucket (see ``buckets.py`` for the layout rule).
The sender double-buffers: bucket k+1 is packed while bucket k's broadcast is in flight.
Receivers stage every bucket into freshly allocated buffers (never the live model), return
views into them, and compare the sender's digest with one recomputed from the staged state.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext

import torch

from async_flowgrpo.config import SYNC_BUCKET_MB, SYNC_TIMEOUT_S
from .base import DigestMismatchError, ReceiveResult, SendResult, StageHook, State, SyncStats, check_digest, digest
from .buckets import Layout, TensorSpec, pack_bucket, plan, unpack
from .group import GroupAddress, WeightSyncGroup, new_address

__all__ = ["WeightSender", "WeightReceiver", "DigestMismatchError", "encode_meta", "decode_meta"]

def encode_meta(version: int, digest_hex: str, layout: Layout) -> bytes:
    return json.dumps({
        "version": int(version),
        "digest": digest_hex,
        "tensors": [[t.name, t.dtype, list(t.shape), t.nbytes, t.bucket, t.offset] for t in layout.tensors],
        "bucket_sizes": list(layout.bucket_sizes),
    }).encode()


def decode_meta(raw: bytes) -> tuple[int, str, Layout]:
    """Parse and check the sender's metadata; anything malformed is a ValueError, nothing is run."""
    try:
        meta = json.loads(raw.decode())
        specs = []
        for name, dtype, shape, nbytes, bucket, offset in meta["tensors"]:
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):  # unpack does getattr(torch, dtype)
                raise ValueError(f"dtype {dtype!r}")
            specs.append(TensorSpec(str(name), dtype, tuple(int(d) for d in shape), int(nbytes), int(bucket), int(offset)))
        layout = Layout(specs, [int(n) for n in meta["bucket_sizes"]])
        return int(meta["version"]), str(meta["digest"]), layout
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"weight sync: malformed metadata from the sender ({e})") from None


class _Member:
    def __init__(self, bucket_mb: float = SYNC_BUCKET_MB, timeout_s: float = SYNC_TIMEOUT_S, device: str | None = None, verify: bool = True):
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s, self.device, self.verify = timeout_s, device, verify
        self.group: WeightSyncGroup | None = None

    def _join(self, address: GroupAddress, rank: int, world_size: int) -> None:
        self.close()  # rebuilding: the old group is abandoned, whatever state its peers are in
        self.group = WeightSyncGroup(address, rank, world_size, self.device, self.timeout_s)

    def _require_group(self) -> WeightSyncGroup:
        if self.group is None:
            raise RuntimeError("weight sync group not connected: call connect() on every member first")
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class WeightSender(_Member):
    """Rank 0. ``new_address()`` then ``connect()`` (concurrently with receivers), then ``send()``."""

    def __init__(self, bucket_mb: float = SYNC_BUCKET_MB, timeout_s: float = SYNC_TIMEOUT_S, device: str | None = None, verify: bool = True):
        super().__init__(bucket_mb, timeout_s, device, verify)
        self._buffers: list[torch.Tensor] = []  # two send buffers, kept across syncs

    def new_address(self, host: str | None = None) -> GroupAddress:
        return new_address(host=host)

    def connect(self, address: GroupAddress, world_size: int) -> None:
        self._join(address, 0, world_size)
        self._buffers = []

    def send(self, state: State, version: int) -> SendResult:
        group = self._require_group()
        start = time.perf_counter()
        layout = plan(state, self.bucket_bytes)
        dg = digest(state) if self.verify else ""
        meta = bytearray(encode_meta(version, dg, layout))
        payload = torch.frombuffer(meta, dtype=torch.uint8).to(group.device)
        group.broadcast(torch.tensor([len(meta)], dtype=torch.int64, device=group.device)).wait()
        group.broadcast(payload).wait()

        tensors = list(state.values())
        bufs = self._ensure_buffers(max(layout.bucket_sizes, default=0), group.device)
        in_flight = [None, None]
        for k in range(len(layout.bucket_sizes)):
            slot = k % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()  # bucket k-2 has left this buffer
            # Packing here overlaps with bucket k-1's broadcast, running on the backend's threads/stream.
            in_flight[slot] = group.broadcast(pack_bucket(tensors, layout, k, bufs[slot]))
        for work in in_flight:
            if work is not None:
                work.wait()
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()  # wall time means "delivered"
        stats = SyncStats(int(version), layout.nbytes, time.perf_counter() - start, len(layout.bucket_sizes), dg)
        return SendResult(handle=None, stats=stats)

    def _ensure_buffers(self, size: int, device: torch.device) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        return self._buffers


class WeightReceiver(_Member):
    """Rank >= 1. ``receive()`` blocks until the sender's next ``send()``; safe on any thread."""

    def __init__(self, bucket_mb: float = SYNC_BUCKET_MB, timeout_s: float = SYNC_TIMEOUT_S, device: str | None = None, verify: bool = True):
        super().__init__(bucket_mb, timeout_s, device, verify)  # bucket_mb unused: the sender's layout rules
        self.stage_hook: StageHook | None = None  # tests: tamper with staged state before verification
        self._stream = None

    def connect(self, address: GroupAddress, rank: int, world_size: int) -> None:
        if rank < 1:
            raise ValueError(f"receiver rank must be >= 1 (rank 0 is the sender), got {rank}")
        self._join(address, rank, world_size)
        if self.group.device.type == "cuda":  # GPU only: a side stream so generation kernels are not stalled
            self._stream = torch.cuda.Stream(self.group.device)

    def receive(self, handle: object = None) -> ReceiveResult:
        """``handle`` is ignored (accepted so drivers treat every transport alike)."""
        group = self._require_group()
        start = time.perf_counter()
        with self._device_context(group):
            length = torch.zeros(1, dtype=torch.int64, device=group.device)
            group.broadcast(length).wait()
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
            group.broadcast(payload).wait()
            version, sent_digest, layout = decode_meta(payload.cpu().numpy().tobytes())
            # Fresh staging buffers every sync: the returned tensors are views into them, owned by the caller.
            bufs = [torch.empty(n, dtype=torch.uint8, device=group.device) for n in layout.bucket_sizes]
            works = [group.broadcast(b) for b in bufs]
            for work in works:
                work.wait()
            if self._stream is not None:
                self._stream.synchronize()  # complete before another thread/stream reads them
        state = unpack(bufs, layout)
        if self.stage_hook is not None:
            self.stage_hook(state)
        dg = check_digest(state, sent_digest) if sent_digest and self.verify else sent_digest
        stats = SyncStats(version, layout.nbytes, time.perf_counter() - start, len(bufs), dg)
        return ReceiveResult(state, version, stats)

    def _device_context(self, group: WeightSyncGroup):
        if self._stream is None:
            return nullcontext()
        # Current device and stream are per thread in CUDA: set both for this (background) thread.
        torch.cuda.set_device(group.device)
        return torch.cuda.stream(self._stream)
