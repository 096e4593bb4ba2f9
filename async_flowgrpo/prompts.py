"""Prompt files and the prompt stream.

Files: `.txt` (one prompt a line, blank lines and #-comments skipped) or `.jsonl`
({"prompt": ..., anything else becomes that prompt's metadata}). A JSONL row's "images" (a path or
a list, relative to the file) are an edit model's input images, checked as the file is read
(`conditioning.check_images`); every row then carries the same number of them. The shipped sets live in
async_flowgrpo/assets/prompts; `resolve_prompt_path` finds them by bare name.

The stream is a pure function of its position: the prompt at stream index i is
permutation(seed, epoch = i // N)[i % N]. So the only state to checkpoint is the cursor, and a
resumed run neither repeats nor skips a prompt.

With a `mix` ({kind: weight}, kinds from the JSONL rows' "kind" field) index i instead draws a
kind by weight and then a prompt of that kind, both from a generator seeded by (seed, i): still a
pure function of i. Use it when a prompt file's kinds are far from the proportions you want to
train on (shapes_train is 97% relation prompts, since there are many more of them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from async_flowgrpo.conditioning import check_images

PROMPT_DIR = os.path.join(os.path.dirname(__file__), "assets", "prompts")


@dataclass
class Prompt:
    text: str
    metadata: dict = field(default_factory=dict)
    images: tuple[str, ...] = ()  # input image paths (an edit model's), resolved


def resolve_prompt_path(path: str) -> str:
    """A path as given, or the name of a shipped prompt file (with or without extension)."""
    if os.path.exists(path):
        return path
    for candidate in (path, path + ".jsonl", path + ".txt"):
        shipped = os.path.join(PROMPT_DIR, candidate)
        if os.path.exists(shipped):
            return shipped
    raise FileNotFoundError(f"prompt file not found: {path}")


def load_prompts(path: str, image_size: tuple[int, int] | None = None) -> list[Prompt]:
    """Raises ValueError naming the file (and line) for anything but a readable, non-empty prompt
    file; input images must also have `image_size` (height, width) when it is given."""
    path = resolve_prompt_path(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not a prompt file (.txt or .jsonl)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")  # (a leading byte-order mark is not part of the first prompt)
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts: list[Prompt] = []
    for line_no, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        line = line.strip()
        if not line or (line.startswith("#") and not path.endswith(".jsonl")):
            continue
        if path.endswith(".jsonl"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a non-empty string 'prompt' key")
            images = ()
            if "images" in row:
                images = check_images(row.pop("images"), os.path.dirname(path), f"{path}:{line_no}", image_size)
                if prompts and len(images) != len(prompts[0].images):
                    raise ValueError(f"{path}:{line_no}: {len(images)} images, but the first row has "
                                     f"{len(prompts[0].images)}: every row needs the same number")
            elif prompts and prompts[0].images:
                raise ValueError(f"{path}:{line_no}: no \"images\", but the file's other rows have them")
            prompts.append(Prompt(row.pop("prompt"), row, images))
        else:
            prompts.append(Prompt(line))
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return prompts


class PromptStream:
    """Deterministic, resumable stream of (stream_index, Prompt)."""

    def __init__(self, prompts: list[Prompt], seed: int = 0, shuffle: bool = True, mix: dict[str, float] | None = None):
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = 0
        self._epoch = -1
        self._order: list[int] = []
        self._kinds: list[list[Prompt]] = []
        if mix:
            self._kinds = [[p for p in prompts if p.metadata.get("kind") == kind] for kind in mix]
            missing = [kind for kind, pool in zip(mix, self._kinds) if not pool]
            if missing:
                raise ValueError(f"prompt mix: no prompt of kind {missing} (kinds come from the JSONL 'kind' field)")
            self._kind_weights = torch.tensor([float(w) for w in mix.values()])

    def prompt_at(self, index: int) -> Prompt:
        if self._kinds:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            pool = self._kinds[int(torch.multinomial(self._kind_weights, 1, generator=g))]
            return pool[int(torch.randint(len(pool), (1,), generator=g))]
        epoch, pos = divmod(index, len(self.prompts))
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(len(self.prompts), generator=g).tolist()
            else:
                self._order = list(range(len(self.prompts)))
        return self.prompts[self._order[pos]]

    def next(self) -> tuple[int, Prompt]:
        index = self.cursor
        self.cursor += 1
        return index, self.prompt_at(index)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
