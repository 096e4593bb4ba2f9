"""What every weight-sync transport shares: the result types, the digest and the interface.

A transport moves an ordered ``dict[str, Tensor]`` plus an int version from one sender
(trainer rank 0) to N receivers (rollout actors). It does not know what the tensors are
(LoRA adapter only or a full state_dict).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

State = dict[str, torch.Tensor]


@dataclass
class SyncStats:
    version: int
    bytes: int  # payload bytes (tensor data, no metadata or padding)
    seconds: float  # wall time of this side's send() / receive()
    num_buckets: int
    digest: str  # "" when verification is off


@dataclass
class SendResult:
    handle: Any  # what receivers need besides the group (object store: an ObjectRef); None for collective
    stats: SyncStats


@dataclass
class ReceiveResult:
    state: State
    version: int
    stats: SyncStats


class DigestMismatchError(RuntimeError):
    """The received weights are not bit-identical to what the sender sent."""


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat uint8 tensor (any dtype, bf16 included; 0-dim too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over, for every tensor in iteration order, "name|dtype|shape\\n" then its raw bytes.

    Identical digests mean identical names, order, dtypes, shapes and bits (NaN payloads and
    -0.0 included, unlike torch.equal). Cost: one pass of CPU hashing (GPU tensors are copied
    to host), roughly 0.5-2 GB/s per core; turn verification off for very large models if needed.
    """
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(tensor_bytes(t).cpu().numpy().data)
    return h.hexdigest()


def check_digest(state: State, expected: str) -> str:
    got = digest(state)
    if got != expected:
        raise DigestMismatchError(
            f"weight sync digest mismatch: received state hashes to {got[:16]}…, sender sent {expected[:16]}…"
        )
    return got


# A test hook a receiver calls with the staged state before verifying it (e.g. to flip a byte).
StageHook = Callable[[State], None]


class Sender(Protocol):
    def new_address(self, host: str | None = None) -> Any:
        """On the sender's process: where members meet for a (re)built group (None if no group);
        ``host``: the interface to listen on (None: this node's IP)."""

    def connect(self, address: Any, world_size: int) -> None:
        """Join (or rebuild) the group as rank 0. Called concurrently with the receivers' connect."""

    def send(self, state: State, version: int) -> SendResult: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    stage_hook: StageHook | None

    def connect(self, address: Any, rank: int, world_size: int) -> None: ...

    def receive(self, handle: Any = None) -> ReceiveResult: ...

    def close(self) -> None: ...
