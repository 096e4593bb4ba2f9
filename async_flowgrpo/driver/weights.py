"""The weight publisher: trainer rank 0 broadcasts the sampling weights to every rollout actor over
the checkpoint engine (async_flowgrpo.sync), and the digests are checked.

The sync group is trainer rank 0 + every rollout actor. A rollout actor that died is restarted by
Ray; the group is then rebuilt and the weights sent again, so a restarted actor never generates
with weights other than the current ones.
"""

from __future__ import annotations

import logging
import time

import ray

from async_flowgrpo.config import Config
from async_flowgrpo.driver.cluster import Cluster, RunError, sync_host

logger = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(self, cluster: Cluster, cfg: Config):
        self.cluster, self.cfg = cluster, cfg
        self.host = sync_host(cfg)
        self.total_time_s = 0.0
        self.total_bytes = 0.0
        self.connect()

    def connect(self) -> None:
        """(Re)build the group of trainer rank 0 + every rollout actor; rerun after replacing one."""
        trainer, rollouts = self.cluster.trainers[0], self.cluster.rollouts
        timeout = self.cfg.sync.timeout_s
        world = len(rollouts) + 1
        address = ray.get(trainer.sync_address.remote(self.host), timeout=timeout)
        ray.get(
            [trainer.sync_connect.remote(address, world)]
            + [rollout.sync_connect.remote(address, i + 1, world) for i, rollout in enumerate(rollouts)],
            timeout=timeout,
        )

    def publish(self, version: int) -> dict:
        """Send weights `version` to every rollout actor and verify; returns sync/* metrics. If a
        rollout actor died (the collective fails), wait for its restart, rebuild and send again."""
        try:
            return self._publish(version)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            logger.warning("weight sync failed (%s); rebuilding the sync group", str(e).splitlines()[0][:200])
            for i in range(len(self.cluster.rollouts)):
                self.cluster.wait_restarted(i)
            self.connect()
            return self._publish(version)

    def recover(self, index: int, error: Exception, version: int) -> None:
        """Rollout actor `index` died: wait for its restart, rejoin it and give it the current weights."""
        logger.warning("rollout actor %d died (%s); waiting for its restart", index, str(error).splitlines()[0][:200])
        self.cluster.wait_restarted(index)
        self.connect()
        self.publish(version)

    def _publish(self, version: int) -> dict:
        start = time.perf_counter()
        cluster = self.cluster
        push, *gathering = [t.push.remote(version) for t in cluster.whole_weight_ranks]  # only rank 0 sends
        pulls = [rollout.pull.remote([push]) for rollout in cluster.rollouts]
        sent, *received = ray.get([push, *pulls], timeout=self.cfg.sync.timeout_s)
        ray.get(gathering, timeout=self.cfg.sync.timeout_s)
        if self.cfg.sync.verify:
            for i, got in enumerate(received):
                if got["digest"] != sent.stats.digest:
                    raise RunError(f"weight sync: rollout actor {i} digest {got['digest'][:12]} != trainer {sent.stats.digest[:12]}")
        elapsed = time.perf_counter() - start
        self.total_time_s += elapsed
        self.total_bytes += sent.stats.bytes * len(cluster.rollouts)
        return {"sync/time_s": elapsed, "sync/bytes": sent.stats.bytes}

    def totals(self) -> dict:
        return {"sync/total_time_s": self.total_time_s, "sync/total_bytes": self.total_bytes}
