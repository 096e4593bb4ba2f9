import contextlib
import importlib.util
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A Ray call made after a module's Ray was shut down (a thread a test left running) must fail where
# it is made: Ray's auto-init would start a second, half-made Ray whose client ends the whole pytest
# process a minute later, with no report.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models on a 2-core machine: one thread avoids oversubscription (10x slower matmuls under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random SD3 pipeline directory (real architecture), built once per test session."""
    from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3")))


@pytest.fixture(scope="session")
def _ray_of_this_worker():
    """Ends the shared Ray of `ray_cluster` when this pytest process (one xdist worker) is done."""
    yield
    from async_flowgrpo.driver import cluster

    cluster.shutdown_ray()


@pytest.fixture(scope="session")
def _warm_workers(tmp_path_factory):
    """Ray workers forked from a process with torch, diffusers and transformers imported
    (warm_workers.py): a test's actor starts in about 0.5 s of CPU instead of 5.5 s, most of what
    the suite's in-process runs cost. Started by the first module that uses `ray_cluster`, for
    this pytest process; yields the environment and the interpreter stand-in that Ray's start
    takes (`warm_worker_python`), or None with ASYNC_FLOWGRPO_TEST_COLD_WORKERS=1 (every actor a
    fresh `python`, as in a user's run)."""
    import shutil
    import subprocess
    import tempfile

    import warm_workers

    if os.environ.get("ASYNC_FLOWGRPO_TEST_COLD_WORKERS") == "1":
        yield None
        return
    root = tmp_path_factory.mktemp("warm_workers")
    python, log = str(root / "python"), str(root / "server.log")
    short = tempfile.mkdtemp(prefix="afg-warm-", dir="/tmp")  # a Unix socket's path has at most 107 bytes
    path = os.path.join(short, "socket")
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -S "{os.path.abspath(warm_workers.__file__)}" "$@"\n')
    os.chmod(python, 0o755)
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, warm_workers.__file__, "--serve", path], stdout=subprocess.PIPE,
                                  stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        if server.stdout.readline().strip() != b"ready":
            with open(log) as f:
                pytest.fail(f"the warm worker server did not start: {f.read()[-2000:]}")
        yield {"env": {warm_workers.ENV_SOCKET: path, warm_workers.ENV_PYTHON: sys.executable}, "python": python}
    finally:
        server.kill()
        server.wait(timeout=30)
        shutil.rmtree(short, ignore_errors=True)


@contextlib.contextmanager
def warm_worker_python(warm: dict | None):
    """While Ray starts (its raylet takes the worker command then, from sys.executable): the
    warm_workers.py client as the interpreter, and where its server is in the environment the
    raylet inherits."""
    with pytest.MonkeyPatch.context() as patch:
        if warm is not None:
            for key, value in warm["env"].items():
                patch.setenv(key, value)
            patch.setattr(sys, "executable", warm["python"])
        yield


@pytest.fixture(scope="module")
def ray_cluster(_ray_of_this_worker, _warm_workers):
    """A 2-CPU local Ray cluster (the runs' actors take fractional CPUs), started by the first module
    that asks for it and kept while the next module in this pytest process uses it too
    (`pytest_runtest_teardown`): each start and shutdown costs about 7 s on 2 cores. A module that leaves an actor holding resources gets its cluster ended, so
    the next module starts a clean one. Its workers are forked warm (`_warm_workers`) and inherit
    this process's environment (HF_HUB_OFFLINE above): a runtime_env would make Ray start each
    worker through its setup script, a fresh interpreter. A test that needs a Ray of its own calls
    `cluster.shutdown_ray()` first (test_multinode)."""
    import ray

    from async_flowgrpo.driver import cluster

    if not ray.is_initialized():
        cluster.shutdown_ray()  # nothing left of a Ray an earlier module's run started
        with warm_worker_python(_warm_workers):
            ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    deadline = time.monotonic() + 15  # a killed actor's resources come back asynchronously
    while ray.is_initialized() and ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            cluster.shutdown_ray()
            break
        time.sleep(0.2)


RAY_MODULES: set[str] = set()  # modules with a test that uses ray_cluster (pytest_collection_modifyitems)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module that used the shared Ray of `ray_cluster`, it is kept only for a next module
    that uses it too: an idle Ray (its GCS, raylet and agents) takes about 5 % of a core, which the
    other modules' runs need."""
    here, after = module_name(item), module_name(nextitem) if nextitem is not None else None
    if here in RAY_MODULES and after != here and after not in RAY_MODULES:
        from async_flowgrpo.driver import cluster

        cluster.shutdown_ray()


# The fast tier (`python -m pytest -q -m "not slow"`, under 2 minutes) leaves out what starts Ray,
# launches or spawns processes, injects faults into whole runs, trains for tens of updates or runs a
# benchmark whole (those tests carry the mark themselves); the full suite (CI) runs everything.
SLOW_MODULES = {"test_cluster_signals", "test_fault_injection", "test_launcher", "test_multinode", "test_wan_run"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts Ray or other processes, or trains for long (left out of the fast tier)")


# The longest modules, longest first (as measured in the suite on 2 cores with warm workers,
# 2026-11-28: the launches of the signal, two-node and fault tests, then test_run). The suite runs
# on two workers a module at a time (`-n 2 --dist loadfile --no-loadscope-reorder`), each taking the
# next module in collection order as it frees up (xdist's own order, by number of tests, left the
# two-test cluster-signal module to the end, one worker busy alone for minutes). Longest first, both
# end within a short module of each other; the first two pair the signal tests' waits with
# test_run's CPU.
LONGEST_MODULES = ("test_cluster_signals", "test_run", "test_multinode", "test_fault_injection", "test_stop_resume_defects",
                   "test_gpu_bench", "test_reward_overlap", "test_reward_services_run", "test_algorithm_modes",
                   "test_wan_run", "test_seqpar", "test_learning_signal", "test_launcher", "test_fsdp", "test_queue",
                   "test_qwen_image_edit", "test_defects_trainer", "test_fully_async")


def module_name(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            RAY_MODULES.add(module_name(item))
        if "ray_cluster" in getattr(item, "fixturenames", ()) or module_name(item) in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(module_name(item), len(rank)))  # stable: each module's own order kept


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, registered in sys.modules (dataclasses and pickling by value
    look it up there); benchmarks/ goes on the path, as the scripts import their siblings."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    spec = importlib.util.spec_from_file_location(name, os.path.join(benchmarks, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
