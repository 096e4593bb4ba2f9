import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models on a 2-core machine: one thread avoids oversubscription (10x slower matmuls under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random SD3 pipeline directory (real architecture), built once per test session."""
    from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3")))


@pytest.fixture(scope="module")
def ray_cluster():
    """A 2-CPU local Ray cluster for one test module (the runs' actors take fractional CPUs)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()
