"""The launcher as an operator meets it: bad input exits 2 with one line before Ray starts; SIGTERM
stops a run with a consistent checkpoint, one line and exit 143; the printed command resumes it."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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


def launch(args, timeout=120, **kw):
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


@pytest.mark.timeout(900)
def test_sigterm_stops_with_a_consistent_checkpoint_and_the_printed_command_resumes(tiny_model_dir, prompt_file, tmp_path):
    out = str(tmp_path / "run")
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**ENV, "RAY_TMPDIR": ray_tmp}
    args = small_args(tiny_model_dir, prompt_file, out, "trainer.total_steps=50", "trainer.checkpoint_every=0")
    try:
        proc = subprocess.Popen([sys.executable, LAUNCHER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=REPO)
        metrics = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 143, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        stopped = [line for line in stderr.splitlines() if line.startswith("stopped at step")]
        assert len(stopped) == 1, stderr[-3000:]
        step = int(stopped[0].split()[3].rstrip(";"))
        assert step >= 1 and "trainer.resume=latest" in stopped[0]

        # the checkpoint holds exactly `step` updates and every logged step
        ckpt = Checkpointer(os.path.join(out, "checkpoints"))
        path, state = ckpt.find("latest")
        assert os.path.basename(path) == f"step_{step:06d}"
        assert state["step"] == state["version"] == step
        assert state["consumed_samples"] == 4 * step  # 2 groups of 2 per step
        rows = [json.loads(line) for line in open(metrics)]
        assert [r["step"] for r in rows] == list(range(1, step + 1))

        # no Ray process outlives the launcher
        deadline = time.time() + 30
        while ray_processes(ray_tmp) and time.time() < deadline:
            time.sleep(1)
        assert ray_processes(ray_tmp) == []

        # the printed command (with a changed lr and total_steps) resumes
        resume_args = [a for a in args if not a.startswith(("trainer.total_steps", "trainer.lr"))]
        resumed = launch([*resume_args, f"trainer.total_steps={step + 1}", "trainer.lr=5e-3", "trainer.resume=latest"], timeout=400)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed.stdout.count("summary: ") == 1, resumed.stdout  # printed once, not by the logger and the cli
        assert "resume: applying changed settings: trainer.lr 0.01 -> 0.005, trainer.total_steps 50 -> " in resumed.stderr
        rows = [json.loads(line) for line in open(metrics)]
        assert [r["step"] for r in rows] == list(range(1, step + 2))
        assert rows[-1]["samples/consumed"] == 4 * (step + 1)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
