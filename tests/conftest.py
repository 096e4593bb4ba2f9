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
    """A 2-CPU local Ray cluster for one test module (the runs' actors take fractional CPUs). It
    inherits this process's environment (HF_HUB_OFFLINE above): a runtime_env would make Ray start a
    fresh worker for every actor instead of taking the ones it starts ahead (about 1 s each)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
