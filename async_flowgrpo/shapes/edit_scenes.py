"""Procedural edit pairs for the embedded edit task: a source scene, an instruction, the edited scene.

Grammar (lower case; every instruction parses back to the same `EditSpec`):

    recolor := "make the" COLOR SHAPE COLOR            "make the red circle blue"
    move    := "move the" COLOR SHAPE DIRECTION        "move the green square to the left"
    remove  := "remove the" COLOR SHAPE                "remove the blue triangle"
    add     := "add a" COLOR SHAPE                     "add a green circle"

    DIRECTION := "to the left" | "to the right" | "up" | "down"

COLOR and SHAPE are the shapes task's (`scenes.COLORS`, `scenes.SHAPES`). A scene holds one or two
objects of different colours, so "the COLOR SHAPE" names one object; the instruction's object is in
the source (recolor, move, remove) or its colour is absent from it (add); a recolor's new colour is
absent too. A move shifts the object by MOVE_FRACTION of the image side and keeps it clear of the
other object; everything but the named object is drawn identically in source and target.

Held-out instructions: a seeded, per-operation share of the instructions never occurs in training
pairs (`split_edits`); the evaluation set is built from them only.
`python -m async_flowgrpo.shapes.edit_scenes [OUTDIR]` writes the shipped prompt sets (JSONL rows
with a source image path each, relative to the file).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, replace

import numpy as np
from PIL import Image

from .scenes import COLORS, SHAPES, Placed, draw

OPS = ("recolor", "move", "remove", "add")
DIRECTIONS = {"to the left": (-1, 0), "to the right": (1, 0), "up": (0, -1), "down": (0, 1)}
MOVE_FRACTION = 0.25  # a move's shift, in image sides (8 px at 32 x 32)
SIZE_RANGE = (0.25, 0.34)  # object side, in image sides
GAP = 2.0  # pixels between objects
HELD_OUT = {"recolor": 16, "move": 12, "remove": 4, "add": 4}  # instructions per operation never trained on


@dataclass(frozen=True)
class EditSpec:
    op: str  # one of OPS
    color: str
    shape: str
    arg: str | None = None  # recolor: the new colour; move: a DIRECTIONS key

    def validate(self) -> "EditSpec":
        if self.op not in OPS or self.color not in COLORS or self.shape not in SHAPES:
            raise ValueError(f"bad edit {self}")
        if self.op == "recolor" and (self.arg not in COLORS or self.arg == self.color):
            raise ValueError(f"a recolor needs a new colour: {self}")
        if self.op == "move" and self.arg not in DIRECTIONS:
            raise ValueError(f"a move needs a direction: {self}")
        if self.op in ("remove", "add") and self.arg is not None:
            raise ValueError(f"{self.op} takes no argument: {self}")
        return self


def instruction(edit: EditSpec) -> str:
    edit.validate()
    obj = f"{edit.color} {edit.shape}"
    return {"recolor": f"make the {obj} {edit.arg}", "move": f"move the {obj} {edit.arg}",
            "remove": f"remove the {obj}", "add": f"add a {obj}"}[edit.op]


def parse_instruction(text: str) -> EditSpec:
    """The EditSpec of an instruction of the grammar above (case and a final full stop ignored)."""
    words = text.lower().strip().rstrip(".").split()
    heads = {("make", "the"): "recolor", ("move", "the"): "move", ("remove", "the"): "remove", ("add", "a"): "add"}
    op = heads.get(tuple(words[:2]))
    if op is None or len(words) < 4:
        raise ValueError(f"not an edit instruction: {text!r}")
    color, shape, rest = words[2], words[3], " ".join(words[4:]) or None
    return EditSpec(op, color, shape, rest).validate()


def vocabulary() -> tuple[str, ...]:
    words = ["make", "the", "move", "remove", "add", "a", *COLORS, *SHAPES]
    for d in DIRECTIONS:
        words += d.split()
    return tuple(dict.fromkeys(words))


def all_edits() -> dict[str, list[EditSpec]]:
    out: dict[str, list[EditSpec]] = {op: [] for op in OPS}
    for c in COLORS:
        for s in SHAPES:
            out["recolor"] += [EditSpec("recolor", c, s, c2) for c2 in COLORS if c2 != c]
            out["move"] += [EditSpec("move", c, s, d) for d in DIRECTIONS]
            out["remove"].append(EditSpec("remove", c, s))
            out["add"].append(EditSpec("add", c, s))
    return out


def split_edits(seed: int = 0) -> tuple[list[EditSpec], list[EditSpec]]:
    """(train, held-out) instructions: HELD_OUT[op] of each operation, seeded shuffle."""
    rng = random.Random(seed)
    train, held = [], []
    for op, edits in all_edits().items():
        edits = list(edits)
        rng.shuffle(edits)
        held += edits[: HELD_OUT[op]]
        train += edits[HELD_OUT[op]:]
    return train, held


# ----------------------------------------------------------------------------- pairs


def _clear(p: Placed, others: list[Placed], res: int) -> bool:
    inside = 1 <= p.x and 1 <= p.y and p.x + p.size <= res - 1 and p.y + p.size <= res - 1
    return inside and all(
        p.x + p.size + GAP <= q.x or q.x + q.size + GAP <= p.x or p.y + p.size + GAP <= q.y or q.y + q.size + GAP <= p.y
        for q in others
    )


def _place(color: str, shape: str, others: list[Placed], rng: random.Random, res: int) -> Placed | None:
    for _ in range(100):
        size = round(rng.uniform(*SIZE_RANGE) * res)
        p = Placed(color, shape, rng.randint(1, res - 1 - size), rng.randint(1, res - 1 - size), size)
        if _clear(p, others, res):
            return p
    return None


def edit_pair(edit: EditSpec, rng: random.Random, res: int = 32) -> tuple[list[Placed], list[Placed]]:
    """(source objects, target objects) for `edit`: the source holds the named object (or, for add,
    lacks its colour) and at most one other object, of another colour (and not the recolor's new one)."""
    edit.validate()
    for _ in range(1000):
        taken = {edit.color} | ({edit.arg} if edit.op == "recolor" else set())
        others: list[Placed] = []
        if rng.random() < 0.6:  # a second, untouched object (what "the rest is unchanged" checks)
            other = _place(rng.choice([c for c in COLORS if c not in taken]), rng.choice(SHAPES), [], rng, res)
            others = [other] if other else []
        if edit.op == "add":
            new = _place(edit.color, edit.shape, others, rng, res)
            if new is not None:
                return others, others + [new]
            continue
        obj = _place(edit.color, edit.shape, others, rng, res)
        if obj is None:
            continue
        if edit.op == "recolor":
            return others + [obj], others + [replace(obj, color=edit.arg)]
        if edit.op == "remove":
            return others + [obj], others
        dx, dy = DIRECTIONS[edit.arg]
        shift = MOVE_FRACTION * res
        moved = replace(obj, x=obj.x + dx * shift, y=obj.y + dy * shift)
        if _clear(moved, others, res):
            return others + [obj], others + [moved]
    raise RuntimeError(f"could not lay out {edit}")


def render_pair(edit: EditSpec, rng: random.Random, res: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) RGB uint8 [res, res, 3] images of one random pair for `edit`."""
    source, target = edit_pair(edit, rng, res)
    return draw(source, res), draw(target, res)


def write_prompt_set(edits: list[EditSpec], path: str, *, pairs_per_edit: int, seed: int, res: int = 32) -> None:
    """A JSONL prompt file at `path` and its source images (PNG) in a folder <name>_images beside it: one row per
    pair, {"prompt": instruction, "images": [relative path], "kind": op, "edit": EditSpec dict}."""
    folder = os.path.splitext(os.path.basename(path))[0] + "_images"  # (not the file's bare name: that finds the file)
    os.makedirs(os.path.join(os.path.dirname(path), folder), exist_ok=True)
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i, edit in enumerate(e for e in edits for _ in range(pairs_per_edit)):
            source, _ = render_pair(edit, rng, res)
            name = f"{folder}/{i:04d}.png"
            Image.fromarray(source).save(os.path.join(os.path.dirname(path), name))
            row = {"prompt": instruction(edit), "images": [name], "kind": edit.op, "edit": asdict(edit)}
            f.write(json.dumps(row) + "\n")


def main() -> None:  # python -m async_flowgrpo.shapes.edit_scenes [outdir]
    import sys

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: python -m async_flowgrpo.shapes.edit_scenes [OUTDIR]\n\n"
              "Writes the edit task's prompt sets (shapes_edit_train.jsonl, shapes_edit_eval.jsonl and their "
              "source images) to OUTDIR (default: the package's assets/prompts).")
        return
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "assets", "prompts")
    train, held = split_edits()
    write_prompt_set(train, os.path.join(out, "shapes_edit_train.jsonl"), pairs_per_edit=2, seed=1)
    write_prompt_set(held, os.path.join(out, "shapes_edit_eval.jsonl"), pairs_per_edit=2, seed=2)
    print(f"wrote {2 * len(train)} train and {2 * len(held)} eval prompts to {out}")


if __name__ == "__main__":
    main()
