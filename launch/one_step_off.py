#!/usr/bin/env python
"""Run FlowGRPO in one_step_off mode: python launch/one_step_off.py [extra.yaml ...] [key=value ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_flowgrpo.cli import main  # noqa: E402

if __name__ == "__main__":
    main("one_step_off", sys.argv[1:])
