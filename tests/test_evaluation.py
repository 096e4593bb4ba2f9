"""evaluation.evaluate_policy, without Ray: abandoned at once when a stop asks (`interrupted`)."""

import pytest
import torch

from async_flowgrpo.builders import build_policy
from async_flowgrpo.config import load_config
from async_flowgrpo.evaluation import EvaluationCut, evaluate_policy


def test_an_interrupted_evaluation_stops_at_the_next_denoising_step_and_leaves_the_weights(tiny_model_dir):
    cfg = load_config("sync", [f"model.path={tiny_model_dir}", "eval.prompts=shapes_eval", "eval.samples_per_prompt=1",
                               "eval.num_steps=6"])
    policy = build_policy(cfg)
    before = {n: t.clone() for n, t in policy.trainable_state().items()}
    steps = []
    velocity = policy._velocity
    policy._velocity = lambda *a, **k: steps.append(1) or velocity(*a, **k)

    with pytest.raises(EvaluationCut):
        evaluate_policy(policy, cfg, interrupted=lambda: len(steps) >= 2)  # the stop lands during step 2
    assert len(steps) == 2  # of 6 steps x 4 chunks of 16 prompts: nothing more ran
    steps.clear()
    with pytest.raises(EvaluationCut):
        evaluate_policy(policy, cfg, interrupted=lambda: True)  # asked before it started: nothing runs
    assert not steps
    assert all(torch.equal(before[n], t) for n, t in policy.trainable_state().items())


def test_the_command_refuses_a_missing_checkpoint_before_it_loads_the_model(tmp_path, monkeypatch, capsys):
    """`python -m async_flowgrpo.evaluation ... trainer.resume=latest` with no checkpoint: one line and
    exit 2, with no model loaded first (its loading bars would come before the line)."""
    from async_flowgrpo import builders, evaluation

    monkeypatch.setattr(builders, "build_policy", lambda *a, **k: pytest.fail("the model was loaded first"))
    with pytest.raises(SystemExit) as exit_:
        evaluation.main([f"trainer.output_dir={tmp_path}", "trainer.resume=latest"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: trainer.resume=latest: no checkpoint under {tmp_path}/checkpoints"
