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


@pytest.mark.slow  # 2 spawned processes
def test_ranks_agree_which_parameters_no_backward_reached(tmp_path):
    """The data-parallel reduce: a parameter some rank reached gets the mean on every rank (zeros
    from the others), one that no rank reached keeps no gradient on any (so no rank steps it)."""
    out_path = str(tmp_path / "grads")
    mp.start_processes(reduce_rank, args=(free_port(), out_path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(f"{out_path}.{rank}")
        assert torch.equal(got["a"], torch.full((3,), 1.0)) and torch.equal(got["c"], torch.full((3,), 1.5))
        assert got["b"] is None


# -- fully_async: a group lost on one rank only ------------------------------------------------------

class RecordingLearner:
    """Stands in for the Learner: records which groups each rank would train (no model)."""

    def __init__(self):
        self.trained = []
        self.policy = type("Policy", (), {"device": torch.device("cpu")})()

    def train_step(self, groups, version):
        self.trained.append([g.prompt_index for g in groups])
        return {"samples/trained": float(sum(g.size for g in groups))}

    def state_dict(self):
        return {}


def fetch_rank(rank, port, model_dir, output_dir, sequence_parallel, shards, lost_on, out_path):
    """A trainer rank (the actor's class, outside Ray) whose object fetches fail for the group
    indices in lost_on[rank]: the rollout actor that held them died between two ranks' fetches."""
    torch.set_num_threads(1)
    from unittest import mock

    import ray

    from async_flowgrpo.actors import trainer as trainer_module
    from async_flowgrpo.config import load_config
    from async_flowgrpo.types import Group

    def fake_get(refs, timeout=None):
        if isinstance(refs, list):
            return [fake_get(r) for r in refs]
        if refs in lost_on[rank]:
            raise ray.exceptions.ObjectLostError(f"{refs:040x}", None, "")
        return mock.Mock(spec=Group, prompt_index=refs, size=2, prompt="a prompt", images=torch.zeros(2, 8, 8, 3))

    cfg = load_config("fully_async", [
        f"model.path={model_dir}", "model.family=wan", "model.lora_rank=4", "reward.weights={frames_jpeg_compressibility: 1.0}",
        "reward.options={}", "trainer.num_workers=2", f"trainer.sequence_parallel={sequence_parallel}",
        "rollout.group_size=2", "rollout.groups_per_step=2", f"trainer.output_dir={output_dir}", "logging.actor_output=console"])
    actor_class = trainer_module.TrainerActor.__ray_metadata__.modified_class
    with mock.patch.object(trainer_module, "build_learner", lambda cfg, grad_all_reduce: RecordingLearner()), \
            mock.patch.object(ray, "get", fake_get):
        trainer = actor_class(cfg, rank, 2, ("127.0.0.1", port), mock.Mock())
        metrics = trainer.train_step([([index], torch.zeros(2)) for index in shards[rank]], version=0)
    torch.save({"trained": trainer.learner.trained, "lost": metrics["samples/lost"]}, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned processes per case
@pytest.mark.parametrize("case", ["sequence group", "data parallel"])
def test_ranks_agree_on_the_groups_they_keep(tmp_path, case):
    """Sequence parallel: both ranks of a group get groups 0 and 1, and group 1 is lost on rank 1 only:
    both must train group 0 alone (different rows would mismatch the all-to-alls). Data parallel:
    rank 1 loses its only group; a rank with nothing to train cannot join the gradient all-reduce,
    so neither trains (the other would wait in it) and rank 0's group counts as lost too."""
    model_dir = make_tiny_wan_dir(str(tmp_path / "wan"))
    sequence_parallel, shards, expected = {
        "sequence group": (2, [[0, 1], [0, 1]], ([[0]], [[0]], 2, 2)),
        "data parallel": (1, [[0], [1]], ([], [], 2, 2)),
    }[case]
    lost_on = [set(), {1}]
    out_path = str(tmp_path / "kept")
    mp.start_processes(fetch_rank, args=(free_port(), model_dir, str(tmp_path / "run"), sequence_parallel, shards,
                                         lost_on, out_path), nprocs=2, join=True, start_method="spawn")
    got = [torch.load(f"{out_path}.{rank}", weights_only=False) for rank in range(2)]
    assert (got[0]["trained"], got[1]["trained"], got[0]["lost"], got[1]["lost"]) == expected
