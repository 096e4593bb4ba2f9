"""Checkpoint engine: weight sync from trainer rank 0 to N rollout actors.

Transports ("sync.transport"):
  collective    process-group broadcast of bucketed weights (NCCL on CUDA, gloo on CPU); default
  object_store  one ray.put by the sender, one ray.get per receiver; the simple reference

Both have the same interface (``base.Sender`` / ``base.Receiver``). How a Ray driver uses them,
with ``transport = make_transport(cfg.sync.transport, bucket_mb=cfg.sync.bucket_mb)`` handed to
every actor, the trainer's rank 0 holding ``transport.sender()`` and each rollout actor
``transport.receiver()``:

  (Re)build the group (at start, and whenever a rollout actor was replaced; every member rejoins):
      addr = ray.get(trainer.sync_address.remote())                  # sender.new_address()
      ray.get([trainer.sync_connect.remote(addr, n + 1),             # sender.connect(addr, n + 1)
               *[r.sync_connect.remote(addr, i + 1, n + 1)           # receiver.connect(addr, rank, n + 1)
                 for i, r in enumerate(rollouts)]])

  Sync: sender and ALL receivers must be called concurrently (collective calls block until every
  member takes part), so launch every call before waiting on any:
      push = trainer.push.remote(version)                            # returns sender.send(state, version)
      pulls = [r.pull.remote([push]) for r in rollouts]              # receiver.receive(handle[0])
      ray.get([push, *pulls], timeout=...)
  ``[push]`` is wrapped in a list so that Ray does not wait for the push to finish before starting
  a pull (top-level ObjectRef arguments are resolved first, which would deadlock the collective);
  the collective receiver ignores it, the object-store receiver ray.gets it to find the weights.
  The push method must return the SendResult (or its ``.handle``).

Receivers may run ``receive`` on a background thread; they return fresh tensors (never the live
model's) plus the version, after checking a sha256 digest of the staged weights (``digest``).
"""

from __future__ import annotations

from dataclasses import dataclass

from async_flowgrpo.config import SYNC_BUCKET_MB, SYNC_TIMEOUT_S
from .base import DigestMismatchError, ReceiveResult, Receiver, SendResult, Sender, SyncStats, digest
from .engine import WeightReceiver, WeightSender
from .group import GroupAddress, WeightSyncGroup, free_port, new_address, node_ip, rendezvous_store

TRANSPORTS = ("collective", "object_store")


@dataclass(frozen=True)
class Transport:
    """Picklable transport settings: build on the driver, ship to actors, call sender()/receiver() there."""

    name: str = "collective"
    bucket_mb: float = SYNC_BUCKET_MB
    timeout_s: float = SYNC_TIMEOUT_S
    device: str | None = None  # None: cuda if available else cpu (collective); cpu (object_store)
    verify: bool = True  # compute and check the digest

    def sender(self) -> Sender:
        if self.name == "collective":
            return WeightSender(self.bucket_mb, self.timeout_s, self.device, self.verify)
        from .object_store import ObjectStoreSender  # imports ray: only where that transport is chosen

        return ObjectStoreSender(self.timeout_s, self.verify)

    def receiver(self) -> Receiver:
        if self.name == "collective":
            return WeightReceiver(self.bucket_mb, self.timeout_s, self.device, self.verify)
        from .object_store import ObjectStoreReceiver

        return ObjectStoreReceiver(self.timeout_s, self.device, self.verify)


def make_transport(
    name: str = "collective",
    *,
    bucket_mb: float = SYNC_BUCKET_MB,
    timeout_s: float = SYNC_TIMEOUT_S,
    device: str | None = None,
    verify: bool = True,
) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"sync.transport: unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    if bucket_mb <= 0:
        raise ValueError(f"sync.bucket_mb must be > 0, got {bucket_mb}")
    return Transport(name, float(bucket_mb), float(timeout_s), device, verify)


__all__ = [
    "DigestMismatchError",
    "GroupAddress",
    "ObjectStoreReceiver",
    "ObjectStoreSender",
    "ReceiveResult",
    "Receiver",
    "SendResult",
    "Sender",
    "SyncStats",
    "TRANSPORTS",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncGroup",
    "digest",
    "free_port",
    "make_transport",
    "new_address",
    "node_ip",
    "rendezvous_store",
]
