"""one_step_off: batch k+1 is generated with weights v while batch k trains; one push per step.

Per step: collect batch k (rollout actors are idle now) -> publish weights v -> start batch k+1
with them -> train on batch k (-> v + 1) while batch k+1 generates. Batch k was generated with
v - 1, so staleness is exactly 1 after the first step. The push sits between two generations, as
in verl's one-step-off trainer; for LoRA it costs milliseconds.
"""

from __future__ import annotations

from async_flowgrpo.config import Config
from async_flowgrpo.pipeline import Pipeline


def run(cfg: Config) -> dict:
    with Pipeline(cfg) as p:
        p.evaluate_at_start()
        pending = p.generate_batch_async()
        while p.step < cfg.trainer.total_steps:
            p.stop.check()  # SIGTERM/SIGINT: stop here, between two steps (the batch in flight is regenerated on resume)
            groups = p.collect(pending)
            sync = p.publish_weights()
            last = p.step + 1 >= cfg.trainer.total_steps
            pending = None if last else p.generate_batch_async()  # overlaps with the training below
            metrics = p.train(groups)
            if metrics is None:  # every group of the batch was skipped: the step is not done yet
                pending = pending or p.generate_batch_async()
                continue
            p.maybe_save_samples(groups)
            eval_metrics = p.maybe_evaluate(force=last)
            p.log.log(p.step, p.step_metrics(metrics, {**sync, **eval_metrics}))
            if p.checkpoint_due() or last:
                p.save_checkpoint()  # the batch in flight is not in it: a resumed run regenerates it
        return p.log.summary({})
