"""The tests' warm Ray workers (warm_workers.py, conftest.py's `ray_cluster`): an actor runs in a
child of the server, with the environment the raylet gave its worker; killing its process is seen
by Ray as the actor's death, and an actor Ray restarts comes back in a new warm process."""

import os
import signal
import sys
import time

import pytest
import ray

import warm_workers


SEEN = ("HF_HUB_OFFLINE", "RAY_RAYLET_PID", warm_workers.ENV_SOCKET)


@ray.remote(num_cpus=0.25, max_restarts=1)
class Probe:
    def where(self, names) -> dict:  # (the names passed in: this module is not importable in a worker)
        return {"pid": os.getpid(), "parent": os.getppid(), "torch": "torch" in sys.modules,
                "env": {k: os.environ.get(k) for k in names}}


@ray.remote(num_cpus=0.25)
class Once:
    def pid(self) -> int:
        return os.getpid()


def test_an_actor_is_forked_warm_and_dies_and_restarts_like_a_process(ray_cluster, _warm_workers):
    if _warm_workers is None:
        pytest.skip("ASYNC_FLOWGRPO_TEST_COLD_WORKERS=1")
    probe = Probe.remote()
    first = ray.get(probe.where.remote(SEEN), timeout=60)
    server = first["parent"]
    with open(f"/proc/{server}/cmdline", "rb") as f:
        assert b"--serve" in f.read()  # a child of the server, which had torch imported already
    assert first["torch"]
    assert first["env"]["HF_HUB_OFFLINE"] == "1" and first["env"]["RAY_RAYLET_PID"]  # the raylet's environment
    assert first["env"][warm_workers.ENV_SOCKET]

    os.kill(first["pid"], signal.SIGKILL)  # Ray restarts it (max_restarts=1) in a new warm process
    deadline = time.monotonic() + 60
    while True:
        try:
            again = ray.get(probe.where.remote(SEEN), timeout=60)
            if again["pid"] != first["pid"]:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the killed actor was not restarted"
        time.sleep(0.2)
    assert again["parent"] == server

    once = Once.remote()
    pid = ray.get(once.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGKILL)  # no restarts: the next call fails as for any dead actor
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(once.pid.remote(), timeout=60)
    for _ in range(100):  # reaped by the server: not left a zombie that still answers kill(pid, 0)
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")
    ray.kill(probe)
