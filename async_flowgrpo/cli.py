"""Command-line entry shared by the launchers: config errors become one line and exit code 2."""

from __future__ import annotations

import sys

from async_flowgrpo.config import Config, ConfigError, load_config


def config_or_exit(mode: str, argv: list[str]) -> Config:
    try:
        return load_config(mode, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(mode: str, argv: list[str]) -> None:
    """Entry point of launch/<mode>.py: load the config, run the mode's driver, print a summary."""
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_or_exit(mode, argv)

    from async_flowgrpo.modes import run
    from async_flowgrpo.pipeline import PipelineError

    print(f"async_flowgrpo {mode}: model={cfg.model.path} output_dir={cfg.trainer.output_dir}", file=sys.stderr)
    try:
        summary = run(cfg)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary)
