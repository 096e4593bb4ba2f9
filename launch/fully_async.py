#!/usr/bin/env python
"""Run FlowGRPO in fully_async mode: python launch/fully_async.py [extra.yaml ...] [key=value ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_flowgrpo.cli import main  # noqa: E402

if __name__ == "__main__":
    main("fully_async", sys.argv[1:])
