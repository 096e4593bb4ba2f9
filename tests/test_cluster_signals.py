"""Stopped the way clusters stop a job, end to end through the launcher:

- SIGTERM to the launcher's whole process group (`timeout`, SLURM's scancel, systemd): a graceful
  stop with a checkpoint of the current step, since Ray's processes are kept out of the group;
- SIGTERM to every process of the run by pid (SLURM, systemd's control-group stop): the trainers
  go too, so one line names the last checkpoint;
- the driver killed outright (SIGKILL, the OOM killer): no Ray process lingers.

Each ends with exit 143 (or -9) within 30 s, one line, no Ray process left, and
`trainer.resume=latest` continuing from the checkpoint with exact step and sample counts.

A stop never waits on long work (the same checks, within trainer.stop_grace_s): SIGTERM during an
evaluation that would outlast the grace period, during a slow reward (a scoring service that
sleeps), during a checkpoint write, and during an update longer than the grace period (given up:
the line names the last checkpoint).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

import test_launcher
from test_fault_injection import (Launch, SleepingScorer, _seeds, alive, assert_counters, checkpoint_state,
                                  last_per_step, unexpected_stderr)
from test_launcher import ray_processes, small_args

prompt_file = test_launcher.prompt_file  # the fixture: four shape prompts

MODE = "fully_async"
TOTAL = 40  # far more steps than the run gets to before the signal
GRACE_S = 30  # a scheduler's grace period between SIGTERM and SIGKILL


def start(tiny_model_dir, prompt_file, tmp_path, what: str, rows: int = 3, delay_s: float = 0.0) -> tuple[Launch, list[str]]:
    """The run, `delay_s` after its metrics row `rows`."""
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={TOTAL}", "trainer.checkpoint_every=2")
    run = Launch(MODE, args, out, what)
    assert run.wait_rows(rows), run.why(f"the run ended before its step {rows}")
    run.sleep(delay_s)
    run.scan(force=True)
    return run, args


def stopped_within_grace(run: Launch, t_signal: float, grace_s: float = GRACE_S) -> tuple[int, str]:
    code, err = run.finish(timeout=grace_s + 60)
    took = time.monotonic() - t_signal
    print(f"{run.context}: exit {code} after {took:.1f} s")
    assert took <= grace_s, run.why(f"took {took:.1f} s to stop")
    junk = unexpected_stderr(err, MODE)
    assert not junk and "Traceback" not in err, run.why(f"more than one line: {junk[:5]}")
    return code, err


def resume_continues(run: Launch, args: list[str], *changes: str, says: str = "") -> None:
    """trainer.resume=latest (with `changes`, key=value) continues from the newest checkpoint: steps
    k+1.., 4 samples a step, one summary on stdout; `says`: a line its stderr must hold."""
    path, state = checkpoint_state(run.output_dir)
    assert state is not None, run.why("no checkpoint to resume")
    k = state["step"]
    assert state["version"] == k and os.path.basename(path) == f"step_{k:06d}", run.why(f"{path}: step {k}")
    rows = [r for r in run.rows(complete_only=False) if r["step"] >= 1]
    target = max(k, len(rows)) + 2
    changes = (*changes, f"trainer.total_steps={target}")
    again = [a for a in args if not a.startswith(tuple(c.split("=")[0] + "=" for c in changes))]
    again += [*changes, "trainer.resume=latest"]
    resumed = Launch(MODE, again, run.output_dir, f"{run.context}; resumed from step {k}")
    try:
        code, err = resumed.finish(timeout=400)
        assert code == 0, resumed.why("the resumed run failed")
        assert f"resumed from {path} at step {k}" in err, resumed.why(f"did not resume from {path}")
        assert says in err, resumed.why(f"no {says!r}")
        assert resumed.stdout.count("summary: ") == 1, resumed.why(f"stdout: {resumed.stdout[-2000:]}")  # not logger and cli both
        all_rows = [r for r in resumed.rows(complete_only=False) if r["step"] >= 1]
        new = [r["step"] for r in all_rows[len(rows):]]
        assert new == list(range(k + 1, target + 1)), resumed.why(f"resumed steps {new}, expected {k + 1}..{target}")
        final = last_per_step(all_rows)
        assert [r["step"] for r in final] == list(range(1, target + 1)), resumed.why(f"steps {[r['step'] for r in final]}")
        assert_counters(resumed, final, final[-1:], killed_rollout=False)
        _, end = checkpoint_state(run.output_dir)
        assert end["step"] == end["version"] == target and end["consumed_samples"] == final[-1]["samples/consumed"], \
            resumed.why(f"final checkpoint: step {end['step']}, consumed {end['consumed_samples']}")
        assert not resumed.leftovers(), resumed.why("Ray processes outlived the resumed launcher")
    finally:
        resumed.cleanup()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", _seeds(default=(0,)))
def test_sigterm_to_the_process_group_stops_with_a_checkpoint_of_the_current_step(tiny_model_dir, prompt_file, tmp_path, seed):
    """At a seeded point: after step 1-6, 0-1.5 s into the next (mid-update, mid-rollout, mid-save).
    A soak: FAULT_SEEDS=0-19 python -m pytest tests/test_cluster_signals.py -k process_group"""
    rng = random.Random(seed)
    rows, delay_s = rng.randint(1, 6), round(rng.uniform(0.0, 1.5), 2)
    run, args = start(tiny_model_dir, prompt_file, tmp_path, f"SIGTERM to the process group after step {rows} + {delay_s} s "
                      f"(seed {seed})", rows=rows, delay_s=delay_s)
    try:
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)  # the launcher leads its own group (Launch: a new session)
        code, err = stopped_within_grace(run, t_signal)
        stopped = [line for line in err.splitlines() if line.startswith("stopped")]
        assert code == 143 and len(stopped) == 1, run.why(f"exit {code}, lines {stopped}")
        m = re.match(r"stopped at step (\d+); resume with: .* trainer\.resume=latest$", stopped[0])
        assert m, run.why(f"not a stop with a checkpoint of its step: {stopped[0]!r}")
        path, state = checkpoint_state(run.output_dir)
        n = int(m.group(1))
        assert state["step"] == state["version"] == n and os.path.basename(path) == f"step_{n:06d}", run.why(path)
        assert [r["step"] for r in run.rows(complete_only=False)] == list(range(1, n + 1)), run.why("rows")
        assert not run.leftovers(), run.why(f"Ray processes outlived the launcher: {run.leftovers()}")
        # the printed command, with a changed lr (and total_steps), resumes
        resume_continues(run, args, "trainer.lr=5e-3",
                         says=f"resume: applying changed settings: trainer.lr 0.01 -> 0.005, trainer.total_steps {TOTAL} -> ")
    finally:
        run.cleanup()


@pytest.mark.timeout(900)
def test_sigterm_to_every_process_names_the_last_checkpoint(tiny_model_dir, prompt_file, tmp_path):
    run, args = start(tiny_model_dir, prompt_file, tmp_path, "SIGTERM to every process by pid")
    try:
        every = [run.proc.pid, *alive(run.seen), *ray_processes(run.ray_tmp)]
        t_signal = time.monotonic()
        for pid in dict.fromkeys(every):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        code, err = stopped_within_grace(run, t_signal)
        stopped = [line for line in err.splitlines() if line.startswith("stopped")]
        assert code == 143 and len(stopped) == 1, run.why(f"exit {code}, lines {stopped}")
        path, state = checkpoint_state(run.output_dir)
        m = re.match(r"stopped at step (\d+)(?: without a checkpoint of it \(the signal stopped Ray's processes too\); "
                     r"the last checkpoint is (\S+))?; resume with: .* trainer\.resume=latest$", stopped[0])
        assert m, run.why(f"unexpected stop line {stopped[0]!r}")
        n = int(m.group(1))
        if m.group(2):  # the trainers went with the signal: the line names the checkpoint that resume takes
            assert m.group(2) == path and state["step"] < n, run.why(f"the line names {m.group(2)}, latest is {path}")
        else:  # the driver saved before the trainers went (or its periodic checkpoint was of this step)
            assert state["step"] == n, run.why(f"stopped at {n}, latest {path}")
        assert not run.leftovers(), run.why(f"Ray processes outlived the launcher: {run.leftovers()}")
        resume_continues(run, args)
    finally:
        run.cleanup()


@pytest.mark.timeout(900)
def test_a_driver_killed_outright_leaves_no_ray_process_and_resumes_from_the_last_periodic_checkpoint(
        tiny_model_dir, prompt_file, tmp_path):
    run, args = start(tiny_model_dir, prompt_file, tmp_path, "SIGKILL to the driver")
    try:
        run.proc.kill()
        code, _ = run.finish(timeout=30)
        assert code == -signal.SIGKILL, run.why(f"exit {code}")
        # the raylet's agents included (they would poll for the raylet for a minute, ignoring SIGTERM)
        left = run.leftovers(timeout=10)
        assert not left, run.why(f"Ray processes outlived the killed driver: {left}")
        resume_continues(run, args)
    finally:
        run.cleanup()


# -- a stop never waits on long work -----------------------------------------------------------------
STOP_GRACE_S = 20  # trainer.stop_grace_s's default
LONG_EVAL = ("eval.at_start_and_end=true", "eval.samples_per_prompt=64", "eval.num_steps=100")


def one_stop_line(run: Launch, code: int, err: str) -> str:
    junk = unexpected_stderr(err, MODE)
    assert not junk and "Traceback" not in err, run.why(f"more than one line: {junk[:5]}")
    stopped = [line for line in err.splitlines() if line.startswith("stopped")]
    assert code == 143 and len(stopped) == 1, run.why(f"exit {code}, lines {stopped}")
    assert not run.leftovers(), run.why(f"Ray processes outlived the launcher: {run.leftovers()}")
    return stopped[0]


def evaluation_time_s(args: list[str], steps: int = 4) -> float:
    """What the evaluation of `args` takes, at the least: its first denoising steps timed in this
    process (one thread, as the trainer runs it), times its number of steps; decoding and scoring
    left out."""
    import torch

    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.config import load_config
    from async_flowgrpo.evaluation import PROMPTS_PER_CALL, EvaluationCut, evaluate_policy
    from async_flowgrpo.prompts import load_prompts

    cfg = load_config(MODE, args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stamps = []
    try:
        evaluate_policy(build_policy(cfg), cfg, interrupted=lambda: stamps.append(time.monotonic()) or len(stamps) > steps)
    except EvaluationCut:
        pass
    finally:
        torch.set_num_threads(threads)
    per_step = (stamps[steps] - stamps[1]) / (steps - 1)  # between denoising steps, the first (warm-up) left out
    calls = -(-len(load_prompts(cfg.eval.prompts)) // PROMPTS_PER_CALL)
    return per_step * cfg.eval.num_steps * calls


@pytest.mark.timeout(900)
def test_sigterm_during_an_evaluation_abandons_it_and_stops_within_the_grace_period(tiny_model_dir, prompt_file, tmp_path):
    """The step-0 evaluation, longer than the grace period: abandoned, step 0 saved, resumed."""
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={TOTAL}", *LONG_EVAL)
    outlasts = evaluation_time_s(args)
    assert outlasts > 1.5 * STOP_GRACE_S, f"the evaluation takes {outlasts:.0f} s: not long enough to test a stop"
    run = Launch(MODE, args, out, f"SIGTERM during the step-0 evaluation (at least {outlasts:.0f} s)")
    try:
        run.wait_until(lambda: "step 0: evaluating" in run.stderr, 300, "the step-0 evaluation")
        run.sleep(2.0)
        run.scan(force=True)
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        code, err = stopped_within_grace(run, t_signal, STOP_GRACE_S)
        line = one_stop_line(run, code, err)
        assert re.match(r"stopped at step 0; resume with: .* trainer\.resume=latest$", line), run.why(line)
        assert "step 0: evaluation abandoned for the stop (SIGTERM); not logged" in err, run.why("no word of the evaluation")
        assert run.rows(complete_only=False) == [], run.why("a metrics row of the abandoned evaluation")
        path, state = checkpoint_state(out)
        assert state["step"] == state["version"] == 0, run.why(path)
        resume_continues(run, args, "eval.at_start_and_end=false")
    finally:
        run.cleanup()


@pytest.mark.timeout(900)
def test_sigterm_during_a_slow_reward_stops_within_the_grace_period(tiny_model_dir, prompt_file, tmp_path):
    """fully_async: the group being scored is not waited for (a ticket in flight, regenerated on resume)."""
    scorer = SleepingScorer()
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={TOTAL}", "trainer.checkpoint_every=2",
                      *scorer.args())
    run = Launch(MODE, args, out, "SIGTERM during a slow reward")
    try:
        assert run.wait_rows(1), run.why("the run ended before its step 1")
        scorer.slow.set()
        run.wait_until(scorer.sleeping.is_set, 120, "a reward call in the slow service")
        run.sleep(1.0)
        run.scan(force=True)
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        code, err = stopped_within_grace(run, t_signal, STOP_GRACE_S)
        line = one_stop_line(run, code, err)
        m = re.match(r"stopped at step (\d+); resume with: .* trainer\.resume=latest$", line)
        assert m, run.why(line)
        path, state = checkpoint_state(out)
        assert state["step"] == state["version"] == int(m.group(1)), run.why(path)
        scorer.slow.clear()
        resume_continues(run, args)
    finally:
        run.cleanup()
        scorer.server.shutdown()


@pytest.mark.timeout(900)
def test_sigterm_during_a_checkpoint_write_stops_within_the_grace_period(tiny_model_dir, prompt_file, tmp_path):
    """The write goes on (a checkpoint is never left half-made), then the stop's own; step N, exact."""
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={TOTAL}", "trainer.checkpoint_every=1")
    run = Launch(MODE, args, out, "SIGTERM during a checkpoint write")
    root = os.path.join(out, "checkpoints")
    try:
        assert run.wait_rows(1), run.why("the run ended before its step 1")
        deadline = time.monotonic() + 120
        while not any(n.startswith(".tmp-") for n in (os.listdir(root) if os.path.isdir(root) else ())):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.why("no checkpoint write seen")
            time.sleep(0.002)
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        run.scan(force=True)
        code, err = stopped_within_grace(run, t_signal, STOP_GRACE_S)
        line = one_stop_line(run, code, err)
        m = re.match(r"stopped at step (\d+); resume with: .* trainer\.resume=latest$", line)
        assert m, run.why(line)
        n = int(m.group(1))
        path, state = checkpoint_state(out)
        assert state["step"] == state["version"] == n and os.path.basename(path) == f"step_{n:06d}", run.why(path)
        assert not [name for name in os.listdir(root) if name.startswith((".tmp-", ".old-"))], run.why("a half-made checkpoint")
        resume_continues(run, args)
    finally:
        run.cleanup()


@pytest.mark.timeout(900)
def test_an_update_longer_than_the_grace_period_is_given_up_naming_the_last_checkpoint(tiny_model_dir, prompt_file, tmp_path):
    """trainer.min_step_time_s=14 against trainer.stop_grace_s=16 (given up after 8 s): update 4, in flight
    (fully_async starts it before step 3 is logged), is discarded; step_000002 is the last checkpoint."""
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={TOTAL}", "trainer.checkpoint_every=2",
                      "trainer.min_step_time_s=14", "trainer.stop_grace_s=16")
    run = Launch(MODE, args, out, "SIGTERM during an update longer than the grace period")
    try:
        assert run.wait_rows(3), run.why("the run ended before its step 3")
        run.scan(force=True)
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        code, err = stopped_within_grace(run, t_signal, 16)
        line = one_stop_line(run, code, err)
        root = os.path.join(out, "checkpoints")
        expected = (f"stopped at step 3 without a checkpoint of it (trainer.stop_grace_s=16 ran out before it was written); "
                    f"the last checkpoint is {os.path.join(root, 'step_000002')}; resume with: ")
        assert line.startswith(expected) and line.endswith("trainer.resume=latest"), run.why(line)
        assert "trainer.stop_grace_s=16 nearly over: the update or save in progress is given up" in err, run.why("no warning")
        path, state = checkpoint_state(out)
        assert state["step"] == state["version"] == 2, run.why(path)
        assert [r["step"] for r in run.rows(complete_only=False)] == [1, 2, 3], run.why("rows")
        resume_continues(run, args, "trainer.min_step_time_s=0")
    finally:
        run.cleanup()
