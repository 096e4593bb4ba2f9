"""benchmarks/learning_curve.py: combining invocations run in parallel (one seed each)."""

import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def learning_curve():
    return load_benchmark("learning_curve")


def fake_run(seed: int, rise: float) -> dict:
    steps = list(range(1, 9))
    return {"seed": seed, "wall_s": 10.0, "step": steps, "samples": [32 * s for s in steps], "time_s": [1.0 * s for s in steps],
            "reward": [0.5 + rise * s for s in steps], "staleness": [0.5] * 8, "samples_per_s": 32.0,
            "evals": [{"step": 0, "samples": 0, "time_s": 0.0, "accuracy": 0.6, "reward": 0.6},
                      {"step": 8, "samples": 256, "time_s": 8.0, "accuracy": 0.6 + 10 * rise, "reward": 0.6}]}


def invocation(tmp_path, name: str, seed: int, rise: float) -> str:
    doc = {"model": "m", "machine": {}, "settings": ["a=1"], "steps": 8, "seeds": [seed],
           "runs": {"sync": [fake_run(seed, rise)], "fully_async": [fake_run(seed, rise / 2)]}, "total_wall_s": 20.0}
    path = tmp_path / name / "learning_curve.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    return str(path)


def test_merged_invocations_aggregate_over_all_their_seeds(learning_curve, tmp_path, capsys):
    a, b = invocation(tmp_path, "a", 0, 0.01), invocation(tmp_path, "b", 1, 0.03)
    out = tmp_path / "merged"
    result = learning_curve.main(["--merge", a, b, "--out", str(out)])
    assert result["seeds"] == [0, 1] and result["total_wall_s"] == 40.0
    assert [r["seed"] for r in result["runs"]["sync"]] == [0, 1]
    mean, std = result["aggregate"]["sync"]["final_eval_accuracy"]
    assert mean == pytest.approx(0.8) and std == pytest.approx(0.1414, abs=1e-3)  # 0.7 and 0.9
    assert json.loads((out / "learning_curve.json").read_text())["seeds"] == [0, 1]
    assert (out / "learning_curve.png").exists()
    assert "diff -0.075, 2 SE = 0.168: within noise" in capsys.readouterr().out  # the comparison spans both seeds


@pytest.mark.parametrize("change, says", [("seed", "a seed appears twice"), ("steps", "has another steps")])
def test_invocations_that_do_not_belong_together_are_refused_with_one_line(learning_curve, tmp_path, change, says):
    a = invocation(tmp_path, "a", 0, 0.01)
    b = invocation(tmp_path, "b", 0 if change == "seed" else 1, 0.02)
    if change == "steps":
        doc = json.loads(open(b).read())
        doc["steps"] = 9
        open(b, "w").write(json.dumps(doc))
    with pytest.raises(SystemExit, match=says):
        learning_curve.main(["--merge", a, b, "--out", str(tmp_path / "merged")])
