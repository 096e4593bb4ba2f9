"""The embedded "shapes" task: procedural scenes, a pixel-level reward, and the pretraining script."""

from .reward import shapes_reward, summarize
from .scenes import (
    COLORS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    SceneSpec,
    caption_to_spec,
    render,
    spec_to_caption,
    vocabulary,
)

__all__ = [
    "COLORS",
    "RELATIONS",
    "SHAPES",
    "ObjectSpec",
    "SceneSpec",
    "caption_to_spec",
    "render",
    "shapes_reward",
    "summarize",
    "spec_to_caption",
    "vocabulary",
]
