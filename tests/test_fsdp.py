"""FSDP2 trainers without Ray: 2 sharded processes (gloo) against one unsharded Learner.

The Ray pipeline test covers full fine-tuning end to end; this one covers LoRA (frozen base
weights and trainable adapters in the same FSDP units), the split evaluation and the optimizer state.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_flowgrpo import fsdp
from async_flowgrpo.config import load_config
from async_flowgrpo.evaluation import evaluate_policy
from async_flowgrpo.prompts import resolve_prompt_path
from async_flowgrpo.builders import build_learner


def lora_config(model_dir, *extra):
    return load_config("sync", [f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
                                "trainer.lr=1e-2", "rollout.sde_window_range=null", "eval.samples_per_prompt=1",
                                "eval.num_steps=2", *extra])


def make_groups(cfg):
    policy = build_learner(cfg).policy
    groups = policy.generate(["a red circle", "a blue square"], 2, num_steps=4, guidance_scale=4.5, noise_level=0.7,
                             sde_type="sde", window_size=2, seed=0)
    for g in groups:
        g.advantages = torch.tensor([1.0, -1.0])
    return groups


def sharded_rank(rank, world_size, port, model_dir, eval_prompts, groups_path, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)

    cfg = lora_config(model_dir, "trainer.fsdp=true", f"eval.prompts={eval_prompts}")
    learner = build_learner(cfg)
    assert learner._sharded  # its parameters are DTensors (base.is_dtensor): no whole gradient on a rank
    transformer = learner.policy.adapter.transformer
    generate, calls = learner.policy.generate, []
    learner.policy.generate = lambda prompts, *a, **k: calls.append(len(prompts)) or generate(prompts, *a, **k)
    result = evaluate_policy(learner.policy, cfg, rank, world_size)  # forward-only, split over the ranks
    fsdp.reshard(transformer)
    groups = torch.load(groups_path, weights_only=False)
    learner.train_step([groups[rank]], version=0)  # each rank its half of the batch
    weights = fsdp.gather(learner.policy.trainable_state().items(), keep=rank == 0)
    optimizer = fsdp.optimizer_state(transformer, learner.optimizer)
    torch.save({"weights": weights, "optimizer": optimizer, "eval": result, "calls": calls}, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # spawns two trainer processes
def test_sharded_lora_trainers_match_an_unsharded_learner(tiny_model_dir, tmp_path):
    # 40 eval prompts: chunks of 16, 16 and 8; rank 0 takes the 1st and 3rd, rank 1 the 2nd and
    # repeats one to make as many forward passes as rank 0 (discarded)
    eval_prompts = tmp_path / "eval40.jsonl"
    eval_prompts.write_text("".join(open(resolve_prompt_path("shapes_eval")).readlines()[:40]))
    cfg = lora_config(tiny_model_dir, f"eval.prompts={eval_prompts}")
    groups = make_groups(cfg)
    torch.save(groups, tmp_path / "groups.pt")
    reference = build_learner(cfg)
    unsplit = evaluate_policy(reference.policy, cfg)
    before = {n: t.clone() for n, t in reference.policy.trainable_state().items()}
    reference.train_step(groups, version=0)
    expected = reference.policy.trainable_state()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mp.start_processes(sharded_rank, args=(2, port, tiny_model_dir, str(eval_prompts), str(tmp_path / "groups.pt"), str(tmp_path / "out.pt")),
                       nprocs=2, join=True, start_method="spawn")
    out, out_rank1 = (torch.load(f"{tmp_path / 'out.pt'}.{rank}", weights_only=False) for rank in (0, 1))

    # evaluation: gathered on rank 0 in prompt order, the same images and metrics as one process
    assert out["calls"] == [16, 8] and out_rank1["calls"] == [16, 16] and out_rank1["eval"] is None
    split = out["eval"]
    assert len(split["captions"]) == 40 and split["captions"] == unsplit["captions"]
    torch.testing.assert_close(split["images"], unsplit["images"], rtol=0, atol=0)
    for name, value in unsplit["metrics"].items():
        if name != "eval/time_s":
            assert split["metrics"][name] == value, name

    assert out["weights"].keys() == expected.keys() and all("lora_" in n for n in expected)
    assert any(not torch.equal(expected[n], before[n]) for n in expected)
    for name in expected:
        # Adam divides by sqrt(v): near-zero gradients amplify summation-order rounding (lr is 1e-2)
        torch.testing.assert_close(out["weights"][name], expected[name], rtol=1e-4, atol=1e-5)
    moments = out["optimizer"]["state"]
    assert set(moments) == set(expected) and all(moments[n]["exp_avg"].shape == expected[n].shape for n in expected)
