"""One short loop per schedule, each in its own file `modes/<name>.py` with a `run(cfg)`: when to
generate, train and publish. A new mode is that file, its name in `config.MODES` and its defaults
in `config/<name>.yaml`."""

from __future__ import annotations

import importlib

from async_flowgrpo.config import Config


def run(cfg: Config, actor_classes: dict | None = None) -> dict:
    """Run cfg.mode's loop. actor_classes: {"rollout_actor": ..., "trainer_actor": ...} stand-ins
    (benchmarks/scale_sim.py); None for the real actors."""
    return importlib.import_module(f"async_flowgrpo.modes.{cfg.mode}").run(cfg, actor_classes)
