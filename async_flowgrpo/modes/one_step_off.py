"""one_step_off: batch k+1 is generated with weights v while batch k trains; one push per step.

Per step: collect batch k (rollout actors are idle now) -> publish weights v -> start batch k+1
with them -> train on batch k (-> v + 1) while batch k+1 generates. Batch k was generated with
v - 1, so staleness is exactly 1 after the first step. The push sits between two generations, as
in verl's one-step-off trainer; for LoRA it costs milliseconds.
"""

from __future__ import annotations

from async_flowgrpo.config import Config
from async_flowgrpo.driver.run import Run


def run(cfg: Config, actor_classes: dict | None = None) -> dict:
    gps = cfg.rollout.groups_per_step
    with Run(cfg, actor_classes) as run:
        run.evaluate_at_start()
        pending = run.batches.start(gps)
        while run.step < cfg.trainer.total_steps:
            run.stop.check()  # SIGTERM/SIGINT: stop here, between two steps (the batch in flight is regenerated on resume)
            records = run.batches.collect(pending)
            sync = run.publish_weights()
            last = run.step + 1 >= cfg.trainer.total_steps
            pending = None if last else run.batches.start(gps)  # overlaps with the training below
            metrics = run.train(records)
            if metrics is None:  # every group of the batch was skipped: the step is not done yet
                pending = pending or run.batches.start(gps)
                continue
            run.end_step(metrics, sync)  # a checkpoint leaves out the batch in flight: a resumed run regenerates it
        return run.log.summary({})
