"""benchmarks/scale_sim.py: stand-in actors of set costs driven by the real fully_async loop."""

import pickle
import sys

import pytest
from conftest import load_benchmark
import ray
import torch


@pytest.fixture(scope="module")
def scale_sim():
    yield load_benchmark("scale_sim")  # registered in sys.modules: the module then registers itself for pickling by value
    sys.modules.pop("scale_sim", None)


def test_a_stand_in_record_arrives_as_a_group_record_with_reward_tensors(scale_sim):
    from async_flowgrpo.types import GroupRecord

    record = pickle.loads(ray.cloudpickle.dumps(scale_sim.SimRecord("p", 7, 4, 2, [0.0, 0.5, 1.0, 0.25], worker_id=3)))
    assert isinstance(record, GroupRecord)
    assert (record.prompt_index, record.size, record.min_version, record.worker_id) == (7, 4, 2, 3)
    assert record.rewards.dtype == torch.float32 and record.rewards.tolist() == [0.0, 0.5, 1.0, 0.25]


@pytest.mark.timeout(150)
def test_the_fully_async_loop_runs_on_stand_ins_and_the_groups_bypass_the_driver(ray_cluster, scale_sim, tmp_path):
    """2 rollout stand-ins, 1 trainer, 4 steps. The trainer is the bound (0.5 s per step against
    0.1 s per group), so the window's samples/s cannot exceed it by more than timing noise."""
    costs = scale_sim.SimCosts(gen_s=0.1, group_size=8, train_s=0.5 / 16, payload_kb=128, poll_s=0.5)
    result = scale_sim.simulate("fully_async", 2, 1, costs, steps=4, warmup=1, workdir=str(tmp_path),
                                overrides=("ray.call_timeout_s=60", "ray.start_timeout_s=120", "ray.work_timeout_s=120",
                                           "sync.timeout_s=60", "ray.batch_wait_s=2"))
    assert result["steps_logged"] == 4
    assert result["groups_per_step"] == 2 and result["batch"] == 16
    assert result["limited_by"] == "trainer" and result["bound"] == pytest.approx(32.0)
    assert result["samples_per_s"] > 0
    assert 0 < result["efficiency"] <= 1.2
    assert result["driver_cpu_ms_per_step"] > 0 and result["startup_s"] > 0
    # the trainers fetched every group's payload from the object store; the driver saw only records
    assert result["trainer_payload_bytes_per_step"] == result["payload_bytes_per_step"] == 2 * 128 * 1024
    assert 0 < result["driver_bytes_per_step"] < 0.01 * result["payload_bytes_per_step"]
