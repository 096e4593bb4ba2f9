"""DiffusionNFT through the Ray pipeline on 2 cores: short sync and fully_async runs on the tiny SD3
finish, train on ODE groups with a finite NFT loss, and leave rollouts holding the published old copy."""

import json
import math
import os

import pytest

from async_flowgrpo.config import load_config
from async_flowgrpo.modes import run

PROMPTS = ["a red circle", "a blue square", "a red square", "a blue circle"]


def nft_config(mode, model_dir, tmp_path, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return load_config(mode, [
        "algorithm.name=diffusion_nft",
        f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
        f"rollout.prompts={prompts}", f"eval.prompts={prompts}", "rollout.prompt_mix=null",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=4",
        "rollout.cpus_per_worker=0.25", "trainer.cpus_per_worker=0.25",
        "trainer.micro_batch_size=8", "trainer.lr=1e-2", "trainer.total_steps=3", "trainer.sample_every=0",
        f"trainer.output_dir={tmp_path / 'out'}", "eval.every=0", "eval.at_start_and_end=false",
        "logging.progress=false", "sync.timeout_s=120",
        *extra,
    ])


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_nft_run_finishes_with_finite_loss(ray_cluster, tiny_model_dir, tmp_path, mode):
    cfg = nft_config(mode, tiny_model_dir, tmp_path)
    assert cfg.rollout.sampler == "ode" and cfg.rollout.guidance_scale == 1.0
    run(cfg)
    with open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["nft/r_mean"]), r
        assert r["nft/old_missing_frac"] == 0.0  # every group scored with its own version's weights
        assert r["staleness/max"] <= cfg.algorithm.max_staleness + cfg.sync.every - 1
        assert "policy/clip_frac" not in r  # Flow-GRPO's ratio metrics do not apply
    assert rows[-1]["samples/consumed"] == 3 * 4
    assert os.listdir(os.path.join(cfg.trainer.output_dir, "checkpoints"))
