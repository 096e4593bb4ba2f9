"""Fault injection, end to end through the launchers: signal or SIGKILL the driver at a random
point (during start-up, the step-0 evaluation, or a random delay after a random step), SIGKILL a
rollout actor or the trainer actor, corrupt the newest checkpoint, feed bad files; then assert that
nothing is lost and every error is one line:

- the exit code (143 / 130 for a stop, 1 for a dead trainer, 2 for bad input, 0 when the run had
  already finished) and nothing on stderr but log lines and that one line (no traceback, no stack
  dump of Ray's signal handler);
- the newest checkpoint holds exactly the updates it is named after, and the metrics rows are steps
  1..N, each once;
- no Ray process (the cluster's daemons, or any worker the run started) outlives the launcher;
- the printed command (or ``trainer.resume=latest``) resumes, and the counters continue exactly:
  steps contiguous, ``samples/consumed`` (+ ``samples/lost``) = 4 samples x step, fully_async's
  produced = consumed + lost + dropped + drained + queued, nothing drained on resume.

Where each fault lands is drawn from a seed (printed in every assertion message, with the stderr
tail). The default seeds run in about two minutes on 2 cores; a soak run picks its own:

    FAULT_SEEDS=1,2,3,4,5,6,7,8 pytest tests/test_fault_injection.py      # or FAULT_SEEDS=100-139
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from async_flowgrpo import checkpoint
from async_flowgrpo.checkpoint import Checkpointer, CheckpointError, RunDirLock, run_dir_used
import test_launcher
from test_launcher import ENV, REPO, ray_processes, small_args

prompt_file = test_launcher.prompt_file  # the fixture: four shape prompts

MODES = ("sync", "one_step_off", "fully_async")
PER_STEP = 4  # samples per step: 2 groups of 2 (small_args)
LONG_RUN = 40  # total_steps of a run that a fault interrupts (it takes well over a minute)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _seeds(default: tuple[int, ...]) -> list[int]:
    """FAULT_SEEDS="1,2,3" or "100-139" (a soak run), else `default`."""
    spec = os.environ.get("FAULT_SEEDS", "").strip()
    if not spec:
        return list(default)
    seeds = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


# The defaults are picked to cover, between them (see DriverFault.draw): SIGTERM after a step with a
# rollout actor killed before it (fully_async, 9), SIGKILL of the driver after a step (one_step_off,
# 3); a trainer killed in fully_async, then an emptied state.json (2). A soak run adds SIGINT, second
# signals, start-up, the step-0 evaluation and the other modes. Seed 0 (SIGTERM 6.45 s after launch)
# is not a default: where it lands depends on the machine's speed, and right after ray.init Ray's C++
# crash handler can still dump a stack (exit -6; README, Limitations).
DRIVER_SEEDS = _seeds((9, 3))
TRAINER_SEEDS = _seeds((2,))


# -- processes -------------------------------------------------------------------------------------
def _process_table() -> dict[int, tuple[int, str, str]]:
    """{pid: (parent pid, start time, command line)} of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[19], cmd)
    return table


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """{pid: (start time, command line)} of every process under `root`."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found[pid] = table[pid][1:]
            todo.append(pid)
    return found


def alive(processes: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str]]:
    """Those of `processes` ({pid: (start time, command line)}) still running (not a reused pid)."""
    table = _process_table()
    return {pid: p for pid, p in processes.items() if pid in table and table[pid][1] == p[0]}


# -- a launcher run ----------------------------------------------------------------------------------
class Launch:
    """`launch/<mode>.py` as a subprocess with a private RAY_TMPDIR, in a session (and process group)
    of its own, as a scheduler starts a job: a signal to its group reaches nothing else. stdout and
    stderr go to files (a pipe could fill while the test waits). Remembers every process it started,
    to check that none outlives it and to clean up after a failed test."""

    def __init__(self, mode: str, args: list[str], output_dir: str, context: str):
        self.mode, self.args, self.output_dir, self.context = mode, args, output_dir, context
        self.ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
        self.err_path = os.path.join(self.ray_tmp, "launcher.stderr")
        self.out_path = os.path.join(self.ray_tmp, "launcher.stdout")
        self.launcher = os.path.join(REPO, "launch", f"{mode}.py")
        with open(self.err_path, "w") as err, open(self.out_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, self.launcher, *args], stdout=out, stderr=err,
                                         env={**ENV, "RAY_TMPDIR": self.ray_tmp}, cwd=REPO, start_new_session=True)
        self.t0 = time.monotonic()
        self.seen: dict[int, tuple[str, str]] = {}  # every process under the launcher, ever
        self._scanned = 0.0

    # what it wrote
    @property
    def stderr(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()

    @property
    def stdout(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def why(self, message: str) -> str:
        """An assertion message: what went wrong, the seed's plan and the stderr tail."""
        return f"{message}\n[{self.context}; exit {self.proc.returncode}]\n--- stderr tail ---\n{self.stderr[-3000:]}"

    def rows(self, complete_only: bool = True) -> list[dict]:
        return read_rows(self.output_dir, complete_only)

    # waiting
    def scan(self, force: bool = False) -> dict[int, tuple[str, str]]:
        if force or time.monotonic() - self._scanned > 1.0:
            self._scanned = time.monotonic()
            found = descendants(self.proc.pid)
            self.seen.update(found)
            return found
        return {}

    def wait_until(self, done, timeout: float, what: str) -> bool:
        """Poll `done()` until true (True) or the launcher exits (False); fail after `timeout` s."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if done():
                return True
            if time.monotonic() > deadline:
                raise AssertionError(self.why(f"timed out after {timeout:.0f} s waiting for {what}"))
            self.scan()
            time.sleep(0.1)
        return False

    def wait_rows(self, n: int, timeout: float = 300) -> bool:
        return self.wait_until(lambda: len(self.rows()) >= n, timeout, f"metrics row {n}")

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.scan()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def actor_pids(self, cls: str) -> list[int]:
        return [pid for pid, (_, cmd) in self.scan(force=True).items() if cmd.startswith(f"ray::{cls}")]

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(self.why(f"the launcher did not exit within {timeout:.0f} s")) from None
        return self.proc.returncode, self.stderr

    def leftovers(self, timeout: float = 30, ignore: tuple[str, ...] = ()) -> list[str]:
        """Ray processes still alive `timeout` s after the launcher exited: its daemons (found by
        the private RAY_TMPDIR in their command line) and any process it ever had under it, but
        those whose command line starts with an `ignore` prefix."""
        deadline = time.monotonic() + timeout
        while True:
            left = [f"{pid} {cmd[:80]}" for pid, (_, cmd) in alive(self.seen).items() if not cmd.startswith(ignore)]
            left += [f"{pid} (ray daemon)" for pid in ray_processes(self.ray_tmp) if pid not in self.seen]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def cleanup(self) -> None:
        """Kill what is left of this launch (only processes it started, by pid) and its temp dir."""
        if self.proc.poll() is None:
            self.scan(force=True)
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in [*alive(self.seen), *ray_processes(self.ray_tmp)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def read_rows(output_dir: str, complete_only: bool = True) -> list[dict]:
    """metrics.jsonl's rows, in order (a resumed run appends). complete_only: leave out a last line
    still being written (while the run goes on); otherwise every line must parse."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in (lines[:-1] if complete_only else lines) if line]


def last_per_step(rows: list[dict]) -> list[dict]:
    """What readers of metrics.jsonl see: the last row of each step (a resumed run may log again a
    step that a killed one logged but did not checkpoint), in step order."""
    by_step = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+(INFO|WARNING)\b")


def unexpected_stderr(stderr: str, mode: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """Lines of stderr that are neither log lines (INFO / WARNING), the launcher's banner, the one
    line a stop prints, nor an `allowed` prefix: tracebacks, Ray's stack dumps, "Exception ignored"."""
    ok = (f"async_flowgrpo {mode}: model=", "stopped at step ", "stopped during start-up", *allowed)
    return [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line) and not line.startswith(ok)]


def checkpoint_state(output_dir: str) -> tuple[str | None, dict | None]:
    """(path, full state) of the checkpoint `trainer.resume=latest` would take, or (None, None)."""
    try:
        path, _ = Checkpointer(os.path.join(output_dir, "checkpoints")).find("latest")
    except CheckpointError:
        return None, None
    return path, checkpoint.load(path)


def assert_counters(launch: Launch, rows: list[dict], identity_rows: list[dict], killed_rollout: bool) -> None:
    """Every step trains exactly one batch: 4 samples per step, trained or (fully_async, a rollout
    actor killed) counted as lost; produced samples all accounted for."""
    for row in rows:
        s = row["step"]
        assert row["version"] == s, launch.why(f"step {s}: version {row['version']}")
        if launch.mode == "fully_async":
            assert row["samples/consumed"] + row["samples/lost"] == PER_STEP * s, launch.why(
                f"step {s}: samples/consumed {row['samples/consumed']} + samples/lost {row['samples/lost']} != {PER_STEP} x {s}")
            # (a step whose groups were all lost with a killed rollout actor trains nothing: no staleness)
            assert row.get("staleness/max", 0) <= 1, launch.why(f"step {s}: staleness/max {row.get('staleness/max')}")
        else:
            assert row["samples/consumed"] == row["samples/produced"] == PER_STEP * s and row["samples/lost"] == 0, launch.why(
                f"step {s}: consumed {row['samples/consumed']}, produced {row['samples/produced']}, lost {row['samples/lost']}")
        if not killed_rollout:
            assert row["samples/lost"] == 0, launch.why(f"step {s}: samples/lost {row['samples/lost']} with no actor killed")
    if launch.mode == "fully_async":
        for row in identity_rows:
            parts = {k: row[k] for k in ("samples/consumed", "samples/lost", "samples/dropped_stale", "samples/drained",
                                         "queue/size_samples")}
            assert row["samples/produced"] == sum(parts.values()), launch.why(
                f"step {row['step']}: samples/produced {row['samples/produced']} != {parts}")


# -- 1. the driver, signalled or killed at a random point --------------------------------------------
@dataclasses.dataclass
class DriverFault:
    """Where the fault lands, drawn from `seed`."""

    seed: int
    mode: str
    signum: int  # SIGTERM / SIGINT (a graceful stop) or SIGKILL (a crash)
    phase: str  # "start-up": `delay` s after the launch; "running": `delay` s after row `after_row`
    delay: float
    after_row: int
    eval_at_start: bool  # the step-0 evaluation runs (start-up: the signal may land in it)
    checkpoint_every: int
    kill_rollout: bool  # running: SIGKILL the rollout actor `kill_delay` s after row `kill_after_row` first
    kill_after_row: int
    kill_delay: float
    twice: bool  # SIGTERM / SIGINT: a second signal `second_delay` s after the first (leave at once)
    second_delay: float
    # running, SIGTERM / SIGINT: the first signal lands in long work, which the stop must not wait for:
    # "evaluation" (longer than trainer.stop_grace_s), "reward" (a scoring service that sleeps),
    # "checkpoint" (a periodic checkpoint being written); "": at `delay` after the row
    stop_point: str = ""

    @classmethod
    def draw(cls, seed: int) -> "DriverFault":
        rng = random.Random(f"driver:{seed}")
        mode = rng.choice(MODES)
        signum = rng.choice([signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
        phase = rng.choice(["start-up", "running", "running"])
        delay = rng.uniform(0.5, 12.0) if phase == "start-up" else rng.uniform(0.0, 1.5)
        after_row, eval_at_start = rng.randint(1, 3), phase == "start-up" and rng.random() < 0.5
        checkpoint_every = 1 if signum == signal.SIGKILL else rng.choice([0, 1])
        kill_rollout, kill_after_row = phase == "running" and rng.random() < 0.5, rng.randint(1, 2)
        kill_delay = rng.uniform(0, 1)
        twice, second_delay = signum != signal.SIGKILL and rng.random() < 0.25, rng.uniform(0.0, 0.6)
        stop_point = ""  # (drawn last, so that the plans of seeds drawn before it stay the same)
        if phase == "running" and signum != signal.SIGKILL and not kill_rollout and rng.random() < 0.5:
            stop_point = rng.choice(["evaluation", "reward", "checkpoint"])
            checkpoint_every = 1 if stop_point == "checkpoint" else checkpoint_every
        return cls(seed, mode, signum, phase, round(delay, 2), after_row, eval_at_start, checkpoint_every, kill_rollout,
                   kill_after_row, round(kill_delay, 2), twice, round(second_delay, 2), stop_point)

    def __str__(self) -> str:
        where = f"{self.delay}s after launch" if self.phase == "start-up" else f"{self.delay}s after row {self.after_row}"
        kill = f", rollout actor killed {self.kill_delay}s after row {self.kill_after_row} first" if self.kill_rollout else ""
        where += f" and again {self.second_delay}s later" if self.twice else ""
        if self.stop_point:
            where = {"evaluation": f"{self.delay}s into the evaluation after row {self.after_row}",
                     "reward": f"{self.delay}s into a slow reward call after row {self.after_row}",
                     "checkpoint": f"during the checkpoint write after row {self.after_row}"}[self.stop_point]
            where += f" and again {self.second_delay}s later" if self.twice else ""
        return (f"seed {self.seed}: {self.mode}, {signal.Signals(self.signum).name} {where}{kill}, "
                f"checkpoint_every={self.checkpoint_every}, eval_at_start={self.eval_at_start}")

    def args(self) -> list[str]:
        """The run's extra overrides for its stop point (and, for the resume, without the long evaluation)."""
        if self.stop_point == "evaluation":  # the first evaluation comes right after row after_row
            return [f"eval.every={self.after_row + 1}", "eval.samples_per_prompt=64", "eval.num_steps=30"]
        return []


class SleepingScorer:
    """A local reward service (rewards/remote.py's protocol): random scores, at once or, while `slow`
    is set, after `sleep_s` (an overloaded OCR or GenEval server)."""

    def __init__(self, sleep_s: float = 50.0):  # under the remote reward's 60-s timeout: it would answer, late
        self.slow, self.sleeping = threading.Event(), threading.Event()
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if scorer.slow.is_set():
                    scorer.sleeping.set()
                    time.sleep(sleep_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps({"scores": [random.random() for _ in body["prompts"]]}).encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def args(self) -> list[str]:
        return ["reward.weights={remote: 1.0}", f"reward.options={{remote: {{url: '{self.url}', retries: 0}}}}"]


STOP_GRACE_S = 20  # trainer.stop_grace_s's default: a stop in long work ends within it


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", DRIVER_SEEDS)
def test_a_driver_fault_at_a_random_point_loses_nothing(seed, tiny_model_dir, prompt_file, tmp_path):
    plan = DriverFault.draw(seed)
    out = str(tmp_path / "run")
    extra = [f"trainer.total_steps={LONG_RUN}", f"trainer.checkpoint_every={plan.checkpoint_every}", "ray.batch_wait_s=1"]
    if plan.eval_at_start:
        extra += ["eval.at_start_and_end=true", "eval.samples_per_prompt=1", "eval.num_steps=2"]
    scorer = SleepingScorer() if plan.stop_point == "reward" else None
    extra += plan.args() + (scorer.args() if scorer else [])
    args = small_args(tiny_model_dir, prompt_file, out, *extra)
    run = Launch(plan.mode, args, out, str(plan))
    resumed = None
    try:
        # -- the fault --------------------------------------------------------------------------------
        if plan.phase == "start-up":
            run.sleep(plan.delay)
        else:
            signal_row = plan.after_row
            if plan.kill_rollout and run.wait_rows(plan.kill_after_row):
                run.sleep(plan.kill_delay)
                pids = run.actor_pids("RolloutActor")
                assert pids, run.why("no rollout actor process found to kill")
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                # the run goes on: the actor is restarted (counted) and steps keep coming
                run.wait_until(lambda: any(r.get("rollout/restarts", 0) >= 1 for r in run.rows()), 300,
                               "a row counting the killed rollout actor's restart")
                signal_row = len(run.rows()) + plan.after_row - 1
            if run.wait_rows(signal_row):
                if plan.stop_point:
                    reach_stop_point(run, plan, scorer)
                else:
                    run.sleep(plan.delay)
        t_signal = time.monotonic()
        if run.proc.poll() is None:
            run.scan(force=True)
            run.proc.send_signal(plan.signum)
            if plan.twice:
                run.sleep(plan.second_delay)
                if run.proc.poll() is None:
                    run.proc.send_signal(plan.signum)
        code, err = run.finish(timeout=300)
        took = time.monotonic() - t_signal
        print(f"{plan}: exit {code} after {time.monotonic() - run.t0:.1f}s ({took:.1f} s after the signal), "
              f"{[line[:60] for line in err.splitlines() if line.startswith(('stopped', 'error'))] or 'no line'}")
        if plan.stop_point:  # the stop did not wait for the long work
            assert took <= STOP_GRACE_S, run.why(f"took {took:.1f} s to stop, more than trainer.stop_grace_s")

        # -- how it ended -------------------------------------------------------------------------------
        junk = unexpected_stderr(err, plan.mode)
        assert not junk, run.why(f"stderr holds more than one line per error: {junk[:5]}")
        assert "Traceback" not in err, run.why("a traceback on stderr")

        def no_leftovers(during_start_up: bool = False):
            # After a SIGKILL nothing in the driver runs: Ray's own fate-sharing takes the GCS, the raylet
            # and the workers down at once, its two agents only about a minute later (they poll the raylet).
            # The same for a stop inside ray.init: ray.shutdown() does not know the agents of a half-started node.
            left = run.leftovers(ignore=RAY_AGENTS if plan.signum == signal.SIGKILL or during_start_up else ())
            assert not left, run.why(f"Ray processes outlived the launcher: {left}")

        rows = run.rows(complete_only=False)
        steps = [r["step"] for r in rows if r["step"] >= 1]
        path, state = checkpoint_state(out)
        stopped = [line for line in err.splitlines() if line.startswith("stopped")]
        if code == 0:  # the run had finished before the fault
            assert steps == list(range(1, LONG_RUN + 1)) and not stopped, run.why(f"exit 0 with steps {steps}")
            no_leftovers()
            return
        if plan.signum == signal.SIGKILL:
            assert code == -signal.SIGKILL and not stopped, run.why(f"exit {code} after SIGKILL")
            # every checkpoint is complete (`latest` names one that passes its checks), and no step is missing
            assert steps == list(range(1, len(steps) + 1)), run.why(f"metrics rows {steps}")
            if state is not None:
                k = state["step"]
                assert state["version"] == k and os.path.basename(path) == f"step_{k:06d}", run.why(f"{path}: {state['step']}")
                assert len(steps) - 1 <= k <= len(steps), run.why(f"checkpoint of step {k}, rows {steps}")
            else:
                assert len(steps) <= 1, run.why(f"no checkpoint, yet rows {steps} (checkpoint_every=1)")
            with open(os.path.join(out, ".lock")) as f:  # the dead driver's pid: a stale lock that must not block
                assert f.read().strip() == str(run.proc.pid)
        else:
            # (a second signal that lands once the line is out and Ray is down, as the interpreter exits, kills it
            # outright: -signum, which a shell reports as 128 + signum too)
            codes = (128 + plan.signum, -plan.signum) if plan.twice and stopped else (128 + plan.signum,)
            assert code in codes, run.why(f"exit {code}, expected {codes}")
            assert len(stopped) == 1, run.why(f"expected one 'stopped ...' line, got {stopped}")
            if stopped[0].startswith("stopped during start-up"):
                assert state is None and steps == [], run.why(f"stopped during start-up, yet steps {steps} / {path}")
                assert not run_dir_used(out), run.why("a stop during start-up left the directory marked as used")
                RunDirLock(out).acquire().release()  # and not locked: "run the same command again" works
                no_leftovers(during_start_up=True)
                return
            m = re.match(r"stopped at step (\d+)( without a checkpoint of it \(second signal; the previous checkpoint is the latest\)"
                         r"| without a checkpoint \(second signal; there is none to resume\))?; (resume|start again) with: (.+)$",
                         stopped[0])
            assert m, run.why(f"unexpected stop line {stopped[0]!r}")
            n, unsaved, resume = int(m.group(1)), bool(m.group(2)), m.group(3) == "resume"
            assert plan.twice or not unsaved, run.why("one signal, yet no checkpoint of the step it stopped at")
            # the checkpoint holds exactly n updates (a second signal: the previous one, fewer), rows are steps 1..n, each once
            assert steps == list(range(1, n + 1)), run.why(f"stopped at step {n}, metrics rows {steps}")
            assert resume == (state is not None), run.why(f"the line says to {m.group(3)}, and the latest checkpoint is {path}")
            if unsaved and resume:
                assert state["step"] == state["version"] < n or (plan.checkpoint_every and state["step"] == n), \
                    run.why(f"stopped at {n} without a checkpoint of it, latest {path}")
            elif not unsaved:
                assert state is not None and os.path.basename(path) == f"step_{n:06d}", run.why(f"stopped at {n}, latest {path}")
                assert state["step"] == state["version"] == n, run.why(f"checkpoint step {state['step']} version {state['version']}")
            if n and not unsaved:
                assert state["consumed_samples"] == rows[-1]["samples/consumed"], run.why(
                    f"checkpoint consumed_samples {state['consumed_samples']}, last row {rows[-1]['samples/consumed']}")
            cmd = shlex.split(m.group(4))
            how = "trainer.resume=latest" if resume else "trainer.overwrite=true"
            assert cmd[:2] == ["python", run.launcher] and cmd[2:] == [*args, how], run.why(
                f"the printed command is not this run's: {cmd}")
        no_leftovers()
        run_rows = [r for r in rows if r["step"] >= 1]
        first_rows = last_per_step(run_rows)
        assert_counters(run, first_rows, first_rows if plan.checkpoint_every == 1 else first_rows[-1:], plan.kill_rollout)

        # -- resume (or, with no checkpoint to resume, start again) and count on -----------------------
        k = state["step"] if state is not None else 0
        target = max(k, len(steps)) + 2  # past every step logged (a second signal or SIGKILL: steps the checkpoint has not)
        again = [a for a in args if not a.startswith("trainer.total_steps=")] + [f"trainer.total_steps={target}"]
        if plan.stop_point == "evaluation":
            again += ["eval.every=0"]  # (the long evaluation has been tested; eval cadence may change on resume)
        if scorer is not None:
            scorer.slow.clear()
        again += ["trainer.resume=latest"] if state is not None else ["trainer.overwrite=true"]
        resumed = Launch(plan.mode, again, out, f"{plan}; resume of a run stopped at step {k}")
        code, err = resumed.finish(timeout=400)
        assert code == 0, resumed.why("the resumed run failed")
        junk = unexpected_stderr(err, plan.mode)
        assert not junk and "Traceback" not in err, resumed.why(f"unexpected stderr lines: {junk[:5]}")
        if state is not None:
            assert f"resumed from {path} at step {k}" in err, resumed.why(f"did not resume from {path}")
        all_rows = [r for r in resumed.rows(complete_only=False) if r["step"] >= 1]
        new = all_rows[len(run_rows):] if state is not None else all_rows
        assert [r["step"] for r in new] == list(range(k + 1, target + 1)), resumed.why(
            f"the resumed run logged steps {[r['step'] for r in new]}, expected {k + 1}..{target}")
        final = last_per_step(all_rows)
        assert [r["step"] for r in final] == list(range(1, target + 1)), resumed.why(f"steps {[r['step'] for r in final]}")
        assert_counters(resumed, final, final if plan.checkpoint_every == 1 else [final[-1]], plan.kill_rollout)
        if plan.mode == "fully_async" and not plan.kill_rollout:
            drained = [r["groups/drained"] for r in new]
            assert drained == [0] * len(new), resumed.why(f"groups drained on resume: {drained}")
        _, end = checkpoint_state(out)
        assert end["step"] == end["version"] == target and end["consumed_samples"] == final[-1]["samples/consumed"], \
            resumed.why(f"final checkpoint: step {end['step']}, consumed {end['consumed_samples']}")
        assert not resumed.leftovers(), resumed.why("Ray processes outlived the resumed launcher")
    finally:
        run.cleanup()
        if resumed is not None:
            resumed.cleanup()
        if scorer is not None:
            scorer.server.shutdown()


def reach_stop_point(run: Launch, plan: DriverFault, scorer: SleepingScorer | None) -> None:
    """After row plan.after_row: wait until the run is in the plan's long work (then plan.delay more)."""
    if plan.stop_point == "evaluation":
        if run.wait_until(lambda: f"step {plan.after_row + 1}: evaluating" in run.stderr, 300, "the evaluation"):
            run.sleep(plan.delay)
    elif plan.stop_point == "reward":
        scorer.slow.set()
        if run.wait_until(scorer.sleeping.is_set, 300, "a call to the slow reward"):
            run.sleep(plan.delay)
    else:  # a checkpoint being written (checkpoint_every=1): its temporary directory exists
        root = os.path.join(run.output_dir, "checkpoints")
        deadline = time.monotonic() + 300
        while run.proc.poll() is None and not any(n.startswith(".tmp-") for n in (os.listdir(root) if os.path.isdir(root) else ())):
            assert time.monotonic() < deadline, run.why("no checkpoint write seen")
            time.sleep(0.002)


# -- 2. the trainer actor killed; then the newest checkpoint corrupted -------------------------------
def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _empty(path: str) -> None:
    os.truncate(path, 0)


CORRUPTIONS = {  # name: (file in the checkpoint, what is done to it)
    "truncate tensors.safetensors": ("tensors.safetensors", _truncate),
    "empty state.json": ("state.json", _empty),
    "delete the LoRA weights file": ("weights", None),  # the first file under weights/
    "delete manifest.json": ("manifest.json", os.remove),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", TRAINER_SEEDS)
def test_a_killed_trainer_stops_with_one_line_and_a_corrupt_latest_checkpoint_falls_back(seed, tiny_model_dir, prompt_file,
                                                                                         tmp_path):
    rng = random.Random(f"trainer:{seed}")
    mode, after_row, delay = rng.choice(MODES), rng.randint(3, 4), round(rng.uniform(0, 1.0), 2)
    damage = rng.choice(sorted(CORRUPTIONS))
    context = f"seed {seed}: {mode}, trainer killed {delay}s after row {after_row}, then {damage}"
    out = str(tmp_path / "run")
    args = small_args(tiny_model_dir, prompt_file, out, f"trainer.total_steps={LONG_RUN}", "trainer.checkpoint_every=1",
                      "ray.batch_wait_s=1")
    run = Launch(mode, args, out, context)
    resumed = None
    try:
        assert run.wait_rows(after_row), run.why(f"the run ended before row {after_row}")
        run.sleep(delay)
        pids = run.actor_pids("TrainerActor")
        assert len(pids) == 1, run.why(f"trainer processes: {pids}")
        os.kill(pids[0], signal.SIGKILL)
        code, err = run.finish(timeout=300)
        print(f"{context}: exit {code} after {time.monotonic() - run.t0:.1f}s, "
              f"{[line[:90] for line in err.splitlines() if line.startswith('error')] or 'no line'}")

        # exit 1 with one line naming the last checkpoint, which is complete and resumable
        ckpt = Checkpointer(os.path.join(out, "checkpoints"))
        latest = ckpt.latest_name()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1, run.why(f"exit {code}, error lines {errors}")
        assert "an actor died" in errors[0] and f"last checkpoint: {latest};" in errors[0], run.why(f"the line: {errors[0]}")
        junk = unexpected_stderr(err, mode, allowed=("error: ",))
        assert not junk and "Traceback" not in err, run.why(f"unexpected stderr lines: {junk[:5]}")
        assert not run.leftovers(), run.why("Ray processes outlived the launcher")
        k = int(latest.split("_")[1])
        state = checkpoint.load(os.path.join(ckpt.root, latest))  # passes its checks and loads whole
        assert state["step"] == state["version"] == k >= 2, run.why(f"{latest}: step {state['step']}, version {state['version']}")
        steps = [r["step"] for r in run.rows(complete_only=False)]
        assert steps in (list(range(1, k + 1)), list(range(1, k + 2))), run.why(f"rows {steps} with {latest} the latest")
        assert state["consumed_samples"] == PER_STEP * k, run.why(
            f"{latest}: consumed_samples {state['consumed_samples']}")

        # corrupt it: the resume warns once naming the file, takes step k - 1 and continues from there
        name, corrupt = CORRUPTIONS[damage]
        target = os.path.join(ckpt.root, latest, name)
        if corrupt is None:
            target = next(os.path.join(d, f) for d, _, fs in sorted(os.walk(target)) for f in sorted(fs))
            os.remove(target)
        else:
            corrupt(target)
        previous = os.path.join(ckpt.root, f"step_{k - 1:06d}")
        again = [a for a in args if not a.startswith("trainer.total_steps=")]
        again += [f"trainer.total_steps={k + 1}", "trainer.resume=latest"]
        resumed = Launch(mode, again, out, f"{context}; resume past {target}")
        code, err = resumed.finish(timeout=400)
        assert code == 0, resumed.why("the resume failed")
        warnings = [line for line in err.splitlines() if "falling back to" in line]
        names = (target, f"{os.path.dirname(target)}: {os.path.basename(target)} missing")  # (manifest.json's wording)
        assert len(warnings) == 1 and any(n in warnings[0] for n in names), resumed.why(f"expected one warning naming {target}")
        assert warnings[0].endswith(f"falling back to {previous}"), resumed.why(f"expected a fallback to {previous}")
        junk = unexpected_stderr(err, mode)
        assert not junk and "Traceback" not in err, resumed.why(f"unexpected stderr lines: {junk[:5]}")
        assert f"resumed from {previous} at step {k - 1}" in err, resumed.why(f"did not resume from {previous}")
        rows = resumed.rows(complete_only=False)
        assert [r["step"] for r in rows[len(steps):]] == [k, k + 1], resumed.why(f"steps {[r['step'] for r in rows]}")
        final = last_per_step(rows)
        assert [r["step"] for r in final] == list(range(1, k + 2)), resumed.why(f"steps {[r['step'] for r in final]}")
        assert_counters(resumed, final, final, killed_rollout=False)
        path, end = checkpoint_state(out)
        assert os.path.basename(path) == f"step_{k + 1:06d}" and end["step"] == end["version"] == k + 1, resumed.why(path)
        assert checkpoint.load(os.path.join(ckpt.root, latest))["step"] == k, resumed.why(f"{latest} was not rewritten whole")
        assert not resumed.leftovers(), resumed.why("Ray processes outlived the resumed launcher")
    finally:
        run.cleanup()
        if resumed is not None:
            resumed.cleanup()


# -- 3. bad checkpoints fed to the launcher: one line, exit 2, before Ray ----------------------------
def _with_weights_file(tmp: str) -> None:
    os.makedirs(os.path.join(tmp, "weights"))
    with open(os.path.join(tmp, "weights", "lora.safetensors"), "wb") as f:
        f.write(b"x" * 64)


def test_a_run_dir_with_no_usable_checkpoint_is_one_line_exit_2(tiny_model_dir, prompt_file, tmp_path, caplog, capsys):
    """Every checkpoint broken in another way, and `latest` naming one that is gone: one warning per
    fallback, each naming its file, then exit 2 with one line; Ray never started. (In process: the
    launcher's own entry point, without a signal to deliver.)"""
    import ray
    import torch

    from async_flowgrpo.cli import main
    from async_flowgrpo.config import load_config
    from async_flowgrpo.driver import cluster

    cluster.shutdown_ray()  # an earlier module's shared Ray (conftest's ray_cluster): this test checks none starts
    out = str(tmp_path / "run")
    cfg = dataclasses.asdict(load_config("sync", small_args(tiny_model_dir, prompt_file, out)))
    ckpt = Checkpointer(os.path.join(out, "checkpoints"))
    broken = {}
    for step, (name, fn) in enumerate(CORRUPTIONS.values(), start=1):
        path = ckpt.save(step, {"step": step, "version": step, "config": cfg, "w": torch.ones(64)}, write_extra=_with_weights_file)
        target = os.path.join(path, name)
        if fn is None:
            target = os.path.join(target, "lora.safetensors")
            os.remove(target)
        else:
            fn(target)
        broken[path] = target
    with open(os.path.join(ckpt.root, "latest"), "w") as f:
        f.write("step_000099\n")
    with pytest.raises(SystemExit) as exit_info, caplog.at_level("WARNING"):
        main("sync", small_args(tiny_model_dir, prompt_file, out, "trainer.resume=latest"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"config error: trainer.resume=latest: no usable checkpoint under {ckpt.root} (newest: "), err
    warnings = [r.getMessage() for r in caplog.records if "falling back to" in r.getMessage()]
    assert len(warnings) == len(broken) - 1, warnings  # newest first; the oldest one's error is the line
    for (path, target), warning in zip(sorted(broken.items(), reverse=True), warnings):
        named = (target, f"{path}: manifest.json missing")
        assert "\n" not in warning and any(n in warning for n in named), (target, warning)
    assert not ray.is_initialized()
