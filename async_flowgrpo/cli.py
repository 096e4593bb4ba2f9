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
