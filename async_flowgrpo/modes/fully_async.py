"""fully_async: rollout actors stream groups into a bounded queue; the trainer consumes batches.

Rollout actors loop on their own (RolloutWorker.run): take an admission ticket from the queue (at
most max_staleness + 1 batches ahead of the published version), generate, score, put the group's
record (the group itself waits in the object store). The trainer takes groups_per_step records
whenever they are there, updates, and every sync.every updates publishes the weights; rollout
actors swap them in between two denoising steps (or between groups) without aborting anything.

Prefetch: while the trainers run update k, the next batch's records are taken from the queue, and
update k + 1 starts right after k's weights are published, before step k is logged; so the
trainers wait only for the publication. (Not when step k evaluates or checkpoints, which need the
trainers' weights after exactly k updates.) The admission bound alone keeps staleness within
max_staleness, whenever a batch is taken.

A stop (SIGTERM/SIGINT) starts nothing: a batch taken after it was asked for, while the driver
waited for one or prefetched during an update, goes back to the head of the queue. The update in
flight finishes, its step is logged, and the stop's checkpoint holds that step.

Checkpoints hold the queued groups and the tickets in flight: a resumed run trains the first and
regenerates the second before anything new, so a stop loses no finished rollout.
"""

from __future__ import annotations

import ray

from async_flowgrpo.config import Config
from async_flowgrpo.driver.cluster import RunError
from async_flowgrpo.driver.run import Run
from async_flowgrpo.queue import make_queue_actor


def run(cfg: Config, actor_classes: dict | None = None) -> dict:
    eta, gps, total = cfg.algorithm.max_staleness, cfg.rollout.groups_per_step, cfg.trainer.total_steps
    wait, batch_wait = cfg.ray.call_timeout_s, cfg.ray.batch_wait_s
    def make_queue():  # started early, so that its process starts while the other actors load their models
        return make_queue_actor(capacity=(eta + 1) * gps, groups_per_step=gps, max_staleness=eta, drop_policy=cfg.algorithm.stale_policy)

    with Run(cfg, actor_classes, start_early=make_queue) as run:
        queue = run.started_early
        run.checkpoint_extra = lambda: {"queue": saved_queue(queue, wait)}
        # the queue's first call waits for its worker process to start: as long as the other actors may
        ray.get(queue.set_version.remote(run.version), timeout=cfg.ray.start_timeout_s)
        if "queue" in run.resumed_state:
            # the queue puts the saved groups into the object store itself: it owns them, not the driver
            ray.get(queue.load_state_dict.remote(run.resumed_state["queue"]), timeout=wait)
            ray.get(queue.set_version.remote(run.version), timeout=wait)
        loops = [rollout.run.remote(queue) for rollout in run.rollouts]

        @run.on_exit  # after the last checkpoint (a stop's too), so that it still holds the queue
        def stop_producing() -> None:
            # Stop producing, wake every waiter, let the loops return; what is left is counted as drained.
            # After a signal the loops are not waited for: a group still being generated or scored (a
            # slow reward) is in the checkpoint as a ticket in flight, regenerated on resume.
            for rollout in run.rollouts:
                rollout.stop.remote()
            ray.get(queue.shutdown.remote(), timeout=wait)
            # (a loop returns once the group it generates is scored: one generation's work at most)
            ray.wait(loops, num_returns=len(loops), timeout=0 if run.stop.requested else cfg.ray.work_timeout_s)
            ray.get(queue.drain.remote(), timeout=wait)

        def take(batch_ref) -> list:
            """A batch taken from the queue (a get_batch call), or [] when a stop was asked for
            meanwhile: after a stop nothing new starts, and the batch goes back to the queue, so the
            stop's checkpoint holds it as queued."""
            records = ray.get(batch_ref, timeout=wait + batch_wait)
            if records and run.stop.requested:
                ray.get(queue.put_back.remote(records), timeout=wait)
                return []
            restart_dead_loops()
            return records

        def restart_dead_loops() -> None:
            ended, _ = ray.wait(loops, num_returns=len(loops), timeout=0)
            for i, loop in enumerate(loops):  # a rollout loop only ends early when its actor died
                if loop in ended:
                    try:
                        ray.get(loop)
                        raise RunError(f"rollout actor {i} stopped generating")
                    except ray.exceptions.RayActorError as e:
                        lost = ray.get(queue.release_worker.remote(i), timeout=wait)  # its tickets are regenerated
                        run.lost_groups += bool(lost)  # at most one was being generated; the other was only admitted
                        run.recover_rollout(i, e)
                        loops[i] = run.rollouts[i].run.remote(queue)

        next_batch = None  # a get_batch call made during the update in flight (prefetch)

        def give_back_prefetched() -> None:
            """A stop's checkpoint is written during the update (it outlasts the grace period): the
            batch prefetched for the next update goes back to the queue first, so it is saved as queued."""
            nonlocal next_batch
            if next_batch is not None:
                take(next_batch)  # a stop was asked for: the batch goes back to the queue
                next_batch = None

        run.before_staged_save = give_back_prefetched
        run.evaluate_at_start()
        in_flight = None  # an update started on the trainers, not yet counted
        while run.step < total:
            if in_flight is None:
                run.stop.check()  # SIGTERM/SIGINT: only here, with no update in flight (at most batch_wait late)
                records = take(queue.get_batch.remote(gps, batch_wait))
                if not records:
                    continue
                in_flight = run.start_train(records)
            prefetch = run.step + 1 < total and not run.needs_trainers_after(run.step + 1) and not run.stop.requested
            next_batch = queue.get_batch.remote(gps, batch_wait) if prefetch else None
            metrics = run.finish_train(in_flight)
            in_flight = None
            sync = {}
            if run.step % cfg.sync.every == 0:
                sync = run.publish_weights()
                ray.get(queue.set_version.remote(run.version), timeout=wait)
            queue_stats = ray.get(queue.stats.remote(), timeout=wait)
            # taken from the queue may include a prefetched batch: samples/consumed is the run's (trained)
            queue_stats.pop("samples/consumed")
            if next_batch is not None:
                in_flight = run.start_train(take(next_batch))  # None: no batch, or a stop came during the update
            run.end_step(metrics, {**queue_stats, **sync})
        return run.log.summary({})


def saved_queue(queue, timeout: float) -> dict:
    """The queue's state for a checkpoint, with the queued groups themselves (the one time
    trajectories pass through the driver), so a resumed run trains them instead of regenerating them."""
    state, groups = ray.get(queue.snapshot.remote(), timeout=timeout)
    return {**state, "queued_groups": [g.to_state() for g in groups]}
