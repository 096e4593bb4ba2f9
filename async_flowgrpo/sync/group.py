"""A weight-sync process group, separate from any default (world) process group.

Trainer rank 0 joins as rank 0 and the rollout actors as ranks 1..N. The group is built
"stateless": its own TCPStore (hosted by rank 0) and a backend object constructed directly
(ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA). Nothing is registered with
``torch.distributed``'s global state, so a trainer that also called ``init_process_group``
for data parallelism keeps its world group untouched, and the group can be thrown away and
rebuilt (new port, new prefix) when a rollout actor is replaced.

Because the group is not registered, the functional API (``dist.broadcast(..., group=pg)``)
rejects it ("Group ... is not registered"); collectives are issued on the backend object,
``pg.broadcast([tensor], opts)``, which returns an async work handle.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_flowgrpo.config import SYNC_TIMEOUT_S


@dataclass(frozen=True)
class GroupAddress:
    """Where members rendezvous: rank 0's TCPStore, plus a name that prefixes every key.

    The store has no authentication: whoever reaches host:port can join the group or feed it
    keys. So rank 0 listens on ``host`` only (not on every interface, torch's default), and
    ``host`` is loopback whenever the whole group is on one node (see ``sync.host``)."""

    host: str
    port: int
    name: str = "weight_sync"


def node_ip() -> str:
    """This node's IP as other Ray nodes see it; loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout_s: float = SYNC_TIMEOUT_S) -> dist.TCPStore:
    """A TCPStore for a process group whose rank 0 listens on ``host`` only (torch's own
    ``tcp://`` rendezvous listens on every interface, unauthenticated): pass it to
    ``dist.init_process_group(store=...)``. Used by the trainers' data-parallel group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach() if listener is not None else None)


_generation = 0
_listeners: dict[int, socket.socket] = {}  # port -> the bound socket rank 0's store will serve on


def new_address(name: str | None = None, host: str | None = None) -> GroupAddress:
    """Call on rank 0's process: a fresh address for a new (or rebuilt) group, listening on
    ``host`` only (default: this node's IP). The socket is bound here and handed to the TCPStore,
    so no other process can take the port in between."""
    global _generation
    _generation += 1
    host = host or node_ip()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    _listeners[port] = listener
    return GroupAddress(host, port, name or f"weight_sync/{_generation}")


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class WeightSyncGroup:
    """One member's handle on the group. All members must construct it concurrently.

    Args:
        address: from ``new_address()`` on rank 0, passed to every member.
        rank: 0 for the sender, 1..world_size-1 for receivers.
        world_size: 1 + number of receivers.
        device: "cpu" -> gloo, "cuda[:i]" -> NCCL. Buffers broadcast over the group live here.
        timeout_s: per-collective (and rendezvous) timeout. Only time spent inside a sync counts,
            so it bounds skew between members' calls, not the gap between syncs.
    """

    def __init__(
        self,
        address: GroupAddress,
        rank: int,
        world_size: int,
        device: torch.device | str | None = None,
        timeout_s: float = SYNC_TIMEOUT_S,
    ):
        self.address, self.rank, self.world_size = address, rank, world_size
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and self.device.index is None:  # NCCL needs the index ("cuda" failed on a GPU)
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=timeout_s)
        # wait_for_workers=False: the backend's own rendezvous below waits for everybody.
        listener = _listeners.pop(address.port, None) if rank == 0 else None
        self._tcp_store = dist.TCPStore(
            address.host, address.port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
            # detach(): the store owns the fd from here and closes it when it is destroyed
            master_listen_fd=listener.detach() if listener is not None else None,
        )
        store = dist.PrefixStore(address.name, self._tcp_store)
        if self.device.type == "cuda":
            self.pg = _nccl(store, rank, world_size, timeout, self.device)
        else:
            self.pg = _gloo(store, rank, world_size, timeout, address.host)
        # NCCL creates its communicator lazily; a tiny collective makes failures surface here.
        self.broadcast(torch.zeros(1, device=self.device)).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting a contiguous tensor from ``src``; returns the work handle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def destroy(self) -> None:
        """Abort pending work and drop connections; safe when peers are already dead."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:  # some backends/versions refuse abort after an error
                pass
        self._tcp_store = None


def _gloo(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, host: str) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Gloo's own listening sockets: on loopback when the rendezvous is (one node), else on the IP
    # Ray knows for this node rather than whatever the hostname resolves to (often 127.0.1.1
    # inside containers, unreachable from other nodes).
    local = host.startswith("127.") or host == "localhost"
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1" if local else node_ip())]
    opts._threads = 2
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _nccl(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device
):  # GPU only: not exercised by the CPU test suite.
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

    torch.cuda.set_device(device)
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, opts)
