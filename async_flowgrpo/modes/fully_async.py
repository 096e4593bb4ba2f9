"""fully_async: rollout actors stream groups into a bounded queue; the trainer consumes batches.

Rollout actors loop on their own (RolloutWorker.run): take an admission ticket from the queue (at
most max_staleness + 1 batches ahead of the published version), generate, score, put. The trainer
takes groups_per_step groups whenever they are there, updates, and every sync.every updates
publishes the weights; rollout actors swap them in between two denoising steps (or between
groups) without aborting anything.
"""

from __future__ import annotations

import ray

from async_flowgrpo.config import Config
from async_flowgrpo.pipeline import Pipeline, PipelineError
from async_flowgrpo.queue import make_queue_actor


def run(cfg: Config) -> dict:
    eta, gps = cfg.algorithm.max_staleness, cfg.rollout.groups_per_step
    with Pipeline(cfg) as p:
        queue = make_queue_actor(capacity=(eta + 1) * gps, groups_per_step=gps, max_staleness=eta, drop_policy=cfg.algorithm.stale_policy)
        p.checkpoint_extra = lambda: {"queue": ray.get(queue.state_dict.remote(), timeout=60)}
        # the queue's first call waits for its worker process to start: as long as the other actors may
        ray.get(queue.set_version.remote(p.version), timeout=600)
        if "queue" in p.resumed_state:
            ray.get(queue.load_state_dict.remote(p.resumed_state["queue"]), timeout=60)
            ray.get(queue.set_version.remote(p.version), timeout=60)
        loops = [rollout.run.remote(queue) for rollout in p.rollouts]
        try:
            p.evaluate_at_start()
            while p.step < cfg.trainer.total_steps:
                p.stop.check()  # SIGTERM/SIGINT: stop here, between two steps (at most get_batch's 5 s late)
                groups = ray.get(queue.get_batch.remote(gps, 5.0), timeout=60)
                for i, loop in enumerate(loops):  # a rollout loop only ends early when its actor died
                    if ray.wait([loop], timeout=0)[0]:
                        try:
                            ray.get(loop)
                            raise PipelineError(f"rollout actor {i} stopped generating")
                        except ray.exceptions.RayActorError as e:
                            lost = ray.get(queue.release_worker.remote(i), timeout=60)
                            p.lost_groups += lost is not None
                            p.recover_rollout(i, e)
                            loops[i] = p.rollouts[i].run.remote(queue)
                if not groups:
                    continue
                metrics = p.train(groups)
                sync = {}
                if p.step % cfg.sync.every == 0:
                    sync = p.publish_weights()
                    ray.get(queue.set_version.remote(p.version), timeout=60)
                p.maybe_save_samples(groups)
                last = p.step >= cfg.trainer.total_steps
                eval_metrics = p.maybe_evaluate(force=last)
                queue_stats = ray.get(queue.stats.remote(), timeout=60)
                p.log.log(p.step, p.step_metrics(metrics, {**queue_stats, **sync, **eval_metrics}))
                if p.checkpoint_due() or last:
                    p.save_checkpoint()
            return p.log.summary({})
        finally:
            # Stop producing, wake every waiter, let the loops return; what is left is counted as drained.
            for rollout in p.rollouts:
                rollout.stop.remote()
            ray.get(queue.shutdown.remote(), timeout=60)
            ray.wait(loops, num_returns=len(loops), timeout=300)
            ray.get(queue.drain.remote(), timeout=60)
