"""Run outputs: metrics.jsonl, config.yaml, sample grids, wandb, a progress bar and an end summary.

One `RunLogger` lives in the driver. It owns the run's output directory (DESIGN §6):

    <output_dir>/config.yaml     the resolved config
    <output_dir>/metrics.jsonl   one JSON object per trainer step (append mode: a resumed run continues it;
                                 each line is written whole, and a torn last line, from a crash
                                 mid-write, is dropped when the file is opened again)
    <output_dir>/samples/        PNG grids of rollout / eval images
    <output_dir>/checkpoints/    written by the trainer, created here so it always exists
    <output_dir>/summary.json    the end-of-run summary

Also here: `reduce_metrics` (combine per-trainer-rank dicts), `make_grid`, and `BusyTracker`
(the busy/idle stopwatch the actors use for perf/*_idle_frac).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from async_flowgrpo.config import Config, to_yaml

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Combining metrics across trainer ranks
# --------------------------------------------------------------------------------------------

# Keys reduced with max besides those ending in "_max" / "/max": a worst case must stay a worst
# case after combining ranks (a mean would hide one rank's blow-up). step/version are equal on
# every rank; max keeps them ints.
MAX_KEYS = frozenset({"is/weight_max", "staleness/max", "logp/max_abs_diff", "step", "version"})
# Counters add up across ranks: each rank counts its own share of the batch (and each rollout
# worker its own groups waiting for a score).
SUM_PREFIXES = ("samples/",)
SUM_KEYS = frozenset({"reward/pending"})
SUM_SUBSTRINGS = ("skipped", "errors")


def reduction_for(key: str) -> str:
    """'max' | 'sum' | 'mean' — the rule `reduce_metrics` applies to `key`."""
    if key in MAX_KEYS or key.endswith(("_max", "/max")):
        return "max"
    if key in SUM_KEYS or key.startswith(SUM_PREFIXES) or any(s in key for s in SUM_SUBSTRINGS):
        return "sum"
    return "mean"


def reduce_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine one metrics dict per trainer rank into one dict.

    mean by default; max for worst-case keys (see `reduction_for`); sum for counters. A key missing
    on some ranks is reduced over the ranks that have it. NaN propagates (a NaN on any rank is a
    signal worth seeing, and Python's max() is order-dependent with NaN).
    """
    keys: dict[str, None] = {}
    for d in per_rank:
        keys.update(dict.fromkeys(d))
    out: dict[str, float] = {}
    for key in keys:
        values = [_as_number(d[key]) for d in per_rank if key in d and d[key] is not None]
        if not values:
            continue
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            out[key] = float("nan")
            continue
        rule = reduction_for(key)
        if rule == "max":
            out[key] = max(values)
        elif rule == "sum":
            out[key] = sum(values)
        elif all(v == values[0] for v in values):
            out[key] = values[0]  # identical on every rank: keep it as is (ints stay ints)
        else:
            out[key] = sum(values) / len(values)
    return out


def _as_number(v: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers (metrics arrive from actors in any of these)."""
    if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
        return v.item()
    return v


def _json_value(v: Any) -> Any:
    """A value that json.dumps(allow_nan=False) accepts: NaN/inf become null."""
    v = _as_number(v)
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


# --------------------------------------------------------------------------------------------
# Stopwatches
# --------------------------------------------------------------------------------------------


class BusyTracker:
    """Busy vs idle wall time of an actor over a reporting window.

    Wrap the useful work in `with tracker.busy(): ...`; `idle_frac()` returns the idle share of the
    time since the previous call (or creation) and starts a new window. Nested `busy()` sections
    count once, and a section still running at read time contributes its part so far (a long
    generation that spans two windows is split between them, not dropped from one). Thread-safe:
    rollout actors may report from another thread than the one generating.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._busy_s = 0.0
        self._depth = 0
        self._busy_since = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._busy_since = self._clock()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._busy_s += self._clock() - self._busy_since

    def fractions(self, reset: bool = True) -> tuple[float, float]:
        """(busy_frac, idle_frac) of the current window, each in [0, 1]."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s
            if self._depth > 0:
                busy += now - self._busy_since
            elapsed = now - self._window_start
            if reset:
                self._window_start = now
                self._busy_s = 0.0
                if self._depth > 0:
                    self._busy_since = now
        if elapsed <= 0:
            return 0.0, 0.0  # an empty window says nothing; 0 idle avoids a spurious "starved" reading
        busy_frac = min(1.0, max(0.0, busy / elapsed))
        return busy_frac, 1.0 - busy_frac

    def idle_frac(self, reset: bool = True) -> float:
        return self.fractions(reset)[1]


# --------------------------------------------------------------------------------------------
# Image grids
# --------------------------------------------------------------------------------------------

_MIN_TILE_PX = 128  # tiles smaller than this are upscaled (nearest) so 32x32 samples are visible


def auto_scale(height: int, width: int) -> int:
    """Integer nearest-neighbour upscale factor: 32 px -> 4, 64 -> 2, >= 128 -> 1."""
    return max(1, _MIN_TILE_PX // max(height, width, 1))


def _to_uint8_hwc(images: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
        raise ValueError(f"expected images [N, H, W, 3], got shape {tuple(arr.shape)}")
    if arr.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got {arr.dtype}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr


def _fit_caption(draw: ImageDraw.ImageDraw, font: Any, text: str, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap into at most max_lines lines of `width` px; the last line is cut with '..'."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < max_lines:
        line = words.pop(0)
        while words and draw.textlength(f"{line} {words[0]}", font=font) <= width:
            line = f"{line} {words.pop(0)}"
        while draw.textlength(line, font=font) > width and len(line) > 1:
            line = line[:-1]
        lines.append(line)
    if words and lines:  # text left over: mark the cut
        last = lines[-1]
        while last and draw.textlength(last + "..", font=font) > width:
            last = last[:-1]
        lines[-1] = last + ".."
    return lines


GIF_FRAME_MS = 125  # 8 frames per second in saved sample GIFs


def make_grid(
    images: torch.Tensor | np.ndarray,
    nrow: Optional[int] = None,
    scale: Optional[int] = None,
    captions: Optional[Sequence[str]] = None,
    pad: int = 2,
    caption_lines: int = 2,
) -> Image.Image:
    """Tile uint8 images [N, H, W, 3] into one RGB image, `nrow` tiles per row.

    nrow None = ceil(sqrt(N)); scale None = `auto_scale`. Size without captions:
    (nrow * W*scale + (nrow+1) * pad) x (rows * H*scale + (rows+1) * pad). With captions each tile
    gets `caption_lines` lines of PIL's default font under it.
    """
    arr = _to_uint8_hwc(images)
    n, h, w, _ = arr.shape
    if n == 0:
        raise ValueError("make_grid needs at least one image")
    if captions is not None and len(captions) != n:
        raise ValueError(f"{len(captions)} captions for {n} images")
    nrow = max(1, min(nrow or math.ceil(math.sqrt(n)), n))
    scale = scale or auto_scale(h, w)
    rows = math.ceil(n / nrow)
    tw, th = w * scale, h * scale

    font = ImageFont.load_default() if captions is not None else None
    line_h = 0
    if font is not None:
        left, top, right, bottom = font.getbbox("Ag")
        line_h = int(bottom - min(top, 0)) + 2
    cap_h = line_h * caption_lines if captions is not None else 0

    grid = Image.new("RGB", (nrow * tw + (nrow + 1) * pad, rows * (th + cap_h) + (rows + 1) * pad), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        r, c = divmod(i, nrow)
        x = pad + c * (tw + pad)
        y = pad + r * (th + cap_h + pad)
        tile = Image.fromarray(arr[i])
        if scale != 1:
            tile = tile.resize((tw, th), Image.Resampling.NEAREST)  # nearest: keep pixels crisp, no blur
        grid.paste(tile, (x, y))
        if captions is not None:
            for k, line in enumerate(_fit_caption(draw, font, captions[i], tw, caption_lines)):
                draw.text((x, y + th + k * line_h), line, fill=(0, 0, 0), font=font)
    return grid


# --------------------------------------------------------------------------------------------
# JSON lines that stay JSON lines
# --------------------------------------------------------------------------------------------


def drop_torn_line(path: str) -> None:
    """Cut a partial last line (a crash or a full disk in the middle of writing it), so that the
    rows appended next start on a line of their own and the file reads as JSON lines (pandas, jq)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        size = end = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            if start + len(block) == size and block.endswith(b"\n"):
                return  # whole
            cut = block.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        f.truncate(end)
    logger.warning("%s: dropped a torn last line (%d bytes, cut off by a crash while it was written)", path, size - end)


def append_whole_line(fd: int, line: str) -> None:
    """Append `line` and a newline to the O_APPEND file `fd`, all of it or none: a write that fails
    part-way (disk full, a quota, a signal) is cut back off before the error goes on."""
    data = memoryview((line + "\n").encode("utf-8"))
    size = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
    except BaseException:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass  # the error being raised says more; the next open drops the torn line
        raise


# --------------------------------------------------------------------------------------------
# The run logger
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Series:
    """first / last / running mean / max of one metric over the run (for the summary)."""

    first: Optional[float] = None
    last: Optional[float] = None
    total: float = 0.0
    count: int = 0
    max: Optional[float] = None

    def add(self, v: float) -> None:
        if self.first is None:
            self.first = v
        self.last = v
        self.total += v
        self.count += 1
        self.max = v if self.max is None else max(self.max, v)

    @property
    def mean(self) -> Optional[float]:
        return self.total / self.count if self.count else None


class RunLogger:
    """Writes a run's outputs; see the module docstring for the layout.

    `log(step, metrics)` is called once per trainer step with the reduced metrics. Counters
    (samples/*, *errors*, *skipped*) are expected to be cumulative totals, so the summary takes
    their last value.
    """

    POSTFIX = (("reward/mean", "reward"), ("eval/accuracy", "eval"), ("staleness/mean", "stale"),
               ("perf/samples_per_s", "samples/s"))

    def __init__(self, output_dir: str, config: Config, *, total_steps: int, progress: bool = True) -> None:
        self.output_dir = output_dir
        self.samples_dir = os.path.join(output_dir, "samples")
        self.checkpoints_dir = os.path.join(output_dir, "checkpoints")
        os.makedirs(self.samples_dir, exist_ok=True)
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        self.config = config
        self.total_steps = total_steps

        # Write-then-rename: a crash mid-write never leaves a truncated config.yaml behind.
        config_path = os.path.join(output_dir, "config.yaml")
        with open(config_path + ".tmp", "w", encoding="utf-8") as f:
            f.write(to_yaml(config))
        os.replace(config_path + ".tmp", config_path)

        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        # Append: a resumed run continues the same file (readers take the last line per step).
        drop_torn_line(self.metrics_path)
        self._jsonl = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

        self._wandb: Any = None
        if config.logging.wandb_mode != "disabled":
            import wandb  # lazy: importing wandb costs seconds and is not needed when disabled

            wandb.init(
                project=config.logging.wandb_project,
                name=config.logging.run_name,
                mode=config.logging.wandb_mode,
                config=dataclasses.asdict(config),
                dir=output_dir,
            )
            self._wandb = wandb

        self._bar = tqdm(total=total_steps, disable=not progress, file=sys.stderr, dynamic_ncols=True, desc="train")
        self._postfix: dict[str, str] = {}
        self._start = time.monotonic()
        self._series: dict[str, _Series] = {}
        self._last: dict[str, float] = {}
        self._steps_logged = 0
        self._last_step: Optional[int] = None
        self._closed = False

    # -- per step ---------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one line to metrics.jsonl, log to wandb, advance the progress bar."""
        row: dict[str, Any] = {k: _json_value(v) for k, v in metrics.items() if k != "step"}
        row.setdefault("time_s", time.monotonic() - self._start)
        line = json.dumps({"step": int(step), **dict(sorted(row.items()))}, allow_nan=False)
        append_whole_line(self._jsonl, line)  # one line per step survives a crash of the driver

        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for k, v in numeric.items():
            self._series.setdefault(k, _Series()).add(v)
            self._last[k] = v
        self._steps_logged += 1
        self._last_step = int(step)

        if self._wandb is not None:
            # wandb takes NaN itself; pass the original numbers, minus non-numeric leftovers.
            self._wandb.log({k: _as_number(v) for k, v in metrics.items() if k != "step"}, step=int(step))

        for key, short in self.POSTFIX:
            if key in numeric:  # eval/accuracy only appears on eval steps: keep the last one shown
                self._postfix[short] = f"{numeric[key]:.3g}"
        # Position = the step number, so a resumed run's bar starts where the run left off.
        self._bar.update(max(0, min(int(step), self.total_steps) - self._bar.n))
        self._bar.set_postfix(self._postfix, refresh=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        self._bar.write(message, file=sys.stderr)

    def log_images(
        self,
        step: int,
        name: str,
        images: torch.Tensor | np.ndarray,
        captions: Optional[Sequence[str]] = None,
        nrow: Optional[int] = None,
    ) -> str:
        """Save `samples/{name}_step{step:05d}.png` (a `make_grid`) and log it to wandb; return the path.

        Videos [N, F, H, W, 3] (a video family's samples): the PNG is a frame grid, one video per
        row, and `samples/{name}_step{step:05d}.gif` animates the grid of the N videos frame by frame."""
        path = os.path.join(self.samples_dir, f"{name}_step{int(step):05d}.png")
        arr = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
        if arr.ndim == 5:
            n, f = arr.shape[:2]
            frames = [make_grid(arr[:, i], nrow=nrow, captions=captions) for i in range(f)]
            frames[0].save(path[:-4] + ".gif", save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)
            row_captions = None if captions is None else [c if i == 0 else "" for c in captions for i in range(f)]
            grid = make_grid(arr.reshape(n * f, *arr.shape[2:]), nrow=f, captions=row_captions)
        else:
            grid = make_grid(arr, nrow=nrow, captions=captions)
        grid.save(path)
        if self._wandb is not None:
            caption = " | ".join(captions) if captions else None
            self._wandb.log({f"samples/{name}": self._wandb.Image(grid, caption=caption)}, step=int(step))
        return path

    # -- end of run -------------------------------------------------------------------------

    def summary(self, extra: Optional[Mapping[str, Any]] = None) -> str:
        """One line for people, all numbers in summary.json; `extra` entries override / add fields."""
        wall = time.monotonic() - self._start
        s = self._series

        def first_last(key: str) -> tuple[Optional[float], Optional[float]]:
            return (s[key].first, s[key].last) if key in s else (None, None)

        error_keys = [k for k in self._last if "errors" in k]
        fields: dict[str, Any] = {
            "steps": self._last_step if self._last_step is not None else 0,
            "steps_logged": self._steps_logged,
            "wall_time_s": wall,
            "reward_first": first_last("reward/mean")[0],
            "reward_last": first_last("reward/mean")[1],
            "eval_accuracy_first": first_last("eval/accuracy")[0],
            "eval_accuracy_last": first_last("eval/accuracy")[1],
            "samples_per_s": s["perf/samples_per_s"].mean if "perf/samples_per_s" in s else None,
            "staleness_mean": s["staleness/mean"].mean if "staleness/mean" in s else None,
            "staleness_max": s["staleness/max"].max if "staleness/max" in s else None,
            "dropped": self._last.get("samples/dropped_stale"),
            "errors": sum(self._last[k] for k in error_keys) if error_keys else None,
        }
        fields.update(extra or {})
        fields = {k: _json_value(v) for k, v in fields.items()}

        def f(v: Any, spec: str = ".3g") -> str:
            return "n/a" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)

        parts = [
            f"steps {fields['steps']}",
            f"wall {f(fields['wall_time_s'], '.1f')}s",
            f"reward {f(fields['reward_first'])}->{f(fields['reward_last'])}",
            f"eval acc {f(fields['eval_accuracy_first'])}->{f(fields['eval_accuracy_last'])}",
            f"{f(fields['samples_per_s'])} samples/s",
            f"staleness mean {f(fields['staleness_mean'])} max {f(fields['staleness_max'])}",
            f"dropped {f(fields['dropped'], 'g')}",
            f"errors {f(fields['errors'], 'g')}",
        ]
        shown = {"steps", "steps_logged", "wall_time_s", "reward_first", "reward_last", "eval_accuracy_first",
                 "eval_accuracy_last", "samples_per_s", "staleness_mean", "staleness_max", "dropped", "errors"}
        parts += [f"{k} {f(v)}" for k, v in fields.items() if k not in shown]
        line = "summary: " + " | ".join(parts)

        with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(fields, fh, indent=2, allow_nan=False)
        self._bar.write(line, file=sys.stdout)
        run = getattr(self._wandb, "run", None)
        if run is not None:
            run.summary.update({k: v for k, v in fields.items() if v is not None})
        return line

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bar.close()
        os.close(self._jsonl)
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
