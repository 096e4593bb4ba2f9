#!/usr/bin/env python
"""The original Flow-GRPO trainer on the embedded shapes model, scored by our evaluation.

Runs github.com/yifan123/flow_grpo's own ``scripts/train_sd3.py`` from a checkout the user has
(``--flow-grpo DIR``; nothing of flow_grpo is in this repository), with its published
``geneval_sd3`` configuration (config/grpo.py) scaled to our sample budget, on the embedded model
and our ``shapes`` reward; then scores the LoRA adapter it saved with our evaluation
(``async_flowgrpo.evaluation.evaluate_policy``: the held-out prompts, fixed seeds, eval/accuracy).

    # its dependencies (ml_collections, absl-py) in a venv of their own, with this package
    python3 -m venv ../refvenv && ../refvenv/bin/pip install torch==2.13.0 \\
        && ../refvenv/bin/pip install diffusers==0.42.1 peft accelerate ml_collections absl-py -e .
    export OMP_NUM_THREADS=1
    ../refvenv/bin/python benchmarks/reference_flow_grpo.py train \\
        --flow-grpo ../flow_grpo --out outputs/ref_flow_grpo/seed0 --seed 0            # its lr, 3e-4
    ../refvenv/bin/python benchmarks/reference_flow_grpo.py train \\
        --flow-grpo ../flow_grpo --out outputs/ref_flow_grpo/lr1e-3_seed0 --seed 0 --lr 1e-3
    ../refvenv/bin/python benchmarks/reference_flow_grpo.py score outputs/ref_flow_grpo/seed0
    # every checkpoint it saved (a learning curve), and the base model (the adapter's B = 0)
    ../refvenv/bin/python benchmarks/reference_flow_grpo.py score outputs/ref_flow_grpo/seed0 --all --base \\
        --out outputs/ref_flow_grpo/seed0/scores.json

``train`` writes into --out: dataset/ (the prompt files in its geneval format), metrics.jsonl
(every scalar its script logs, one row per wandb.log call, with the wall time), run.json (its
configuration as run, the budget, the patches applied, timings) and its own checkpoints,
checkpoints/checkpoint-<global step>/lora (PEFT save_pretrained of the EMA weights, as its
save_ckpt writes them). ``score`` prints and writes eval/accuracy at CFG 4.5 and CFG 1.

The budget, scaled from geneval_sd3 (32 GPUs x 9 images a sampling batch, 24 images a prompt, 4
sampling batches an epoch, gradients accumulated over 2 of them: 576 samples an optimizer step, 2
steps an epoch) to ours (config/base.yaml: 300 optimizer steps x 32 samples, 8 images a prompt, 4
prompts a step): one process, sample.train_batch_size = train.batch_size = 16 (2 prompts x 8
images), sample.num_image_per_prompt = 8, sample.num_batches_per_epoch = 4 and
train.gradient_accumulation_steps = 2 as published, so 2 optimizer steps of 32 samples an epoch,
150 epochs, 9,600 samples. Published and kept: 10 sampler steps (sample.num_steps), CFG 4.5 in
sampling and in training (train.cfg), noise_level 0.7, timestep_fraction 0.99 (9 of the 10 steps
trained, every one an SDE step), beta 0.04 (KL to the adapter-free model), clip_range 1e-4,
adv_clip_max 5, lr 3e-4 constant (``--lr`` overrides it), AdamW (0.9, 0.999, weight decay 1e-4,
eps 1e-8), max_grad_norm 1.0, per-prompt advantages over the global std (global_std), the
zero-advantage sample filter, EMA (train.ema; its decay 0.9 updated every 8 steps is hard-coded),
LoRA r 32 / alpha 64 on the attention projections (hard-coded), its in-loop evaluation
(eval_num_steps 40, test_batch_size 14) at the first and the last epoch. Its prompt sampler is
seeded with a fixed 42 (hard-coded), so seeds 0 and 1 draw the same prompts and differ in their
noise; config.seed only seeds the sampling noise and the LoRA init.

Configuration values set (plain config overrides, no code; reasons):
- pretrained.model: the embedded model's directory (nothing is downloaded; HF_HUB_OFFLINE=1).
- dataset: DIR/dataset, our prompt files in its geneval format (train_metadata.jsonl,
  test_metadata.jsonl: {"prompt": ..., our metadata}); prompt_fn stays "geneval". Its sampler draws
  rows uniformly; shapes_train is 97 % relation prompts, so by default (``--prompt-mix ours``) each
  row is written the number of times that makes the uniform draw follow our rollout.prompt_mix
  (single x14, count x29, position x1: 0.097 / 0.302 / 0.601 against 0.1 / 0.3 / 0.6);
  ``--prompt-mix file`` writes each row once. The test file is our held-out shapes_eval.
- reward_fn: {"shapes": 1.0} (our reward; see the multi_score patch).
- resolution: 32 (the embedded model's; published 512).
- mixed_precision: "no" (CPU; our runs are fp32; its fp16 needs a GPU).
- sample.train_batch_size, train.batch_size, sample.num_image_per_prompt: the budget above.
- train.learning_rate: only with ``--lr``.
- seed, run_name, logdir, save_dir: --seed and --out.
- save_freq: 1, with the save_ckpt patch choosing the steps (``--save-every``, and the last);
  eval_freq: the number of epochs (its evaluation at the first and the last epoch only).

Changes applied at run time to its code (train_sd3.py is imported from the checkout and these
names are replaced in its module namespace before its main() runs; no file of it is changed):
1. StableDiffusion3Pipeline.from_pretrained -> our model loader (async_flowgrpo.models.load_adapter,
   fp32, CPU). The embedded model has no T5 encoder (text_encoder_3 is None): train_sd3.py calls
   pipeline.text_encoder_3.requires_grad_(False) and .to(...), so the pipeline gets a weightless
   stand-in module in that slot (it is hidden again while the prompts are encoded, below).
2. encode_prompt (from its diffusers_patch/train_dreambooth_lora_sd3.py) -> our SD3 adapter's
   encode_prompts, which is diffusers' StableDiffusion3Pipeline.encode_prompt: its copy pads CLIP
   tokens to a hard-coded 77, which the tiny CLIP encoders (12 positions) refuse, and needs a T5
   encoder. The T5 slot is zeros of the model's own length (1 token, as the model was trained and
   as our runs encode it) instead of its max_sequence_length 128. The empty negative prompt is
   encoded the same way, as in ours.
3. flow_grpo.rewards.multi_score -> a function of the same interface around our CombinedReward
   ({"shapes": 1}): its images (float [0, 1], NCHW) rounded to uint8 NHWC exactly as our
   decoder does, its metadata rows less their "prompt" key; returns our score as "avg" and each
   component (shapes, correct, ...) under its own key.
4. wandb -> a recorder that writes each wandb.log call's scalars (and the wall time) to
   DIR/metrics.jsonl and drops the images: no account, no network, and its training curve kept.
5. get_peft_model -> the same, and the PeftModel answers .module with itself: its KL reference,
   transformer.module.disable_adapter(), assumes the DistributedDataParallel wrapper that
   accelerate adds only with more than one process; one CPU process gets the bare PeftModel
   (AttributeError at the first KL term). Not applied where the model already has .module.
6. save_ckpt -> the same at the chosen steps, and the run ends after the checkpoint at the last
   step: its loop is `while True` (stopped by hand).
7. PerPromptStatTracker.update: in an epoch in which every group's rewards are all equal (every
   advantage 0) its zero-advantage filter would leave no sample and its reshape would raise; there
   every advantage becomes 1e-30 instead (no policy gradient; the KL term and both optimizer steps
   run as in any epoch). Such epochs are counted in run.json (all_zero_advantage_epochs). With
   8 prompts an epoch and a 0/1 reward this can happen; with its 48 prompts an epoch it did not.
8. Only where Python has no `imp` (3.12+): a one-function `imp` module (load_source), which its
   config/grpo.py uses to load config/base.py.
Also: accelerate runs on the CPU as it finds no GPU; torch uses --threads threads (default 1);
its train DataLoader (1 worker) and test DataLoader (8 workers) are as written.

Scoring (``score``): its adapter (adapter_config.json + adapter_model.safetensors; a pickled
adapter_model.bin is refused) is loaded into our policy built with its rank and alpha: PEFT's
names (base_model.model.<module>.lora_A.weight) become ours (<module>.lora_A.default.weight);
a module we adapt and it did not gets B = 0 (its output unchanged). Then
async_flowgrpo.evaluation.evaluate_policy with config/base.yaml's evaluation: 64 held-out prompts
(shapes_eval) x 4 samples, 20 ODE steps, eval.seed 1234, at each --cfg (default 4.5 and 1).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (offline / no-wandb environment defaults; the repository on sys.path)
from common import argument_parser, log  # noqa: E402

PUBLISHED_CONFIG = "geneval_sd3"
GRAD_ACCUMULATION = 2  # published: updates twice an epoch (config/grpo.py asserts it)
BATCHES_PER_EPOCH = 4  # published: int(48 / (32 GPUs * 9 / 24 images a prompt))
ZERO_ADVANTAGE = 1e-30


# ------------------------------------------------------------------------------------- budget
def budget(steps: int, prompts_per_step: int, group_size: int) -> dict:
    """Its sampling and accumulation sizes for `steps` optimizer steps of prompts_per_step x
    group_size samples, keeping geneval_sd3's 4 sampling batches an epoch and 2 steps an epoch."""
    samples = prompts_per_step * group_size
    if samples % GRAD_ACCUMULATION or (samples // GRAD_ACCUMULATION) % group_size:
        raise ValueError(f"{prompts_per_step} prompts x {group_size} images a step: a sampling batch "
                         f"(half a step) must hold whole groups")
    if steps % (BATCHES_PER_EPOCH // GRAD_ACCUMULATION):
        raise ValueError(f"--steps {steps}: its epochs make {BATCHES_PER_EPOCH // GRAD_ACCUMULATION} steps each")
    batch = samples // GRAD_ACCUMULATION
    return {
        "optimizer_steps": steps,
        "samples_per_step": samples,
        "samples": steps * samples,
        "epochs": steps // (BATCHES_PER_EPOCH // GRAD_ACCUMULATION),
        "sample.train_batch_size": batch,
        "train.batch_size": batch,
        "sample.num_image_per_prompt": group_size,
        "sample.num_batches_per_epoch": BATCHES_PER_EPOCH,
        "train.gradient_accumulation_steps": GRAD_ACCUMULATION,
    }


# ------------------------------------------------------------------------------------ dataset
def mix_repeats(kinds: list[str], mix: dict[str, float] | None) -> dict[str, int]:
    """How many times to write a row of each kind so that a uniform draw over the rows follows `mix`."""
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    if not mix:
        return {k: 1 for k in counts}
    missing = [k for k in mix if k not in counts]
    if missing:
        raise ValueError(f"prompt mix: no prompt of kind {missing}")
    per_row = {k: mix.get(k, 0.0) / counts[k] for k in counts}
    unit = min(v for v in per_row.values() if v > 0)
    return {k: round(v / unit) for k, v in per_row.items()}


def write_dataset(root: str, train: str, test: str, mix: dict | None, test_prompts: int = 0) -> dict:
    """Our prompt files as its geneval dataset: root/{train,test}_metadata.jsonl, rows
    {"prompt": text, **our metadata}. Returns what was written, for run.json."""
    from async_flowgrpo.prompts import load_prompts

    os.makedirs(root, exist_ok=True)
    train_rows = load_prompts(train)
    repeats = mix_repeats([p.metadata.get("kind") for p in train_rows], mix)
    written = {}
    with open(os.path.join(root, "train_metadata.jsonl"), "w", encoding="utf-8") as f:
        for p in train_rows:
            n = repeats[p.metadata.get("kind")]
            for _ in range(n):
                f.write(json.dumps({"prompt": p.text, **p.metadata}) + "\n")
            written[p.metadata.get("kind")] = written.get(p.metadata.get("kind"), 0) + n
    test_rows = load_prompts(test)[: test_prompts or None]
    with open(os.path.join(root, "test_metadata.jsonl"), "w", encoding="utf-8") as f:
        for p in test_rows:
            f.write(json.dumps({"prompt": p.text, **p.metadata}) + "\n")
    total = sum(written.values())
    return {"train": train, "test": test, "repeats": repeats, "train_rows": written,
            "train_mix": {k: round(v / total, 4) for k, v in written.items()}, "test_rows": len(test_rows)}


# ---------------------------------------------------------------------------- run-time patches
class WandbRecorder:
    """Stands in for the wandb module in train_sd3.py: scalars of every log call to a JSONL file."""

    def __init__(self, path: str):
        self.path, self.start = path, time.time()
        self.Image = lambda *a, **k: None

    def init(self, *args, **kwargs):
        return None

    def finish(self, *args, **kwargs):
        return None

    def log(self, data: dict, step: int | None = None, **kwargs) -> None:
        row = {"step": step, "time_s": round(time.time() - self.start, 3)}
        for key, value in data.items():
            try:
                row[key] = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError, RuntimeError):
                continue  # images, lists
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def reward_fn(weights: dict[str, float], options: dict | None = None):
    """flow_grpo.rewards.multi_score's interface around our CombinedReward."""
    import numpy as np
    import torch

    from async_flowgrpo.rewards import CombinedReward

    combined = CombinedReward(weights, options)

    def multi_score(device, score_dict):
        def _fn(images, prompts, metadata, only_strict=True):
            if not isinstance(images, torch.Tensor):
                images = torch.as_tensor(np.asarray(images))
            # [0, 1] NCHW floats -> uint8 NHWC, as our decoder rounds them
            pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
            meta = [{k: v for k, v in dict(m).items() if k != "prompt"} for m in metadata]
            score, components = combined(pixels, list(prompts), meta)
            details = {name: value.float().numpy() for name, value in components.items()}
            details["avg"] = score.float().numpy()
            return details, {}

        return _fn

    return multi_score


class _AbsentT5:
    """Builds the weightless stand-in lazily (torch is imported late)."""

    @staticmethod
    def module():
        import torch

        class NoT5(torch.nn.Module):
            """Stands in for the embedded model's absent T5 encoder where train_sd3.py calls
            .requires_grad_() and .to() on pipeline.text_encoder_3; an empty buffer answers the
            .device and .dtype that diffusers asks every pipeline module for."""

            def __init__(self):
                super().__init__()
                self.register_buffer("anchor", torch.zeros(0), persistent=False)

            @property
            def device(self):
                return self.anchor.device

            @property
            def dtype(self):
                return self.anchor.dtype

        return NoT5()


def ensure_imp() -> bool:
    """config/grpo.py imports `imp` (gone in Python 3.12): a one-function stand-in where missing."""
    try:
        import imp  # noqa: F401
        return False
    except ImportError:
        from importlib.machinery import SourceFileLoader

        module = types.ModuleType("imp")
        module.load_source = lambda name, path: SourceFileLoader(name, path).load_module()
        sys.modules["imp"] = module
        return True


def import_train_sd3(checkout: str):
    """Its scripts/train_sd3.py as a module (its own imports resolved from the checkout)."""
    checkout = os.path.abspath(checkout)
    for rel in ("scripts/train_sd3.py", "config/grpo.py", "flow_grpo/rewards.py"):
        if not os.path.exists(os.path.join(checkout, rel)):
            raise SystemExit(f"--flow-grpo: {checkout} is not a flow_grpo checkout (no {rel})")
    sys.path.insert(0, checkout)
    spec = importlib.util.spec_from_file_location("flow_grpo_train_sd3", os.path.join(checkout, "scripts", "train_sd3.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Finished(Exception):
    pass


def with_module_alias(get_peft_model, stats: dict):
    """get_peft_model whose model answers .module with itself where it has no .module (patch 5)."""

    def wrapped(model, *args, **kwargs):
        peft_model = get_peft_model(model, *args, **kwargs)
        try:
            peft_model.module
        except AttributeError:
            object.__setattr__(peft_model, "module", peft_model)  # an attribute, not a registered submodule
            stats["module_alias"] = True
        return peft_model

    return wrapped


def save_then_stop(save_ckpt, save_steps: set[int], last_step: int, stats: dict):
    """save_ckpt at the chosen steps and the last; Finished after the last (patch 6)."""

    def wrapped(save_dir, transformer, global_step, *args, **kwargs):
        if global_step in save_steps or global_step >= last_step:
            save_ckpt(save_dir, transformer, global_step, *args, **kwargs)
            stats.setdefault("checkpoints", []).append(global_step)
            stats.setdefault("checkpoint_time_s", []).append(round(time.time() - stats.get("start", time.time()), 1))
            log(f"its checkpoint at step {global_step}: {os.path.join(save_dir, 'checkpoints', f'checkpoint-{global_step}')}")
        if global_step >= last_step:
            raise Finished(global_step)

    return wrapped


def zero_advantage_guard(tracker_cls, stats: dict):
    """Its PerPromptStatTracker whose update hands every sample ZERO_ADVANTAGE where all its
    advantages are 0 (patch 7)."""
    import numpy as np

    class Tracker(tracker_cls):
        def update(self, prompts, rewards, type="grpo"):
            advantages = super().update(prompts, rewards, type)
            if type == "grpo" and not np.any(advantages):
                stats["all_zero_advantage_epochs"] = stats.get("all_zero_advantage_epochs", 0) + 1
                advantages = np.full_like(advantages, ZERO_ADVANTAGE)
            return advantages

    return Tracker


def apply_patches(m, *, out: str, save_steps: set[int], last_step: int, stats: dict) -> list[str]:
    """Replace names in train_sd3.py's module namespace (see the module docstring). Returns their list."""
    import contextlib

    import torch

    import flow_grpo.rewards
    from async_flowgrpo.models import load_adapter

    applied = []
    state = {}

    class Loader:
        @staticmethod
        def from_pretrained(path, *args, **kwargs):
            adapter = load_adapter(path, device=torch.device("cpu"), dtype=torch.float32)
            state["adapter"] = adapter
            pipe = adapter.pipeline
            if pipe.text_encoder_3 is None:
                pipe.__dict__["text_encoder_3"] = _AbsentT5.module()  # (no config entry: diffusers keeps it None)
                state["stand_in"] = pipe.text_encoder_3
            return pipe

    m.StableDiffusion3Pipeline = Loader
    applied.append("StableDiffusion3Pipeline.from_pretrained -> our loader; a weightless stand-in for the absent T5")

    @contextlib.contextmanager
    def t5_hidden(pipe):
        stand_in = state.get("stand_in")
        if stand_in is not None:
            pipe.__dict__["text_encoder_3"] = None
        try:
            yield
        finally:
            if stand_in is not None:
                pipe.__dict__["text_encoder_3"] = stand_in

    def encode_prompt(text_encoders, tokenizers, prompt, max_sequence_length, device=None, **kwargs):
        adapter = state["adapter"]
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        with t5_hidden(adapter.pipeline):
            embeds = adapter.encode_prompts(prompts, cfg=False)
        return embeds.embeds, embeds.pooled

    m.encode_prompt = encode_prompt
    applied.append("encode_prompt -> our SD3 adapter's (diffusers' encode_prompt; the model's own text lengths)")

    flow_grpo.rewards.multi_score = reward_fn({"shapes": 1.0})
    applied.append("flow_grpo.rewards.multi_score -> our shapes reward")

    m.wandb = WandbRecorder(os.path.join(out, "metrics.jsonl"))
    applied.append("wandb -> metrics.jsonl recorder")

    m.get_peft_model = with_module_alias(m.get_peft_model, stats)
    applied.append("get_peft_model -> the same, the model answering .module (one process: no DDP wrapper)")

    m.save_ckpt = save_then_stop(m.save_ckpt, save_steps, last_step, stats)
    applied.append("save_ckpt -> at the chosen steps; the run ends after the last")

    m.PerPromptStatTracker = zero_advantage_guard(m.PerPromptStatTracker, stats)
    applied.append("PerPromptStatTracker.update -> every advantage 1e-30 where all are 0 (its filter would leave none)")
    return applied


# -------------------------------------------------------------------------------------- train
def train(args, passthrough: list[str]) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from async_flowgrpo.config import resolve_model_path
    from async_flowgrpo.models.common import read_model_settings

    ours = common.load_mode_config("fully_async", args.overrides)
    r = ours.rollout
    steps = args.steps or ours.trainer.total_steps
    group = args.group_size or r.group_size
    per_step = args.prompts_per_step or r.groups_per_step
    try:
        b = budget(steps, per_step, group)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = os.path.abspath(args.out)
    if os.path.exists(os.path.join(out, "run.json")) or glob.glob(os.path.join(out, "checkpoints", "checkpoint-*")):
        raise SystemExit(f"--out {out} holds a previous run; choose another directory")
    os.makedirs(out, exist_ok=True)
    model_path = resolve_model_path(ours.model.path)
    settings = read_model_settings(model_path)
    dataset = write_dataset(os.path.join(out, "dataset"), r.prompts, ours.eval.prompts,
                            r.prompt_mix if args.prompt_mix == "ours" else None, args.test_prompts)

    stats = {"start": time.time()}
    imp_shim = ensure_imp()
    m = import_train_sd3(args.flow_grpo)
    every = args.save_every
    save_steps = set(range(every, steps + 1, every)) if every else set()
    patches = apply_patches(m, out=out, save_steps=save_steps, last_step=steps, stats=stats)
    if imp_shim:
        patches.append("imp -> a one-function stand-in (Python 3.12+)")

    config_file = os.path.join(os.path.abspath(args.flow_grpo), "config", "grpo.py")
    m.FLAGS([sys.argv[0], f"--config={config_file}:{args.config}", *passthrough])
    config = m.FLAGS.config
    published = json.loads(config.to_json_best_effort())
    overrides = {
        "pretrained.model": model_path,
        "dataset": os.path.join(out, "dataset"),
        "reward_fn": {"shapes": 1.0},
        "resolution": int(settings.get("resolution") or 0) or config.resolution,
        "mixed_precision": "no",
        "sample.train_batch_size": b["sample.train_batch_size"],
        "train.batch_size": b["train.batch_size"],
        "sample.num_image_per_prompt": b["sample.num_image_per_prompt"],
        "sample.num_batches_per_epoch": b["sample.num_batches_per_epoch"],
        "train.gradient_accumulation_steps": b["train.gradient_accumulation_steps"],
        "seed": args.seed,
        "run_name": f"seed{args.seed}",
        "logdir": os.path.join(out, "logs"),
        "save_dir": out,
        "save_freq": 1,
        "eval_freq": b["epochs"],
    }
    if args.lr is not None:
        overrides["train.learning_rate"] = args.lr
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    as_run = json.loads(config.to_json_best_effort())

    def changed(a, b, prefix=""):
        out_ = {}
        for k in sorted(set(a) | set(b)):
            key = f"{prefix}{k}"
            if isinstance(a.get(k), dict) and isinstance(b.get(k), dict) and k != "reward_fn":
                out_.update(changed(a[k], b[k], key + "."))
            elif a.get(k) != b.get(k):
                out_[key] = [a.get(k), b.get(k)]
        return out_

    record = {
        "flow_grpo": {"checkout": os.path.abspath(args.flow_grpo), "commit": _commit(args.flow_grpo),
                      "script": "scripts/train_sd3.py", "config": f"config/grpo.py:{args.config}"},
        "budget": b,
        "dataset": dataset,
        "changed_from_published": changed(published, as_run),
        "config": as_run,
        "patches": patches,
        "threads": args.threads,
        "machine": common.machine_info(),
    }
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    log(f"flow_grpo train_sd3.py ({args.config}), {b['optimizer_steps']} steps x {b['samples_per_step']} samples "
        f"= {b['epochs']} epochs, lr {config.train.learning_rate}, seed {args.seed} -> {out}")
    try:
        m.main(None)
    except Finished as e:
        stats["finished_step"] = int(str(e))
    elapsed = time.time() - stats.pop("start")
    record.update({"result": {**stats, "wall_s": round(elapsed, 1)}, "seconds_per_step": _step_times(out)})
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    log(f"done in {elapsed:.0f} s: {stats}")
    return record


def _commit(checkout: str) -> str | None:
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:  # (not the commit of a repository that merely holds the checkout's directory)
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(checkout):
            return None
        return git("rev-parse", "HEAD") or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _step_times(out: str) -> dict | None:
    """Seconds per optimizer step from its logged rows (the first step's row to the last's)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    steps = [(r["step"], r["time_s"]) for r in rows if "policy_loss" in r and r.get("step") is not None]
    if len(steps) < 2:
        return None
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    return {"from_step": s0, "to_step": s1, "mean_s": round((t1 - t0) / max(1, s1 - s0), 2)}


# -------------------------------------------------------------------------------------- score
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])\.weight$")


def read_peft_adapter(path: str) -> tuple[dict, dict]:
    """(adapter_config.json, {module name + '.lora_A'/'.lora_B': tensor}) of a PEFT LoRA directory
    as PeftModel.save_pretrained writes it. Only what our LoRA layers can hold is accepted."""
    from safetensors.torch import load_file

    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(config_path):
        raise ValueError(f"{path}: no adapter_config.json (not a PEFT adapter directory)")
    if not os.path.exists(weights_path):
        raise ValueError(f"{path}: no adapter_model.safetensors (a pickled adapter_model.bin is not loaded)")
    with open(config_path) as f:
        config = json.load(f)
    unsupported = {k: config.get(k) for k in ("use_rslora", "use_dora") if config.get(k)}
    unsupported.update({k: config[k] for k in ("rank_pattern", "alpha_pattern") if config.get(k)})
    if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none" or config.get("modules_to_save"):
        unsupported["peft_type/bias/modules_to_save"] = [config.get("peft_type"), config.get("bias"), config.get("modules_to_save")]
    if unsupported:
        raise ValueError(f"{path}: adapter options our LoRA layers do not have: {unsupported}")
    tensors = {}
    for key, value in load_file(weights_path).items():
        match = _PEFT_KEY.match(key)
        if not match:
            raise ValueError(f"{path}: unexpected tensor {key} (only lora_A / lora_B weights are loaded)")
        tensors[f"{match.group(1)}.{match.group(2)}"] = value
    return config, tensors


def adapter_state(tensors: dict, trainable: dict) -> tuple[dict, list[str]]:
    """Its tensors under our trainable-state names (<module>.lora_A.default.weight). A module we
    adapt and it did not keeps its A with B = 0 (its output is the base's); returns those modules."""
    import torch

    ours = {}
    for name in trainable:
        match = re.match(r"^(.+)\.(lora_[AB])\.[^.]+\.weight$", name)
        if not match:
            raise ValueError(f"our trainable state has a non-LoRA weight {name}")
        ours[f"{match.group(1)}.{match.group(2)}"] = name
    extra = sorted(set(tensors) - set(ours))
    if extra:
        raise ValueError(f"the adapter has layers our policy does not adapt: {extra[:3]}")
    state, untouched = {}, set()
    for short, name in ours.items():
        if short in tensors:
            t = tensors[short]
            if t.shape != trainable[name].shape:
                raise ValueError(f"{short}: shape {tuple(t.shape)}, ours {tuple(trainable[name].shape)}")
            state[name] = t.to(trainable[name].dtype)
        else:
            untouched.add(short.rsplit(".", 1)[0])
            state[name] = torch.zeros_like(trainable[name]) if short.endswith("lora_B") else trainable[name].clone()
    return state, sorted(untouched)


def load_peft_into_policy(policy, path: str) -> list[str]:
    _, tensors = read_peft_adapter(path)
    state, untouched = adapter_state(tensors, policy.trainable_state())
    policy.load_trainable_state(state)
    return untouched


def find_adapters(target: str, every: bool) -> list[tuple[int | None, str]]:
    """[(step, adapter dir)]: a PEFT directory itself, or a run's checkpoints/checkpoint-N/lora
    (the last one, or all with every)."""
    if os.path.exists(os.path.join(target, "adapter_config.json")):
        m = re.search(r"checkpoint-(\d+)", target)
        return [(int(m.group(1)) if m else None, target)]
    found = []
    for d in glob.glob(os.path.join(target, "checkpoints", "checkpoint-*", "lora")):
        m = re.search(r"checkpoint-(\d+)", d)
        if m and os.path.exists(os.path.join(d, "adapter_config.json")):
            found.append((int(m.group(1)), d))
    if not found:
        raise SystemExit(f"{target}: no adapter (adapter_config.json) and no checkpoints/checkpoint-*/lora")
    found.sort()
    return found if every else found[-1:]


def score(args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.evaluation import evaluate_policy
    from async_flowgrpo.prompts import load_prompts

    adapters = find_adapters(args.target, args.all)
    config, _ = read_peft_adapter(adapters[0][1])
    rank, alpha = int(config["r"]), int(config["lora_alpha"])
    overrides = [f"model.lora_rank={rank}", f"model.lora_alpha={alpha}", *args.overrides]
    base_cfg = common.load_mode_config("fully_async", overrides)
    tmp = None
    if args.eval_prompts:
        rows = load_prompts(base_cfg.eval.prompts)[: args.eval_prompts]
        tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
        for p in rows:
            tmp.write(json.dumps({"prompt": p.text, **p.metadata}) + "\n")
        tmp.close()
        overrides.append(f"eval.prompts={tmp.name}")
    cfgs = {g: common.load_mode_config("fully_async", overrides + [f"eval.guidance_scale={g}"]) for g in args.cfg}
    policy = build_policy(cfgs[args.cfg[0]])
    e = cfgs[args.cfg[0]].eval
    result = {"adapters": [], "eval": {"prompts": e.prompts if not tmp else f"{base_cfg.eval.prompts} (first {args.eval_prompts})",
                                       "samples_per_prompt": e.samples_per_prompt, "num_steps": e.num_steps,
                                       "seed": e.seed, "lora_rank": rank, "lora_alpha": alpha}}
    todo = ([(0, None)] if args.base else []) + adapters
    try:
        for step, path in todo:
            if path is None:  # the base model: every B = 0
                policy.load_trainable_state({k: torch.zeros_like(v) if ".lora_B." in k else v.clone()
                                             for k, v in policy.trainable_state().items()})
                untouched = []
            else:
                untouched = load_peft_into_policy(policy, path)
            entry = {"step": step, "adapter": path or "base (B = 0)", "untouched_modules": untouched, "metrics": {}}
            for g, cfg in cfgs.items():
                metrics = evaluate_policy(policy, cfg)["metrics"]
                entry["metrics"][str(g)] = metrics
                log(f"{entry['adapter']} (step {step}) CFG {g}: eval/accuracy {metrics.get('eval/accuracy', float('nan')):.4f}"
                    f" (reward {metrics['eval/reward']:.4f}, {metrics['eval/time_s']:.0f} s)")
            result["adapters"].append(entry)
    finally:
        if tmp:
            os.unlink(tmp.name)
    print(f"{'step':>6s} " + " ".join(f"{'CFG ' + str(g):>10s}" for g in args.cfg) + "  adapter")
    for entry in result["adapters"]:
        accs = [entry["metrics"][str(g)].get("eval/accuracy", float("nan")) for g in args.cfg]
        print(f"{str(entry['step']):>6s} " + " ".join(f"{a:10.4f}" for a in accs) + f"  {entry['adapter']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


# --------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argument_parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run its train_sd3.py (see the module docstring); extra --config.KEY=VALUE "
                                     "flags go to its absl flags")
    t.add_argument("--flow-grpo", required=True, metavar="DIR", help="a checkout of github.com/yifan123/flow_grpo")
    t.add_argument("--out", required=True, help="output directory (new)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=None, help="its train.learning_rate (default: published, 3e-4)")
    t.add_argument("--config", default=PUBLISHED_CONFIG, help="its config/grpo.py function")
    t.add_argument("--steps", type=int, default=0, help="optimizer steps (default: our trainer.total_steps, 300)")
    t.add_argument("--prompts-per-step", type=int, default=0, help="default: our rollout.groups_per_step (4)")
    t.add_argument("--group-size", type=int, default=0, help="images per prompt (default: our rollout.group_size, 8)")
    t.add_argument("--prompt-mix", choices=("ours", "file"), default="ours",
                   help="ours: train rows repeated to follow our rollout.prompt_mix; file: each row once")
    t.add_argument("--test-prompts", type=int, default=0, help="its in-loop evaluation on the first N held-out prompts (0: all)")
    t.add_argument("--save-every", type=int, default=50, help="its checkpoint every N optimizer steps (0: only the last)")
    t.add_argument("--threads", type=int, default=1, help="torch threads")
    s = sub.add_parser("score", help="our evaluation of its saved adapter(s)")
    s.add_argument("target", help="a train --out directory, or a PEFT adapter directory")
    s.add_argument("--all", action="store_true", help="every checkpoint of the run, not only the last")
    s.add_argument("--base", action="store_true", help="also the base model (step 0)")
    s.add_argument("--cfg", type=lambda v: [float(x) for x in v.split(",")], default=[4.5, 1.0],
                   help="eval.guidance_scale values, comma-separated (default 4.5,1)")
    s.add_argument("--eval-prompts", type=int, default=0, help="only the first N held-out prompts (0: all 64)")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--out", default=None, help="write the scores as JSON")
    ap.epilog += ("\n\nOur config's key=value overrides may follow either command (train: where its budget is "
                  "read; score: eval.*); train passes --config.KEY=VALUE on to its absl flags.")
    args, rest = ap.parse_known_args(argv)
    args.overrides = [a for a in rest if not a.startswith("-") and "=" in a]
    flags = [a for a in rest if a.startswith("--config.") and args.command == "train"]
    bad = [a for a in rest if a not in args.overrides and a not in flags]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    return train(args, flags) if args.command == "train" else score(args)


if __name__ == "__main__":
    main()
