"""benchmarks/time_to_accuracy.py: the bookkeeping on synthetic runs (no launcher, no timing)."""

import json
import os

import pytest
from conftest import load_benchmark


@pytest.fixture
def tta(tmp_path, monkeypatch):
    module = load_benchmark("time_to_accuracy")
    monkeypatch.setattr(module, "ROOT", str(tmp_path))
    return module


def fake_run(tta, algorithm, mode, seed, accuracies, step_s=10.0, eval_s=5.0, every=10):
    """A finished cell: `accuracies` at steps 0, every, 2 every, ...; each step takes step_s and
    each evaluation eval_s of the run's clock (time_s counts both, as the driver's does)."""
    out = tta.cell_dir("t", algorithm, mode, seed)
    os.makedirs(out)
    rows, clock = [], 0.0
    for step in range(0, every * (len(accuracies) - 1) + 1):
        clock += step_s if step else 0.0
        row = {"step": step}
        if step % every == 0:
            clock += eval_s
            row.update({"eval/accuracy": accuracies[step // every], "eval/time_s": eval_s})
        rows.append({**row, "time_s": clock})
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"command": f"python launch/{mode}.py", "seed": seed, "mode": mode, "algorithm": algorithm}, f)
    return out


def test_time_to_target_takes_evaluation_out_of_the_clock(tta):
    out = fake_run(tta, "flow_grpo", "sync", 0, [0.50, 0.55, 0.61, 0.58], step_s=10.0, eval_s=5.0)
    run = tta.summarize_run(out, target_rise=0.10)
    assert run["target"] == pytest.approx(0.60)
    # reached at the second evaluation (step 20): 20 steps of 10 s, the three evaluations' 15 s out
    assert (run["step_to_target"], run["time_to_target_s"]) == (20, 200.0)
    assert run["final_accuracy"] == 0.58 and run["train_s"] == 300.0 and run["eval_s"] == 20.0
    never = tta.summarize_run(fake_run(tta, "flow_grpo", "sync", 1, [0.5, 0.55, 0.59]), 0.10)
    assert never["time_to_target_s"] is None and never["step_to_target"] is None


def test_report_merges_cells_with_mean_se_and_ratio_to_sync(tta, tmp_path, capsys):
    for seed, (sync_hit, async_hit) in enumerate([(2, 1), (3, 2)]):
        accs = lambda hit: [0.5] + [0.5 + 0.1 * (k >= hit) for k in range(1, 5)]  # noqa: E731
        fake_run(tta, "flow_grpo", "sync", seed, accs(sync_hit))
        fake_run(tta, "flow_grpo", "fully_async", seed, accs(async_hit), step_s=5.0)
    fake_run(tta, "diffusion_nft", "fully_async", 0, [0.4, 0.45])
    os.makedirs(tta.cell_dir("t", "flow_grpo", "one_step_off", 0))  # interrupted: no run.json, left out
    tta.main(["report", "t", "--plot", str(tmp_path / "p.png")])
    summary = json.load(open(tmp_path / "t" / "summary.json"))
    sync, fa = summary["cells"]["flow_grpo"]["sync"], summary["cells"]["flow_grpo"]["fully_async"]
    assert "one_step_off" not in summary["cells"]["flow_grpo"]
    # sync: hits at steps 20 and 30, 10 s a step; fully_async: steps 10 and 20, 5 s a step
    assert [r["time_to_target_s"] for r in sync["runs"]] == [200.0, 300.0]
    assert sync["time_to_target_mean_s"] == 250.0 and sync["time_to_target_se_s"] == pytest.approx(50.0)
    assert fa["time_to_target_mean_s"] == 75.0
    assert summary["ratio_to_sync"]["flow_grpo"]["fully_async"] == pytest.approx(0.3)
    assert summary["cells"]["diffusion_nft"]["fully_async"]["reached"] == 0
    assert summary["ratio_to_sync"]["diffusion_nft"] == {}
    assert os.path.getsize(tmp_path / "p.png") > 0
    text = capsys.readouterr().out
    assert "fully_async 0.30x" in text and "not reached" in text
    # one rise per algorithm, each on its own evaluation: DiffusionNFT's 0.4 -> 0.45 reaches + 0.05
    tta.main(["report", "t", "--target-rise", "flow_grpo=0.1,diffusion_nft=0.05", "--plot", str(tmp_path / "p.png")])
    summary = json.load(open(tmp_path / "t" / "summary.json"))
    assert summary["target_rise"] == {"flow_grpo": 0.1, "diffusion_nft": 0.05}
    assert summary["cells"]["diffusion_nft"]["fully_async"]["reached"] == 1
    assert summary["cells"]["flow_grpo"]["sync"]["time_to_target_mean_s"] == 250.0
    for bad in ("flow_grpo=0.1", "fast=0.1,flow_grpo=0.1,diffusion_nft=0.1", "lots"):
        with pytest.raises(SystemExit):
            tta.main(["report", "t", "--target-rise", bad])
        assert "--target-rise" in capsys.readouterr().err


def test_run_skips_finished_cells_and_interleaves(tta, monkeypatch):
    fake_run(tta, "flow_grpo", "sync", 0, [0.5, 0.6])
    calls = []

    def fake_subprocess(cmd, **kw):
        calls.append(cmd)
        out = next(c.split("=", 1)[1] for c in cmd if c.startswith("trainer.output_dir="))
        os.makedirs(out, exist_ok=True)
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(tta.subprocess, "run", fake_subprocess)
    tta.main(["run", "t", "--seeds", "0,1", "--modes", "sync,fully_async", "--algorithms", "flow_grpo",
              "trainer.total_steps=3", "fully_async:sync.every=2"])
    cells = [(c[1].split("/")[-1], next(x for x in c if x.startswith("trainer.seed="))) for c in calls]
    assert cells == [("fully_async.py", "trainer.seed=0"), ("sync.py", "trainer.seed=1"),
                     ("fully_async.py", "trainer.seed=1")]  # seed 0's sync finished before: skipped
    assert all("trainer.total_steps=3" in c and "algorithm.name=flow_grpo" in c for c in calls)
    assert ["sync.every=2" in c for c in calls] == [True, False, True]
    assert os.path.exists(os.path.join(tta.cell_dir("t", "flow_grpo", "sync", 1), "run.json"))
