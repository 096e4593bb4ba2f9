"""Trainer-side failure cases, each a test that failed before its fix: a Wan2.2 expert with no rows
in an update stays where it is (no AdamW momentum or weight decay), also across data-parallel ranks
whose shards differ."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_flowgrpo import seqpar
from async_flowgrpo.learner import Learner
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir
from async_flowgrpo.policy import DiffusionPolicy

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4  # the A14B twin: steps 0-1 by transformer (high noise), 2-3 by transformer_2 (low noise)
PROMPTS = ["a red circle moving left", "a blue square moving right"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Wan2.2: an expert that had no rows does not move -----------------------------------------------

def test_an_expert_without_rows_is_not_stepped(tmp_path):
    policy = DiffusionPolicy(make_tiny_wan_dir(str(tmp_path), "wan22_a14b"), lora_rank=4, lora_alpha=8)
    learner = Learner(policy, micro_batch_size=2, clip_range=1e-2, lr=1e-2, weight_decay=0.1)
    common = dict(num_steps=STEPS, guidance_scale=4.0, noise_level=0.7, sde_type="sde")
    both = policy.generate(PROMPTS, 2, window_size=STEPS - 1, seed=0, **common)  # steps 0-2: both experts
    high = policy.generate(PROMPTS, 2, window_size=2, window_range=(0, 2), seed=1, **common)  # steps 0-1 only
    for g in both + high:
        g.advantages = torch.tensor([-1.0, 1.0])
    assert all(float(s) * 1000 >= policy.adapter.boundary for g in high for s in g.sigmas[:-1])
    learner.train_step(both, version=0)  # transformer_2's adapters now have AdamW moments
    low_params = [p for n, p in zip(policy.trainable_state(), learner.params) if n.startswith("transformer_2.")]
    low_steps = [learner.optimizer.state[p]["step"].clone() for p in low_params]
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = learner.train_step(high, version=1)
    assert metrics["samples/trained"] == 4
    after = policy.trainable_state()
    moved = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    assert moved == {"transformer"}  # before the fix also transformer_2 (momentum and weight decay)
    assert [learner.optimizer.state[p]["step"] for p in low_params] == low_steps  # not even a counted step


def reduce_rank(rank, port, out_path):
    """Rank 0 reached parameters a and c, rank 1 only c; nobody reached b."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    if rank == 0:
        a.grad = torch.full((3,), 2.0)
    c.grad = torch.full((3,), float(rank + 1))
    seqpar.all_reduce_grads([a, b, c], data_parallel=2)
    torch.save({"a": a.grad, "b": b.grad, "c": c.grad}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_ranks_agree_which_parameters_no_backward_reached(tmp_path):
    """The data-parallel reduce: a parameter some rank reached gets the mean on every rank (zeros
    from the others), one that no rank reached keeps no gradient on any (so no rank steps it)."""
    out_path = str(tmp_path / "grads")
    mp.start_processes(reduce_rank, args=(free_port(), out_path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(f"{out_path}.{rank}")
        assert torch.equal(got["a"], torch.full((3,), 1.0)) and torch.equal(got["c"], torch.full((3,), 1.5))
        assert got["b"] is None
