"""Reward registry: name -> callable(images, prompts, metadata) -> scores.

A reward callable takes images as a uint8 tensor [n, H, W, 3], the n prompts and their metadata
dicts, and returns either a float tensor [n] or a dict with key "score" (tensor [n]) plus named
components (logged as reward/<component>). Built-ins are registered lazily by "module:attribute"
so that importing the registry never imports a heavy reward model.

Video rewards (registered with video=True) take videos [n, F, H, W, 3] instead; every image
reward <name> also serves videos as `frames_<name>`, its mean over frames. A reward given the
other kind fails with a message that says which to use.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from typing import Callable, Union

import torch

RewardOutput = Union[torch.Tensor, dict]
RewardFn = Callable[[torch.Tensor, list, list], RewardOutput]

_REGISTRY: dict[str, Union[str, RewardFn]] = {
    "jpeg_compressibility": "async_flowgrpo.rewards.jpeg:jpeg_compressibility",
    "jpeg_incompressibility": "async_flowgrpo.rewards.jpeg:jpeg_incompressibility",
    "shapes": "async_flowgrpo.shapes.reward:shapes_reward",
    "shapes_edit": "async_flowgrpo.shapes.edit_reward:shapes_edit_reward",  # the embedded edit task's
    # model / service rewards: local paths and URLs come from keyword options or env vars
    "clip_score": "async_flowgrpo.rewards.clip_score:clip_score",
    "pickscore": "async_flowgrpo.rewards.clip_score:pickscore",
    "aesthetic": "async_flowgrpo.rewards.aesthetic:aesthetic",
    "hpsv2": "async_flowgrpo.rewards.preference:hpsv2",
    "imagereward": "async_flowgrpo.rewards.preference:imagereward",
    "remote": "async_flowgrpo.rewards.remote:remote",
    "ocr": "async_flowgrpo.rewards.remote:ocr",
    "geneval": "async_flowgrpo.rewards.remote:geneval",
    "temporal_consistency": "async_flowgrpo.rewards.video:temporal_consistency",
    "remote_video": "async_flowgrpo.rewards.remote:remote_video",
    "vlm_judge": "async_flowgrpo.rewards.vlm_judge:vlm_judge",
    "vlm_judge_video": "async_flowgrpo.rewards.vlm_judge:vlm_judge_video",
}
BUILTIN_REWARDS = frozenset(_REGISTRY)  # what ships (the registry also holds what users and tests register)
_VIDEO_REWARDS = {"temporal_consistency", "remote_video", "vlm_judge_video"}  # names whose callables take videos [n, F, H, W, 3]
FRAMES_PREFIX = "frames_"  # frames_<image reward>: that reward averaged over a video's frames


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; `name` says which."""

    def __init__(self, name: str, message: str):
        super().__init__(f"reward '{name}' failed: {message}")
        self.name, self.message = name, message

    def __reduce__(self):
        # raised in a reward actor (reward.num_workers), it crosses Ray pickled: without this, pickle
        # would call RewardError(<the formatted line>) and Ray could not rebuild it, so a NaN score
        # or a raising reward in the pool ended the run instead of skipping its group
        return type(self), (self.name, self.message)


def register_reward(name: str, fn: RewardFn | None = None, *, video: bool = False):
    """Register `fn` under `name` (usable as a decorator); video=True: it takes videos [n, F, H, W, 3]."""

    def add(f: RewardFn) -> RewardFn:
        _REGISTRY[name] = f
        if video:
            _VIDEO_REWARDS.add(name)
        else:
            _VIDEO_REWARDS.discard(name)
        return f

    return add(fn) if fn is not None else add


def available_rewards() -> list[str]:
    frames = [FRAMES_PREFIX + name for name in _REGISTRY if name not in _VIDEO_REWARDS]
    return sorted([*_REGISTRY, *frames])


def takes_video(name: str) -> bool:
    """Whether the reward `name` scores videos [n, F, H, W, 3] (else images [n, H, W, 3])."""
    return name in _VIDEO_REWARDS or (name.startswith(FRAMES_PREFIX) and name not in _REGISTRY)


def _entry(name: str) -> RewardFn:
    """The registered callable of `name` (a registered image reward for frames_<name>), imported on first use."""
    if name not in _REGISTRY and name in available_rewards():
        name = name.removeprefix(FRAMES_PREFIX)
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward '{name}' (available: {', '.join(available_rewards())})")
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = entry
    return entry


def check_options(name: str, options: dict) -> None:
    """Raise ValueError unless the reward `name` takes these keyword options, with a value among
    its choices where the parameter is annotated `Literal[...]` (caught at config time, not at
    the first rollout)."""
    entry = _entry(name)
    try:
        inspect.signature(entry).bind_partial(None, None, None, **options)
    except TypeError as e:
        raise ValueError(f"reward '{name}' does not take option(s) {', '.join(sorted(options))}: {e}") from None
    try:
        hints = typing.get_type_hints(entry.func if isinstance(entry, functools.partial) else entry)
    except TypeError:  # a callable object: no annotations to check against
        hints = {}
    for key, value in options.items():
        choices = typing.get_args(hints.get(key)) if typing.get_origin(hints.get(key)) is typing.Literal else ()
        if choices and value not in choices:
            raise ValueError(f"reward '{name}' option {key} must be one of {', '.join(map(str, choices))}, got {value!r}")
    check = getattr(entry, "check_options", None)  # a reward's own rule across options (remote: pickle opt-in)
    if check is not None:
        try:
            check(dict(options))
        except ValueError as e:
            raise ValueError(f"reward '{name}': {e}") from None


def get_reward(name: str, **options) -> RewardFn:
    """The reward registered as `name`, with keyword `options` bound (e.g. a local model path)."""
    check_options(name, options)
    entry = _entry(name)
    fn = functools.partial(entry, **options) if options else entry
    if name in _REGISTRY:
        return fn
    from async_flowgrpo.rewards.video import frame_average  # frames_<image reward>

    return frame_average(fn)


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
        result = self.score_groups([(images, prompts, metadata)])[0]
        if isinstance(result, RewardError):
            raise result
        return result

    def score_groups(self, groups: list[tuple[torch.Tensor, list, list]]) -> list[tuple | RewardError]:
        """Several groups (images, prompts, metadata) in one call of each reward, a batch for a
        reward model: per group (score [n], components) or the RewardError that skips it. Each
        group's scores are checked on their own (a NaN fails its group only); a reward that raises
        or miscounts the batch fails every group of it."""
        sizes = [g[0].shape[0] for g in groups]
        images = groups[0][0] if len(groups) == 1 else torch.cat([g[0] for g in groups])
        prompts = [p for g in groups for p in g[1]]
        metadata = [m for g in groups for m in g[2]]
        components: list[dict[str, torch.Tensor]] = [{} for _ in groups]
        errors: list[RewardError | None] = [None] * len(groups)
        totals = [torch.zeros(size, dtype=torch.float32) for size in sizes]
        video = images.dim() == 5
        for name, fn in self.fns.items():
            try:
                parts = self._parts(name, fn, images, prompts, metadata, video)
            except RewardError as e:
                return [e] * len(groups)
            start = 0
            for i, size in enumerate(sizes):
                for key, value in parts.items():
                    part = value[start:start + size]
                    if key == "score" and not torch.isfinite(part).all():
                        errors[i] = errors[i] or RewardError(name, "returned a non-finite score")
                    components[i][name if key == "score" else key] = part
                totals[i] += self.weights[name] * components[i][name]
                start += size
        return [e or (t, c) for e, t, c in zip(errors, totals, components)]

    @staticmethod
    def _parts(name: str, fn, images: torch.Tensor, prompts: list, metadata: list, video: bool) -> dict[str, torch.Tensor]:
        """One reward's outputs on the batch: {"score" or component: [n] float32}."""
        n = images.shape[0]
        if video and not takes_video(name):
            raise RewardError(name, f"takes images [n, H, W, 3], got videos {list(images.shape)}; use "
                                    f"{FRAMES_PREFIX}{name} (its mean over frames) or a video reward")
        if not video and takes_video(name):
            raise RewardError(name, f"takes videos [n, F, H, W, 3], got images {list(images.shape)}")
        try:
            out = fn(images, prompts, metadata)
        except Exception as e:  # surfaced with the reward's name; the caller skips and counts
            raise RewardError(name, f"{type(e).__name__}: {e}") from e
        parts = dict(out) if isinstance(out, dict) else {"score": out}
        if "score" not in parts:
            raise RewardError(name, "returned a dict without a 'score' entry")
        for key, value in parts.items():
            parts[key] = value = torch.as_tensor(value, dtype=torch.float32).reshape(-1).cpu()
            if value.shape[0] != n:
                raise RewardError(name, f"'{key}' has {value.shape[0]} values for {n} images")
        return parts
