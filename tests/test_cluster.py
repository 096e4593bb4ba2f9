"""driver/cluster.py without starting Ray: what the cluster asks of Ray for the actors it places."""

import pytest

from async_flowgrpo.config import load_config
from async_flowgrpo.driver.cluster import reward_concurrency


@pytest.mark.parametrize("overlap, max_pending, workers, calls_at_once", [
    ("false", 2, 3, 3),  # each worker waits on its one group: 3 calls can reach one actor together
    ("false", 2, 1, 1),
    ("true", 2, 3, 6),  # each worker has up to max_pending groups being scored
])
def test_a_reward_actor_takes_every_call_the_rollout_workers_can_send_at_once(overlap, max_pending, workers,
                                                                               calls_at_once):
    """Every rollout worker may send its groups to the same reward actor at the same moment (each
    worker takes the actors in turn from the first); a call queued inside the actor would wait
    there and spend its reward.timeout_s waiting."""
    cfg = load_config("fully_async", [f"reward.overlap={overlap}", f"reward.max_pending={max_pending}",
                                      f"rollout.num_workers={workers}", "reward.num_workers=1"])
    assert reward_concurrency(cfg) == calls_at_once


def test_a_local_ray_that_does_not_start_is_one_line(monkeypatch, tmp_path):
    """ray.init raising while it starts a local Ray (an overloaded machine: "The current node timed
    out during startup") is the run's one-line error, not the launcher's traceback."""
    import ray

    from async_flowgrpo.driver import cluster

    def fails(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.\nmore")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fails)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config("fully_async", [f"trainer.output_dir={tmp_path}", "ray.num_cpus=1"])
    with pytest.raises(cluster.RunError, match="could not start a local Ray: The current node timed out") as e:
        cluster.init_ray(cfg)
    assert "\n" not in str(e.value)
