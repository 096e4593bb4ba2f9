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


@pytest.mark.parametrize("given_by", ["ray.address", "RAY_ADDRESS"])
def test_unreachable_cluster_is_a_one_line_error(given_by, tiny_model_dir, tmp_path):
    """RAY_ADDRESS (what `ray job submit` sets) is joined as ray.address is, and named in the error."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, os.path.join(REPO, "launch", "sync.py"), "ray.connect_timeout_s=2",
           f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}"]
    env = dict(os.environ)
    if given_by == "ray.address":
        cmd.append(f"ray.address={address}")
    else:
        env["RAY_ADDRESS"] = address
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert time.time() - start < 60
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {given_by}: cannot reach"), result.stderr[-1000:]


def test_without_an_address_a_cluster_left_by_ray_start_is_not_joined(tmp_path):
    """`ray start` records its cluster in <tmp>/ray/ray_current_cluster and Ray's default ray.init joins
    it, where num_cpus is refused (ValueError). No ray.address means a Ray of the run's own: here the
    record names a cluster that is not there, and the driver's Ray still comes up with its 1 CPU."""
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{free_port()}")
    script = (
        "import ray\n"
        "from async_flowgrpo.config import load_config\n"
        "from async_flowgrpo.driver.cluster import init_ray, shutdown_ray\n"
        f"init_ray(load_config('sync', ['ray.num_cpus=1', 'trainer.output_dir={tmp_path}']))\n"
        "print('cpus', ray.cluster_resources()['CPU'])\n"
        "shutdown_ray()\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp}, cwd=REPO)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0 and "cpus 1.0" in done.stdout, done.stderr[-2000:]


# -- two nodes on one machine (Ray's own multi-node tests do the same: a head and a second raylet) --
@pytest.fixture
def two_nodes():
    """A head node offering 'trainer_node' and a second node offering 'rollout_node', each its own
    raylet and object store: objects and weights between them cross a node boundary (TCP)."""
    from ray.cluster_utils import Cluster as RayNodes

    from async_flowgrpo.driver import cluster

    cluster.shutdown_ray()  # the shared Ray of an earlier module (conftest's ray_cluster): this test joins another
    nodes = RayNodes(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1},
                                                            "include_dashboard": False})
    rollout_node = nodes.add_node(num_cpus=2, resources={"rollout_node": 2})
    yield nodes, rollout_node
    nodes.shutdown()


def two_node_command(mode, address, model_dir, prompts, out, *extra):
    return [
        sys.executable, os.path.join(REPO, "launch", f"{mode}.py"), f"ray.address={address}",
        "trainer.resources={trainer_node: 1}", "rollout.resources={rollout_node: 1}", "rollout.num_workers=2",
        f"model.path={model_dir}", f"rollout.prompts={prompts}", "rollout.prompt_mix=null", "rollout.sde_window_range=null",
        f"eval.prompts={prompts}", "reward.weights={jpeg_incompressibility: 1.0}", "model.lora_rank=4",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=3", "rollout.sde_window_size=0",
        "trainer.micro_batch_size=4", "rollout.cpus_per_worker=0.5", "trainer.cpus_per_worker=0.5",
        "eval.at_start_and_end=false", "trainer.sample_every=0", "logging.progress=false", f"trainer.output_dir={out}",
        "trainer.lr_schedule=constant", "trainer.warmup_steps=0", *extra,
    ]


def wait_until_marked_dead(address: str, node_id: str, timeout_s: float = 120) -> None:
    """The GCS marks a killed raylet dead only after missed heartbeats (seconds later); until then
    it still places actors there, and a run resumed at once would lose its rollout actor with
    that node (seen in the suite: "an actor died at step 2")."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.time() + timeout_s
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            assert time.time() < deadline, "the GCS did not mark the removed node dead"
            time.sleep(0.5)
    finally:
        ray.shutdown()


def test_two_nodes_between_steps_and_mid_generation_then_the_rollout_node_dies_and_the_run_resumes(two_nodes, tiny_model_dir, tmp_path):
    """The launcher joins an existing cluster by ray.address (as after `ray start --head` on one
    machine and `ray start --address` on the other), rollout actors on one node, the trainer on the
    other: weights and groups cross the node boundary, published between steps (one_step_off; sync
    publishes the same way) and mid-generation (fully_async). The rollout node's raylet is killed
    mid-run: the run stops with one line naming the last checkpoint, and resumes once a node
    offering 'rollout_node' is back."""
    nodes, rollout_node = two_nodes
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}

    def metrics(out):
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    out = tmp_path / "one_step_off"
    cmd = two_node_command("one_step_off", nodes.address, tiny_model_dir, prompts, out, "trainer.total_steps=2")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = metrics(out)
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["cluster/nodes"] == 2 and r["sync/bytes"] > 0 for r in rows)  # placed apart, weights pushed across

    out = tmp_path / "node_lost"
    cmd = two_node_command("fully_async", nodes.address, tiny_model_dir, prompts, out, "trainer.total_steps=200",
                           "trainer.checkpoint_every=2", "ray.restart_timeout_s=5")  # how long a lost actor is waited for
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or len(metrics(out)) < 3:
        assert run.poll() is None and time.time() < deadline, f"the run did not get going: {run.stderr.read()[-2000:]}"
        time.sleep(0.5)
    assert all(r["cluster/nodes"] == 2 and r["sync/bytes"] > 0 for r in metrics(out))  # fully_async, across nodes
    nodes.remove_node(rollout_node, allow_graceful=False)  # kills its raylet and its workers
    _, stderr = run.communicate(timeout=300)
    lines = [line for line in stderr.strip().splitlines() if " INFO " not in line and " WARNING " not in line]
    assert run.returncode == 1, stderr[-2000:]
    assert "last checkpoint: step_" in lines[-1] and "trainer.resume=latest" in lines[-1], lines[-3:]
    saved = max(r["step"] for r in metrics(out) if r["step"] % 2 == 0)

    wait_until_marked_dead(nodes.address, rollout_node.node_id)
    nodes.add_node(num_cpus=2, resources={"rollout_node": 2})  # space for the rollout actors again
    resume = two_node_command("fully_async", nodes.address, tiny_model_dir, prompts, out,
                              f"trainer.total_steps={saved + 2}", "trainer.resume=latest")
    result = subprocess.run(resume, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    last = {r["step"]: r for r in metrics(out)}
    assert sorted(last)[-1] == saved + 2 and last[saved + 2]["version"] == saved + 2
    assert last[saved + 2]["cluster/nodes"] == 2
