"""Trainer-side defects, each a test that failed before its fix: a Wan2.2 expert with no rows in an
update stays where it is (no AdamW momentum or weight decay), also across data-parallel ranks whose
shards differ; the trainers agree on the fully_async groups they keep when one rank's fetch loses
one; a sequence-parallel degree that cannot split a sample's tokens is a config error (exit 2); a
sequence group scores each evaluation prompt once. The spawned ones run the trainer actor's class
outside Ray, over gloo, with stand-ins for the learner, the policy and the reward."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from unittest import mock

from async_flowgrpo import seqpar
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
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


@pytest.mark.slow  # 2 spawned processes (the module's)
def test_ranks_agree_which_parameters_no_backward_reached(spawned):
    """The data-parallel reduce: a parameter some rank reached gets the mean on every rank (zeros
    from the others), one that no rank reached keeps no gradient on any (so no rank steps it)."""
    for rank in range(2):
        got = spawned["reduce"][rank]
        assert torch.equal(got["a"], torch.full((3,), 1.0)) and torch.equal(got["c"], torch.full((3,), 1.5))
        assert got["b"] is None


# -- fully_async: a group lost on one rank only ------------------------------------------------------

class EvalPolicy:
    """Stands in for the policy in an evaluation: each prompt's images are a function of its seed and
    place in the chunk, and every denoising step polls version_fn as the real generate does."""

    device = torch.device("cpu")

    def generate(self, prompts, n, *, seed, num_steps, version_fn=None, **kwargs):
        for _ in range(num_steps):
            if version_fn is not None:
                version_fn()
        return [mock.Mock(size=n, images=torch.full((n, 4, 4, 3), (seed + i) % 251, dtype=torch.uint8))
                for i in range(len(prompts))]

    def transformers(self):
        return []


class CountingReward:
    """Stands in for CombinedReward: appends how many images it scored to SCORED."""

    def __init__(self, weights, options):
        pass

    def __call__(self, images, texts, metadata):
        SCORED.append(len(images))
        value = images[:, 0, 0, 0].float()
        return value / 251, {"correct": (value % 2 == 0).float()}


SCORED: list[int] = []


class RecordingLearner:
    """Stands in for the Learner: records which groups each rank would train (no model)."""

    def __init__(self):
        self.trained = []
        self.policy = EvalPolicy()

    def train_step(self, groups, version):
        self.trained.append([g.prompt_index for g in groups])
        return {"samples/trained": float(sum(g.size for g in groups))}

    def state_dict(self):
        return {}


def fetch_rank(rank, port, model_dir, output_dir, sequence_parallel, shards, lost_on, out_path):
    """A trainer rank (the actor's class, outside Ray) whose object fetches fail for the group
    indices in lost_on[rank]: the rollout actor that held them died between two ranks' fetches."""
    torch.set_num_threads(1)
    import ray

    from async_flowgrpo.actors import trainer as trainer_module
    from async_flowgrpo.config import load_config
    from async_flowgrpo.types import Group

    def fake_get(refs, timeout=None):
        if isinstance(refs, list):
            return [fake_get(r) for r in refs]
        if refs in lost_on[rank]:
            raise ray.exceptions.ObjectLostError(f"{refs:040x}", None, "")
        return mock.Mock(spec=Group, prompt_index=refs, size=2, prompt="a prompt", images=torch.zeros(2, 8, 8, 3),
                         metadata={})

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


# (sequence_parallel, each rank's shard of group indices): group 1 is lost on rank 1 only
FETCH_CASES = {"sequence group": (2, [[0, 1], [0, 1]]), "data parallel": (1, [[0], [1]])}
LOST_ON = [set(), {1}]


@pytest.mark.slow  # 2 spawned processes (the module's)
@pytest.mark.parametrize("case, expected", [("sequence group", ([[0]], [[0]], 2, 2)), ("data parallel", ([], [], 2, 2))],
                         ids=list(FETCH_CASES))
def test_ranks_agree_on_the_groups_they_keep(spawned, case, expected):
    """Sequence parallel: both ranks of a group get groups 0 and 1, and group 1 is lost on rank 1 only:
    both must train group 0 alone (different rows would mismatch the all-to-alls). Data parallel:
    rank 1 loses its only group; a rank with nothing to train cannot join the gradient all-reduce,
    so neither trains (the other would wait in it) and rank 0's group counts as lost too."""
    got = spawned[case]
    assert (got[0]["trained"], got[1]["trained"], got[0]["lost"], got[1]["lost"]) == expected


# -- sequence parallelism: a token count the degree does not divide ---------------------------------

def test_a_token_count_the_sequence_group_cannot_split_is_a_config_error(tmp_path, capsys):
    """3 ranks (the twin has 3 heads) and 3 frames: 2 latent frames x 8 x 8 patches = 128 tokens,
    which Ulysses cannot split in 3 (diffusers asserts it at the trainers' first forward pass)."""
    from async_flowgrpo.config import ConfigError, config_or_exit, load_config

    model_dir = make_tiny_wan_dir(str(tmp_path / "wan"), heads=3)
    base = [f"model.path={model_dir}", "model.family=wan", "model.lora_rank=4",
            "reward.weights={frames_jpeg_compressibility: 1.0}", "reward.options={}", "trainer.num_workers=3",
            "trainer.sequence_parallel=3", "rollout.groups_per_step=3"]
    load_config("sync", base)  # 5 frames: 3 x 64 = 192 tokens, a multiple of 3
    with pytest.raises(ConfigError, match=r"^trainer.sequence_parallel: .*128 image tokens.* 3 ranks") as e:
        load_config("sync", [*base, "rollout.num_frames=3"])
    assert "\n" not in str(e.value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("sync", [*base, "rollout.num_frames=3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("config error: trainer.sequence_parallel")


# -- sequence parallelism: each evaluation prompt scored once ----------------------------------------

def evaluate_rank(rank, port, model_dir, output_dir, out_path):
    """A trainer rank of a 2-rank sequence group (the actor's class, outside Ray) evaluating with a
    stand-in policy and reward: what it returns and how many images it scored."""
    torch.set_num_threads(1)
    from async_flowgrpo import evaluation
    from async_flowgrpo.actors import trainer as trainer_module

    with mock.patch.object(trainer_module, "build_learner", lambda cfg, grad_all_reduce: RecordingLearner()), \
            mock.patch.object(evaluation, "CombinedReward", CountingReward):
        trainer = trainer_module.TrainerActor.__ray_metadata__.modified_class(
            sequence_config(model_dir, output_dir), rank, 2, ("127.0.0.1", port), mock.Mock())
        result = trainer.evaluate(step=0)
    torch.save({"result": result, "scored": sum(SCORED)}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def sequence_config(model_dir, output_dir):
    from async_flowgrpo.config import load_config

    return load_config("fully_async", [
        f"model.path={model_dir}", "model.family=wan", "model.lora_rank=4", "reward.weights={frames_jpeg_compressibility: 1.0}",
        "reward.options={}", "trainer.num_workers=2", "trainer.sequence_parallel=2", "rollout.group_size=2",
        "rollout.groups_per_step=2", f"trainer.output_dir={output_dir}", "logging.actor_output=console", "eval.num_steps=2"])


@pytest.mark.slow  # 2 spawned processes (the module's)
def test_a_sequence_group_scores_each_evaluation_prompt_once(spawned):
    """Both ranks of a sequence group take part in every forward pass, but a prompt is scored on one
    of them (a model reward or a remote judge would otherwise get every prompt twice), and rank 0's
    result is the one-process evaluation's."""
    from async_flowgrpo import evaluation
    from async_flowgrpo.prompts import load_prompts

    got = spawned["evaluate"]
    cfg = sequence_config(spawned["model_dir"], spawned["evaluate_run"])
    samples = len(load_prompts(cfg.eval.prompts)) * cfg.eval.samples_per_prompt
    assert got[0]["scored"] + got[1]["scored"] == samples  # before: 2 x samples, every rank scored every prompt
    assert got[0]["scored"] > 0 and got[1]["scored"] > 0 and got[1]["result"] is None
    with mock.patch.object(evaluation, "CombinedReward", CountingReward):
        alone = evaluation.evaluate_policy(EvalPolicy(), cfg)
    metrics = got[0]["result"]["metrics"]
    assert {k: v for k, v in metrics.items() if k != "eval/time_s"} == \
        {k: v for k, v in alone["metrics"].items() if k != "eval/time_s"}
    assert torch.equal(got[0]["result"]["images"], alone["images"]) and got[0]["result"]["captions"] == alone["captions"]


# -- the spawned ranks, once for the module ----------------------------------------------------------

def scenario_rank(rank, ports, model_dir, root):
    """One process's part in every two-rank scenario above, one after another, each over its own
    process group (a spawned process's start, importing torch and diffusers, costs several seconds
    of CPU: once for the module instead of once per test)."""
    reduce_rank(rank, ports[0], f"{root}/reduce")
    for i, (case, (sequence_parallel, shards)) in enumerate(FETCH_CASES.items(), start=1):
        fetch_rank(rank, ports[i], model_dir, f"{root}/run_{case.replace(' ', '_')}", sequence_parallel, shards,
                   LOST_ON, f"{root}/{case}")
    evaluate_rank(rank, ports[len(FETCH_CASES) + 1], model_dir, f"{root}/run_evaluate", f"{root}/evaluate")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """{scenario: [rank 0's result, rank 1's]} from one pair of spawned ranks (scenario_rank)."""
    root = tmp_path_factory.mktemp("spawned")
    model_dir = make_tiny_wan_dir(str(root / "wan"))
    ports = [free_port() for _ in range(len(FETCH_CASES) + 2)]
    mp.start_processes(scenario_rank, args=(ports, model_dir, str(root)), nprocs=2, join=True, start_method="spawn")
    results = {name: [torch.load(f"{root}/{name}.{rank}", weights_only=False) for rank in range(2)]
               for name in ("reduce", *FETCH_CASES, "evaluate")}
    return {**results, "model_dir": model_dir, "evaluate_run": f"{root}/run_evaluate"}
