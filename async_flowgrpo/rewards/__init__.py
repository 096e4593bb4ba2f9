"""Reward registry: name -> callable(images, prompts, metadata) -> scores.

A reward callable takes images as a uint8 tensor [n, H, W, 3], the n prompts and their metadata
dicts, and returns either a float tensor [n] or a dict with key "score" (tensor [n]) plus named
components (logged as reward/<component>). Built-ins are registered lazily by "module:attribute"
so that importing the registry never imports a heavy reward model.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, Union

import torch

RewardOutput = Union[torch.Tensor, dict]
RewardFn = Callable[[torch.Tensor, list, list], RewardOutput]

_REGISTRY: dict[str, Union[str, RewardFn]] = {
    "jpeg_compressibility": "async_flowgrpo.rewards.jpeg:jpeg_compressibility",
    "jpeg_incompressibility": "async_flowgrpo.rewards.jpeg:jpeg_incompressibility",
    "shapes": "async_flowgrpo.shapes.reward:shapes_reward",
    # model / service rewards: local paths and URLs come from keyword options or env vars
    "clip_score": "async_flowgrpo.rewards.clip_score:clip_score",
    "pickscore": "async_flowgrpo.rewards.clip_score:pickscore",
    "aesthetic": "async_flowgrpo.rewards.aesthetic:aesthetic",
    "remote": "async_flowgrpo.rewards.remote:remote",
    "ocr": "async_flowgrpo.rewards.remote:ocr",
    "geneval": "async_flowgrpo.rewards.remote:geneval",
}


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; `name` says which."""

    def __init__(self, name: str, message: str):
        super().__init__(f"reward '{name}' failed: {message}")
        self.name = name


def register_reward(name: str, fn: RewardFn | None = None):
    """Register `fn` under `name` (usable as a decorator)."""

    def add(f: RewardFn) -> RewardFn:
        _REGISTRY[name] = f
        return f

    return add(fn) if fn is not None else add


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **options) -> RewardFn:
    """The reward registered as `name`, with keyword `options` bound (e.g. a local model path)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward '{name}' (available: {', '.join(available_rewards())})")
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = entry
    if not options:
        return entry
    try:
        inspect.signature(entry).bind_partial(None, None, None, **options)
    except TypeError as e:
        raise TypeError(f"reward '{name}' does not take option(s) {', '.join(sorted(options))}: {e}") from None
    return functools.partial(entry, **options)


class CombinedReward:
    """Weighted sum of registered rewards. Returns (score [n], components {name: [n]})."""

    def __init__(self, weights: dict[str, float], options: dict[str, dict] | None = None):
        if not weights:
            raise ValueError("reward.weights is empty: name at least one reward")
        self.weights = dict(weights)
        options = {name: dict(opts or {}) for name, opts in (options or {}).items()}
        extra = sorted(set(options) - set(self.weights))
        if extra:
            raise ValueError(f"reward.options names rewards without a weight: {', '.join(extra)}")
        self.fns = {name: get_reward(name, **options.get(name, {})) for name in self.weights}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        n = images.shape[0]
        total = torch.zeros(n, dtype=torch.float32)
        components: dict[str, torch.Tensor] = {}
        for name, fn in self.fns.items():
            try:
                out = fn(images, prompts, metadata)
            except Exception as e:  # surfaced with the reward's name; the caller skips and counts
                raise RewardError(name, f"{type(e).__name__}: {e}") from e
            parts = dict(out) if isinstance(out, dict) else {"score": out}
            if "score" not in parts:
                raise RewardError(name, "returned a dict without a 'score' entry")
            for key, value in parts.items():
                value = torch.as_tensor(value, dtype=torch.float32).reshape(-1).cpu()
                if value.shape[0] != n:
                    raise RewardError(name, f"'{key}' has {value.shape[0]} values for {n} images")
                if key == "score" and not torch.isfinite(value).all():
                    raise RewardError(name, "returned a non-finite score")
                components[name if key == "score" else key] = value
            total += self.weights[name] * components[name]
        return total, components
