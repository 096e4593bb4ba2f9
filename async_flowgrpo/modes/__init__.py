"""One short loop per schedule, each in its own file `modes/<name>.py` with a `run(cfg)`: when to
generate, train and publish. A new mode is that file, its name in `config.MODES` and its defaults
in `config/<name>.yaml`."""

from __future__ import annotations

import importlib

from async_flowgrpo.config import Config


def run(cfg: Config) -> dict:
    return importlib.import_module(f"async_flowgrpo.modes.{cfg.mode}").run(cfg)
