"""The launcher as an operator meets it: bad input exits 2 with one line before Ray starts. (Stops by
signal, and the printed command resuming them: test_cluster_signals.)"""

import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest

from async_flowgrpo.checkpoint import Checkpointer
from async_flowgrpo.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "fully_async.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "shapes.txt"
    path.write_text("a red circle\na blue square\na red square\na blue circle\n")
    return str(path)


def small_args(model_dir, prompts, output_dir, *extra):
    return [
        f"model.path={model_dir}", "model.lora_rank=4", "model.lora_alpha=8",
        f"rollout.prompts={prompts}", "rollout.prompt_mix=null", "rollout.sde_window_range=null", f"eval.prompts={prompts}",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=4", "rollout.sde_window_size=0",
        "rollout.cpus_per_worker=0.25", "trainer.cpus_per_worker=0.25", "trainer.micro_batch_size=4", "trainer.lr=1e-2",
        "trainer.total_steps=3", "trainer.sample_every=0", f"trainer.output_dir={output_dir}", "eval.every=0",
        "eval.at_start_and_end=false", "logging.progress=false", "sync.timeout_s=120", "ray.num_cpus=2", *extra,
    ]


def launch(args, timeout=300, **kw):  # a 3-step run takes 50-70 s on a loaded 2-core machine
    return subprocess.run([sys.executable, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO, **kw)


def assert_one_line_exit_2(proc, needle):
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert needle in err, err


# -- bad input: exit 2, one line, before Ray -------------------------------------------------------
def test_bad_inputs_exit_2_with_one_line_before_ray(tiny_model_dir, prompt_file, tmp_path):
    empty, a_file = tmp_path / "empty.jsonl", tmp_path / "a_file"
    empty.write_text("")
    a_file.write_text("x")
    cases = [
        ([f"rollout.prompts={empty}"], "rollout.prompts: prompt file"),
        ([f"rollout.prompts={tmp_path}"], "is a directory"),
        ([f"trainer.output_dir={a_file}"], "trainer.output_dir"),
        (["trainer.output_dir=/proc/async_flowgrpo_run"], "trainer.output_dir: cannot create or write"),
    ]
    try:
        import vllm_omni  # noqa: F401
    except ImportError:
        cases.append((["rollout.engine=vllm_omni"], "rollout.engine: vllm-omni is not installed"))
    for extra, needle in cases:
        proc = launch(small_args(tiny_model_dir, prompt_file, str(tmp_path / "out"), *extra))
        assert_one_line_exit_2(proc, needle)
        assert "async_flowgrpo fully_async:" not in proc.stderr  # stopped before the run began


def test_a_used_run_dir_needs_resume_or_overwrite(tiny_model_dir, prompt_file, tmp_path):
    out = str(tmp_path / "run")
    Checkpointer(os.path.join(out, "checkpoints")).save(1, {"step": 1})
    proc = launch(small_args(tiny_model_dir, prompt_file, out))
    assert_one_line_exit_2(proc, "trainer.overwrite=true")


def test_resume_refuses_changes_it_cannot_honour_naming_the_keys(tiny_model_dir, prompt_file, tmp_path):
    out = str(tmp_path / "run")
    saved = load_config("fully_async", small_args(tiny_model_dir, prompt_file, out))
    Checkpointer(os.path.join(out, "checkpoints")).save(2, {"step": 2, "config": dataclasses.asdict(saved)})
    proc = launch(small_args(tiny_model_dir, prompt_file, out, "model.lora_rank=8", "rollout.group_size=4", "trainer.resume=latest"))
    assert_one_line_exit_2(proc, "model.lora_rank 4 -> 8, rollout.group_size 2 -> 4")


def test_resume_from_a_crafted_pickle_is_refused(tiny_model_dir, prompt_file, tmp_path):
    import pickle

    out = tmp_path / "run"
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    with open(out / "checkpoints" / "step_000001" / "state.pt", "wb") as f:
        pickle.dump({"step": 1, "x": _Exploit()}, f)
    proc = launch(small_args(tiny_model_dir, prompt_file, str(out), "trainer.resume=latest"))
    assert_one_line_exit_2(proc, "state.pt: refused")
    assert not (tmp_path / "pwned").exists()


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {tempfile.gettempdir()}/pwned",))


# -- graceful stop ---------------------------------------------------------------------------------
def ray_processes(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


