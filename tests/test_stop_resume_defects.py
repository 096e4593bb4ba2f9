"""Stops and resumes as a scheduler drives them: the same command restarts a preempted job
(trainer.resume=auto), metrics.jsonl stays JSON lines across a crash mid-write, and a stop during
an update longer than the grace period still saves the last completed step (the trainer's state
staged in host memory)."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from async_flowgrpo import checkpoint
from async_flowgrpo.checkpoint import Checkpointer
from async_flowgrpo.cli import preflight
from async_flowgrpo.config import load_config, validate
from async_flowgrpo.metrics import RunLogger

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
