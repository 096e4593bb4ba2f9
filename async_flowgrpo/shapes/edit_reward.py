"""Verifiable reward of the embedded edit task: was the edit made, and is the rest unchanged?

Both the source image (metadata["source_images"][0], which the rollout passes) and the result go
through the shapes detector (`reward.detect`); the instruction is parsed by
`edit_scenes.parse_instruction`. The edited object is the source's detection of the instruction's
colour and shape (absent for add); every other source detection is "the rest".

Checks (0/1 floats):
  edit_ok  recolor: an object of the new colour and the shape within NEAR px of the old one's
           centre, and none of the old colour left;
           move: the object found, moved >= MOVE_MIN px along the direction and <= NEAR px across;
           remove: no object of that colour left;
           add: exactly one object of that colour, with that shape;
  rest_ok  every other source object found with its colour and shape within NEAR px of its place,
           and no object the edit does not explain;
  correct  both.
Partial credit ("score" with score="partial"): the mean of a graded edit term (the recolor/move/add
object found with a wrong shape or too short a move earns part) and a rest term (the share of the
rest kept, divided by 1 + the number of unexplained objects).
"""

from __future__ import annotations

import numpy as np
import torch

from .edit_scenes import DIRECTIONS, MOVE_FRACTION, EditSpec, parse_instruction
from .reward import Detection, detect, to_uint8_hwc

NEAR = 3.0  # px at 32 x 32: where a kept or recoloured object may have drifted
SCORES = ("correct", "partial")


def _near(a: Detection, b: Detection, tol: float = NEAR) -> bool:
    return abs(a.cx - b.cx) <= tol and abs(a.cy - b.cy) <= tol


def _edit_terms(edit: EditSpec, target: Detection | None, out: list[Detection], res: int) -> tuple[float, float, list]:
    """(edit_ok, graded edit term, the output detections the edit explains)."""
    same = [d for d in out if d.color == edit.color]
    if edit.op == "remove":
        return float(not same), float(not same), []
    if edit.op == "add":
        right = [d for d in same if d.shape == edit.shape]
        return float(len(same) == 1 and len(right) == 1), (1.0 if right else 0.5 if same else 0.0), same
    if target is None:  # the source lacks the named object: nothing to edit
        return 0.0, 0.0, []
    if edit.op == "recolor":
        new = [d for d in out if d.color == edit.arg and _near(d, target)]
        right = [d for d in new if d.shape == edit.shape]
        ok = bool(right) and not same
        return float(ok), (1.0 if right else 0.5 if new else 0.0) * (1.0 if not same else 0.5), new
    dx, dy = DIRECTIONS[edit.arg]
    best, best_term, ok = None, 0.0, False
    for d in same:
        along = (d.cx - target.cx) * dx + (d.cy - target.cy) * dy
        across = abs((d.cx - target.cx) * dy) + abs((d.cy - target.cy) * dx)
        term = float(np.clip(along / (MOVE_FRACTION * res), 0, 1)) * (1.0 if d.shape == edit.shape else 0.5)
        if term > best_term:
            best, best_term = d, term
        ok |= d.shape == edit.shape and along >= MOVE_FRACTION * res / 2 and across <= NEAR
    return float(ok and len(same) == 1), best_term, [best] if best else []


def score_edit(source: np.ndarray, result: np.ndarray, edit: EditSpec) -> dict[str, float]:
    src, out = detect(source), detect(result)
    matches = [d for d in src if d.color == edit.color and d.shape == edit.shape]
    target = max(matches, key=lambda d: d.area) if matches and edit.op != "add" else None
    rest = [d for d in src if d is not target]
    edit_ok, edit_term, explained = _edit_terms(edit, target, out, result.shape[1])
    kept = []
    for r in rest:
        found = next((d for d in out if d.color == r.color and d.shape == r.shape and _near(d, r)
                      and not any(d is k for k in kept)), None)
        if found is not None:
            kept.append(found)
    others = [d for d in out if not any(d is k for k in kept + explained) and d.color != edit.color]
    rest_term = (len(kept) / len(rest) if rest else 1.0) / (1 + len(others))
    rest_ok = float(len(kept) == len(rest) and not others)
    return {"edit": edit_term, "rest": rest_term, "edit_ok": edit_ok, "rest_ok": rest_ok,
            "correct": float(edit_ok and rest_ok), "partial": (edit_term + rest_term) / 2}


def shapes_edit_reward(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None,
                       score: str = "correct") -> dict[str, torch.Tensor]:
    """Score edited images [n, H, W, 3] uint8 against their instructions and source images
    (metadata[i]["source_images"][0], uint8 [H, W, 3]). Returns float32 [n] tensors: "score" (the
    "correct" check, or with score="partial" the partial credit), "edit", "rest", "edit_ok",
    "rest_ok", "correct"."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    imgs = to_uint8_hwc(images)
    metadata = metadata if metadata is not None else [{}] * len(prompts)
    if not len(imgs) == len(prompts) == len(metadata):
        raise ValueError(f"{len(imgs)} images for {len(prompts)} prompts and {len(metadata)} metadata")
    rows = []
    for img, prompt, meta in zip(imgs, prompts, metadata):
        sources = (meta or {}).get("source_images")
        if not sources:
            raise ValueError("shapes_edit needs each prompt's source image (metadata['source_images']): "
                             "use a prompt file whose rows carry \"images\"")
        rows.append(score_edit(to_uint8_hwc(sources[0])[0], img, parse_instruction(prompt)))
    for row in rows:
        row["score"] = row[score]
    keys = ("score", "edit", "rest", "edit_ok", "rest_ok", "correct")
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in keys}
