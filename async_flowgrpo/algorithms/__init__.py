"""The RL algorithms, one module each, and their registry by `algorithm.name`.

A module holds its settings dataclass (`algorithm.<name>.*`, one section of config.AlgorithmConfig),
its loss, its learner (a `base.Learner`: what a trained row is, how a stale sample is weighted), what
it needs from a rollout (`SAMPLER`: "sde", a recorded window with log-probs, or "ode", final
samples only), `sampling(settings, kwargs, version)` (the rollout's generate() arguments for a group
started at a version), `validate(settings, config, require)` and `build(policy, settings, config,
shared)`. Adding one: a module with those names and a row in `ALGORITHMS`; no mode, driver or
builder asks which algorithm runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from async_flowgrpo.algorithms import awm, dgpo, diffusion_nft, flow_grpo

ALGORITHMS: dict[str, ModuleType] = {m.NAME: m for m in (flow_grpo, diffusion_nft, awm, dgpo)}


def settings(algorithm_config: Any):
    """The running algorithm's settings section (algorithm.<name>)."""
    return getattr(algorithm_config, algorithm_config.name)


def rollout_sampling(algorithm_config: Any, sampling: dict, version: int) -> dict:
    """generate() arguments for a group a rollout starts while holding weights `version`."""
    return ALGORITHMS[algorithm_config.name].sampling(settings(algorithm_config), sampling, version)
