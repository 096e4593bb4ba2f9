"""Checkpoint engine: bit-exact weight sync from one sender to N receivers, over both transports."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import sys
import threading

import pytest
import ray
import torch

from async_flowgrpo.sync import DigestMismatchError, Transport, digest, make_transport
from async_flowgrpo.sync.buckets import ALIGN, pack_bucket, plan, unpack

TIMEOUT = 60
SMALL_BUCKET_MB = 0.01  # ~10 KB: the "full" state spans many buckets and has one oversized tensor


def make_state(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors with mixed dtypes and odd shapes, in a fixed order."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dt=torch.float32: torch.randn(s, generator=g).to(dt)  # noqa: E731
    state = {
        "blk0.attn.to_q.lora_A.weight": r(3, 17),
        "blk0.attn.to_q.lora_B.weight": r(33, 3, dt=torch.bfloat16),
        "blk0.attn.to_k.lora_A.weight": r(5, 7, dt=torch.float16),
        "blk0.counts": torch.randint(-(2**40), 2**40, (3, 5), generator=g),
        "blk0.scale": r(dt=torch.float32),  # 0-dim
        "blk0.empty": torch.empty(0, 4),
        "blk0.mask": torch.rand(9, generator=g) > 0.5,
    }
    if kind == "full":  # ~200 KB
        state.update({
            "blk1.proj.weight": r(60, 61),  # ~14.6 KB: alone exceeds one bucket
            "blk1.proj.bias": r(61, dt=torch.bfloat16),
            "blk2.ff.weight": r(193, 257, dt=torch.bfloat16),  # ~99 KB
            "blk2.norm.weight": r(1023, dt=torch.float16),
            "blk3.big": r(11, 13, 17, 7),  # ~68 KB
        })
    return state


def assert_same(expected: dict, got: dict) -> None:
    assert list(got) == list(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
    assert digest(got) == digest(expected)


# --- no Ray -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 10_000, 1 << 30])
def test_pack_unpack_roundtrip(bucket_bytes):
    state = make_state("full", seed=0)
    layout = plan(state, bucket_bytes)
    tensors = list(state.values())
    buffers = []
    for k, size in enumerate(layout.bucket_sizes):
        buf = torch.full((size + 100,), 0xAB, dtype=torch.uint8)  # garbage everywhere first
        pack_bucket(tensors, layout, k, buf)
        buffers.append(buf.clone())
    assert_same(state, unpack(buffers, layout))
    assert all(s.offset % ALIGN == 0 for s in layout.tensors)
    for k, size in enumerate(layout.bucket_sizes):  # only an oversized tensor may overflow a bucket
        assert size <= bucket_bytes or len([s for s in layout.tensors if s.bucket == k]) == 1
    if bucket_bytes == 1 << 30:
        assert len(layout.bucket_sizes) == 1


def test_layout_puts_oversized_tensor_alone():
    state = make_state("full", seed=0)
    layout = plan(state, 10_000)
    big = next(s for s in layout.tensors if s.name == "blk2.ff.weight")
    assert [s.name for s in layout.tensors if s.bucket == big.bucket] == ["blk2.ff.weight"]
    assert layout.bucket_sizes[big.bucket] == big.nbytes
    assert layout.nbytes == sum(t.numel() * t.element_size() for t in state.values())


def test_digest_sees_every_bit_name_and_order():
    a = make_state("lora", seed=0)
    assert digest(a) == digest({k: v.clone() for k, v in a.items()})
    flipped = {k: v.clone() for k, v in a.items()}
    flipped["blk0.attn.to_q.lora_B.weight"].view(torch.int16).view(-1)[5] ^= 1  # one bf16 mantissa bit
    assert digest(flipped) != digest(a)
    renamed = {("other" if k == "blk0.scale" else k): v for k, v in a.items()}  # same bytes, same order
    assert digest(renamed) != digest(a)
    reshaped = {k: (v.reshape(-1) if k == "blk0.counts" else v) for k, v in a.items()}
    assert digest(reshaped) != digest(a)
    assert digest(dict(reversed(list(a.items())))) != digest(a)
    assert digest({"x": torch.tensor([0.0])}) != digest({"x": torch.tensor([-0.0])})  # torch.equal can't tell


def test_make_transport_validates_name():
    assert make_transport().name == "collective"
    assert make_transport("object_store").name == "object_store"
    with pytest.raises(ValueError, match="sync.transport"):
        make_transport("carrier_pigeon")


def test_sync_metadata_is_json_and_round_trips():
    from async_flowgrpo.sync.engine import decode_meta, encode_meta

    layout = plan(make_state("full", 0), 10_000)
    raw = encode_meta(7, "ab" * 32, layout)
    assert raw.startswith(b"{")  # JSON on the wire, never pickle
    assert decode_meta(raw) == (7, "ab" * 32, layout)


@pytest.mark.parametrize("raw", [
    b"\x80\x04\x95...",  # a pickle
    b'{"version": 1, "digest": "", "tensors": [["w", "os.system", [2], 8, 0, 0]], "bucket_sizes": [8]}',
    b'{"version": 1}',
    b"\xff\xfe",
])
def test_malformed_sync_metadata_is_refused(raw):
    from async_flowgrpo.sync.engine import decode_meta

    with pytest.raises(ValueError, match="malformed metadata"):
        decode_meta(raw)


def test_rendezvous_listens_only_where_asked():
    """new_address(host=127.0.0.1): the store's socket is bound to loopback, not every interface."""
    import socket

    from async_flowgrpo.sync import WeightSyncGroup, new_address

    address = new_address(host="127.0.0.1")
    group = WeightSyncGroup(address, 0, 1, "cpu", timeout_s=30)
    try:
        assert address.host == "127.0.0.1"
        listening = open("/proc/net/tcp").read().splitlines()[1:]
        port_hex = f"{address.port:04X}"
        local = [line.split()[1] for line in listening if line.split()[1].endswith(":" + port_hex) and line.split()[3] == "0A"]
        assert local == [f"0100007F:{port_hex}"], local  # 127.0.0.1 only
        with socket.create_connection(("127.0.0.1", address.port), timeout=5):
            pass
    finally:
        group.destroy()


def test_trainers_rendezvous_listens_only_where_asked():
    """The trainers' data-parallel store (rendezvous_store) is bound to loopback too, and a group
    forms over it."""
    import torch.distributed as dist

    from async_flowgrpo.sync import free_port, rendezvous_store

    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 0, 1, timeout_s=30)
    listening = open("/proc/net/tcp").read().splitlines()[1:]
    local = [line.split()[1] for line in listening if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"]
    assert local == [f"0100007F:{port:04X}"], local
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


# --- Ray actors ---------------------------------------------------------------------------------


@ray.remote(num_cpus=0.25)
class SenderActor:
    def setup(self, transport: Transport, kind: str, seed: int):
        if getattr(self, "sender", None) is not None:
            self.sender.close()
        self.sender = transport.sender()
        self.set_state(kind, seed)

    def set_state(self, kind: str, seed: int):
        self.state = make_state(kind, seed)

    def get_state(self):
        return self.state

    def address(self):
        return self.sender.new_address()

    def connect(self, address, world_size):
        self.sender.connect(address, world_size)

    def push(self, version):
        return self.sender.send(self.state, version)


@ray.remote(num_cpus=0.25)
class ReceiverActor:
    def setup(self, transport: Transport):
        if getattr(self, "receiver", None) is not None:
            self.receiver.close()
        self.receiver = transport.receiver()
        self.state, self.version = None, None

    def connect(self, address, rank, world_size):
        self.receiver.connect(address, rank, world_size)

    def pull(self, handle):
        # Receive on a background thread, as a rollout actor that keeps generating would.
        box = {}

        def run():
            try:
                box["result"] = self.receiver.receive(handle[0])
            except BaseException as e:  # re-raised on the actor's main thread
                box["error"] = e

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        self.state, self.version = box["result"].state, box["result"].version
        return box["result"].stats

    def get(self):
        return self.state, self.version

    def corrupt_next(self, name: str):
        def flip(staged):  # the whole state (object store) or one bucket's tensors (collective)
            if name in staged:
                staged[name].reshape(-1).view(torch.uint8)[0] ^= 0x10

        self.receiver.stage_hook = flip


@pytest.fixture(scope="module")
def actors(ray_cluster):
    # Workers cannot import this test module: ship the actor classes (and helpers) by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = {"sender": SenderActor.remote(), "receivers": [ReceiverActor.remote() for _ in range(2)]}
    yield pool
    for actor in (pool["sender"], *pool["receivers"]):
        ray.kill(actor)


def setup(pool, transport, kind, n, seed=0):
    sender, receivers = pool["sender"], pool["receivers"][:n]
    ray.get([sender.setup.remote(transport, kind, seed), *[r.setup.remote(transport) for r in receivers]], timeout=TIMEOUT)
    connect(sender, receivers)
    return sender, receivers


def connect(sender, receivers):
    """(Re)build the group: every member joins concurrently."""
    address = ray.get(sender.address.remote(), timeout=TIMEOUT)
    n = len(receivers) + 1
    ray.get([sender.connect.remote(address, n), *[r.connect.remote(address, i + 1, n) for i, r in enumerate(receivers)]],
            timeout=TIMEOUT)


def sync(sender, receivers, version):
    """The driver pattern: launch the push and every pull before waiting on any of them."""
    push = sender.push.remote(version)
    pulls = [r.pull.remote([push]) for r in receivers]
    sent, *received = ray.get([push, *pulls], timeout=TIMEOUT)
    return sent, received


def check(sender, receivers, version, sent, received):
    expected = ray.get(sender.get_state.remote(), timeout=TIMEOUT)
    want = digest(expected)
    assert sent.stats.digest == want and sent.stats.version == version
    for r, stats in zip(receivers, received):
        got, got_version = ray.get(r.get.remote(), timeout=TIMEOUT)
        assert got_version == version and stats.version == version
        assert stats.digest == want and stats.bytes == sent.stats.bytes
        assert_same(expected, got)


@pytest.mark.slow  # starts Ray (the actors fixture)
@pytest.mark.parametrize("name", ["collective", "object_store"])
@pytest.mark.parametrize("kind,n", [("lora", 1), ("full", 2)])
def test_sync_is_bit_exact_over_consecutive_versions(actors, name, kind, n):
    transport = make_transport(name, bucket_mb=SMALL_BUCKET_MB if kind == "full" else 1.0, timeout_s=TIMEOUT)
    sender, receivers = setup(actors, transport, kind, n, seed=1)
    sent, received = sync(sender, receivers, version=1)
    check(sender, receivers, 1, sent, received)
    if name == "collective":
        assert sent.stats.num_buckets == len(plan(make_state(kind, 1), int(transport.bucket_mb * 2**20)).bucket_sizes)
        assert (sent.stats.num_buckets > 3) == (kind == "full")

    ray.get(sender.set_state.remote(kind, 2), timeout=TIMEOUT)  # a training step later
    sent, received = sync(sender, receivers, version=2)
    check(sender, receivers, 2, sent, received)
    assert sent.stats.digest != digest(make_state(kind, 1))


@pytest.mark.slow  # starts Ray (the actors fixture)
@pytest.mark.parametrize("name", ["collective", "object_store"])
def test_digest_mismatch_is_detected(actors, name):
    sender, receivers = setup(actors, make_transport(name, bucket_mb=SMALL_BUCKET_MB, timeout_s=TIMEOUT), "full", 2)
    last = list(make_state("full", 0))[-1]  # in the last bucket: every bucket must be checked
    ray.get(receivers[1].corrupt_next.remote(last), timeout=TIMEOUT)
    push = sender.push.remote(7)
    good, bad = [r.pull.remote([push]) for r in receivers]
    ray.get([push, good], timeout=TIMEOUT)  # the untouched receiver is fine
    with pytest.raises(DigestMismatchError, match="digest mismatch"):
        ray.get(bad, timeout=TIMEOUT)


@pytest.mark.slow  # starts Ray (the actors fixture)
def test_a_receiver_that_does_not_verify_still_reads_the_senders_digest(actors):
    """Verification is each side's own choice: a receiver that skips the check still reports the
    sender's digest, and the wire stays in step over consecutive syncs."""
    sender, receivers = actors["sender"], actors["receivers"][:2]
    verified = make_transport("collective", bucket_mb=SMALL_BUCKET_MB, timeout_s=TIMEOUT, verify=True)
    unverified = make_transport("collective", bucket_mb=SMALL_BUCKET_MB, timeout_s=TIMEOUT, verify=False)
    ray.get([sender.setup.remote(verified, "full", 5), receivers[0].setup.remote(verified),
             receivers[1].setup.remote(unverified)], timeout=TIMEOUT)
    connect(sender, receivers)
    for version in (1, 2):
        check(sender, receivers, version, *sync(sender, receivers, version))


@pytest.mark.slow  # starts Ray (the actors fixture)
def test_rebuild_group_after_replacing_a_receiver(actors):
    transport = make_transport("collective", bucket_mb=SMALL_BUCKET_MB, timeout_s=TIMEOUT)
    sender, receivers = setup(actors, transport, "full", 2, seed=3)
    check(sender, receivers, 1, *sync(sender, receivers, 1))

    ray.kill(receivers[1])  # a rollout actor dies...
    replacement = ReceiverActor.remote()  # ...and is replaced; every member rejoins a new group
    actors["receivers"][1] = receivers[1] = replacement
    ray.get(replacement.setup.remote(transport), timeout=TIMEOUT)
    connect(sender, receivers)

    ray.get(sender.set_state.remote("full", 4), timeout=TIMEOUT)
    check(sender, receivers, 2, *sync(sender, receivers, 2))
