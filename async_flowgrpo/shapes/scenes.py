"""Procedural "shapes" scenes: spec dataclasses, drawing, captions <-> specs, prompt sets.

Grammar (lower case, one space between words; every caption parses back to the same spec):

    single    := "a" COLOR SHAPE                                  "a red circle"
    count     := NUMBER COLOR SHAPE "s"                           "two blue squares"
    position  := "a" COLOR SHAPE RELATION "a" COLOR SHAPE         "a red circle left of a green triangle"

    COLOR     := red | green | blue | yellow | purple | cyan
    SHAPE     := circle | square | triangle
    NUMBER    := two | three
    RELATION  := "left of" | "right of" | "above" | "below"

In a position scene the two colours differ (objects are found by colour) and the relation reads
"object 0 RELATION object 1" (e.g. object 0's centre is left of object 1's centre).

Images are RGB uint8 [H, W, 3], 32x32 by default: flat-coloured shapes on white, drawn 4x
supersampled and box-filtered down (soft edges, like a real decoder produces). Triangles point up,
squares are axis aligned, so the fill ratio of a shape's bounding box tells the shape apart
(square ~1.0, circle ~pi/4, triangle ~0.5). Objects never touch (>= 2 px gap).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (35, 70, 225),
    "yellow": (235, 205, 20),
    "purple": (150, 40, 190),
    "cyan": (20, 190, 205),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = {"two": 2, "three": 3}
NUMBER_WORDS = {v: k for k, v in NUMBERS.items()}
RELATIONS = ("left of", "right of", "above", "below")
KINDS = ("single", "count", "position")
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class ObjectSpec:
    color: str
    shape: str
    count: int = 1


@dataclass(frozen=True)
class SceneSpec:
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None  # objects[0] <relation> objects[1]

    @property
    def kind(self) -> str:
        if self.relation is not None:
            return "position"
        if self.objects[0].count > 1:
            return "count"
        return "single"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "objects": [asdict(o) for o in self.objects], "relation": self.relation}

    @staticmethod
    def from_dict(d: dict) -> "SceneSpec":
        objs = tuple(ObjectSpec(o["color"], o["shape"], int(o.get("count", 1))) for o in d["objects"])
        return SceneSpec(objs, d.get("relation"))

    def validate(self) -> "SceneSpec":
        if not 1 <= len(self.objects) <= 2:
            raise ValueError(f"1 or 2 objects expected: {self}")
        for o in self.objects:
            if o.color not in COLORS or o.shape not in SHAPES or not 1 <= o.count <= 3:
                raise ValueError(f"bad object {o}")
        if len(self.objects) == 2:
            if self.relation not in RELATIONS:
                raise ValueError(f"two objects need a relation: {self}")
            if self.objects[0].color == self.objects[1].color:
                raise ValueError(f"objects of a position scene must differ in colour: {self}")
            if any(o.count != 1 for o in self.objects):
                raise ValueError(f"counts in position scenes are not supported: {self}")
        elif self.relation is not None:
            raise ValueError(f"a relation needs two objects: {self}")
        return self


# ----------------------------------------------------------------------------- captions


def spec_to_caption(spec: SceneSpec) -> str:
    spec.validate()
    o = spec.objects[0]
    if spec.relation is not None:
        b = spec.objects[1]
        return f"a {o.color} {o.shape} {spec.relation} a {b.color} {b.shape}"
    if o.count == 1:
        return f"a {o.color} {o.shape}"
    return f"{NUMBER_WORDS[o.count]} {o.color} {o.shape}s"


def _parse_object(words: list[str]) -> ObjectSpec:
    if len(words) != 3:
        raise ValueError(f"cannot parse object {' '.join(words)!r}")
    det, color, shape = words
    if det == "a" or det == "an" or det == "one":
        count = 1
    elif det in NUMBERS:
        count = NUMBERS[det]
        if not shape.endswith("s"):
            raise ValueError(f"plural expected after {det!r}: {shape!r}")
        shape = shape[:-1]
    else:
        raise ValueError(f"unknown determiner {det!r}")
    if color not in COLORS:
        raise ValueError(f"unknown colour {color!r}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}")
    return ObjectSpec(color, shape, count)


def caption_to_spec(caption: str) -> SceneSpec:
    """Parse a caption of the grammar above (case and surrounding punctuation ignored)."""
    words = caption.lower().strip().rstrip(".").split()
    for rel in RELATIONS:
        rw = rel.split()
        for i in range(len(words) - len(rw) + 1):
            if words[i : i + len(rw)] == rw:
                a, b = words[:i], words[i + len(rw) :]
                return SceneSpec((_parse_object(a), _parse_object(b)), rel).validate()
    return SceneSpec((_parse_object(words),)).validate()


def vocabulary() -> tuple[str, ...]:
    """Every word the grammar can produce (for the tokenizer)."""
    words = ["a", *NUMBERS, *COLORS, *SHAPES, *(s + "s" for s in SHAPES)]
    for rel in RELATIONS:
        words += rel.split()
    return tuple(dict.fromkeys(words))


# ----------------------------------------------------------------------------- drawing


@dataclass
class Placed:
    """One drawn object: colour, shape and its box (x0, y0, size) in pixels."""

    color: str
    shape: str
    x: float
    y: float
    size: float

    @property
    def center(self) -> tuple[float, float]:
        return (self.x + self.size / 2, self.y + self.size / 2)


def _size_range(spec: SceneSpec, res: int) -> tuple[float, float]:
    n = sum(o.count for o in spec.objects)
    frac = {1: (0.30, 0.50), 2: (0.24, 0.36), 3: (0.21, 0.29)}[min(n, 3)]
    return frac[0] * res, frac[1] * res


def _overlaps(a: Placed, b: Placed, gap: float) -> bool:
    return not (
        a.x + a.size + gap <= b.x
        or b.x + b.size + gap <= a.x
        or a.y + a.size + gap <= b.y
        or b.y + b.size + gap <= a.y
    )


def _relation_holds(a: Placed, b: Placed, relation: str, margin: float) -> bool:
    (ax, ay), (bx, by) = a.center, b.center
    if relation == "left of":
        return bx - ax >= margin
    if relation == "right of":
        return ax - bx >= margin
    if relation == "above":
        return by - ay >= margin
    if relation == "below":
        return ay - by >= margin
    raise ValueError(relation)


def layout(spec: SceneSpec, rng: random.Random, res: int = 32, gap: float = 2.0, tries: int = 1000) -> list[Placed]:
    """Random non-overlapping placement satisfying the spec's relation (centres >= res/4 apart)."""
    spec.validate()
    lo, hi = _size_range(spec, res)
    items = [(o.color, o.shape) for o in spec.objects for _ in range(o.count)]
    margin = res / 4
    for _ in range(tries):
        placed: list[Placed] = []
        for color, shape in items:
            size = round(rng.uniform(lo, hi))
            for _ in range(50):
                x = rng.randint(1, res - 1 - size)
                y = rng.randint(1, res - 1 - size)
                p = Placed(color, shape, x, y, size)
                if not any(_overlaps(p, q, gap) for q in placed):
                    placed.append(p)
                    break
            else:
                break
        if len(placed) != len(items):
            continue
        if spec.relation is not None and not _relation_holds(placed[0], placed[1], spec.relation, margin):
            continue
        return placed
    raise RuntimeError(f"could not lay out {spec}")


def draw(placed: Iterable[Placed], res: int = 32, supersample: int = 4) -> np.ndarray:
    """Render placed objects to an RGB uint8 [res, res, 3] array."""
    s = supersample
    img = Image.new("RGB", (res * s, res * s), BACKGROUND)
    d = ImageDraw.Draw(img)
    for p in placed:
        x0, y0, x1, y1 = p.x * s, p.y * s, (p.x + p.size) * s - 1, (p.y + p.size) * s - 1
        fill = COLORS[p.color]
        if p.shape == "circle":
            d.ellipse([x0, y0, x1, y1], fill=fill)
        elif p.shape == "square":
            d.rectangle([x0, y0, x1, y1], fill=fill)
        elif p.shape == "triangle":
            d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
        else:
            raise ValueError(p.shape)
    if s > 1:
        img = img.resize((res, res), Image.BOX)
    return np.asarray(img, dtype=np.uint8).copy()


def render(spec: SceneSpec, seed: int | random.Random = 0, res: int = 32) -> np.ndarray:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return draw(layout(spec, rng, res), res)


# ----------------------------------------------------------------------------- prompt sets


def all_specs() -> dict[str, list[SceneSpec]]:
    out: dict[str, list[SceneSpec]] = {k: [] for k in KINDS}
    for c in COLORS:
        for s in SHAPES:
            out["single"].append(SceneSpec((ObjectSpec(c, s),)))
            for n in NUMBERS.values():
                out["count"].append(SceneSpec((ObjectSpec(c, s, n),)))
    for c1 in COLORS:
        for s1 in SHAPES:
            for c2 in COLORS:
                if c2 == c1:
                    continue
                for s2 in SHAPES:
                    for rel in RELATIONS:
                        out["position"].append(SceneSpec((ObjectSpec(c1, s1), ObjectSpec(c2, s2)), rel))
    return out


# held-out eval prompts per kind (64 in all); the rest are the train prompts
EVAL_COUNTS = {"single": 6, "count": 18, "position": 40}


def strata(spec: SceneSpec) -> list[tuple[str, str]]:
    """The attributes a stratified split balances: (attribute, value) pairs of one spec."""
    out = [("relation", spec.relation or "")]
    for i, o in enumerate(spec.objects):
        out += [(f"color{i}", o.color), (f"shape{i}", o.shape), (f"count{i}", str(o.count))]
    return out


def _imbalance(held: list[SceneSpec], values: dict[str, set[str]]) -> int:
    """Sum over attributes of (most - fewest) held-out specs sharing one value of that attribute."""
    counts: dict[str, dict[str, int]] = {a: dict.fromkeys(vs, 0) for a, vs in values.items()}
    for s in held:
        for a, v in strata(s):
            counts[a][v] += 1
    return sum(max(c.values()) - min(c.values()) for c in counts.values())


def split_prompts(seed: int = 0, eval_counts: dict[str, int] = EVAL_COUNTS) -> tuple[list[SceneSpec], list[SceneSpec]]:
    """Deterministic, stratified train / held-out split. Held-out prompts never occur as training captions.

    Within each kind the held-out prompts spread evenly over every attribute (number word, relation,
    each object's colour and shape: counts differ by at most one where the sizes allow), found by
    swapping held-out and kept prompts from a seeded shuffle while the imbalance falls. Every value of
    every attribute is then in both splits.
    """
    rng = random.Random(seed)
    train, evals = [], []
    for kind, pool in all_specs().items():
        values: dict[str, set[str]] = {}
        for s in pool:
            for a, v in strata(s):
                values.setdefault(a, set()).add(v)
        pool = list(pool)
        rng.shuffle(pool)
        n = eval_counts[kind]
        held, kept = pool[:n], pool[n:]
        score = _imbalance(held, values)
        for _ in range(20_000):
            if score == sum(1 for vs in values.values() if n % len(vs)):  # as even as n allows
                break
            i, j = rng.randrange(n), rng.randrange(len(kept))
            held[i], kept[j] = kept[j], held[i]
            new = _imbalance(held, values)
            if new <= score:
                score = new
            else:
                held[i], kept[j] = kept[j], held[i]
        evals += held
        train += kept
    return train, evals


def write_jsonl(specs: Iterable[SceneSpec], path: str) -> None:
    with open(path, "w") as f:
        for s in specs:
            f.write(json.dumps({"prompt": spec_to_caption(s), "kind": s.kind, "spec": s.to_dict()}) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


MOTION_SIZE = 12  # pixels: the object of a motion prompt's first frame


def motion_first_frame(caption: str, res: int = 32) -> np.ndarray:
    """The first frame of a motion prompt ("a red circle moving left"): the object, vertically
    centred, at the side it moves away from (an image-to-video model's input, `motion_first_frames`)."""
    words = caption.split()
    if len(words) != 5 or words[0] != "a" or words[3] != "moving" or words[4] not in ("left", "right"):
        raise ValueError(f"not a motion prompt: {caption!r}")
    color, shape = words[1], words[2]
    if color not in COLORS or shape not in SHAPES:
        raise ValueError(f"not a motion prompt: {caption!r}")
    margin = (res - MOTION_SIZE) / 2
    x = res - 3 - MOTION_SIZE if words[4] == "left" else 3
    return draw([Placed(color, shape, x, margin, MOTION_SIZE)], res)


def write_motion_first_frames(prompt_dir: str) -> None:
    """motion_first_frames_{train,eval}.jsonl beside motion_{train,eval}.txt: the same prompts, each
    with its first frame (motion_first_frames/NAME.png, 32 x 32)."""
    frames = os.path.join(prompt_dir, "motion_first_frames")
    os.makedirs(frames, exist_ok=True)
    for split in ("train", "eval"):
        with open(os.path.join(prompt_dir, f"motion_{split}.txt")) as f:
            captions = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        with open(os.path.join(prompt_dir, f"motion_first_frames_{split}.jsonl"), "w") as f:
            for caption in captions:
                name = caption.removeprefix("a ").replace(" ", "_") + ".png"
                Image.fromarray(motion_first_frame(caption)).save(os.path.join(frames, name))
                f.write(json.dumps({"prompt": caption, "images": f"motion_first_frames/{name}"}) + "\n")


def main() -> None:  # python -m async_flowgrpo.shapes.scenes [outdir]
    import sys

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: python -m async_flowgrpo.shapes.scenes [OUTDIR]\n\n"
              "Writes the shapes prompt split (shapes_train.jsonl, shapes_eval.jsonl) to OUTDIR "
              "(default: the package's assets/prompts), and there the first frames of its motion "
              "prompts (motion_first_frames_{train,eval}.jsonl, from motion_{train,eval}.txt).")
        return
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "assets", "prompts")
    train, evals = split_prompts()
    write_jsonl(train, os.path.join(out, "shapes_train.jsonl"))
    write_jsonl(evals, os.path.join(out, "shapes_eval.jsonl"))
    write_motion_first_frames(out)
    print(f"wrote {len(train)} train and {len(evals)} eval prompts, and the motion prompts' first frames, to {out}")


if __name__ == "__main__":
    main()
