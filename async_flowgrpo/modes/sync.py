"""sync: generate a batch, train on it, publish the weights. Staleness 0; the baseline."""

from __future__ import annotations

from async_flowgrpo.config import Config
from async_flowgrpo.pipeline import Pipeline


def run(cfg: Config) -> dict:
    with Pipeline(cfg) as p:
        p.evaluate_at_start()
        while p.step < cfg.trainer.total_steps:
            p.stop.check()  # SIGTERM/SIGINT: stop here, between two steps
            groups = p.collect(p.generate_batch_async())  # rollout ...
            metrics = p.train(groups)  # ... then train (rollout actors idle meanwhile)
            if metrics is None:  # every group of the batch was skipped
                continue
            sync = p.publish_weights()
            p.maybe_save_samples(groups)
            last = p.step >= cfg.trainer.total_steps
            eval_metrics = p.maybe_evaluate(force=last)
            p.log.log(p.step, p.step_metrics(metrics, {**sync, **eval_metrics}))
            if p.checkpoint_due() or last:
                p.save_checkpoint()
        return p.log.summary({})
