#!/usr/bin/env python
"""Run FlowGRPO in sync mode: python launch/sync.py [extra.yaml ...] [key=value ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_flowgrpo.cli import main  # noqa: E402

if __name__ == "__main__":
    main("sync", sys.argv[1:])
