"""Checkpoints without Ray: safe formats, atomic save, keep-K, fallback, the run directory's rules."""

import json
import logging
import os
import pickle

import pytest
import torch

from async_flowgrpo import checkpoint
from async_flowgrpo.checkpoint import Checkpointer, CheckpointError, RunDirError, RunDirLock, prepare_run_dir
from async_flowgrpo.config import load_config


def learner_state(lr=1e-2):
    """What TrainerActor.state_dict returns: weights, AdamW state (int keys, tuple betas), RNG."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"trainable": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, model


def full_state(step, lr=1e-2):
    learner, _ = learner_state(lr)
    return {"step": step, "version": step, "next_ticket": 2 * step, "consumed_samples": 4 * step,
            "queue": {"queue": {"produced": 3, "producer_wait_s": 0.5}}, "learner": learner}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_state_round_trips_through_json_and_safetensors(tmp_path):
    state = full_state(3)
    path = Checkpointer(str(tmp_path)).save(3, state)
    assert sorted(os.listdir(path)) == ["manifest.json", "state.json", "tensors.safetensors"]
    back = checkpoint.load(path)
    assert_same(state, back)
    # and the optimizer state loads into a fresh optimizer
    model = torch.nn.Linear(3, 2)
    torch.optim.AdamW(model.parameters(), lr=1.0).load_state_dict(back["learner"]["optimizer"])


def test_arbitrary_objects_are_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match="cannot store a object"):
        Checkpointer(str(tmp_path)).save(1, {"x": object()})
    assert not os.path.exists(tmp_path / "step_000001")  # nothing half-written left
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/async_flowgrpo_pwned",))


def test_crafted_pickle_checkpoint_is_refused_with_one_line(tmp_path):
    """A state.pt (the old format) holding a pickled object: refused, and the payload never runs."""
    if os.path.exists("/tmp/async_flowgrpo_pwned"):
        os.remove("/tmp/async_flowgrpo_pwned")
    bad = tmp_path / "checkpoints" / "step_000005"
    bad.mkdir(parents=True)
    with open(bad / "state.pt", "wb") as f:
        pickle.dump({"step": 5, "learner": _Exploit()}, f)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(str(bad))
    message = str(err.value)
    assert "\n" not in message and "state.pt" in message and "refused" in message
    assert not os.path.exists("/tmp/async_flowgrpo_pwned")


def test_legacy_state_pt_with_plain_tensors_still_loads(tmp_path):
    path = tmp_path / "step_000002"
    path.mkdir()
    state = full_state(2)
    torch.save(state, path / "state.pt")
    assert_same(state, checkpoint.load(str(path)))


def test_save_is_atomic_latest_names_a_complete_one_and_keeps_k(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"step": step, "w": torch.full((2,), float(step))})
    assert [os.path.basename(p) for p in ckpt.steps()] == ["step_000002", "step_000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    # a save that dies half-way leaves the previous checkpoints and `latest` as they were
    def die(tmp):
        assert os.path.basename(tmp).startswith(".tmp-")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.save(4, {"step": 4}, write_extra=die)
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002", "step_000003"]
    path, tree = ckpt.find("latest")
    assert os.path.basename(path) == "step_000003" and tree["step"] == 3


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete_state", "garbage_json", "no_manifest"])
def test_corrupt_latest_falls_back_to_the_previous_with_one_warning(tmp_path, damage, caplog):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, {"step": 1, "w": torch.ones(1000)})
    newest = ckpt.save(2, {"step": 2, "w": torch.ones(1000) * 2})
    tensors, state = os.path.join(newest, "tensors.safetensors"), os.path.join(newest, "state.json")
    if damage == "truncate":
        with open(tensors, "r+b") as f:
            f.truncate(os.path.getsize(tensors) // 2)
    elif damage == "empty":
        open(tensors, "w").close()
    elif damage == "delete_state":
        os.remove(state)
    elif damage == "garbage_json":
        with open(state, "r+") as f:  # same size, not JSON
            f.write("x" * os.path.getsize(state))
    else:
        os.remove(os.path.join(newest, "manifest.json"))
    with caplog.at_level(logging.WARNING, logger="async_flowgrpo.checkpoint"):
        path, _ = ckpt.find("latest")
    assert os.path.basename(path) == "step_000001"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert newest in warnings[0] and "falling back to" in warnings[0]
    assert checkpoint.load(path)["w"][0] == 1


def test_no_usable_checkpoint_is_one_clear_error(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        ckpt.find("latest")
    only = ckpt.save(1, {"step": 1, "w": torch.ones(3)})
    open(os.path.join(only, "tensors.safetensors"), "w").close()
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        ckpt.find("latest")
    assert "tensors.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_run_dir_is_used_once_unless_resumed_or_overwritten(tmp_path):
    out = str(tmp_path / "run")
    prepare_run_dir(out, None, False).release()  # fresh: fine
    Checkpointer(os.path.join(out, "checkpoints")).save(1, {"step": 1})
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    with pytest.raises(RunDirError, match="trainer.resume=latest .* trainer.overwrite=true"):
        prepare_run_dir(out, None, False)
    prepare_run_dir(out, "latest", False).release()  # resuming: fine, nothing deleted
    assert os.path.exists(os.path.join(out, "metrics.jsonl"))
    prepare_run_dir(out, None, True).release()  # overwrite: old results gone
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) and not os.path.exists(os.path.join(out, "checkpoints"))


def test_a_run_dir_that_cannot_be_made_is_a_run_dir_error(tmp_path):
    """A directory the run cannot create or write (procfs takes no new entries, as a read-only
    mount or a parent without permission would refuse): one line naming it and why, not a traceback."""
    with pytest.raises(RunDirError, match=r"trainer.output_dir: cannot create or write /proc/async_flowgrpo_run/out: "):
        prepare_run_dir("/proc/async_flowgrpo_run/out", None, False)


@pytest.mark.slow  # a second process holds the lock: about 4 s
def test_a_second_run_into_a_locked_dir_is_refused(tmp_path):
    import subprocess
    import sys

    out = str(tmp_path)
    lock = RunDirLock(out).acquire()
    try:
        # flock is per open file description: another process (as a second launcher would be) is refused
        code = f"from async_flowgrpo.checkpoint import RunDirLock\nRunDirLock({out!r}).acquire()"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and f"another run (pid {os.getpid()})" in proc.stderr
    finally:
        lock.release()
    RunDirLock(out).acquire().release()  # released: free again


def test_config_changes_split_honoured_from_fixed(tiny_model_dir):
    import dataclasses

    old = load_config("sync", [f"model.path={tiny_model_dir}", "model.lora_rank=4", "rollout.group_size=2"])
    saved = json.loads(json.dumps(dataclasses.asdict(old)))
    new = load_config("sync", [f"model.path={tiny_model_dir}", "model.lora_rank=8", "rollout.group_size=4",
                               "trainer.lr=1e-5", "trainer.total_steps=7", "eval.every=3", "trainer.resume=latest"])
    fixed, changed = checkpoint.config_changes(saved, new)
    assert fixed == ["model.lora_rank", "rollout.group_size"]
    assert set(changed) == {"trainer.lr", "trainer.total_steps", "eval.every"}  # trainer.resume is not a change
    assert changed["trainer.lr"] == (old.trainer.lr, 1e-5)


def test_a_changed_lr_really_reaches_the_restored_optimizer(tiny_model_dir):
    state, model = learner_state(lr=1e-2)
    cfg = load_config("sync", [f"model.path={tiny_model_dir}", "trainer.lr=1e-5", "trainer.weight_decay=0.5"])
    checkpoint.apply_optimizer_settings(state["optimizer"], cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["optimizer"])
    assert [g["lr"] for g in opt.param_groups] == [1e-5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5]


@pytest.mark.parametrize("command", ["async_flowgrpo.models.tiny_wan", "async_flowgrpo.shapes.pretrain",
                                     "async_flowgrpo.shapes.edit_pretrain"])
def test_a_model_maker_refuses_an_output_dir_it_cannot_make_before_any_work(command, capsys):
    """The commands that write a model directory (a tiny twin; the pretraining of a shipped base, which
    takes minutes) check it first: exit 2 and the reason, not a traceback once the model is made."""
    import importlib

    argv = ["/proc/async_flowgrpo_run/m"] if command.endswith("tiny_wan") else ["--out", "/proc/async_flowgrpo_run/m"]
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(command).main(argv)
    assert exit_.value.code == 2
    assert "cannot create or write /proc/async_flowgrpo_run/m: " in capsys.readouterr().err
