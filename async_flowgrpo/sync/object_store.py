"""Reference transport through Ray's object store: one ``ray.put`` by the sender, one ``ray.get`` per receiver.

No process group and no buckets: simple and robust, the baseline the collective transport is
compared against. The sender keeps a reference to the latest weights, so they stay in the object
store until the next send (a replacement rollout actor can still fetch them).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from async_flowgrpo.config import SYNC_TIMEOUT_S
from .base import ReceiveResult, SendResult, StageHook, State, SyncStats, check_digest, digest

_ZERO_COPY = os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "0").lower() in ("1", "true")


class ObjectStoreSender:
    def __init__(self, timeout_s: float = SYNC_TIMEOUT_S, verify: bool = True):
        self.timeout_s, self.verify = timeout_s, verify
        self._latest: ray.ObjectRef | None = None

    def new_address(self, host: str | None = None) -> None:
        return None  # nothing to rendezvous on

    def connect(self, address: Any = None, world_size: int = 0) -> None:
        pass

    def send(self, state: State, version: int) -> SendResult:
        start = time.perf_counter()
        cpu = {k: v.detach().cpu() for k, v in state.items()}  # receivers need not own a GPU
        dg = digest(cpu) if self.verify else ""
        self._latest = ray.put({"state": cpu, "version": int(version), "digest": dg})
        nbytes = sum(t.numel() * t.element_size() for t in cpu.values())
        return SendResult(self._latest, SyncStats(int(version), nbytes, time.perf_counter() - start, 1, dg))

    def close(self) -> None:
        self._latest = None


class ObjectStoreReceiver:
    def __init__(self, timeout_s: float = SYNC_TIMEOUT_S, device: str | None = None, verify: bool = True):
        self.timeout_s, self.verify = timeout_s, verify
        self.device = torch.device(device) if device else None  # None: keep the CPU tensors ray.get returns
        self.stage_hook: StageHook | None = None

    def connect(self, address: Any = None, rank: int = 0, world_size: int = 0) -> None:
        pass

    def receive(self, handle: Any = None) -> ReceiveResult:
        """``handle``: the sender's SendResult, its ``.handle``, or an ObjectRef to either (a one-element
        list around the ref is unwrapped: drivers pass ``[push_ref]`` so Ray does not wait on it)."""
        start = time.perf_counter()
        payload = self._resolve(handle)
        state = payload["state"]  # by default ray.get unpickles a private copy: staging is already ours
        if self.device is not None or _ZERO_COPY:  # zero-copy tensors sit in read-only shared memory
            state = {k: v.to(self.device or "cpu", copy=True) for k, v in state.items()}
        if self.stage_hook is not None:
            self.stage_hook(state)
        dg = check_digest(state, payload["digest"]) if payload["digest"] and self.verify else payload["digest"]
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        stats = SyncStats(payload["version"], nbytes, time.perf_counter() - start, 1, dg)
        return ReceiveResult(state, payload["version"], stats)

    def _resolve(self, handle: Any) -> dict:
        if handle is None:
            raise ValueError("object_store transport: receive() needs the sender's handle (SendResult or ObjectRef)")
        if isinstance(handle, (list, tuple)) and len(handle) == 1:
            handle = handle[0]
        while True:
            if isinstance(handle, ray.ObjectRef):
                handle = ray.get(handle, timeout=self.timeout_s)
            elif isinstance(handle, SendResult):
                handle = handle.handle
            else:
                return handle

    def close(self) -> None:
        pass
