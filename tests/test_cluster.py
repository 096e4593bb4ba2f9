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
