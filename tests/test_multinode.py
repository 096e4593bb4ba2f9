"""Joining an existing Ray cluster (`ray start --head`, then ray.address=HOST:PORT), as on a multi-node setup."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_node():
    import ray.util

    port, host = free_port(), ray.util.get_node_ip_address()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    # --block keeps the head in the foreground, so terminating it stops this cluster only.
    head = subprocess.Popen(
        [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", "--block", f"--temp-dir={temp_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    deadline = time.time() + 120
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None and time.time() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
    yield f"{host}:{port}"
    head.terminate()
    head.wait(timeout=90)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_launcher_joins_an_existing_cluster(head_node, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    out = tmp_path / "run"
    cmd = [
        sys.executable, os.path.join(REPO, "launch", "one_step_off.py"), f"ray.address={head_node}",
        f"model.path={tiny_model_dir}", f"rollout.prompts={prompts}", "rollout.prompt_mix=null", "rollout.sde_window_range=null", f"eval.prompts={prompts}",
        "reward.weights={jpeg_incompressibility: 1.0}", "model.lora_rank=4", "rollout.group_size=2",
        "rollout.groups_per_step=2", "rollout.num_steps=3", "rollout.sde_window_size=0", "trainer.total_steps=2", "trainer.micro_batch_size=4",
        "rollout.cpus_per_worker=0.5", "trainer.cpus_per_worker=0.5", "eval.at_start_and_end=false",
        "trainer.sample_every=0", "logging.progress=false", f"trainer.output_dir={out}",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["version"] for r in rows] == [1, 2]


def test_unreachable_cluster_is_a_one_line_error(tiny_model_dir, tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "launch", "sync.py"), f"ray.address=127.0.0.1:{free_port()}",
           "ray.connect_timeout_s=2", f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}"]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert time.time() - start < 60
    assert "ray.address" in result.stderr.strip().splitlines()[-1]
