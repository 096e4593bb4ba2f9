"""The Flow-GRPO learner under the name scripts and tests import (`learner.Learner`); the algorithm
lives in `algorithms/flow_grpo.py` and the shell every learner shares in `algorithms/base.py`."""

from async_flowgrpo.algorithms.base import reduce_grads, set_lr  # noqa: F401
from async_flowgrpo.algorithms.flow_grpo import PROX_MODES  # noqa: F401
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner  # noqa: F401
