"""sync: generate a batch, train on it, publish the weights. Staleness 0; the baseline."""

from __future__ import annotations

from async_flowgrpo.config import Config
from async_flowgrpo.driver.run import Run


def run(cfg: Config, actor_classes: dict | None = None) -> dict:
    with Run(cfg, actor_classes) as run:
        run.evaluate_at_start()
        while run.step < cfg.trainer.total_steps:
            run.stop.check()  # SIGTERM/SIGINT: stop here, between two steps
            records = run.batches.collect(run.batches.start(cfg.rollout.groups_per_step))  # rollout ...
            metrics = run.train(records)  # ... then train (rollout actors idle meanwhile)
            if metrics is None:  # every group of the batch was skipped
                continue
            sync = run.publish_weights()
            run.end_step(metrics, sync)
        return run.log.summary({})
