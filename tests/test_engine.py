"""DiffusersEngine: weights loaded at once, or staged and swapped in at the next safe point."""

import os

import pytest
import torch

from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.rollout.engine import DiffusersEngine

# 2 shared cores: OpenMP threads spinning against other jobs make tiny matmuls ~20x slower
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAMPLING = dict(num_steps=5, guidance_scale=1.0, noise_level=0.7, sde_type="sde", window_size=4)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return DiffusionPolicy(make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3"))), lora_rank=4, lora_alpha=8)


def new_weights(policy):
    return {k: v + 0.01 for k, v in policy.trainable_state().items()}


def stage_at_step(engine, step, state, version):
    """Make the engine's step-boundary hook stage weights when it reaches `step` (as a receiver
    thread would, mid-sample)."""
    original, calls = engine._step_boundary, []

    def boundary():
        calls.append(1)
        if len(calls) == step + 1:
            engine.stage_weights(state, version)
        return original()

    engine._step_boundary = boundary


def test_load_weights_and_version(policy):
    engine = DiffusersEngine(policy, version=3)
    groups = engine.generate(["a red circle"], 2, seed=0, **SAMPLING)
    assert len(groups) == 1 and groups[0].versions.tolist() == [3] * 4
    state = new_weights(policy)
    engine.load_weights(state, 4)
    assert engine.version == 4 and all(torch.equal(policy.trainable_state()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="update_point"):
        DiffusersEngine(policy, update_point="whenever")


def test_in_flight_update_between_steps(policy):
    engine = DiffusersEngine(policy, version=0, update_point="between_steps")
    state = new_weights(policy)
    stage_at_step(engine, 2, state, 1)
    g = engine.generate(["a blue square"], 2, seed=1, **SAMPLING)[0]
    assert g.versions.tolist() == [0, 0, 1, 1] and engine.version == 1
    assert all(torch.equal(policy.trainable_state()[k], v) for k, v in state.items())


def test_update_between_groups_waits_for_the_next_generate(policy):
    engine = DiffusersEngine(policy, version=0, update_point="between_groups")
    state = new_weights(policy)
    stage_at_step(engine, 2, state, 1)
    assert engine.generate(["a blue square"], 2, seed=1, **SAMPLING)[0].versions.tolist() == [0] * 4
    assert engine.version == 0
    assert engine.generate(["a blue square"], 2, seed=1, **SAMPLING)[0].versions.tolist() == [1] * 4


@pytest.mark.parametrize("overrides, fused", [
    ([], False),  # fp32 (CPU): the adapters stay apart, rollout log-probs equal the trainer's to the bit
    (["model.dtype=bfloat16"], True),  # bf16 (GPUs): folded, the base model's speed
    (["model.dtype=bfloat16", "rollout.fuse_lora=false"], False),
    (["rollout.fuse_lora=true"], True),
    # these trust the recorded log-probs to the bit, which folded bf16 weights do not give
    (["model.dtype=bfloat16", "algorithm.is_correction=step"], False),
    (["model.dtype=bfloat16", "algorithm.prox_mode=bypass"], False),
])
def test_engine_folds_lora_where_the_policy_computes_in_low_precision(tiny_model_dir, overrides, fused):
    from async_flowgrpo.builders import build_engine
    from async_flowgrpo.config import load_config

    cfg = load_config("sync", [f"model.path={tiny_model_dir}", "model.lora_rank=4", *overrides])
    assert build_engine(cfg, "between_steps").policy.lora_fused == fused


@pytest.mark.slow  # aot_eager compiles each block variant: about 15 s
def test_rollout_compile_compiles_each_block_and_samples_the_same(tiny_model_dir):
    """rollout.compile: the engine's transformer blocks under torch.compile (aot_eager: the same
    graphs without inductor's C++ build) give the eager engine's samples and log-probs, before and
    after a weight update."""
    from async_flowgrpo.builders import build_engine
    from async_flowgrpo.config import load_config

    def samples(*overrides):
        cfg = load_config("sync", [f"model.path={tiny_model_dir}", "model.lora_rank=4", *overrides])
        engine = build_engine(cfg, "between_steps")
        first = engine.generate(["a red circle"], 2, seed=3, **SAMPLING)
        engine.load_weights(new_weights(engine.policy), version=1)
        return engine, first + engine.generate(["a red circle"], 2, seed=3, **SAMPLING)

    _, eager = samples()
    engine, compiled = samples("rollout.compile=aot_eager")
    blocks = engine.policy.adapter.transformer.transformer_blocks
    assert all(block._compiled_call_impl is not None for block in blocks)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c.log_probs, e.log_probs, rtol=1e-4, atol=1e-5)
        assert (c.images.int() - e.images.int()).abs().max() <= 1
