"""Verifiable pixel reward for the shapes task, in the spirit of GenEval (no model, no download).

Detection (per image, RGB uint8):
  * a pixel is *foreground* when its chroma (max - min channel) >= CHROMA_MIN; white, greys and
    black are background;
  * blobs are the 8-connected components of foreground, ignoring specks < MIN_AREA px; a blob's
    colour is the palette colour (red, yellow, green, cyan, blue, purple) of nearest hue, by
    chroma-weighted majority over its pixels; a blob where a second colour holds >= 25% of that
    weight is split into per-colour objects (two touching objects of different colours); touching
    objects of one colour stay one object;
  * shape and position are measured on the object's core (pixels >= half its 90th-percentile
    chroma), so soft edges do not change them;
  * an object's shape comes from its bounding box: "other" if the aspect ratio > 2; "triangle" if
    its top and bottom halves hold unequal pixel counts (min/max < 0.65; our triangles point up,
    ~0.35); "square" if the box is filled (fill ratio area/box >= 0.8) including its corners
    (corner patches >= 0.6 occupied); otherwise "circle" (fill ~pi/4, empty corners). The fill
    ratio alone cannot separate 7-px circles (fill up to 0.92 when pixelated) from squares.

Per-sample components, each in [0, 1], against the prompt's spec (objects (colour, shape, count) and
an optional relation "A left of / right of / above / below B"); M_i = detected objects of colour i:
  color    = mean_i [M_i non-empty] * purity,  purity = 1 - (area of objects in colours the
             prompt does not name) / (area of all objects)
  shape    = mean_i (fraction of M_i with the prompted shape; 0 if M_i is empty)
  count    = mean_i (1 / (1 + | |M_i| - count_i |); 0 if M_i is empty)
  position = clip(0.5 + 4 d, 0, 1) where d is the signed offset (in image widths) of the largest
             object of colour 0 from the largest of colour 1 along the relation's axis (positive
             = relation holds); 0 if either is missing; 1 for prompts without a relation.
  score    = mean of the applicable components (color, shape, count, and position only for
             prompts with a relation): partial credit, so RL has a gradient.

Boolean checks (for eval accuracy, returned as 0/1 floats):
  color_ok    every prompted colour found, and objects of other colours cover < 20% of the
              object area (purity >= 0.8)
  shape_ok    every object of a prompted colour has the prompted shape (and one exists)
  count_ok    exactly count_i objects of each prompted colour and none of any other colour
  position_ok d >= 1/16 (2 px at 32x32); true for prompts without a relation
  correct     all four (GenEval-style "all checks right"; the joint accuracy)
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

from .scenes import COLORS, SceneSpec, caption_to_spec

CHROMA_MIN = 50
MIN_AREA = 5
TRIANGLE_MAX_HALVES = 0.65
SQUARE_MIN_CORNERS = 0.6
SQUARE_MIN_FILL = 0.8
MAX_ASPECT = 2.0
POSITION_OK = 1 / 16
PURITY_OK = 0.8
SPLIT_SHARE = 0.25
COMPONENTS = ("color", "shape", "count", "position")
CHECKS = ("color_ok", "shape_ok", "count_ok", "position_ok", "correct")

_NAMES = list(COLORS)
_HUES = np.array([colorsys.rgb_to_hsv(*(c / 255 for c in COLORS[n]))[0] for n in _NAMES]) * 360.0


@dataclass
class Detection:
    color: str
    shape: str
    area: int
    fill: float
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive
    cx: float
    cy: float


def pixel_hues(img: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chroma [H, W], palette index of nearest hue [H, W], hue distance to each palette colour
    [H, W, len(COLORS)] in degrees) of an RGB uint8 image."""
    rgb = img.astype(np.float32)
    mx, mn = rgb.max(-1), rgb.min(-1)
    chroma = mx - mn
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    c = np.maximum(chroma, 1e-6)
    h = np.where(mx == r, ((g - b) / c) % 6, np.where(mx == g, (b - r) / c + 2, (r - g) / c + 4)) * 60.0
    dist = np.abs(h[..., None] - _HUES)
    dist = np.minimum(dist, 360.0 - dist)
    return chroma, dist.argmin(-1), dist


def classify_pixels(img: np.ndarray) -> np.ndarray:
    """[H, W] int: -1 background, else index into COLORS (by nearest hue)."""
    chroma, label, _ = pixel_hues(img)
    return np.where(chroma >= CHROMA_MIN, label, -1)


def _components(labels: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
    """8-connected components of equal non-negative label: (label, [(y, x), ...]) each."""
    h, w = labels.shape
    lab = labels.tolist()
    seen = [[False] * w for _ in range(h)]
    out = []
    for y0 in range(h):
        for x0 in range(w):
            c = lab[y0][x0]
            if c < 0 or seen[y0][x0]:
                continue
            seen[y0][x0] = True
            stack, pix = [(y0, x0)], []
            while stack:
                y, x = stack.pop()
                pix.append((y, x))
                for yy in (y - 1, y, y + 1):
                    if 0 <= yy < h:
                        row, srow = lab[yy], seen[yy]
                        for xx in (x - 1, x, x + 1):
                            if 0 <= xx < w and row[xx] == c and not srow[xx]:
                                srow[xx] = True
                                stack.append((yy, xx))
            out.append((c, pix))
    return out


def shape_features(mask: np.ndarray) -> tuple[float, float, float, float]:
    """(fill, halves, corners, aspect) of a component's mask cropped to its bounding box.

    fill    area / bounding-box area (square ~1, circle ~0.8, triangle ~0.55)
    halves  min/max of the pixel counts of the top and bottom halves (triangle ~0.35, else ~1)
    corners mean occupancy of the four corner patches (side 20% of the box; square ~1, circle
            <= 0.35, triangle ~0.45)
    """
    h, w = mask.shape
    fill = float(mask.mean())
    top, bot = float(mask[: h // 2].sum()), float(mask[(h + 1) // 2 :].sum())
    halves = min(top, bot) / max(top, bot, 1.0)
    k = max(1, round(0.2 * min(h, w)))
    corners = float(np.mean([mask[:k, :k].mean(), mask[:k, -k:].mean(), mask[-k:, :k].mean(), mask[-k:, -k:].mean()]))
    return fill, halves, corners, max(h, w) / min(h, w)


def shape_of(fill: float, halves: float, corners: float, aspect: float) -> str:
    if aspect > MAX_ASPECT:
        return "other"
    if halves < TRIANGLE_MAX_HALVES:
        return "triangle"
    if corners >= SQUARE_MIN_CORNERS and fill >= SQUARE_MIN_FILL:
        return "square"
    return "circle"


def _object(name: str, ys: np.ndarray, xs: np.ndarray, ch: np.ndarray) -> Detection:
    core = ch >= 0.5 * np.percentile(ch, 90)
    cy, cx = ys[core], xs[core]
    x0, x1, y0, y1 = cx.min(), cx.max(), cy.min(), cy.max()
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=bool)
    mask[cy - y0, cx - x0] = True
    fill, halves, corners, aspect = shape_features(mask)
    return Detection(name, shape_of(fill, halves, corners, aspect), len(ys), fill,
                     (int(x0), int(y0), int(x1), int(y1)), float(cx.mean() + 0.5), float(cy.mean() + 0.5))


def detect(img: np.ndarray) -> list[Detection]:
    """Objects in one RGB uint8 [H, W, 3] image.

    Blobs are 8-connected components of foreground (chromatic) pixels of at least MIN_AREA pixels.
    A blob's colour is the chroma-weighted majority hue of its pixels (robust to a decoder's colour
    noise inside a shape). A blob in which a second colour holds >= SPLIT_SHARE of the weight is
    two touching objects: its pixels go to the nearer of its major colours and each colour's
    connected parts become objects. Shape and centre are judged on an object's core, the pixels
    with at least half its typical (90th percentile) chroma, so a soft halo does not round corners.
    """
    chroma, hue, dist = pixel_hues(img)
    h, w = chroma.shape
    fg = (chroma >= CHROMA_MIN).astype(np.int64) - 1  # 0 foreground, -1 background
    dets = []
    for _, pix in _components(fg):
        if len(pix) < MIN_AREA:
            continue
        p = np.asarray(pix)
        ys, xs = p[:, 0], p[:, 1]
        ch = chroma[ys, xs]
        weight = np.bincount(hue[ys, xs], weights=ch, minlength=len(_NAMES))
        major = np.nonzero(weight >= SPLIT_SHARE * weight.sum())[0]
        if len(major) <= 1:
            dets.append(_object(_NAMES[int(weight.argmax())], ys, xs, ch))
            continue
        nearest = major[dist[ys, xs][:, major].argmin(-1)]
        sub = np.full((h, w), -1, dtype=np.int64)
        sub[ys, xs] = nearest
        for ci, part in _components(sub):
            if len(part) < MIN_AREA:
                continue
            q = np.asarray(part)
            dets.append(_object(_NAMES[ci], q[:, 0], q[:, 1], chroma[q[:, 0], q[:, 1]]))
    return dets


def _offset(a: Detection, b: Detection, relation: str, w: int, h: int) -> float:
    if relation == "left of":
        return (b.cx - a.cx) / w
    if relation == "right of":
        return (a.cx - b.cx) / w
    if relation == "above":
        return (b.cy - a.cy) / h
    if relation == "below":
        return (a.cy - b.cy) / h
    raise ValueError(relation)


def score_image(img: np.ndarray, spec: SceneSpec) -> dict[str, float]:
    """Components, score and boolean checks for one image against one spec."""
    h, w = img.shape[:2]
    dets = detect(img)
    colors = [o.color for o in spec.objects]
    groups = [[d for d in dets if d.color == o.color] for o in spec.objects]
    total = sum(d.area for d in dets)
    extra = [d for d in dets if d.color not in colors]
    purity = 1.0 - sum(d.area for d in extra) / total if total else 1.0

    present = [len(g) > 0 for g in groups]
    color = float(np.mean(present)) * purity
    shape_fr = [sum(d.shape == o.shape for d in g) / len(g) if g else 0.0 for g, o in zip(groups, spec.objects)]
    count_sc = [1.0 / (1 + abs(len(g) - o.count)) if g else 0.0 for g, o in zip(groups, spec.objects)]
    res = {
        "color": color,
        "shape": float(np.mean(shape_fr)),
        "count": float(np.mean(count_sc)),
        "color_ok": float(all(present) and purity >= PURITY_OK),
        "shape_ok": float(all(f == 1.0 for f in shape_fr)),
        "count_ok": float(all(len(g) == o.count for g, o in zip(groups, spec.objects)) and not extra),
    }
    if spec.relation is not None:
        if all(present):
            a, b = (max(g, key=lambda d: d.area) for g in groups[:2])
            d = _offset(a, b, spec.relation, w, h)
            res["position"] = float(np.clip(0.5 + 4 * d, 0.0, 1.0))
            res["position_ok"] = float(d >= POSITION_OK)
        else:
            res["position"], res["position_ok"] = 0.0, 0.0
        res["score"] = (res["color"] + res["shape"] + res["count"] + res["position"]) / 4
    else:
        res["position"], res["position_ok"] = 1.0, 1.0
        res["score"] = (res["color"] + res["shape"] + res["count"]) / 3
    res["correct"] = float(all(res[k] == 1.0 for k in CHECKS[:-1]))
    return res


def _spec_for(prompt: str, meta: dict | None) -> SceneSpec:
    spec = (meta or {}).get("spec")
    if spec is None:
        return caption_to_spec(prompt)
    if isinstance(spec, SceneSpec):
        return spec
    return SceneSpec.from_dict(spec)


def to_uint8_hwc(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """Accept uint8 [n,H,W,3] (the contract) and, leniently, float [0,1] and/or [n,3,H,W]."""
    x = images.detach().cpu() if isinstance(images, torch.Tensor) else torch.as_tensor(images)
    if x.ndim == 3:
        x = x[None]
    if x.shape[-1] != 3 and x.shape[1] == 3:
        x = x.permute(0, 2, 3, 1)
    if x.dtype != torch.uint8:
        x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return x.numpy()


# What "score" (the reward RL optimises) is made of; the components and checks are returned either way.
Score = Literal["partial", "checks", "correct", "graded"]  # config validation checks the option against it
SCORES = get_args(Score)
# "graded": a wrong image earns at most this share of its partial credit, so every right image
# outranks every wrong one and a group where all are wrong still ranks its members.
GRADED_WRONG_MAX = 0.5


def shapes_reward(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None,
                  score: Score = "correct") -> dict[str, torch.Tensor]:
    """Score images against their prompts. Returns float32 tensors [n]: "score", the components
    "color", "shape", "count", "position" (all in [0, 1]) and the 0/1 checks "color_ok", "shape_ok",
    "count_ok", "position_ok", "correct". metadata[i]["spec"] (a SceneSpec dict) overrides parsing.

    `score` picks the reward: "correct" (the default: 1 when every check is right, exactly what the
    evaluation counts, so it cannot be raised by breaking one check to pass another; the one that
    raised held-out accuracy on the embedded default), "partial" (mean of the graded components:
    the most gradient, but it can be raised by trading one check for another, e.g. extra objects
    for surer colours), "checks" (fraction of the applicable 0/1 checks right) or "graded" (1 when
    correct, else GRADED_WRONG_MAX x the partial credit: the evaluation's ranking first, the
    partial credit only among wrong images)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    imgs = to_uint8_hwc(images)
    if len(imgs) != len(prompts):
        raise ValueError(f"{len(imgs)} images for {len(prompts)} prompts")
    metadata = metadata if metadata is not None else [{}] * len(prompts)
    specs = [_spec_for(p, m) for p, m in zip(prompts, metadata)]
    rows = [score_image(img, spec) for img, spec in zip(imgs, specs)]
    for row, spec in zip(rows, specs):
        if score == "correct":
            row["score"] = row["correct"]
        elif score == "checks":
            checks = CHECKS[:4] if spec.relation is not None else CHECKS[:3]
            row["score"] = sum(row[k] for k in checks) / len(checks)
        elif score == "graded" and not row["correct"]:
            row["score"] *= GRADED_WRONG_MAX
    keys = ("score",) + COMPONENTS + CHECKS
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in keys}


def summarize(result: dict[str, torch.Tensor], kinds: list[str] | None = None) -> dict[str, float]:
    """Eval accuracies from a shapes_reward result: mean score, per-check accuracy and joint accuracy
    ("correct"); position accuracy is over prompts with a relation when `kinds` is given."""
    out = {"score": result["score"].mean().item()}
    for k in ("color_ok", "shape_ok", "count_ok"):
        out[k.replace("_ok", "_acc")] = result[k].mean().item()
    pos = result["position_ok"]
    if kinds is not None:
        sel = torch.tensor([k == "position" for k in kinds])
        pos = pos[sel] if sel.any() else pos
    out["position_acc"] = pos.mean().item()
    out["joint_acc"] = result["correct"].mean().item()
    return out
