"""Checkpoints that are safe to load and safe to crash in; the run directory's one-run rule.

A checkpoint is a directory ``<output_dir>/checkpoints/step_NNNNNN/``:

    state.json            counters, the run's config, and the structure of the state (JSON)
    tensors.safetensors   every tensor of the state (weights, optimizer moments, RNG state)
    weights/              the trained weights in diffusers format (safetensors), for inference
    manifest.json         written last: the size of every file above

Nothing is ever unpickled: ``torch.load(weights_only=False)`` on a downloaded or tampered
checkpoint runs whatever code the file names, so tensors go through safetensors and the rest
through JSON. (A pre-JSON ``state.pt`` is still read, with ``weights_only=True``, which refuses
anything but tensors and plain containers.)

Atomic: a checkpoint is written into ``.tmp-step_NNNNNN-<pid>/``, every file fsynced, then renamed
into place; ``checkpoints/latest`` (a one-line text file, like verl's
latest_checkpointed_iteration.txt) is replaced atomically only afterwards, so it only ever names
a complete checkpoint. The last ``keep`` checkpoints are kept. A checkpoint that fails its checks
(a truncated or missing file, unreadable JSON) is skipped with a one-line warning naming the file,
and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
import shutil
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
LEGACY_STATE_FILE = "state.pt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


# -- state <-> (JSON tree, flat tensor dict) -------------------------------------------------------
def encode(obj: Any, tensors: dict[str, torch.Tensor] | None = None, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples, numbers, strings, tensors) into a JSON-able tree
    and a flat {key: tensor} dict for safetensors. Tensors become {"__tensor__": key}; dicts with
    non-string keys (optimizer state is keyed by parameter index) become {"__items__": [[k, v], ...]}.
    Anything else (an arbitrary object) is refused here, at save time, rather than pickled."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        while key in tensors:  # a name containing "/" could meet a nested path
            key += "'"
        tensors[key] = obj
        return {"__tensor__": key}, tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{prefix}/{i}")[0] for i, v in enumerate(obj)]}, tensors
    if isinstance(obj, list):
        return [encode(v, tensors, f"{prefix}/{i}")[0] for i, v in enumerate(obj)], tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{prefix}/{k}" if prefix else k)[0] for k, v in obj.items()}, tensors
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            return {"__items__": [[k, encode(v, tensors, f"{prefix}/{k}")[0]] for k, v in obj.items()]}, tensors
    raise TypeError(f"checkpoint state at {prefix or '<root>'}: cannot store a {type(obj).__name__} (tensors, numbers, strings and containers only)")


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        if set(tree) == {"__tuple__"}:
            return tuple(decode(v, tensors) for v in tree["__tuple__"])
        if set(tree) == {"__items__"}:
            return {k: decode(v, tensors) for k, v in tree["__items__"]}
        return {k: decode(v, tensors) for k, v in tree.items()}
    return tree


def _for_safetensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors wants contiguous CPU tensors that share no storage."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


# -- small filesystem helpers -----------------------------------------------------------------------
def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: str) -> dict[str, int]:
    """{relative path: size} of every file under root."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = os.path.getsize(full)
    return out


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def step_of(path: str) -> int | None:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


# -- the checkpointer --------------------------------------------------------------------------------
class Checkpointer:
    """Atomic save, keep-last-K, and load with fallback for ``<root>`` (= output_dir/checkpoints)."""

    def __init__(self, root: str, keep: int = 0):
        self.root, self.keep = root, keep

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:06d}")

    def steps(self) -> list[str]:
        """Checkpoint directories (renamed into place, so written completely once), oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = [(step_of(n), n) for n in os.listdir(self.root)]
        return [os.path.join(self.root, n) for s, n in sorted(f for f in found if f[0] is not None)]

    def save(self, step: int, state: dict, write_extra: Callable[[str], None] | None = None) -> str:
        """Write ``state`` (see `encode`) as checkpoint ``step``; ``write_extra(tmp_dir)`` may add files
        (the diffusers weights). Returns the final path."""
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # debris of a crash mid-save
            if name.startswith(".tmp-") or name.startswith(".old-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        final = self.path_for(step)
        tmp = os.path.join(self.root, f".tmp-{os.path.basename(final)}-{os.getpid()}")
        os.makedirs(tmp)
        try:
            from safetensors.torch import save_file

            tree, tensors = encode(state)
            save_file(_for_safetensors(tensors), os.path.join(tmp, TENSOR_FILE))
            with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT_VERSION, "state": tree}, f)
            if write_extra is not None:
                write_extra(tmp)
            files = _files(tmp)  # before the manifest exists: it does not list itself
            with open(os.path.join(tmp, MANIFEST_FILE), "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT_VERSION, "step": step, "files": files}, f)
            for dirpath, _, names in os.walk(tmp):
                for name in names:
                    _fsync_file(os.path.join(dirpath, name))
                _fsync_dir(dirpath)
            if os.path.exists(final):  # the same step saved again (a stop right after a checkpoint)
                old = os.path.join(self.root, f".old-{os.path.basename(final)}-{os.getpid()}")
                try:
                    os.rename(final, old)
                    os.rename(tmp, final)
                except BaseException:  # (a stop's deadline or second signal between the two: keep the old one)
                    if os.path.exists(old) and not os.path.exists(final):
                        os.rename(old, final)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_text_atomic(os.path.join(self.root, LATEST_FILE), os.path.basename(final) + "\n")
        self._prune()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for path in self.steps()[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------------
    def latest_name(self) -> str | None:
        try:
            with open(os.path.join(self.root, LATEST_FILE), encoding="utf-8") as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return name if _STEP_DIR.match(name) else None

    def candidates(self) -> list[str]:
        """The one ``latest`` names, then every other checkpoint, newest first."""
        steps = self.steps()[::-1]
        named = self.latest_name()
        first = [p for p in steps if os.path.basename(p) == named]
        return first + [p for p in steps if p not in first]

    def find(self, resume: str) -> tuple[str | None, dict]:
        """Resolve trainer.resume ("latest", "auto" or a directory) to a checkpoint that passes its
        checks; returns (path, state.json contents). "latest" falls back past broken ones, one
        warning each. "auto" is "latest" where a checkpoint exists, else (None, {}): start fresh,
        said in one line. (A checkpoint that exists but cannot be read is an error for both: a run
        must not quietly restart from step 0 over one.)"""
        if resume not in ("latest", "auto"):
            return resume, check(resume)
        candidates = self.candidates()
        if not candidates and resume == "auto":
            logger.info("trainer.resume=auto: no checkpoint under %s; starting fresh", self.root)
            return None, {}
        if not candidates:
            raise CheckpointError(f"trainer.resume=latest: no checkpoint under {self.root}")
        errors = []
        for i, path in enumerate(candidates):
            try:
                return path, check(path)
            except CheckpointError as e:
                errors.append(str(e))
                if i + 1 < len(candidates):  # (the last one's error is the exception's message)
                    logger.warning("%s; falling back to %s", e, candidates[i + 1])
        raise CheckpointError(f"trainer.resume={resume}: no usable checkpoint under {self.root} (newest: {errors[0]})")


def check(path: str) -> dict:
    """Cheap checks of checkpoint ``path`` (no tensor data read): every file the manifest lists is
    there with its size, state.json parses, the safetensors header parses. Returns the state tree
    (tensors not loaded). Raises CheckpointError naming the offending file."""
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest_path):
        legacy = os.path.join(path, LEGACY_STATE_FILE)
        if os.path.exists(legacy):
            _load_legacy(legacy)  # refused here, before anything starts, if it holds more than tensors
            return {"legacy": True}
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} missing (incomplete or not a checkpoint)")
    manifest = _read_json(manifest_path)
    for rel, size in manifest.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            raise CheckpointError(f"checkpoint file {full} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint file {full} is truncated or changed ({os.path.getsize(full)} bytes, expected {size})")
    state = _read_json(os.path.join(path, STATE_FILE))
    if not isinstance(state, dict) or "state" not in state:
        raise CheckpointError(f"checkpoint file {os.path.join(path, STATE_FILE)}: not a checkpoint state")
    tensor_path = os.path.join(path, TENSOR_FILE)
    try:
        from safetensors import safe_open

        with safe_open(tensor_path, framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"checkpoint file {tensor_path}: unreadable ({str(e).splitlines()[0]})") from None
    return state["state"]


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path}: unreadable ({e})") from None


def load(path: str) -> dict:
    """The full state of checkpoint ``path`` (tensors included). Never unpickles code."""
    tree = check(path)
    if tree.get("legacy"):
        return _load_legacy(os.path.join(path, LEGACY_STATE_FILE))
    tensor_path = os.path.join(path, TENSOR_FILE)
    try:
        from safetensors.torch import load_file

        tensors = load_file(tensor_path)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {tensor_path}: unreadable ({str(e).splitlines()[0]})") from None
    try:
        return decode(tree, tensors)
    except KeyError as e:
        raise CheckpointError(f"checkpoint file {tensor_path}: tensor {e} missing") from None


def _load_legacy(file: str) -> dict:
    """A checkpoint from before the JSON format: tensors and plain containers only."""
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol
            return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # torch's message suggests weights_only=False, i.e. running the file's code: never say that.
        named = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        raise CheckpointError(
            f"checkpoint file {file}: refused: it holds pickled objects, not only tensors and plain containers, "
            f"and loading it could run code{' (' + named[0][:120] + ')' if named else ''}"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {file}: unreadable ({first[:200]})") from None


# -- the run directory: one run per directory ------------------------------------------------------
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "samples", "config.yaml")
LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """The output directory cannot take this run (used, locked); reported as one line, exit 2."""


def run_dir_used(output_dir: str) -> bool:
    """A previous run left results here: a checkpoint or a logged step."""
    metrics = os.path.join(output_dir, "metrics.jsonl")
    return bool(Checkpointer(os.path.join(output_dir, "checkpoints")).steps()) or (
        os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    )


def make_output_dir(path: str) -> str:
    """Create `path` (and its parents) for a command to write into; one that cannot be made (a
    read-only mount, a parent without permission) raises OSError naming it and why."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create or write {path}: {e.strerror}") from None
    return path


def output_dir_arg(path: str) -> str:
    """argparse `type` for the directory a command writes (a tiny twin, a pretrained base): made at
    once, so one that cannot be made is a usage error (exit 2) before the work, not a traceback after."""
    import argparse

    try:
        return make_output_dir(path)
    except OSError as e:
        raise argparse.ArgumentTypeError(e.strerror) from None


class RunDirLock:
    """An exclusive flock on ``<output_dir>/.lock``, held for the process's life: a second run into
    the same directory fails at once. The kernel drops the lock when the process dies, so a crashed
    run leaves no stale lock behind."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        output_dir = os.path.dirname(self.path)
        try:
            make_output_dir(output_dir)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only mount, a parent without permission, a full disk
            raise RunDirError(f"trainer.output_dir: cannot create or write {output_dir}: {os.strerror(e.errno)}; "
                              "choose another trainer.output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"trainer.output_dir: another run (pid {holder}) is using {os.path.dirname(self.path)}; "
                "wait for it or choose another trainer.output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def prepare_run_dir(output_dir: str, resume: str | None, overwrite: bool) -> RunDirLock:
    """Take the directory's lock, then enforce one run per directory: a used directory needs
    trainer.resume (continue it) or trainer.overwrite=true (its old results are deleted)."""
    lock = RunDirLock(output_dir).acquire()
    try:
        if not resume and run_dir_used(output_dir):
            if not overwrite:
                raise RunDirError(
                    f"trainer.output_dir: {output_dir} holds a previous run; add trainer.resume=latest to continue it "
                    "or trainer.overwrite=true to delete it and start over"
                )
            for name in RUN_OUTPUTS:
                target = os.path.join(output_dir, name)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                elif os.path.exists(target):
                    os.remove(target)
    except BaseException:
        lock.release()
        raise
    return lock


# -- resume: what a changed config may change ------------------------------------------------------
# Settings a checkpoint cannot follow: they change the shape of the saved state (model, LoRA, FSDP
# layout) or the meaning of its counters (group and batch sizes, the prompt stream, the schedule).
FIXED_ON_RESUME = (
    "mode",
    "model.path",
    "model.family",
    "model.lora_rank",
    "model.lora_alpha",
    "rollout.group_size",
    "rollout.groups_per_step",
    "rollout.prompts",
    "rollout.prompt_mix",
    "rollout.seed",
    "trainer.fsdp",
)
# Applied to the restored optimizer (the rest of the config is read afresh anyway).
OPTIMIZER_KEYS = {"trainer.lr": "lr", "trainer.weight_decay": "weight_decay"}
_NOT_COMPARED = ("trainer.resume", "trainer.overwrite")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree and not prefix.endswith(("weights", "options", "prompt_mix")):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def config_changes(saved: dict, config) -> tuple[list[str], dict[str, tuple[Any, Any]]]:
    """Compare the checkpoint's config with the new one: (fixed keys that changed, {changed key:
    (old, new)} for the rest)."""
    old = _flatten(json.loads(json.dumps(saved)))  # tuples -> lists, as on the new side
    new = _flatten(json.loads(json.dumps(dataclasses.asdict(config))))
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and not k.startswith(_NOT_COMPARED)}
    fixed = [k for k in changed if k in FIXED_ON_RESUME]
    return fixed, {k: v for k, v in changed.items() if k not in FIXED_ON_RESUME}


def apply_optimizer_settings(optimizer_state: dict, config) -> None:
    """A restored optimizer keeps the lr it was saved with; set the new config's lr and weight decay
    so a changed trainer.lr really takes effect (torch's optimizer.load_state_dict restores
    param_groups, hyper-parameters included)."""
    t = config.trainer
    for group in optimizer_state.get("param_groups", []):
        group["lr"] = t.lr
        group["weight_decay"] = t.weight_decay
