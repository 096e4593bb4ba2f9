"""Stopped the way clusters stop a job, end to end through the launcher, one job stopped and resumed
again and again as a preemptible job is:

- SIGTERM to the launcher's whole process group (`timeout`, SLURM's scancel, systemd): a graceful
  stop with a checkpoint of the current step, since Ray's processes are kept out of the group;
- SIGTERM to every process of the run by pid (SLURM, systemd's control-group stop): the trainers
  go too, so one line names the last checkpoint;
- the driver killed outright (SIGKILL, the OOM killer): no Ray process lingers.

Each ends with exit 143 (or -9) within 30 s, one line, no Ray process left, and
`trainer.resume=latest` continuing from the checkpoint with exact step and sample counts.

A stop never waits on long work (the same checks, within trainer.stop_grace_s): SIGTERM during an
evaluation that would outlast the grace period, during a slow reward (a scoring service that
sleeps), during a checkpoint write, and during an update longer than the grace period (given up;
the step before it is saved from the trainer's staged state).

Each test is one job: every stop's resumed run is where the next stop lands (starting a run costs
more than the steps it makes), and the last one runs to its end, its counters checked over every
step of every run.
"""

from __future__ import annotations

import contextlib
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


def stopped_within_grace(run: Launch, t_signal: float, grace_s: float = GRACE_S) -> tuple[int, str]:
    code, err = run.finish(timeout=grace_s + 60)
    took = time.monotonic() - t_signal
    print(f"{run.context}: exit {code} after {took:.1f} s")
    assert took <= grace_s, run.why(f"took {took:.1f} s to stop")
    junk = unexpected_stderr(err, MODE)
    assert not junk and "Traceback" not in err, run.why(f"more than one line: {junk[:5]}")
    return code, err


def one_stop_line(run: Launch, code: int, err: str) -> str:
    stopped = [line for line in err.splitlines() if line.startswith("stopped")]
    assert code == 143 and len(stopped) == 1, run.why(f"exit {code}, lines {stopped}")
    assert not run.leftovers(), run.why(f"Ray processes outlived the launcher: {run.leftovers()}")
    return stopped[0]


def steps_logged(run: Launch) -> list[int]:
    """The steps of metrics.jsonl's rows, every run's (a resumed run logs again the steps after its checkpoint)."""
    return [r["step"] for r in run.rows(complete_only=False) if r["step"] >= 1]


class Job:
    """One output_dir, launched, stopped and resumed: `resume` starts the next run from the newest
    checkpoint; `steps` are the steps the current run has logged."""

    def __init__(self, tiny_model_dir, prompt_file, tmp_path, *extra: str):
        self.out = str(tmp_path / "run")
        self.args = small_args(tiny_model_dir, prompt_file, self.out, f"trainer.total_steps={TOTAL}", *extra)
        self.launches: list[Launch] = []
        self.logged_before = 0  # rows of earlier runs
        self.resumed_at: int | None = None  # the step the current run resumed from (check_continued)
        self.resume_line = self.says = ""  # what the current run must say it resumed from, and `says`

    def launch(self, what: str) -> Launch:
        self.launches.append(Launch(MODE, self.args, self.out, what))
        return self.run

    @property
    def run(self) -> Launch:
        return self.launches[-1]

    @property
    def steps(self) -> list[int]:
        return steps_logged(self.run)[self.logged_before:]

    def wait_steps(self, n: int, delay_s: float = 0.0) -> None:
        """Until the current run has logged `n` steps, then `delay_s` more."""
        assert self.run.wait_until(lambda: len(self.steps) >= n, 300, f"its step {n}"), self.run.why(f"the run ended before its step {n}")
        self.run.sleep(delay_s)
        self.run.scan(force=True)

    def resume(self, what: str, *changes: str, says: str = "") -> Launch:
        """trainer.resume=latest with `changes` (key=value): the new run says it resumed from the
        newest checkpoint (and `says`), and is checked to go on from its step with `check_continued`."""
        path, state = checkpoint_state(self.out)
        assert state is not None, self.run.why("no checkpoint to resume")
        k = state["step"]
        assert state["version"] == k and os.path.basename(path) == f"step_{k:06d}", self.run.why(f"{path}: step {k}")
        keys = tuple(c.split("=")[0] + "=" for c in (*changes, "trainer.resume=latest"))
        self.args = [a for a in self.args if not a.startswith(keys)] + [*changes, "trainer.resume=latest"]
        self.logged_before, self.resumed_at = len(steps_logged(self.run)), k
        self.resume_line, self.says = f"resumed from {path} at step {k}", says
        return self.launch(f"{self.run.context}; resumed from step {k}: {what}")

    def check_continued(self) -> None:
        """The resumed run took the newest checkpoint and logs the steps after it, in order."""
        err, k = self.run.stderr, self.resumed_at
        assert self.resume_line in err, self.run.why(f"no {self.resume_line!r}")
        assert self.says in err, self.run.why(f"no {self.says!r}")
        assert self.steps == list(range(k + 1, k + 1 + len(self.steps))), self.run.why(f"resumed steps {self.steps} after {k}")

    def finish_resumed(self, *changes: str, says: str = "") -> None:
        """The last run: resumed (with `changes`) for two steps past the furthest step logged; one
        summary on stdout, every step's counters exact over all the runs, the final checkpoint's too."""
        target = max([*steps_logged(self.run), checkpoint_state(self.out)[1]["step"]]) + 2
        run = self.resume("to the end", *changes, f"trainer.total_steps={target}", says=says)
        code, _ = run.finish(timeout=400)
        assert code == 0, run.why("the resumed run failed")
        self.check_continued()
        assert self.steps[-1] == target, run.why(f"ended at {self.steps}, expected {target}")
        assert run.stdout.count("summary: ") == 1, run.why(f"stdout: {run.stdout[-2000:]}")  # not logger and cli both
        final = last_per_step(run.rows(complete_only=False))
        final = [r for r in final if r["step"] >= 1]
        assert [r["step"] for r in final] == list(range(1, target + 1)), run.why(f"steps {[r['step'] for r in final]}")
        assert_counters(run, final, final[-1:], killed_rollout=False)
        _, end = checkpoint_state(self.out)
        assert end["step"] == end["version"] == target and end["consumed_samples"] == final[-1]["samples/consumed"], \
            run.why(f"final checkpoint: step {end['step']}, consumed {end['consumed_samples']}")
        assert not run.leftovers(), run.why("Ray processes outlived the resumed launcher")

    def cleanup(self) -> None:
        for run in self.launches:
            with contextlib.suppress(Exception):
                run.cleanup()


def stop_line(job: Job, grace_s: float, pattern: str) -> re.Match:
    """SIGTERM to the current run's process group: gone within `grace_s`, one line matching `pattern`."""
    run = job.run
    t_signal = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    run.scan(force=True)
    code, err = stopped_within_grace(run, t_signal, grace_s)
    line = one_stop_line(run, code, err)
    m = re.match(pattern, line)
    assert m, job.run.why(line)
    return m


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", _seeds(default=(0,)))
def test_a_job_stopped_as_clusters_stop_it_resumes_each_time_with_exact_counts(tiny_model_dir, prompt_file, tmp_path, seed):
    """SIGTERM to every process, then, resumed with a changed lr, SIGTERM to the process group at a
    seeded point (after step 1-6, 0-1.5 s into the next: mid-update, mid-rollout, mid-save), then,
    resumed, SIGKILL to the driver, then resumed to the end.
    A soak: FAULT_SEEDS=0-19 python -m pytest tests/test_cluster_signals.py -k clusters"""
    rng = random.Random(seed)
    rows, delay_s = rng.randint(1, 6), round(rng.uniform(0.0, 1.5), 2)
    job = Job(tiny_model_dir, prompt_file, tmp_path, "trainer.checkpoint_every=2")
    try:
        # 1. SIGTERM to every process by pid: the trainers go too, the line names the last checkpoint
        # (Kept on a fresh run: in a resumed one the driver once exited 1 after its stop line, Ray
        # printing that it tried to recover 2 lost objects; probably the queue it restored, which it owns.)
        run = job.launch("SIGTERM to every process by pid")
        job.wait_steps(3)
        every = [run.proc.pid, *alive(run.seen), *ray_processes(run.ray_tmp)]
        t_signal = time.monotonic()
        for pid in dict.fromkeys(every):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        code, err = stopped_within_grace(run, t_signal)
        line = one_stop_line(run, code, err)
        path, state = checkpoint_state(job.out)
        m = re.match(r"stopped at step (\d+)(?: without a checkpoint of it \(the signal stopped Ray's processes too\); "
                     r"the last checkpoint is (\S+))?; resume with: .* trainer\.resume=latest$", line)
        assert m, run.why(f"unexpected stop line {line!r}")
        n = int(m.group(1))
        if m.group(2):  # the trainers went with the signal: the line names the checkpoint that resume takes
            assert m.group(2) == path and state["step"] < n, run.why(f"the line names {m.group(2)}, latest is {path}")
        else:  # the driver saved before the trainers went (or its periodic checkpoint was of this step)
            assert state["step"] == n, run.why(f"stopped at {n}, latest {path}")

        # 2. the printed command, with a changed lr; SIGTERM to the process group: a checkpoint of
        # the step it stops at, since Ray's processes are kept out of the group
        run = job.resume(f"SIGTERM to the process group after step {rows} + {delay_s} s (seed {seed})", "trainer.lr=5e-3",
                         says="resume: applying changed settings: trainer.lr 0.01 -> 0.005")
        job.wait_steps(rows, delay_s)
        m = stop_line(job, GRACE_S, r"stopped at step (\d+); resume with: .* trainer\.resume=latest$")
        job.check_continued()
        path, state = checkpoint_state(job.out)
        n = int(m.group(1))
        assert state["step"] == state["version"] == n and os.path.basename(path) == f"step_{n:06d}", run.why(path)
        assert job.steps[-1] == n, run.why(f"steps {job.steps}")

        # 3. SIGKILL to the driver: no Ray process lingers; resumed from the last periodic checkpoint
        run = job.resume("SIGKILL to the driver")
        job.wait_steps(3)
        run.proc.kill()
        code, _ = run.finish(timeout=30)
        assert code == -signal.SIGKILL, run.why(f"exit {code}")
        # the raylet's agents included (they would poll for the raylet for a minute, ignoring SIGTERM)
        left = run.leftovers(timeout=10)
        assert not left, run.why(f"Ray processes outlived the killed driver: {left}")
        job.check_continued()

        job.finish_resumed()
    finally:
        job.cleanup()


# -- a stop never waits on long work -----------------------------------------------------------------
STOP_GRACE_S = 20  # trainer.stop_grace_s's default
LONG_EVAL = ("eval.at_start_and_end=true", "eval.samples_per_prompt=64", "eval.num_steps=100")
GIVE_UP_GRACE_S = 16  # the least trainer.stop_grace_s (its last 8 s shut Ray down): an update is given up after 8 s
LONG_UPDATE_S = 14  # trainer.min_step_time_s: an update in flight at the signal outlasts those 8 s


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
def test_a_stop_never_waits_on_long_work(tiny_model_dir, prompt_file, tmp_path):
    """SIGTERM during the step-0 evaluation, then (resumed) during a slow reward, then during a
    checkpoint write, then during an update longer than the grace period; then resumed to the end."""
    scorer = SleepingScorer()
    job = Job(tiny_model_dir, prompt_file, tmp_path, "trainer.checkpoint_every=2", *LONG_EVAL, *scorer.args())
    root = os.path.join(job.out, "checkpoints")
    stopped_at = r"stopped at step (\d+); resume with: .* trainer\.resume=latest$"
    try:
        # 1. the step-0 evaluation, longer than the grace period: abandoned, step 0 saved
        outlasts = evaluation_time_s(job.args)
        assert outlasts > 1.5 * STOP_GRACE_S, f"the evaluation takes {outlasts:.0f} s: not long enough to test a stop"
        run = job.launch(f"SIGTERM during the step-0 evaluation (at least {outlasts:.0f} s)")
        run.wait_until(lambda: "step 0: evaluating" in run.stderr, 300, "the step-0 evaluation")
        run.sleep(2.0)
        stop_line(job, STOP_GRACE_S, r"stopped at step 0; resume with: .* trainer\.resume=latest$")
        assert "step 0: evaluation abandoned for the stop (SIGTERM); not logged" in run.stderr, run.why("no word of the evaluation")
        assert run.rows(complete_only=False) == [], run.why("a metrics row of the abandoned evaluation")
        path, state = checkpoint_state(job.out)
        assert state["step"] == state["version"] == 0, run.why(path)

        # 2. a slow reward (fully_async): the group being scored is not waited for (a ticket in
        # flight, regenerated on resume)
        run = job.resume("SIGTERM during a slow reward", "eval.at_start_and_end=false")
        job.wait_steps(1)
        scorer.slow.set()
        run.wait_until(scorer.sleeping.is_set, 120, "a reward call in the slow service")
        run.sleep(1.0)
        n = int(stop_line(job, STOP_GRACE_S, stopped_at).group(1))
        job.check_continued()
        path, state = checkpoint_state(job.out)
        assert state["step"] == state["version"] == n, run.why(path)
        scorer.slow.clear()

        # 3. a checkpoint write goes on (a checkpoint is never left half-made), then the stop's own
        run = job.resume("SIGTERM during a checkpoint write", "trainer.checkpoint_every=1")
        job.wait_steps(1)
        deadline = time.monotonic() + 120
        while not any(name.startswith(".tmp-") for name in os.listdir(root)):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.why("no checkpoint write seen")
            time.sleep(0.002)
        n = int(stop_line(job, STOP_GRACE_S, stopped_at).group(1))
        job.check_continued()
        path, state = checkpoint_state(job.out)
        assert state["step"] == state["version"] == n and os.path.basename(path) == f"step_{n:06d}", run.why(path)
        assert not [name for name in os.listdir(root) if name.startswith((".tmp-", ".old-"))], run.why("a half-made checkpoint")

        # 4. an update longer than the grace period is given up, and the step before it saved from the
        # trainer's staged state: the signal lands once an odd step j is logged (update j+1 in flight:
        # fully_async starts it before step j is logged); step j-1 is the last periodic checkpoint
        run = job.resume("SIGTERM during an update longer than the grace period", "trainer.checkpoint_every=2",
                         f"trainer.min_step_time_s={LONG_UPDATE_S}", f"trainer.stop_grace_s={GIVE_UP_GRACE_S}")
        j = job.resumed_at + 1 + job.resumed_at % 2
        job.wait_steps(j - job.resumed_at)
        n = int(stop_line(job, GIVE_UP_GRACE_S, stopped_at).group(1))
        job.check_continued()
        assert n == j and f"step {j}: a stop during update {j + 1}: step {j} saved from the trainer's staged state" in run.stderr, \
            run.why(f"stopped at {n}")
        assert f"trainer.stop_grace_s={GIVE_UP_GRACE_S} nearly over: the update or save in progress is given up" in run.stderr, \
            run.why("no warning")
        path, state = checkpoint_state(job.out)
        assert state["step"] == state["version"] == j and os.path.basename(path) == f"step_{j:06d}", run.why(path)
        assert os.listdir(os.path.join(path, "weights")), run.why("no weights in the staged checkpoint")
        assert job.steps[-1] == j, run.why(f"steps {job.steps}")

        job.finish_resumed("trainer.min_step_time_s=0")
    finally:
        job.cleanup()
        scorer.server.shutdown()
