"""benchmarks/common.py: what every benchmark script shares."""

import signal
from types import SimpleNamespace

import pytest
from conftest import load_benchmark

from async_flowgrpo.driver.cluster import RunError
from async_flowgrpo.stop import Stopped


@pytest.fixture
def common():
    return load_benchmark("common")


@pytest.mark.parametrize("error, code, says", [
    (Stopped(signal.SIGTERM, 7, saved=True, last="step_000007"), 143, "stopped by a signal at step 7 of /runs/a"),
    (RunError("the rollout actor died"), 1, "error in /runs/a: the rollout actor died"),
])
def test_a_benchmark_run_that_stops_or_fails_ends_with_one_line_and_its_exit_code(common, monkeypatch, capsys, error, code, says):
    import async_flowgrpo.modes as modes

    def run(cfg):
        raise error

    monkeypatch.setattr(modes, "run", run)
    with pytest.raises(SystemExit) as exited:
        common.run_or_exit(SimpleNamespace(trainer=SimpleNamespace(output_dir="/runs/a")))
    assert exited.value.code == code
    printed = capsys.readouterr()
    assert printed.out.count("\n") == 1 and says in printed.out and "Traceback" not in printed.err


def test_a_pruned_run_keeps_its_metrics_gzipped_and_readable(common, tmp_path):
    import json
    import os

    out = tmp_path / "run"
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "reward/mean": 0.25}, {"step": 1, "reward/mean": 0.75}]  # resumed: step 1 twice
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = common.read_metrics(str(out))
    common.prune_run_outputs(str(out))
    assert sorted(os.listdir(out)) == ["metrics.jsonl.gz"]
    assert common.read_metrics(str(out)) == before == [rows[0], rows[2]]
    with common.open_metrics(str(out / "metrics.jsonl")) as f:  # the path it had before: plot_run.py's argument
        assert [json.loads(line) for line in f] == rows


def test_run_cost_counts_an_actor_process_that_is_gone_by_the_end_under_its_role():
    """benchmarks/run_cost.py: a child titled as Ray titles a rollout actor burns CPU and exits
    before the count ends; its CPU (to its last sample) still counts, as the rollout's."""
    import subprocess
    import sys
    import time

    run_cost = load_benchmark("run_cost")
    counter = run_cost.ProcessCpu(interval=0.05)
    counter.start()
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(0.3)"
    child = subprocess.Popen(["bash", "-c", f'exec -a "ray::RolloutActor" {sys.executable} -c "{burn}"'])
    assert child.wait(timeout=30) == 0
    time.sleep(0.2)
    cpu = counter.stop()
    assert 0.3 <= cpu["rollout"] <= 2.0, cpu  # 0.5 s burnt, less the last sample interval's share
    assert cpu["trainer"] == cpu["queue"] == 0.0


def test_rollout_time_compares_settings_of_one_model_by_their_transformer_calls(tiny_model_dir, tmp_path):
    """benchmarks/rollout_time.py on the tiny SD3 (one round, one group): MixGRPO against
    MixGRPO-Flash, the window at steps 0-1 (version 0): 10 transformer calls against 2 + 3."""
    from async_flowgrpo.config import CONFIG_DIR

    rollout_time = load_benchmark("rollout_time")
    files = [f"{CONFIG_DIR}/{name}.yaml model.path={tiny_model_dir} rollout.group_size=2" for name in ("mixgrpo", "mixgrpo_flash")]
    result = rollout_time.main([*files, "--prompts", "1", "--rounds", "1", "--reward", "--out", str(tmp_path / "r.json")])
    plain, flash = result["rows"]
    assert (plain["transformer_calls"], flash["transformer_calls"]) == (10, 5)
    assert plain["groups_scored"] == flash["groups_scored"] == 2 and 0 <= flash["mean_reward"] <= 1  # warm-up + 1 round
    assert plain["vs_first"] == 1.0 and len(flash["seconds_per_group"]) == 1 and flash["median_s"] > 0
    assert flash["sampling"]["after_window_solver"] == "dpm2" and flash["sampling"]["window_range"] == (0, 2)
    assert (tmp_path / "r.json").exists()
    with pytest.raises(SystemExit, match="same model"):
        rollout_time.main([files[0], f"{CONFIG_DIR}/mixgrpo.yaml", "--rounds", "1"])


def test_a_benchmarks_config_error_is_one_line_and_exit_2(common, capsys):
    """As the launchers': a benchmark given a bad setting exits 2 with the key named."""
    with pytest.raises(SystemExit) as exit_:
        common.load_mode_config("sync", ["trainer.lr=abc"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().startswith("config error (sync): trainer.lr: ")
