"""benchmarks/rl_probe.py: its "side" and "left" rewards and one end-to-end step on a tiny random model."""

import json

import pytest
from conftest import load_benchmark
import torch

from async_flowgrpo.shapes.scenes import ObjectSpec, Placed, SceneSpec, draw


@pytest.fixture(scope="module")
def rl_probe():
    return load_benchmark("rl_probe")


def scene_meta(color: str) -> dict:
    return {"spec": SceneSpec((ObjectSpec(color, "circle"),)).to_dict()}


def test_side_reward_wants_the_colour_mass_on_the_side_the_first_colour_asks_for(rl_probe):
    left = torch.from_numpy(draw([Placed("red", "circle", 2, 10, 10)]))
    right = torch.from_numpy(draw([Placed("red", "circle", 20, 10, 10)]))
    images = torch.stack([left, right, left, right])
    out = rl_probe.side_reward(images, ["p"] * 4, [scene_meta("red"), scene_meta("red"), scene_meta("cyan"), scene_meta("cyan")])
    # red asks for the left half, cyan for the right: the object's own colour does not matter
    assert out["correct"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out["score"][0] > 0.7 and out["score"][1] < 0.3
    torch.testing.assert_close(out["score"][0] + out["score"][2], torch.tensor(1.0))
    control = rl_probe.left_reward(images, ["p"] * 4, [scene_meta("red"), scene_meta("red"), scene_meta("cyan"), scene_meta("cyan")])
    assert control["correct"].tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.slow  # the probe run whole: about 6 s
def test_probe_runs_a_step_and_evaluates_held_out_and_training_prompts(rl_probe, tiny_model_dir, tmp_path):
    result = rl_probe.main([
        "--model", tiny_model_dir, "--steps", "1", "--eval-every", "0", "--kinds", "count",
        "--out", str(tmp_path), "--name", "smoke",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=3", "rollout.sde_window_size=1",
        "rollout.sde_window_range=null", "eval.samples_per_prompt=1", "eval.num_steps=2",
    ])
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["kinds"] == {"count": 1.0} and [e["step"] for e in saved["evals"]] == [0, 1]
    assert len(saved["curve"]) == 1 and 0.0 <= saved["curve"][0]["reward"] <= 1.0
    start = saved["evals"][0]
    assert {k for k in start["train"] if k.startswith("accuracy")} == {"accuracy", "accuracy_count"}  # 64 count prompts
    assert {"accuracy_single", "accuracy_count", "accuracy_position"} <= set(start["held_out"])
    assert result["evals"] == saved["evals"]
