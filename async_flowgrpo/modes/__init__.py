"""One short driver per schedule. Each reads top to bottom: when to generate, train and publish."""

from __future__ import annotations

from async_flowgrpo.config import Config


def run(cfg: Config) -> dict:
    if cfg.mode == "sync":
        from async_flowgrpo.modes.sync import run as run_mode
    elif cfg.mode == "one_step_off":
        from async_flowgrpo.modes.one_step_off import run as run_mode
    else:
        from async_flowgrpo.modes.fully_async import run as run_mode
    return run_mode(cfg)
