"""benchmarks/staleness_sweep.py: the cells, their overrides and the report on synthetic runs (no launcher)."""

import json
import os

import pytest
from conftest import load_benchmark


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    module = load_benchmark("staleness_sweep")
    monkeypatch.setattr(module.seed_runs, "ROOT", str(tmp_path))
    return module


def fake_cell(sweep, algorithm, eta, correction, seed, accuracies, staleness):
    """A finished seed_runs run: eval/accuracy at steps 0, 10, 20, ...; staleness/mean at every step."""
    out = os.path.join(sweep.seed_runs.ROOT, sweep.cell_name("s", algorithm, eta, correction), f"seed{seed}")
    os.makedirs(out)
    rows = []
    for step in range(1, 10 * (len(accuracies) - 1) + 1):
        row = {"step": step, "reward/mean": 0.5, "staleness/mean": staleness}
        if step % 10 == 0:  # a second a step, an evaluation 5 s: time_s is written after it
            row.update({"eval/accuracy": accuracies[step // 10], "eval/time_s": 5.0, "time_s": 5.0 * (step // 10 + 1) + step})
        rows.append(row)
    rows.insert(0, {"step": 0, "eval/accuracy": accuracies[0], "eval/time_s": 5.0, "time_s": 5.0})
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"command": "python launch/fully_async.py", "seed": seed, "mode": "fully_async", "wall_s": 1.0}, f)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write("eval:\n  guidance_scale: 4.5\n")


def test_cells_are_interleaved_and_nft_has_one_per_eta(sweep):
    cells = sweep.cells(["flow_grpo", "diffusion_nft"], [1, 4], ["none", "step"])
    assert cells == [("flow_grpo", 1, "none"), ("flow_grpo", 1, "step"), ("flow_grpo", 4, "none"), ("flow_grpo", 4, "step"),
                     ("diffusion_nft", 1, "-"), ("diffusion_nft", 4, "-")]
    assert sweep.cell_args("flow_grpo", 4, "none", 1.5, ["trainer.total_steps=10"]) == [
        "algorithm.max_staleness=4", "trainer.min_step_time_s=1.5", "algorithm.is_correction=none", "trainer.total_steps=10"]
    assert sweep.cell_args("diffusion_nft", 2, "-", 1.5, [])[:2] == ["config/diffusion_nft.yaml", "algorithm.max_staleness=2"]
    assert sweep.cell_name("s", "flow_grpo", 8, "step").endswith(os.path.join("flow_grpo", "eta8_step"))


def test_report_gives_each_cell_its_rise_and_the_staleness_it_reached(sweep, capsys):
    fake_cell(sweep, "flow_grpo", 4, "none", 0, [0.6, 0.7, 0.66], staleness=3.8)
    fake_cell(sweep, "flow_grpo", 4, "none", 1, [0.6, 0.65, 0.70], staleness=3.6)
    fake_cell(sweep, "flow_grpo", 8, "step", 0, [0.6, 0.62], staleness=4.0)  # did not reach 0.7 x 8
    fake_cell(sweep, "diffusion_nft", 1, "-", 0, [0.5, 0.7], staleness=1.0)
    result = sweep.report("s")
    by = {(c["algorithm"], c["eta"], c["correction"]): c for c in result["cells"]}
    four = by[("flow_grpo", 4, "none")]
    assert four["n"] == 2 and four["rise_mean"] == pytest.approx(0.08) and four["rise_worst"] == pytest.approx(0.06)
    assert four["staleness_reached"] == pytest.approx(3.7)
    assert by[("diffusion_nft", 1, "-")]["rise_mean"] == pytest.approx(0.2)
    text = sweep.table(result)
    assert "| flow_grpo | step | 8 | 4.00 (< 0.7 eta) |" in text and "3.70 |" in text
    assert os.path.exists(os.path.join(sweep.seed_runs.ROOT, "s", "sweep.json"))


def test_seed_runs_use_the_eval_reward_where_there_is_no_accuracy(sweep):
    """A model other than the shapes one (the Wan demo) logs eval/reward only: the rise is of that."""
    fake_cell(sweep, "flow_grpo", 1, "none", 0, [0.6, 0.7], staleness=1.0)
    run_dir = os.path.join(sweep.seed_runs.ROOT, sweep.cell_name("s", "flow_grpo", 1, "none"), "seed0")
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        if "eval/accuracy" in r:
            r["eval/reward"] = r.pop("eval/accuracy") + 0.25
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    run = sweep.seed_runs.summarize_run(run_dir)
    assert run["eval_metric"] == "eval/reward" and run["rise"] == pytest.approx(0.1)
    assert run["eval_accuracy"] == {0: 0.85, 10: 0.95}


def test_seed_runs_report_the_weight_average_against_the_live_weights_seed_by_seed(sweep):
    """Runs that evaluated a weight average also carry their last checkpoint's live-weight accuracy:
    the report pairs the two per seed (the average's last evaluation less the live weights')."""
    for seed, (accuracies, live, large) in enumerate([([0.6, 0.70], 0.66, (0.72, 0.69)), ([0.6, 0.64], 0.68, (0.70, 0.66))]):
        fake_cell(sweep, "flow_grpo", 1, "none", seed, accuracies, staleness=1.0)
        path = os.path.join(sweep.seed_runs.ROOT, sweep.cell_name("s", "flow_grpo", 1, "none"), f"seed{seed}", "run.json")
        info = json.load(open(path))
        on_8 = {"samples_per_prompt": 8, "base": 0.62, "last": large[0], "last_live": large[1]}  # (--final-samples 8)
        json.dump({**info, "final_eval_accuracy_live": live, "final_eval_large": on_8}, open(path, "w"))
    summary = sweep.seed_runs.summarize(sweep.cell_name("s", "flow_grpo", 1, "none"))
    gap = summary["average_minus_live"]
    assert gap["per_seed"] == [pytest.approx(0.04), pytest.approx(-0.04)] and gap["mean"] == pytest.approx(0.0)
    assert gap["se"] == pytest.approx(0.04)
    gap_8 = summary["rise_large"]["average_minus_live"]  # the same pairing on the larger evaluation
    assert gap_8["per_seed"] == [pytest.approx(0.03), pytest.approx(0.04)] and gap_8["mean"] == pytest.approx(0.035)
    text = sweep.seed_runs.table(summary)
    assert "0.600 -> 0.700; live weights: 0.660; on 8 samples a prompt: 0.620 -> 0.720 (live weights: 0.690) |" in text
    assert "per seed +0.040, -0.040" in text and "live weights there: +0.035 (SE 0.005; per seed +0.030, +0.040)" in text


def test_seed_runs_report_the_rise_on_a_larger_final_evaluation(sweep, monkeypatch):
    """--final-samples N: the last checkpoint and the base evaluated on N samples a prompt; the base
    once for every seed of a name (its noise is fixed by eval.seed), and the report's rise from the two."""
    seed_runs = sweep.seed_runs
    name = sweep.cell_name("s", "flow_grpo", 1, "none")
    calls = []

    def evaluate(args, env, overrides, flags=()):
        calls.append(overrides)
        return 0.6 + 0.05 * len(calls) if "trainer.resume=latest" in overrides else 0.55

    monkeypatch.setattr(seed_runs, "evaluate", evaluate)
    for seed in (0, 1):
        fake_cell(sweep, "flow_grpo", 1, "none", seed, [0.6, 0.70], staleness=1.0)
        out = os.path.join(seed_runs.ROOT, name, f"seed{seed}")
        large = {"samples_per_prompt": 8, "base": seed_runs.base_accuracy(name, [], {}, 8),
                 "last": seed_runs.evaluate_final(out, [], {}, samples=8)}
        path = os.path.join(out, "run.json")
        json.dump({**json.load(open(path)), "final_eval_large": large}, open(path, "w"))
    assert len(calls) == 3 and "eval.samples_per_prompt=8" in calls[0] and "eval.samples_per_prompt=8" in calls[1]
    assert "trainer.resume=null" in calls[0]  # the base: no checkpoint, whatever the run's files say
    summary = seed_runs.summarize(name)
    large = summary["rise_large"]
    assert large["per_seed"] == [pytest.approx(0.15), pytest.approx(0.20)] and large["mean"] == pytest.approx(0.175)
    assert large["worst"] == pytest.approx(0.15) and large["base"] == 0.55
    text = seed_runs.table(summary)
    assert "on 8 samples a prompt: 0.550 -> 0.700" in text and "rise +0.175 (SE 0.025, worst +0.150)" in text


def test_seed_runs_compare_puts_each_name_in_one_row(sweep):
    """`compare`: the last evaluation, the rise, the first step at a target rise (a median only when
    most seeds reach it, else the range of those that do), how far the last is under the best."""
    seed_runs = sweep.seed_runs
    fake_cell(sweep, "flow_grpo", 1, "none", 0, [0.6, 0.70, 0.75, 0.72], staleness=1.0)
    fake_cell(sweep, "flow_grpo", 1, "none", 1, [0.6, 0.65, 0.66, 0.68], staleness=1.0)
    fake_cell(sweep, "flow_grpo", 1, "none", 2, [0.6, 0.62, 0.64, 0.65], staleness=1.0)
    name = sweep.cell_name("s", "flow_grpo", 1, "none")
    row = seed_runs.compare_row(seed_runs.summarize(name), target=0.09)
    assert row["steps_to_target"] == [10] and row["reached"] == 1 and row["step_to_target_median"] is None
    assert row["last_mean"] == pytest.approx((0.72 + 0.68 + 0.65) / 3, abs=1e-4) and row["last_worst"] == 0.65
    assert row["best_minus_last_max"] == pytest.approx(0.03) and row["mode"] == "fully_async"
    assert "| 10 (1/3) | 10 |" in seed_runs.compare_table([row])  # one seed of three: its seconds, not a median
    row = seed_runs.compare_row(seed_runs.summarize(name), target=0.055)  # seeds 0 and 1 at steps 10 and 20
    assert row["steps_to_target"] == [10, 20] and row["step_to_target_median"] == 15
    assert row["seconds_to_target"] == [10.0, 20.0] and row["seconds_to_target_median"] == 15  # evaluations left out
    assert "| 15 (2/3) | 15 |" in seed_runs.compare_table([row])
    assert seed_runs.first_step_at({"eval_accuracy": {"0": 0.6, "10": 0.59}}, 0.0) is None  # step 0 itself never counts


def test_seed_runs_paired_differences_the_last_evaluations_on_common_seeds(sweep):
    seed_runs = sweep.seed_runs
    for seed, last in ((0, 0.70), (1, 0.66), (2, 0.65)):
        fake_cell(sweep, "flow_grpo", 1, "none", seed, [0.6, last], staleness=1.0)
    for seed, last in ((1, 0.70), (2, 0.66), (3, 0.9)):  # seed 0 missing, seed 3 without a partner
        fake_cell(sweep, "flow_grpo", 2, "none", seed, [0.6, last], staleness=1.0)
    a, b = (seed_runs.summarize(sweep.cell_name("s", "flow_grpo", eta, "none")) for eta in (1, 2))
    x = seed_runs.paired(a, b)
    assert x["seeds"] == [1, 2] and x["per_seed"] == [0.04, 0.01] and x["worst"] == 0.01
    assert x["mean"] == pytest.approx(0.025) and x["se"] == pytest.approx(0.015)


def test_seed_runs_continue_a_cut_off_run_of_the_same_command_from_its_checkpoint(sweep, monkeypatch):
    """A seed whose launcher was stopped (a signal, a session's end) continues with
    trainer.resume=latest, its time counted on; another command, or no checkpoint, starts again."""
    seed_runs = sweep.seed_runs
    launched = []

    def launcher(cmd, **kwargs):  # stopped after its first checkpoint, as SIGTERM leaves a run
        launched.append(cmd)
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.output_dir="))
        os.makedirs(os.path.join(out, "checkpoints", "latest"), exist_ok=True)
        return type("Proc", (), {"returncode": 143, "stderr": "stopped at step 50; resume with: ...", "stdout": ""})()

    monkeypatch.setattr(seed_runs.subprocess, "run", launcher)
    args = ["config/shapes_edit.yaml", "rollout.groups_per_step=8"]
    for _ in range(2):
        with pytest.raises(SystemExit, match="exit 143"):
            seed_runs.run_seed("cut", 20, "fully_async", args, [])
    assert "trainer.resume=latest" not in launched[0] and launched[1][-1] == "trainer.resume=latest"
    assert launched[1][:-1] == launched[0]
    out = os.path.join(seed_runs.ROOT, "cut", "seed20")
    assert json.load(open(os.path.join(out, seed_runs.LAUNCH)))["wall_s"] >= 0
    with pytest.raises(SystemExit):  # another command: its directory starts again
        seed_runs.run_seed("cut", 20, "fully_async", [*args, "trainer.lr=1e-3"], [])
    assert "trainer.resume=latest" not in launched[2]


def test_a_seed_refused_for_its_config_exits_2_and_leaves_no_directory(sweep, monkeypatch, capsys):
    """The launcher's exit 2 (a config error, before anything ran): seed_runs exits 2 with its line, and
    no seed or sweep directory is left to look like a run."""
    seed_runs = sweep.seed_runs
    monkeypatch.setattr(seed_runs.subprocess, "run", lambda cmd, **kwargs: type(
        "Proc", (), {"returncode": 2, "stderr": "config error: trainer.lr: must be a finite number, got nan", "stdout": ""})())
    with pytest.raises(SystemExit) as exit_:
        seed_runs.run_seed("refused", 0, "fully_async", ["trainer.lr=nan"], [])
    assert exit_.value.code == 2
    assert "refused seed 0: config error: trainer.lr: must be a finite number" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(seed_runs.ROOT, "refused"))
