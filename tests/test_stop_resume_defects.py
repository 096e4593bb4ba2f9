"""Stops and resumes as a scheduler drives them: the same command restarts a preempted job
(trainer.resume=auto), metrics.jsonl stays JSON lines across a crash mid-write, and a stop during
an update longer than the grace period still saves the last completed step (the trainer's state
staged in host memory)."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from async_flowgrpo import checkpoint
from async_flowgrpo.checkpoint import Checkpointer
from async_flowgrpo.cli import preflight
from async_flowgrpo.config import load_config, validate
from async_flowgrpo.metrics import RunLogger
from test_launcher import prompt_file  # noqa: F401 (the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # validation only needs a directory with model_index.json
    d = tmp_path_factory.mktemp("model")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return str(d)


def cfg_for(model_dir, out, *overrides):
    return load_config("sync", [f"model.path={model_dir}", f"trainer.output_dir={out}", *overrides])


# -- trainer.resume=auto ----------------------------------------------------------------------------
def test_resume_auto_without_a_checkpoint_starts_fresh_with_one_line(model_dir, tmp_path, caplog):
    """A job script's command, first run: no checkpoint yet, so it starts fresh and says so once.
    (Before: `auto` was refused as "not a directory", and `latest` exits 2 here.)"""
    out = tmp_path / "run"
    cfg = cfg_for(model_dir, out, "trainer.resume=auto")
    validate(cfg)
    with caplog.at_level(logging.INFO, logger="async_flowgrpo"):
        lock = preflight(cfg)
    lock.release()
    assert cfg.trainer.resume is None  # the run starts fresh
    said = [r.getMessage() for r in caplog.records if "trainer.resume=auto" in r.getMessage()]
    assert len(said) == 1 and "starting fresh" in said[0] and str(out / "checkpoints") in said[0]


def test_resume_auto_after_a_preemption_an_attempt_without_a_checkpoint(model_dir, tmp_path, caplog):
    """The requeued job's attempt left metrics rows but died before its first checkpoint: the same
    command starts fresh again (no exit 2 asking for trainer.overwrite)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = cfg_for(model_dir, out, "trainer.resume=auto")
    with caplog.at_level(logging.INFO, logger="async_flowgrpo"):
        preflight(cfg).release()
    assert cfg.trainer.resume is None


def test_resume_auto_with_a_checkpoint_resumes_the_latest(model_dir, tmp_path):
    out = tmp_path / "run"
    ckpt = Checkpointer(str(out / "checkpoints"))
    ckpt.save(1, {"step": 1})
    newest = ckpt.save(2, {"step": 2})
    cfg = cfg_for(model_dir, out, "trainer.resume=auto")
    preflight(cfg).release()
    assert cfg.trainer.resume == newest


def test_resume_auto_with_only_broken_checkpoints_is_an_error_not_a_fresh_start(model_dir, tmp_path):
    """A checkpoint that exists but cannot be read must not be silently replaced by step 0."""
    out = tmp_path / "run"
    path = Checkpointer(str(out / "checkpoints")).save(1, {"step": 1})
    with open(os.path.join(path, checkpoint.STATE_FILE), "w") as f:
        f.write("{not json")
    cfg = cfg_for(model_dir, out, "trainer.resume=auto")
    with pytest.raises(Exception, match="no usable checkpoint"):
        preflight(cfg)


# -- metrics.jsonl: whole lines --------------------------------------------------------------------
def test_a_torn_last_metrics_line_is_dropped_on_resume_with_one_line(model_dir, tmp_path, caplog):
    """A crash mid-write left half a line; the resumed run's rows must not be glued onto it.
    (Before: the next row was appended after the torn one, and the file no longer read as JSON lines.)"""
    out = tmp_path / "run"
    out.mkdir()
    whole = '{"step": 1, "reward/mean": 0.5}\n'
    (out / "metrics.jsonl").write_text(whole + '{"step": 2, "reward/me')
    cfg = cfg_for(model_dir, out)
    with caplog.at_level(logging.INFO, logger="async_flowgrpo"):
        with RunLogger(str(out), cfg, total_steps=3, progress=False) as log:
            log.log(2, {"reward/mean": 0.75})
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    said = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
    assert len(said) == 1 and "torn" in said[0]


@pytest.mark.parametrize("text", ['{"step": 1}\n', ""])
def test_an_intact_metrics_file_is_left_alone(model_dir, tmp_path, caplog, text):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(text)
    with caplog.at_level(logging.INFO, logger="async_flowgrpo"):
        RunLogger(str(out), cfg_for(model_dir, out), total_steps=3, progress=False).close()
    assert (out / "metrics.jsonl").read_text() == text
    assert not [r for r in caplog.records if "metrics.jsonl" in r.getMessage()]


def test_a_file_that_is_one_torn_line_is_emptied(model_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "rew')
    RunLogger(str(out), cfg_for(model_dir, out), total_steps=3, progress=False).close()
    assert (out / "metrics.jsonl").read_text() == ""


@pytest.mark.slow  # a subprocess
def test_a_write_that_fails_part_way_leaves_whole_lines(model_dir, tmp_path):
    """The disk (here a file-size limit) fills in the middle of a row: the error reaches the caller
    and the file still ends with a whole line. (Before: the part that fit stayed in the file.)"""
    out = tmp_path / "run"
    out.mkdir()
    script = textwrap.dedent(f"""
        import errno, json, os, resource, signal, sys
        sys.path.insert(0, {ROOT!r})
        from async_flowgrpo.config import load_config
        from async_flowgrpo.metrics import RunLogger
        cfg = load_config("sync", ["model.path={model_dir}", "trainer.output_dir={out}"])
        log = RunLogger({str(out)!r}, cfg, total_steps=3, progress=False)
        log.log(1, {{"reward/mean": 0.5}})
        size = os.path.getsize(log.metrics_path)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
        try:
            log.log(2, {{f"key_{{i}}": float(i) for i in range(50)}})
        except OSError as e:
            print("failed", errno.errorcode[e.errno])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "failed EFBIG" in done.stdout, done.stderr[-2000:]
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1]


# -- a stop during an update longer than the grace period ----------------------------------------
GIVE_UP_GRACE_S = 16  # the least trainer.stop_grace_s (its last 8 s shut Ray down): an update is given up after 8 s
LONG_UPDATE_S = 14  # trainer.min_step_time_s: the update in flight at the signal outlasts those 8 s


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stop_during_a_long_update_saves_the_step_before_it(tiny_model_dir, prompt_file, tmp_path):
    """SIGTERM during update 2, which outlasts the grace period, with no checkpoint written yet:
    step 1 is saved from the trainer's staged state without waiting for the
    update, the line says so, and the same command (trainer.resume=auto) continues from it with
    exact counts. (Before: `stopped at step 1 without a checkpoint (trainer.stop_grace_s=16 ran out
    before it was written; there is none to resume)`: the run was lost.) fully_async's stop during
    a long update is step 4 of test_cluster_signals.py's chain, with the same checks."""
    from test_fault_injection import Launch, assert_counters, checkpoint_state, last_per_step, unexpected_stderr
    from test_launcher import small_args

    mode = "one_step_off"
    out = str(tmp_path / "run")
    # no checkpoint before the stop; one_step_off generates batch 3 during update 2 (regenerated on resume)
    command = small_args(tiny_model_dir, prompt_file, out, "trainer.checkpoint_every=50", "trainer.resume=auto")
    first = Launch(mode, [*command, "trainer.total_steps=40", f"trainer.min_step_time_s={LONG_UPDATE_S}",
                          f"trainer.stop_grace_s={GIVE_UP_GRACE_S}"], out, f"{mode}: SIGTERM during update 2")
    resumed = None
    try:
        assert first.wait_until(lambda: len(first.rows()) >= 1, 300, "step 1"), first.why("ended before step 1")
        assert "trainer.resume=auto: no checkpoint under" in first.stderr, first.why("no word of the fresh start")
        first.sleep(3.0)  # update 2 is in flight
        t_signal = time.monotonic()
        os.killpg(first.proc.pid, signal.SIGTERM)
        first.scan(force=True)
        code, err = first.finish(timeout=GIVE_UP_GRACE_S + 60)
        # (the exit within the grace period is test_cluster_signals' to check: on these 2 busy cores
        # shutting Ray down has taken a few seconds more than the 8 s kept for it)
        assert time.monotonic() - t_signal <= GIVE_UP_GRACE_S + 10, first.why("not stopped within the grace period")
        stopped = [line for line in err.splitlines() if line.startswith("stopped")]
        assert code == 143 and len(stopped) == 1, first.why(f"exit {code}, lines {stopped}")
        assert re.match(r"stopped at step 1; resume with: .* trainer\.resume=latest$", stopped[0]), first.why(stopped[0])
        assert not unexpected_stderr(err, mode) and "Traceback" not in err, first.why("more than one line")
        assert not first.leftovers(), first.why("Ray processes outlived the launcher")
        path, state = checkpoint_state(out)
        assert os.path.basename(path) == "step_000001" and state["step"] == state["version"] == 1, first.why(path)
        assert os.listdir(os.path.join(path, "weights")), first.why("no weights in the staged checkpoint")

        resumed = Launch(mode, [*command, "trainer.total_steps=3"], out, f"{mode}: the same command again")
        code, _ = resumed.finish(timeout=400)
        assert code == 0, resumed.why("the resumed run failed")
        assert f"resumed from {path} at step 1" in resumed.stderr, resumed.why("did not resume step 1")
        rows = [r for r in last_per_step(resumed.rows(complete_only=False)) if r["step"] >= 1]
        assert [r["step"] for r in rows] == [1, 2, 3], resumed.why(f"steps {[r['step'] for r in rows]}")
        assert_counters(resumed, rows, rows[-1:], killed_rollout=False)
        _, end = checkpoint_state(out)
        assert end["step"] == 3 and end["consumed_samples"] == rows[-1]["samples/consumed"], resumed.why("final checkpoint")
    finally:
        for run in (first, resumed):
            if run is not None:
                run.cleanup()
