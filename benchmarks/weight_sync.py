#!/usr/bin/env python
"""Weight-sync benchmark: the checkpoint engine (``async_flowgrpo.sync``) against a raw broadcast.

For every combination of flavour (``lora``: many small A/B matrices; ``full``: fewer, large
transformer matrices plus their small norm/bias vectors), payload size, transport
(``collective`` process-group broadcast, ``object_store``), bucket size (collective only),
number of receivers and digest verification on/off, it runs the driver protocol of
``async_flowgrpo.sync``::

    push = sender.push.remote(v); pulls = [r.pull.remote([push]) for r in receivers]; ray.get([push, *pulls])

and records the median driver-observed, sender-side and receiver-side times, the effective
bandwidth (payload bytes / driver time) and the ratio to a *raw* baseline: one contiguous uint8
tensor of the same number of bytes broadcast with ``WeightSyncGroup.broadcast`` over a group of
the same members and kind (gloo on CPU, NCCL on CUDA), timed the same way (Ray call from the
driver, buffers preallocated). Raw and transport syncs are interleaved repeat by repeat so that
load drift on a shared machine hits both alike.

Generation blocking: a receiving actor runs a fixed CPU/GPU-bound "generation" loop (matmuls)
on its default thread while the sync is received on its ``sync`` concurrency-group thread, as
``RolloutActor`` does. The loop swaps staged weights into a live ``nn.Module`` at its next step
boundary (the only part of a sync on the generation path). Reported: ``swap_in_s`` (that copy)
and ``blocked_s``: the time the loop's steps that overlap the receive (plus the swap-in step)
took beyond the loop's own median step (median over repeats); the same steps of a sync-free loop
run just before give ``noise_s``, the resolution. ``blocked_s`` includes CPU contention from the
background receive and, on a single node, from the co-located sender's packing/hashing (in a real
deployment it runs on the trainer's machine); the "bystander" control runs the loop in an actor
that does not receive while the same sync goes to another one: the machine-wide part of it.
With ``--rollout-s-per-group`` both become fractions of rollout time (target for LoRA: < 1%).

Diagnostics (largest size): sha256 digest rate, bucket packing rate, a raw broadcast into a
freshly allocated receive buffer (what the receiver does every sync) vs a preallocated one, and
``ray.put``/``ray.get`` of the state dict vs one flat tensor.

Writes ``benchmarks/results/weight_sync.json`` and ``benchmarks/results/weight_sync.png``.

    python benchmarks/weight_sync.py                    # defaults: ~2-2.5 min on 2 busy CPU cores
    python benchmarks/weight_sync.py --rollout-s-per-group 12.5   # blocking as a fraction of rollout time
    python benchmarks/weight_sync.py --sizes-mb 1,64,512 --bucket-mb 16,256 --receivers 1,2 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the repository on sys.path, the offline environment, before ray is imported)

import ray  # noqa: E402
import torch  # noqa: E402

from async_flowgrpo.sync import WeightSyncGroup, make_transport  # noqa: E402
from async_flowgrpo.sync.base import digest  # noqa: E402

MB = 2**20
RESULTS = common.RESULTS
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


# --- synthetic state dicts ----------------------------------------------------------------------


def lora_shapes(size_bytes: int, esize: int, rank: int = 16) -> list[tuple[str, tuple[int, ...]]]:
    """A LoRA adapter: pairs lora_A [r, d] / lora_B [d, r], each matrix 4-256 KiB, >= 64 of them."""
    per = min(256 * 1024, max(4 * 1024, size_bytes // 64))
    d = max(8, per // (rank * esize))
    n_pairs = max(1, round(size_bytes / (2 * rank * d * esize)))
    shapes = []
    for i in range(n_pairs):
        block, target = divmod(i, len(LORA_TARGETS))
        base = f"transformer_blocks.{block}.attn.{LORA_TARGETS[target]}"
        shapes += [(f"{base}.lora_A.weight", (rank, d)), (f"{base}.lora_B.weight", (d, rank))]
    return shapes


def full_shapes(size_bytes: int, esize: int, n_blocks: int = 8) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer: per block qkv [3d, d], proj [d, d], fc1 [4d, d], fc2 [d, 4d] plus norms/biases."""
    d = max(8, round(math.sqrt(size_bytes / esize / (12 * n_blocks))))
    shapes = []
    for b in range(n_blocks):
        p = f"blocks.{b}"
        shapes += [
            (f"{p}.norm1.weight", (d,)), (f"{p}.norm1.bias", (d,)),
            (f"{p}.attn.qkv.weight", (3 * d, d)), (f"{p}.attn.qkv.bias", (3 * d,)),
            (f"{p}.attn.proj.weight", (d, d)), (f"{p}.attn.proj.bias", (d,)),
            (f"{p}.norm2.weight", (d,)), (f"{p}.norm2.bias", (d,)),
            (f"{p}.mlp.fc1.weight", (4 * d, d)), (f"{p}.mlp.fc1.bias", (4 * d,)),
            (f"{p}.mlp.fc2.weight", (d, 4 * d)), (f"{p}.mlp.fc2.bias", (d,)),
        ]  # fmt: skip
    return shapes


def shapes_for(flavour: str, size_mb: float, dtype: torch.dtype):
    esize = torch.empty((), dtype=dtype).element_size()
    fn = {"lora": lora_shapes, "full": full_shapes}[flavour]
    return fn(int(size_mb * MB), esize)


def make_state(flavour: str, size_mb: float, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype).to(device) for n, s in shapes_for(flavour, size_mb, dtype)}


def state_nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- actors --------------------------------------------------------------------------------------


class _RawMember:
    """A raw WeightSyncGroup beside the transport's group, for the one-tensor baseline."""

    device: str
    raw_group = None
    raw_buf = None

    def raw_connect(self, address, rank: int, world_size: int) -> None:
        if self.raw_group is not None:
            self.raw_group.destroy()
        self.raw_group = WeightSyncGroup(address, rank, world_size, self.device, timeout_s=120)

    def raw_prepare(self, nbytes: int) -> None:
        """Select (allocate and touch once, then reuse) the buffer for ``nbytes``; contents do not matter."""
        cache = self.__dict__.setdefault("raw_bufs", {})
        if nbytes not in cache:
            cache[nbytes] = torch.full((nbytes,), 7, dtype=torch.uint8, device=self.device)
        self.raw_buf = cache[nbytes]

    def raw_broadcast(self, fresh: bool = False) -> float:
        """One broadcast of the preallocated buffer (fresh=True: receive into a newly allocated one)."""
        start = time.perf_counter()
        buf = torch.empty_like(self.raw_buf) if fresh and self.raw_group.rank > 0 else self.raw_buf
        self.raw_group.broadcast(buf).wait()
        sync_device(self.device)
        return time.perf_counter() - start


@ray.remote
class BenchSender(_RawMember):
    def __init__(self, device: str, dtype: str):
        torch.set_num_threads(1)
        self.device, self.dtype = device, getattr(torch, dtype)
        self.sender, self.states, self.state = None, {}, None

    def setup(self, transport) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = transport.sender()

    def set_state(self, flavour: str, size_mb: float) -> dict:
        key = (flavour, size_mb)
        if key not in self.states:
            self.states[key] = make_state(flavour, size_mb, self.dtype, self.device)
        self.state = self.states[key]
        return {"bytes": state_nbytes(self.state), "tensors": len(self.state)}

    def address(self):
        return self.sender.new_address()

    def raw_address(self):
        from async_flowgrpo.sync import new_address

        return new_address("weight_sync_raw")

    def connect(self, address, world_size: int) -> None:
        self.sender.connect(address, world_size)

    def push(self, version: int):
        return self.sender.send(self.state, version)

    def pack_time(self, bucket_mb: float, repeats: int = 3) -> float:
        """Seconds to pack the current state into buckets (the sender's copy work, no communication)."""
        from async_flowgrpo.sync.buckets import pack_bucket, plan

        layout = plan(self.state, int(bucket_mb * MB))
        tensors = list(self.state.values())
        out = torch.empty(max(layout.bucket_sizes), dtype=torch.uint8, device=self.device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for k in range(len(layout.bucket_sizes)):
                pack_bucket(tensors, layout, k, out)
            sync_device(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def digest_rate(self, flavour: str, size_mb: float, repeats: int = 3) -> float:
        state = self.states[(flavour, size_mb)]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            digest(state)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


@ray.remote(concurrency_groups={"sync": 1})
class BenchReceiver(_RawMember):
    """Generation (matmul loop + swap-in at step boundaries) on the default thread, receive on "sync"."""

    def __init__(self, device: str, dtype: str):
        torch.set_num_threads(1)
        self.device, self.dtype = device, getattr(torch, dtype)
        self.receiver = None
        self.staged, self.lock = None, threading.Lock()
        self.live: list[tuple[str, torch.nn.Parameter]] = []
        self.live_module = None
        self.gen_x = self.gen_w = None

    @ray.method(concurrency_group="sync")
    def setup(self, transport) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = transport.receiver()

    @ray.method(concurrency_group="sync")
    def connect(self, address, rank: int, world_size: int) -> None:
        self.receiver.connect(address, rank, world_size)

    @ray.method(concurrency_group="sync")
    def pull(self, handle: list) -> dict:
        start = time.perf_counter()
        result = self.receiver.receive(handle[0])
        with self.lock:
            self.staged = result.state
        return {"seconds": result.stats.seconds, "digest": result.stats.digest, "bytes": result.stats.bytes,
                "window": (start, time.perf_counter())}  # this process's clock, to line up with generate()'s steps

    @ray.method(concurrency_group="sync")
    def raw_connect(self, address, rank: int, world_size: int) -> None:
        _RawMember.raw_connect(self, address, rank, world_size)

    @ray.method(concurrency_group="sync")
    def raw_prepare(self, nbytes: int) -> None:
        _RawMember.raw_prepare(self, nbytes)

    @ray.method(concurrency_group="sync")
    def raw_broadcast(self, fresh: bool = False) -> float:
        return _RawMember.raw_broadcast(self, fresh)

    # -- generation side (default thread) --------------------------------------------------------
    def build_live(self, flavour: str, size_mb: float) -> int:
        """A live module whose parameters have the synced state's names/shapes (what swap-in targets)."""
        params = [(n, torch.nn.Parameter(torch.zeros(s, dtype=self.dtype, device=self.device), requires_grad=False))
                  for n, s in shapes_for(flavour, size_mb, self.dtype)]
        self.live_module = torch.nn.ParameterList([p for _, p in params])
        self.live = params
        with self.lock:
            self.staged = None
        return len(params)

    def calibrate(self, dim: int) -> float:
        """Seconds per generation step (one dim x dim matmul)."""
        g = torch.Generator().manual_seed(1)
        self.gen_x = torch.randn(dim, dim, generator=g).to(self.device)
        self.gen_w = (torch.randn(dim, dim, generator=g) / dim**0.5).to(self.device)
        self._steps(5)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            self._steps(20)
            times.append((time.perf_counter() - start) / 20)
        return statistics.median(times)

    def _steps(self, n: int) -> None:
        x = self.gen_x
        for _ in range(n):
            x = torch.tanh(x @ self.gen_w)
        sync_device(self.device)

    def _swap_in(self, state) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for name, p in self.live:
                p.copy_(state[name])
        sync_device(self.device)
        return time.perf_counter() - start

    def generate(self, n_steps: int) -> dict:
        """The generation loop: at every step boundary swap in staged weights if any (a safe point)."""
        swap_s, swap_steps = 0.0, []
        start = time.perf_counter()
        ts = [start]  # step i runs from ts[i] to ts[i + 1] (a swap-in counts towards the step it precedes)
        for i in range(n_steps):
            with self.lock:
                staged, self.staged = self.staged, None
            if staged is not None:
                swap_s += self._swap_in(staged)
                swap_steps.append(i)
            self._steps(1)
            ts.append(time.perf_counter())
        return {"seconds": ts[-1] - start, "swap_s": swap_s, "swaps": len(swap_steps), "swap_steps": swap_steps, "ts": ts}

    def swap_pending(self) -> dict:
        """Swap in weights staged after the loop ended (the sync outlasted it)."""
        with self.lock:
            staged, self.staged = self.staged, None
        return {"swap_s": self._swap_in(staged) if staged is not None else 0.0, "swaps": int(staged is not None)}

    def drop_staged(self) -> None:
        with self.lock:
            self.staged = None


# --- driver --------------------------------------------------------------------------------------


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def sizes_for(args, flavour: str) -> list[float]:
    """--sizes-mb, less LoRA sizes above --lora-max-mb (an adapter that big is not a LoRA use case)."""
    return [x for x in args.sizes_mb if flavour != "lora" or x <= args.lora_max_mb]


def window_steps(ts: list[float], window: tuple[float, float], swap_steps: list[int]) -> list[int]:
    """Indices of generation steps that overlap the receive window, plus the step the swap-in preceded."""
    w0, w1 = window
    idx = {i for i in range(len(ts) - 1) if ts[i + 1] > w0 and ts[i] < w1}
    return sorted(idx | set(swap_steps))


def excess(ts: list[float], idx: list[int]) -> float:
    """Time the steps ``idx`` took beyond the median step of the others (the same loop, same load)."""
    d = [b - a for a, b in zip(ts, ts[1:])]
    inside = set(idx)
    ref = med([x for i, x in enumerate(d) if i not in inside]) or med(d)
    return sum(d[i] - ref for i in idx)


def med(xs):
    return statistics.median(xs) if xs else None


class Bench:
    def __init__(self, args):
        self.args = args
        self.timeout = args.timeout_s
        self.device = args.resolved_device
        dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.dtype = dtype
        n_max = max(args.receivers)
        ngpu = torch.cuda.device_count() if self.device.startswith("cuda") else 0
        gpu_each = min(1.0, ngpu / (n_max + 1)) if ngpu else 0
        opts = {"num_cpus": 0.25, "num_gpus": gpu_each}
        self.sender = BenchSender.options(**opts).remote(self.device, dtype)
        self.receivers = [BenchReceiver.options(**opts).remote(self.device, dtype) for _ in range(n_max)]
        self.ngpu = ngpu
        self.payload: dict[tuple[str, float], dict] = {}

    def get(self, refs):
        return ray.get(refs, timeout=self.timeout)

    def group_possible(self, n: int) -> bool:
        """NCCL needs one GPU per member; gloo on CPU always works."""
        return not self.device.startswith("cuda") or self.ngpu >= n + 1

    def connect_raw(self, n: int) -> None:
        address = self.get(self.sender.raw_address.remote())
        recv = self.receivers[:n]
        self.get([self.sender.raw_connect.remote(address, 0, n + 1),
                  *[r.raw_connect.remote(address, i + 1, n + 1) for i, r in enumerate(recv)]])

    def setup(self, transport, n: int, recv: list | None = None) -> None:
        recv = self.receivers[:n] if recv is None else recv
        self.get([self.sender.setup.remote(transport), *[r.setup.remote(transport) for r in recv]])
        address = self.get(self.sender.address.remote())
        self.get([self.sender.connect.remote(address, n + 1),
                  *[r.connect.remote(address, i + 1, n + 1) for i, r in enumerate(recv)]])

    def sync_once(self, n: int, version: int) -> tuple[float, float, list[float], list[str], str]:
        start = time.perf_counter()
        push = self.sender.push.remote(version)
        pulls = [r.pull.remote([push]) for r in self.receivers[:n]]
        sent, *got = self.get([push, *pulls])
        wall = time.perf_counter() - start
        return wall, sent.stats.seconds, [g["seconds"] for g in got], [g["digest"] for g in got], sent.stats.digest

    def raw_once(self, n: int, fresh: bool = False) -> tuple[float, float]:
        start = time.perf_counter()
        push = self.sender.raw_broadcast.remote()
        pulls = [r.raw_broadcast.remote(fresh) for r in self.receivers[:n]]
        sender_s, *_ = self.get([push, *pulls])
        return time.perf_counter() - start, sender_s

    def raw_prepare(self, n: int, nbytes: int) -> None:
        self.get([self.sender.raw_prepare.remote(nbytes), *[r.raw_prepare.remote(nbytes) for r in self.receivers[:n]]])

    def set_state(self, flavour: str, size_mb: float) -> dict:
        info = self.get(self.sender.set_state.remote(flavour, size_mb))
        self.payload[(flavour, size_mb)] = info
        return info

    def cases(self) -> list[tuple[str, float]]:
        return [(f, s) for f in self.args.flavours for s in sizes_for(self.args, f)]

    def configs(self) -> list[tuple[str, float | None, bool]]:
        a = self.args
        out = []
        for name in sorted(a.transports, key=lambda t: t != "collective"):  # collective first: it measures raw
            for bucket in (a.bucket_mb if name == "collective" else [None]):
                for verify in a.verify:
                    out.append((name, bucket, verify))
        return out

    def run_combos(self) -> list[dict]:
        """Every (receivers, transport config, flavour, size): warm-up, then repeats of sync + raw back to back.

        Raw broadcasts are interleaved with the collective configs' syncs (ratio = median of per-repeat
        ratios); object-store rows are compared with the median of those raw times (measured afresh
        only when no collective config ran)."""
        a = self.args
        rows = []
        for n in a.receivers:
            grouped = self.group_possible(n)
            if not grouped:
                print(f"  receivers={n}: {self.device} needs {n + 1} GPUs for NCCL groups, have {self.ngpu}: "
                      "no collective transport, no raw baseline")
            else:
                self.connect_raw(n)
            raw_pool: dict[tuple[str, float], list[tuple[float, float]]] = {}
            for name, bucket, verify in self.configs():
                if name == "collective" and not grouped:
                    continue
                transport = make_transport(name, bucket_mb=bucket or 64.0, timeout_s=self.timeout, verify=verify)
                self.setup(transport, n)
                for i, (flavour, size_mb) in enumerate(self.cases()):
                    info = self.set_state(flavour, size_mb)
                    measure_raw = grouped and (name == "collective" or (flavour, size_mb) not in raw_pool)
                    if measure_raw:
                        self.raw_prepare(n, info["bytes"])
                    if i == 0:  # warm-up per group: connections, first-touch of the sender's buffers
                        self.sync_once(n, 0)
                        if measure_raw:
                            self.raw_once(n)
                    walls, senders, recvs, raws = [], [], [], []
                    for rep in range(a.repeats):
                        w, s, r, digests, sent_digest = self.sync_once(n, rep + 1)
                        if verify and any(d != sent_digest for d in digests):
                            raise RuntimeError(f"digest mismatch {name} {flavour} {size_mb}")
                        walls.append(w), senders.append(s), recvs.append(max(r))
                        if measure_raw:
                            raws.append(self.raw_once(n))
                    self.get([r.drop_staged.remote() for r in self.receivers[:n]])
                    if raws:
                        raw_pool.setdefault((flavour, size_mb), []).extend(raws)
                        ratio = med([rw / w for w, (rw, _) in zip(walls, raws)])
                        ratio_tx = med([rs / s for s, (_, rs) in zip(senders, raws)])
                    elif grouped:
                        raws = raw_pool[(flavour, size_mb)]
                        ratio = med([rw for rw, _ in raws]) / med(walls)
                        ratio_tx = med([rs for _, rs in raws]) / med(senders)
                    else:
                        ratio = ratio_tx = None
                    nbytes = info["bytes"]
                    raw_wall = med([rw for rw, _ in raws])
                    row = {
                        "flavour": flavour, "size_mb": size_mb, "payload_bytes": nbytes, "tensors": info["tensors"],
                        "transport": name, "bucket_mb": bucket, "receivers": n, "verify": verify,
                        "repeats": a.repeats,
                        "driver_s": med(walls), "sender_s": med(senders), "receiver_s": med(recvs),
                        "driver_s_all": walls,
                        "bandwidth_MBps": nbytes / MB / med(walls),
                        "raw_driver_s": raw_wall, "raw_sender_s": med([rs for _, rs in raws]),
                        "raw_bandwidth_MBps": nbytes / MB / raw_wall if raw_wall else None,
                        "raw_interleaved": measure_raw,
                        "ratio": ratio,  # bandwidth / raw bandwidth, driver-observed
                        "ratio_sender_side": ratio_tx,  # the same from the sender's send() time
                        "load_1m": os.getloadavg()[0],
                    }  # fmt: skip
                    rows.append(row)
                    print_row(row)
        return rows

    def blocking_trials(self, gen_actor, rx_actor, n_steps: int, reps: int) -> dict:
        """``reps`` pairs: a generation loop alone, then one with a sync to ``rx_actor`` in flight.

        ``rx_actor`` is ``gen_actor`` (the real case: receive on its sync thread, swap in at a step
        boundary) or another actor (control: what the co-located sender and receive cost the machine)."""
        own = rx_actor is gen_actor
        base, withs, extra, swaps, walls, outlasted, blocked, null = [], [], [], [], [], 0, [], []
        self.sync_to(rx_actor, 0)  # warm-up
        self.get([gen_actor.swap_pending.remote(), rx_actor.drop_staged.remote()])
        for rep in range(reps):
            b = self.get(gen_actor.generate.remote(n_steps))
            gen = gen_actor.generate.remote(n_steps)
            w, got = self.sync_to(rx_actor, rep + 1)
            g = self.get(gen)
            late = self.get(gen_actor.swap_pending.remote()) if own else {"swap_s": 0.0, "swaps": 0}
            if not own:
                self.get(rx_actor.drop_staged.remote())
            outlasted += late["swaps"]
            base.append(b["seconds"]), withs.append(g["seconds"] + late["swap_s"])
            extra.append(withs[-1] - b["seconds"]), swaps.append(g["swap_s"] + late["swap_s"]), walls.append(w)
            # The window is on rx_actor's clock; CLOCK_MONOTONIC (perf_counter) is shared by processes on a node.
            idx = window_steps(g["ts"], got["window"], g["swap_steps"])
            blocked.append(excess(g["ts"], idx) + late["swap_s"])
            null.append(excess(b["ts"], idx))  # the same steps of the sync-free loop: the noise floor
        return {"base": base, "withs": withs, "extra": extra, "swaps": swaps, "walls": walls,
                "outlasted": outlasted, "blocked": blocked, "null": null}

    def sync_to(self, rx_actor, version: int) -> tuple[float, dict]:
        start = time.perf_counter()
        push = self.sender.push.remote(version)
        pull = rx_actor.pull.remote([push])
        _, got = self.get([push, pull])
        return time.perf_counter() - start, got

    def run_blocking(self, combos: list[dict]) -> list[dict]:
        """Generation slowdown while a sync is received on the generating actor's background thread.

        Blocked time = time the loop's steps overlapping the receive (plus the swap-in step) took beyond
        the loop's median step; the same steps of a sync-free loop give the noise floor. With a second
        receiver actor, a control ("bystander") sends the same sync to it instead while receiver 0
        generates: the contention of the co-located sender and receive alone, without swap-in.
        """
        a = self.args
        out = []
        gen_actor = self.receivers[0]
        bystander = self.receivers[1] if len(self.receivers) > 1 and not a.no_bystander else None
        step_s = self.get(gen_actor.calibrate.remote(a.gen_dim))
        bucket = 64.0 if 64.0 in a.bucket_mb else a.bucket_mb[0]
        verify = a.verify[0]
        for name in a.transports:
            if name == "collective" and not self.group_possible(1):
                continue
            transport = make_transport(name, bucket_mb=bucket, timeout_s=self.timeout, verify=verify)
            for role, rx in (("receiver", gen_actor), ("bystander", bystander)):
                if rx is None:
                    continue
                self.setup(transport, 1, [rx])
                for flavour, size_mb in self.cases():
                    if flavour not in a.blocking_flavours:
                        continue
                    info = self.set_state(flavour, size_mb)
                    self.get(gen_actor.build_live.remote(flavour, size_mb))
                    prior = [r["driver_s"] for r in combos if r["flavour"] == flavour and r["size_mb"] == size_mb
                             and r["transport"] == name and r["receivers"] == 1 and r["verify"] == verify]
                    est = med(prior) if prior else 0.5
                    target_s = max(a.gen_min_s, 2.0 * est + 0.1)  # the loop must outlast the sync
                    n_steps = max(20, int(target_s / step_s))
                    t = self.blocking_trials(gen_actor, rx, n_steps, a.blocking_repeats)
                    blocked = max(0.0, med(t["blocked"]))
                    row = {
                        "flavour": flavour, "size_mb": size_mb, "payload_bytes": info["bytes"], "transport": name,
                        "bucket_mb": bucket if name == "collective" else None, "receivers": 1, "verify": verify,
                        "role": role,  # receiver: generation in the receiving actor; bystander: control
                        "gen_steps": n_steps, "gen_step_s": step_s,
                        "gen_base_s": med(t["base"]), "gen_with_sync_s": med(t["withs"]),
                        "sync_driver_s": med(t["walls"]), "swap_in_s": med(t["swaps"]),
                        # steps overlapping the receive (+ the swap-in step): time beyond the loop's median step
                        "blocked_s": blocked, "blocked_s_all": t["blocked"],
                        "noise_s": med([abs(x) for x in t["null"]]), "noise_s_all": t["null"],
                        # coarser: whole loop with a sync minus whole loop without (noise grows with loop length)
                        "blocked_total_diff_s": med(t["extra"]), "blocked_total_diff_s_all": t["extra"],
                        "sync_outlasted_loop": t["outlasted"],
                        "slowdown_frac_during_sync": blocked / med(t["walls"]) if med(t["walls"]) else None,
                        "load_1m": os.getloadavg()[0],
                    }  # fmt: skip
                    if a.rollout_s_per_group:
                        row["swap_in_frac_of_rollout"] = row["swap_in_s"] / a.rollout_s_per_group
                        row["blocked_frac_of_rollout"] = blocked / a.rollout_s_per_group
                    out.append(row)
                    print_block_row(row, a.rollout_s_per_group)
        return out

    def diagnostics(self) -> dict:
        """Where time goes, at the largest size of each flavour: digest hashing, bucket packing,
        fresh receive buffers vs preallocated (raw, 1 receiver), object-store (de)serialisation."""
        a = self.args
        d = {}
        for flavour in a.flavours:
            size = max(sizes_for(a, flavour))
            info = self.set_state(flavour, size)
            mb = info["bytes"] / MB
            t = self.get(self.sender.digest_rate.remote(flavour, size))
            d[f"digest_{flavour}_{size:g}MB_s"] = t
            d[f"digest_{flavour}_MBps"] = mb / t
            bucket = max(a.bucket_mb)
            t = self.get(self.sender.pack_time.remote(bucket))
            d[f"pack_{flavour}_{size:g}MB_bucket{bucket:g}_s"] = t
            d[f"pack_{flavour}_MBps"] = mb / t
            if self.group_possible(1) and flavour == a.flavours[-1]:
                self.connect_raw(1)
                self.raw_prepare(1, info["bytes"])
                self.raw_once(1)
                pre, fresh = [], []
                for _ in range(3):
                    pre.append(self.raw_once(1)[0])
                    fresh.append(self.raw_once(1, fresh=True)[0])
                d[f"raw_{size:g}MB_prealloc_s"] = med(pre)
                d[f"raw_{size:g}MB_fresh_recv_buffer_s"] = med(fresh)
        # ray.put/get in the driver process: a state dict of many tensors vs one flat tensor of the same bytes
        for flavour in a.flavours:
            size = max(sizes_for(a, flavour))
            state = make_state(flavour, size, getattr(torch, self.dtype), "cpu")
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
            for label, obj in (("state", state), ("flat", flat)):
                puts, gets = [], []
                for _ in range(3):
                    s = time.perf_counter()
                    ref = ray.put(obj)
                    puts.append(time.perf_counter() - s)
                    s = time.perf_counter()
                    ray.get(ref, timeout=self.timeout)
                    gets.append(time.perf_counter() - s)
                    del ref
                d[f"ray_put_{flavour}_{size:g}MB_{label}_s"] = med(puts)
                d[f"ray_get_{flavour}_{size:g}MB_{label}_s"] = med(gets)
        h = hashlib.sha256()
        buf = os.urandom(64 * MB)
        s = time.perf_counter()
        h.update(buf)
        d["sha256_driver_MBps"] = 64 / (time.perf_counter() - s)
        return d


# --- output ----------------------------------------------------------------------------------------

HEADER = (f"{'flavour':7} {'MB':>6} {'tens':>5} {'transport':12} {'bkt':>4} {'rx':>2} {'vfy':>3} "
          f"{'driver_s':>9} {'send_s':>8} {'recv_s':>8} {'MB/s':>8} {'raw_s':>8} {'ratio':>6} {'ratio_tx':>8}")  # fmt: skip


def _f(x, width: int, prec: int) -> str:
    return f"{x:{width}.{prec}f}" if x is not None else f"{'-':>{width}}"


def print_row(r: dict) -> None:
    bkt = f"{r['bucket_mb']:g}" if r["bucket_mb"] else "-"
    print(f"{r['flavour']:7} {r['payload_bytes'] / MB:6.2f} {r['tensors']:5d} {r['transport']:12} {bkt:>4} {r['receivers']:2d} "
          f"{'on' if r['verify'] else 'off':>3} {r['driver_s']:9.4f} {r['sender_s']:8.4f} {r['receiver_s']:8.4f} "
          f"{r['bandwidth_MBps']:8.1f} {_f(r['raw_driver_s'], 8, 4)} {_f(r['ratio'], 6, 2)} {_f(r['ratio_sender_side'], 8, 2)}",
          flush=True)  # fmt: skip


BLOCK_HEADER = (f"{'flavour':7} {'MB':>6} {'transport':12} {'gen_in':9} {'sync_s':>8} {'gen_base_s':>10} {'gen+sync_s':>10} "
                f"{'noise_s':>8} {'swap_in_s':>9} {'blocked_s':>9} {'slowdown':>8}")  # fmt: skip


def print_block_row(r: dict, rollout_s) -> None:
    line = (f"{r['flavour']:7} {r['payload_bytes'] / MB:6.2f} {r['transport']:12} {r['role']:9} {r['sync_driver_s']:8.4f} "
            f"{r['gen_base_s']:10.4f} {r['gen_with_sync_s']:10.4f} {r['noise_s']:8.4f} {r['swap_in_s']:9.5f} {r['blocked_s']:9.4f} "
            f"{r['slowdown_frac_during_sync']:8.2f}")  # fmt: skip
    if rollout_s:
        line += f"  swap={100 * r['swap_in_frac_of_rollout']:.3f}% blocked={100 * r['blocked_frac_of_rollout']:.3f}% of rollout"
    print(line, flush=True)


def plot(rows: list[dict], blocking: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    with_raw = [r for r in rows if r["ratio"] is not None] or rows
    n = max(r["receivers"] for r in with_raw)  # the most receivers that have a raw baseline
    sel = [r for r in rows if r["receivers"] == n]
    series = sorted({(r["transport"], r["bucket_mb"] or 0) for r in sel})
    colors = {k: f"C{i}" for i, k in enumerate(series)}
    for (t, b) in series:
        for v in (True, False):
            for f, marker in (("lora", "o"), ("full", "s")):
                pts = sorted(((r["payload_bytes"] / MB, r) for r in sel
                              if (r["transport"], r["bucket_mb"] or 0, r["verify"], r["flavour"]) == (t, b, v, f)),
                             key=lambda p: p[0])
                if not pts:
                    continue
                label = f"{t}{f' {b:g}MB' if b else ''} {f} verify={'on' if v else 'off'}"
                kw = dict(color=colors[(t, b)], ls="--" if v else "-", marker=marker, label=label, ms=4)
                xs = [p[0] for p in pts]
                axes[0].plot(xs, [p[1]["driver_s"] for p in pts], **kw)
                axes[1].plot(xs, [p[1]["ratio"] if p[1]["ratio"] is not None else math.nan for p in pts], **kw)
    raw_by_size = {}
    for r in sel:
        if r["raw_driver_s"] is not None:
            raw_by_size.setdefault(round(r["payload_bytes"] / MB, 1), []).append(r["raw_driver_s"])
    xs = sorted(raw_by_size)
    axes[0].plot(xs, [med(raw_by_size[x]) for x in xs], "k:", marker="x", lw=2, label="raw one-tensor broadcast")
    axes[0].set(xscale="log", yscale="log", xlabel="payload MiB", ylabel="driver-observed sync time (s)",
                title=f"sync time, {n} receiver(s) (dashed: verify on)")
    axes[1].axhline(0.8, color="r", lw=1, ls=":", label="target 0.8")
    axes[1].set(xscale="log", xlabel="payload MiB", ylabel="bandwidth / raw broadcast bandwidth",
                title=f"bandwidth ratio vs raw broadcast, {n} receiver(s)")
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].legend(fontsize=6, ncol=2)
    if blocking:
        for i, t in enumerate(sorted({b["transport"] for b in blocking})):
            for f in sorted({b["flavour"] for b in blocking}):
                for role in ("receiver", "bystander"):
                    pts = sorted(((b["payload_bytes"] / MB, b) for b in blocking
                                  if (b["transport"], b["flavour"], b["role"]) == (t, f, role)), key=lambda p: p[0])
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    if role == "bystander":
                        axes[2].plot(xs, [1e3 * p[1]["blocked_s"] for p in pts], color=f"C{i}", ls=":", marker=".",
                                     label=f"control: sync to another actor, {t} {f}")
                        continue
                    axes[2].plot(xs, [1e3 * p[1]["blocked_s"] for p in pts], color=f"C{i}", marker="o",
                                 label=f"blocked {t} {f}")
                    axes[2].fill_between(xs, 0, [1e3 * p[1]["noise_s"] for p in pts], color=f"C{i}", alpha=0.15,
                                         label=f"noise floor {t} {f}")
                    axes[2].plot(xs, [1e3 * p[1]["swap_in_s"] for p in pts], color=f"C{i}", ls="--", marker="x",
                                 label=f"swap-in {t} {f}")
        axes[2].set(xscale="log", xlabel="payload MiB", ylabel="generation time lost (ms)",
                    title="generation blocked by one sync (1 receiver)")
        axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = common.argument_parser(__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", type=floats, default=floats("0.5,4,32,128"), help="payload sizes (MiB)")
    p.add_argument("--lora-max-mb", type=float, default=32.0, help="skip LoRA sizes above this")
    p.add_argument("--flavours", type=strs, default=strs("lora,full"), help="lora (many small A/B) and/or full")
    p.add_argument("--transports", type=strs, default=strs("collective,object_store"))
    p.add_argument("--bucket-mb", type=floats, default=floats("4,64"), help="collective bucket sizes (MiB)")
    p.add_argument("--receivers", type=ints, default=ints("1,2"), help="numbers of receiving actors")
    p.add_argument("--verify", type=lambda s: [x in ("on", "1", "true") for x in strs(s)], default=[True, False],
                   help="digest verification: on,off")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per combination (after one warm-up)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--rollout-s-per-group", type=float, default=None,
                   help="rollout seconds per group of the embedded model: report blocking as a fraction of it")
    p.add_argument("--no-blocking", action="store_true", help="skip the generation-blocking measurement")
    p.add_argument("--blocking-flavours", type=strs, default=strs("lora"), help="flavours for the blocking test")
    p.add_argument("--blocking-repeats", type=int, default=3)
    p.add_argument("--no-bystander", action="store_true", help="skip the control: generate in a non-receiving actor")
    p.add_argument("--gen-dim", type=int, default=256, help="generation step: one dim x dim matmul")
    p.add_argument("--gen-min-s", type=float, default=0.2, help="minimum length of a generation loop")
    p.add_argument("--timeout-s", type=float, default=300.0, help="timeout on every ray.get")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    for t in args.transports:
        if t not in ("collective", "object_store"):
            p.error(f"unknown transport {t}")
    args.resolved_device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    phases = {}
    if __name__ != "__main__":  # imported (benchmarks/ is not a package): ship the actor classes by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=2 * 2**30)
    phases["ray_init_s"] = time.perf_counter() - t_start
    try:
        bench = Bench(args)
        print(f"device={args.resolved_device} dtype={bench.dtype} cpus={os.cpu_count()} torch={torch.__version__} "
              f"ray={ray.__version__} load={load_before}")  # fmt: skip
        print(HEADER)
        t = time.perf_counter()
        rows = bench.run_combos()
        phases["combos_s"] = time.perf_counter() - t
        t = time.perf_counter()
        blocking = []
        if not args.no_blocking:
            print("\ngeneration blocking (1 receiver, receive on the actor's sync thread, swap-in at a step boundary;"
                  "\n  gen_in=bystander: the loop runs in an actor that does NOT receive, the control for machine contention):")
            print(BLOCK_HEADER)
            blocking = bench.run_blocking(rows)
        phases["blocking_s"] = time.perf_counter() - t
        t = time.perf_counter()
        diag = bench.diagnostics()
        phases["diagnostics_s"] = time.perf_counter() - t
    finally:
        ray.shutdown()
    elapsed = time.perf_counter() - t_start
    load_after = os.getloadavg()

    print("\ndiagnostics:", json.dumps({k: round(v, 4) for k, v in diag.items()}))
    summary = summarize(rows, blocking, args)
    for line in summary["lines"]:
        print(line)
    print(f"total {elapsed:.1f}s ({', '.join(f'{k} {v:.1f}' for k, v in phases.items())}), "
          f"load average before {load_before} after {load_after}")

    os.makedirs(args.out, exist_ok=True)
    result = {
        "machine": {
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "torch": torch.__version__, "ray": ray.__version__, "device": args.resolved_device, "dtype": bench.dtype,
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average_before": load_before, "load_average_after": load_after,
        },
        "args": {k: v for k, v in vars(args).items()},
        "elapsed_s": elapsed,
        "phases": phases,
        "rows": rows,
        "blocking": blocking,
        "diagnostics": diag,
        "targets": summary["targets"],
    }  # fmt: skip
    with open(os.path.join(args.out, "weight_sync.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, blocking, os.path.join(args.out, "weight_sync.png"))
    print(f"wrote {os.path.join(args.out, 'weight_sync.json')} and weight_sync.png")
    return 0


def summarize(rows, blocking, args) -> dict:
    lines, targets = ["", "targets:"], {}
    coll = [r for r in rows if r["transport"] == "collective"]
    for flavour in args.flavours:
        sel = [r for r in coll if r["flavour"] == flavour]
        if not sel:
            continue
        big = max(r["size_mb"] for r in sel)
        best = {}
        for r in sel:
            if r["size_mb"] == big:
                k = (r["receivers"], r["verify"])
                if k not in best or r["ratio"] > best[k]["ratio"]:
                    best[k] = r
        for (n, v), r in sorted(best.items()):
            ok = r["ratio"] >= 0.8
            targets[f"ratio_collective_{flavour}_{big:g}MB_rx{n}_verify_{'on' if v else 'off'}"] = {
                "value": r["ratio"], "target": ">= 0.8", "met": ok, "bucket_mb": r["bucket_mb"]}
            lines.append(f"  bandwidth ratio collective {flavour} {big:g}MB rx={n} verify={'on' if v else 'off'} "
                         f"(best bucket {r['bucket_mb']:g}MB): {r['ratio']:.3f} {'OK' if ok else 'MISSED'} (target >= 0.8)")  # fmt: skip
    for b in blocking:
        if b["flavour"] != "lora" or b["role"] != "receiver":
            continue
        key = f"lora_blocking_{b['transport']}_{b['size_mb']:g}MB"
        if args.rollout_s_per_group:
            frac = b["blocked_frac_of_rollout"]
            targets[key] = {"value": frac, "target": "< 0.01", "met": frac < 0.01, "swap_in_frac": b["swap_in_frac_of_rollout"]}
            lines.append(f"  LoRA {b['size_mb']:g}MB {b['transport']}: blocked {100 * frac:.3f}% of rollout "
                         f"(swap-in {100 * b['swap_in_frac_of_rollout']:.4f}%) {'OK' if frac < 0.01 else 'MISSED'} (target < 1%)")
        else:
            targets[key] = {"blocked_s": b["blocked_s"], "swap_in_s": b["swap_in_s"], "target": "< 1% of rollout time",
                            "met": None, "min_rollout_s_per_group": 100 * b["blocked_s"]}
            lines.append(f"  LoRA {b['size_mb']:g}MB {b['transport']}: blocked {b['blocked_s']:.4f}s "
                         f"(noise floor {b['noise_s']:.4f}s), swap-in {b['swap_in_s']:.5f}s: < 1% needs a rollout of "
                         f"> {100 * b['blocked_s']:.2f}s/group (swap-in alone: > {100 * b['swap_in_s']:.3f}s)")
    return {"lines": lines, "targets": targets}


if __name__ == "__main__":
    sys.exit(main())
