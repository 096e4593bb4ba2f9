"""fully_async: rollout actors stream groups into a bounded queue; the trainer consumes batches.

Rollout actors loop on their own (RolloutWorker.run): take an admission ticket from the queue (at
most max_staleness + 1 batches ahead of the published version), generate, score, put the group's
record (the group itself waits in the object store). The trainer takes groups_per_step records
whenever they are there, updates, and every sync.every updates publishes the weights; rollout
actors swap them in between two denoising steps (or between groups) without aborting anything.
"""

from __future__ import annotations

import ray

from async_flowgrpo.config import Config
from async_flowgrpo.driver.cluster import RunError
from async_flowgrpo.driver.run import Run
from async_flowgrpo.queue import make_queue_actor


def run(cfg: Config, actor_classes: dict | None = None) -> dict:
    eta, gps, wait = cfg.algorithm.max_staleness, cfg.rollout.groups_per_step, cfg.ray.call_timeout_s
    with Run(cfg, actor_classes) as run:
        queue = make_queue_actor(capacity=(eta + 1) * gps, groups_per_step=gps, max_staleness=eta, drop_policy=cfg.algorithm.stale_policy)
        run.checkpoint_extra = lambda: {"queue": ray.get(queue.state_dict.remote(), timeout=wait)}
        # the queue's first call waits for its worker process to start: as long as the other actors may
        ray.get(queue.set_version.remote(run.version), timeout=cfg.ray.start_timeout_s)
        if "queue" in run.resumed_state:
            ray.get(queue.load_state_dict.remote(run.resumed_state["queue"]), timeout=wait)
            ray.get(queue.set_version.remote(run.version), timeout=wait)
        loops = [rollout.run.remote(queue) for rollout in run.rollouts]
        try:
            run.evaluate_at_start()
            while run.step < cfg.trainer.total_steps:
                run.stop.check()  # SIGTERM/SIGINT: stop here, between two steps (at most ray.batch_wait_s late)
                records = ray.get(queue.get_batch.remote(gps, cfg.ray.batch_wait_s), timeout=wait + cfg.ray.batch_wait_s)
                for i, loop in enumerate(loops):  # a rollout loop only ends early when its actor died
                    if ray.wait([loop], timeout=0)[0]:
                        try:
                            ray.get(loop)
                            raise RunError(f"rollout actor {i} stopped generating")
                        except ray.exceptions.RayActorError as e:
                            lost = ray.get(queue.release_worker.remote(i), timeout=wait)
                            run.lost_groups += lost is not None
                            run.recover_rollout(i, e)
                            loops[i] = run.rollouts[i].run.remote(queue)
                if not records:
                    continue
                metrics = run.train(records)
                sync = {}
                if run.step % cfg.sync.every == 0:
                    sync = run.publish_weights()
                    ray.get(queue.set_version.remote(run.version), timeout=wait)
                run.end_step(metrics, {**ray.get(queue.stats.remote(), timeout=wait), **sync})
            return run.log.summary({})
        finally:
            # Stop producing, wake every waiter, let the loops return; what is left is counted as drained.
            for rollout in run.rollouts:
                rollout.stop.remote()
            ray.get(queue.shutdown.remote(), timeout=wait)
            ray.wait(loops, num_returns=len(loops), timeout=cfg.ray.start_timeout_s)
            ray.get(queue.drain.remote(), timeout=wait)
