"""Typed configuration: dataclasses merged with YAML files and `key=value` overrides (OmegaConf).

`load_config(mode, args)` is what the launchers call: base.yaml, then config/<mode>.yaml, then any
YAML files named on the command line (e.g. config/model/sd35_medium.yaml), then dot-list overrides.
Unknown keys, wrong types and impossible combinations raise `ConfigError`, a one-line message
naming the key; the launchers turn it into exit code 2.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from async_flowgrpo import stop
from async_flowgrpo import algorithms
from async_flowgrpo.algo import LR_SCHEDULES
from async_flowgrpo.algorithms.awm import AWMSettings
from async_flowgrpo.algorithms.dgpo import DGPOSettings
from async_flowgrpo.algorithms.diffusion_nft import DiffusionNFTSettings
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOSettings
from async_flowgrpo.models import (FAMILIES, IMAGE_FAMILIES, VIDEO_FAMILIES, image_inputs, model_experts, transformer_heads,
                                   video_frames)
from async_flowgrpo.models.common import read_model_settings
from async_flowgrpo.prompts import load_prompts
from async_flowgrpo.rewards import FRAMES_PREFIX, available_rewards, check_options, takes_video
from async_flowgrpo.seqpar import FAMILIES as SEQUENCE_PARALLEL_FAMILIES
from async_flowgrpo.seqpar import split_token_counts

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")
EMBEDDED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "shapes_sd3")
EMBEDDED_EDIT_MODEL = os.path.join(os.path.dirname(EMBEDDED_MODEL), "shapes_edit")  # model.path embedded_edit
MODES = ("sync", "one_step_off", "fully_async")
ALGORITHMS = tuple(algorithms.ALGORITHMS)


class ConfigError(ValueError):
    """A configuration mistake, reported as one line that names the key."""


@dataclass
class ModelConfig:
    path: str = "embedded"  # a diffusers directory; "embedded" = the shipped tiny shapes model, "embedded_edit" = the shipped tiny edit model (config/shapes_edit.yaml)
    # sd3 | flux | qwen_image | wan | flux_kontext | qwen_image_edit | qwen_image_edit_plus (the adapter
    # itself is picked from model_index.json)
    family: str = "sd3"
    lora_rank: int = 32  # 0 = full fine-tune
    lora_alpha: int = 64
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16; a VAE on a CPU stays fp32
    gradient_checkpointing: bool = False
    # two-expert models (Wan2.2 A14B): the experts that train, by pipeline name: transformer (high
    # noise) and/or transformer_2 (low noise); null = all. The others denoise frozen
    trained_experts: Optional[list[str]] = None
    # two-expert models: transformer_2's CFG scale (>= 1) wherever the call's guidance_scale > 1
    # (rollout, evaluation, the trainer's replay); null = the call's (WanPipeline's guidance_scale_2)
    guidance_scale_2: Optional[float] = None


@dataclass
class RolloutConfig:
    engine: str = "diffusers"  # diffusers | vllm_omni (GPU extra)
    num_workers: int = 1
    gpus_per_worker: float = 0.0  # 0 on CPU machines; 1 per rollout actor on GPU clusters
    cpus_per_worker: float = 0.5
    # custom Ray resources each actor needs, e.g. {rollout_node: 1}: with `ray start --resources`
    # on the nodes, pins rollout and trainer actors to different nodes
    resources: dict[str, float] = field(default_factory=dict)
    group_size: int = 16
    groups_per_step: int = 4  # groups consumed per trainer step (batch = group_size * groups_per_step)
    num_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    sde_type: str = "sde"  # sde | cps
    # sde: a stochastic window recorded step by step (Flow-GRPO); ode: deterministic Euler steps,
    # only the final latent recorded (DiffusionNFT)
    sampler: str = "sde"
    sde_window_size: int = 0  # recorded stochastic steps; 0 = all but the last (original Flow-GRPO)
    sde_window_range: Optional[list[int]] = None  # [lo, hi) for the window; None = [0, num_steps-1)
    shared_initial_noise: bool = False  # one initial noise per group (DanceGRPO init_same_noise)
    # MixGRPO-Flash: the ODE steps after the SDE window by euler or dpm2 (DPM-Solver++(2M)); the
    # window and what the trainer replays are unchanged, only the final image costs fewer calls
    after_window_solver: str = "euler"
    # MixGRPO-Flash: the fraction of the steps after the window taken (at least one): 0.4 makes 8 steps 3
    after_window_steps: float = 1.0
    # generate with the LoRA deltas folded into the base weights: the base model's speed (the
    # adapters' own matmuls cost 15 % on an H200); null: on where the policy computes in bf16/fp16
    # (GPUs), unless algorithm.is_correction=step or prox_mode=bypass (builders.should_fuse_lora says why)
    fuse_lora: Optional[bool] = None
    # a torch.compile backend (inductor on GPUs) for each transformer block of the rollout actors' policy;
    # null = eager. As trainer.compile (the first generations compile); not yet timed on a GPU
    compile: Optional[str] = None
    resolution: int = 0  # 0 = the model's own (embedded model: 32)
    # frames per video (video families: wan), rollouts and evaluation; 0 = the model's own
    # (<model.path>/async_flowgrpo.json, else 81). num_frames - 1 must be a multiple of the VAE's temporal factor (Wan: 4)
    num_frames: int = 0
    prompts: str = "shapes_train"  # shipped prompt set name or a .txt/.jsonl path; a JSONL row's "images" (a path or list, relative to the file) are an edit model's input images, each checked at start (exists, decodes, has the sampled size)
    prompt_mix: Optional[dict[str, float]] = None  # {kind: weight}: sample prompts by their JSONL "kind"
    seed: int = 0


@dataclass
class TrainerConfig:
    num_workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 0.5
    resources: dict[str, float] = field(default_factory=dict)  # as rollout.resources, e.g. {trainer_node: 1}
    total_steps: int = 100
    output_dir: str = "outputs/run"
    # a checkpoint dir, "latest" (the newest usable one; none: exit 2) or "auto" (the newest if there is
    # one, else start fresh, saying so in one line: for a job script that a scheduler requeues)
    resume: Optional[str] = None
    seed: int = 42
    lr: float = 3e-4
    # the lr over the run: constant | cosine | linear decay from lr to lr * lr_min_ratio at total_steps,
    # after a linear warm-up over warmup_steps (torchtune's cosine-with-warm-up; a run shorter than its
    # warm-up, e.g. a 3-step smoke test, stays in it)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_min_ratio: float = 0.0
    # the step at which the decay reaches lr * lr_min_ratio and stays (0, or past total_steps: at
    # total_steps). Set, a longer run keeps the same pace of decay instead of stretching it (AWM's
    # collapse needs the lr low by about step 200, whatever total_steps is)
    lr_decay_steps: int = 0
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    # rows per transformer call in the trainer (what bounds its activation memory): (sample, step) pairs
    # of the SDE window for flow_grpo, (sample, noise level) points for diffusion_nft; a call mixes
    # samples and steps, each row at its own sigma
    micro_batch_size: int = 8
    mini_batches: int = 1  # optimizer steps per batch
    fsdp: bool = False  # shard the transformer over the trainers (torch fully_shard); else replicate (DDP-style)
    # a torch.compile backend (inductor on GPUs) for each transformer block of the learner; null = eager.
    # The first steps compile (a minute or more on a GPU). SD3.5-M's LoRA step on an H200 ran 5.48 trained
    # images/s against 3.71 eager (docs/gpu.md)
    compile: Optional[str] = None
    # N > 1: sequence parallelism (async_flowgrpo.seqpar, Ulysses attention). Each N consecutive trainers
    # take the same micro-batches and each runs 1/N of every sample's tokens (long videos, large images:
    # activations / N); num_workers / N data-parallel groups split the batch. N must divide the
    # attention heads and the token counts. Wan, Flux, Qwen-Image (diffusers' _cp_plan); 1 = off
    sequence_parallel: int = 1
    checkpoint_every: int = 50
    keep_checkpoints: int = 3  # the newest K checkpoints are kept; 0 = keep all
    overwrite: bool = False  # a fresh run into a used output_dir deletes its old results (else: exit 2)
    max_nonfinite_steps: int = 5  # stop after this many consecutive steps whose every update was NaN/inf
    # seconds from SIGTERM/SIGINT to the exit (under a scheduler's grace period: SLURM's KillWait and
    # Kubernetes' terminationGracePeriodSeconds are 30). An evaluation in progress is abandoned; the
    # update in flight and the checkpoint are given up 8 s before the end (kept for shutting Ray down),
    # and the exit line then names the last complete checkpoint
    stop_grace_s: float = 20.0
    # > 0: each update takes at least this many seconds (the trainer waits out the rest). For staleness
    # studies where rollout is the bottleneck: a slower trainer lets rollouts run max_staleness ahead
    # without changing the update's math (benchmarks/staleness_sweep.py). 0: off
    min_step_time_s: float = 0.0
    sample_every: int = 10  # steps between saved PNG grids of rollout samples
    # > 0: evaluation and saved weights use an average of the trained weights (async_flowgrpo.ema;
    # Flow-GRPO's train.ema); rollouts sample with the live ones. 0: off, the default (on paired seeds
    # of both algorithms the average scored no higher than the live weights; docs/results.md)
    ema_decay: float = 0.0


@dataclass
class AlgorithmConfig:
    # flow_grpo | diffusion_nft | awm | dgpo (async_flowgrpo/algorithms/, one module each); a name other than
    # flow_grpo also merges config/<name>.yaml
    name: str = "flow_grpo"
    max_staleness: int = 1  # eta: admission control bound (0 = sync)
    adv_clip: float = 5.0  # advantages clipped to +-adv_clip (diffusion_nft maps them to r over it, awm scales by it)
    beta: float = 0.0  # KL to the reference (adapters disabled); config/base.yaml: 0.04, as Flow-GRPO's quality runs
    global_std: bool = True
    mean_only: bool = False
    drop_zero_std: bool = False  # drop groups whose rewards are all equal (counted either way)
    # fully_async: a group whose rewards are all equal is not queued and its admission slot starts a
    # new group, so every batch is groups_per_step groups with something to learn (DAPO's dynamic
    # sampling); at most 4 x groups_per_step in a row per rollout worker, then one is kept so the
    # trainer never starves (samples/resampled_flat counts them)
    resample_flat_groups: bool = False
    stale_policy: str = "block"  # block | drop (groups that still arrive older than eta)
    # each algorithm's own keys, in its module (algorithms/<name>.py): only the running one's are read
    flow_grpo: FlowGRPOSettings = field(default_factory=FlowGRPOSettings)
    diffusion_nft: DiffusionNFTSettings = field(default_factory=DiffusionNFTSettings)
    awm: AWMSettings = field(default_factory=AWMSettings)
    dgpo: DGPOSettings = field(default_factory=DGPOSettings)


# algorithm.* keys from before each algorithm had its own section: still accepted, as the new key
# (in YAML files and key=value overrides alike)
LEGACY_KEYS = {
    **{f"algorithm.{k}": f"algorithm.flow_grpo.{k}"
       for k in ("clip_range", "is_cap", "is_correction", "is_mode", "prox_mode", "uncond_grad")},
    **{f"algorithm.nft_{k}": f"algorithm.diffusion_nft.{k}"
       for k in ("beta", "timestep_fraction", "decay_start", "decay_rate", "decay_max")},
}


# Weight-sync defaults, also the sync package's (one default each)
SYNC_BUCKET_MB = 64.0  # bucket of the checkpoint engine's packed transfer
SYNC_TIMEOUT_S = 1800.0  # one weight publication, end to end


@dataclass
class SyncConfig:
    transport: str = "collective"  # collective (NCCL on CUDA / gloo on CPU) | object_store
    every: int = 1  # trainer updates between weight publications
    bucket_mb: float = SYNC_BUCKET_MB
    update_point: str = "between_steps"  # between_steps (in-flight) | between_groups
    verify: bool = True  # digest check after every sync
    timeout_s: float = SYNC_TIMEOUT_S
    # Where the weight-sync rendezvous (TCPStore + gloo) listens. None = 127.0.0.1 when the Ray
    # cluster has one node (nothing off this machine can connect), else this node's cluster IP.
    host: Optional[str] = None


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"shapes": 1.0})
    # per-reward keyword options, e.g. {pickscore: {path: /models/PickScore_v1, processor_path: /models/CLIP-ViT-H-14}}
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_workers: int = 0  # 0 = score inside the rollout actor; >0 = a pool of reward actors
    cpus_per_worker: float = 0.25
    gpus_per_worker: float = 0.0  # a reward model on a GPU of its own (or a share of one)
    resources: dict[str, float] = field(default_factory=dict)  # as rollout.resources, e.g. {reward_node: 1}
    # A reward actor scores the groups that reach it together (from several rollout workers) in one
    # call, up to this many images or batch_wait_s after the first arrived; 0 = one group per call
    batch_size: int = 0
    batch_wait_s: float = 0.05
    timeout_s: float = 300.0  # per group; enforced by the pool (num_workers > 0)
    max_consecutive_failures: int = 5
    # Score a group on a scoring thread while the rollout worker generates the next one; false =
    # score each group before starting the next (the blocking path, for comparison)
    overlap: bool = True
    # groups per rollout worker handed to scoring and not yet scored (back-pressure); a worker
    # that would exceed it waits (counted in perf/reward_wait_frac)
    max_pending: int = 2


@dataclass
class EvalConfig:
    every: int = 10  # trainer steps between evaluations; 0 = never (still runs at start and end if enabled)
    prompts: str = "shapes_eval"
    num_steps: int = 20
    samples_per_prompt: int = 2
    guidance_scale: float = 4.5
    seed: int = 1234
    at_start_and_end: bool = True


@dataclass
class LoggingConfig:
    wandb_mode: str = "disabled"  # online | offline | disabled
    wandb_project: str = "async_flowgrpo"
    run_name: Optional[str] = None
    progress: bool = True  # one progress bar on stderr: step, reward, eval accuracy, staleness, samples/s, ETA
    # Where rollout and trainer actors print (model loading, library warnings): "file" =
    # <output_dir>/logs/<actor>.log, keeping the console to the progress bar; "console" = Ray's default.
    actor_output: str = "file"


@dataclass
class RayConfig:
    address: Optional[str] = None  # "auto" or host:port = join one; None = $RAY_ADDRESS if set, else start a local cluster
    num_cpus: Optional[int] = None  # for a local cluster; None = all cores
    num_gpus: Optional[int] = None
    # Every wait on the cluster is bounded by one of these (a dead or hung actor is an error, not a hang):
    connect_timeout_s: float = 30.0  # reach an existing cluster; place the actors
    start_timeout_s: float = 600.0  # the actors load their models at start-up
    restart_timeout_s: float = 600.0  # a lost rollout actor answers again (Ray restarts it where its resources are)
    call_timeout_s: float = 60.0  # small calls: counters, queue bookkeeping, a trainer fetching its shard
    work_timeout_s: float = 3600.0  # one generation batch, one training step, one evaluation, a checkpoint
    poll_s: float = 1.0  # rollout actors re-check their stop flag at least this often while blocked on the queue
    batch_wait_s: float = 5.0  # fully_async: the driver re-checks for signals and dead actors this often


@dataclass
class Config:
    mode: str = "fully_async"
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def batch_size(self) -> int:
        return self.rollout.group_size * self.rollout.groups_per_step


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"{key}: {msg}" if key else msg


def load_config(mode: str, args: list[str] | None = None, config_dir: str = CONFIG_DIR) -> Config:
    """Merge base.yaml, <mode>.yaml, YAML files given in args and key=value overrides; validate."""
    args = list(args or [])
    yaml_files = [os.path.join(config_dir, "base.yaml"), os.path.join(config_dir, f"{mode}.yaml")]
    overrides = []
    for arg in args:
        if arg.endswith((".yaml", ".yml")) and "=" not in arg:
            yaml_files.append(arg)
        elif "=" in arg:
            overrides.append(arg)
        else:
            raise ConfigError(f"{arg}: expected key=value or a .yaml file")
    try:
        cfg = _merge(yaml_files, overrides)
        if cfg.algorithm.name != "flow_grpo" and cfg.algorithm.name in ALGORITHMS:
            # The algorithm's own defaults go after the mode file and before the user's files and
            # overrides: one key selects it in any launcher, and anything given explicitly wins.
            cfg = _merge(yaml_files[:2] + [os.path.join(config_dir, f"{cfg.algorithm.name}.yaml")] + yaml_files[2:], overrides)
        config: Config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    validate(config)
    return config


def _merge(yaml_files: list[str], overrides: list[str]):
    cfg = OmegaConf.structured(Config)
    for path in yaml_files:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        loaded = _renamed(OmegaConf.load(path))
        cfg = OmegaConf.merge(cfg, loaded)
        # A file's reward.weights is the reward it means (a model file's replaces base.yaml's
        # shapes checker, which cannot score its images or videos); a merge would keep both.
        weights = OmegaConf.select(loaded, "reward.weights")
        if weights is not None:
            OmegaConf.update(cfg, "reward.weights", weights, merge=False)
    overrides = [_renamed_override(o) for o in overrides]
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    for override in overrides:
        # A whole-dict value (reward.weights={jpeg_incompressibility: 1.0}) replaces the
        # dict; a plain merge would keep the base file's entries too.
        key, value = override.split("=", 1)
        if value.lstrip().startswith("{"):
            OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.from_dotlist([override]), key), merge=False)
    return cfg


def _renamed(loaded):
    """A YAML file's legacy algorithm keys (LEGACY_KEYS) moved to their new place."""
    section = loaded.get("algorithm") if OmegaConf.is_dict(loaded) else None
    for old, new in LEGACY_KEYS.items():
        key = old.split(".", 1)[1]
        if OmegaConf.is_dict(section) and key in section:
            value = section.pop(key)
            OmegaConf.update(loaded, new, value, merge=True)
    return loaded


def _renamed_override(override: str) -> str:
    key, sep, value = override.partition("=")
    return LEGACY_KEYS.get(key, key) + sep + value


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def resolve_model_path(path: str) -> str:
    return {"embedded": EMBEDDED_MODEL, "embedded_edit": EMBEDDED_EDIT_MODEL}.get(path, path)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _choice(value: Any, key: str, choices: tuple) -> None:
    _require(value in choices, key, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


def _finite_numbers(node: Any, prefix: str = "") -> None:
    """NaN or infinity in a float setting (`nan`, a mistyped 1e1000) is never meaningful here: it
    would reach the loss or a timeout as it is."""
    for f in fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if is_dataclass(value):
            _finite_numbers(value, key + ".")
        elif isinstance(value, float):
            _require(math.isfinite(value), key, f"must be a finite number, got {value}")


def validate(c: Config) -> None:
    """Impossible combinations fail here, at start, naming the key."""
    _finite_numbers(c)
    _choice(c.mode, "mode", MODES)
    _choice(c.model.family, "model.family", FAMILIES)
    _choice(c.model.dtype, "model.dtype", ("auto", "float32", "bfloat16", "float16"))
    model_dir = resolve_model_path(c.model.path)
    _require(os.path.isdir(model_dir), "model.path", f"not a directory: {model_dir}")
    _require(
        os.path.exists(os.path.join(model_dir, "model_index.json")),
        "model.path",
        f"no model_index.json in {model_dir} (expected a diffusers pipeline directory)",
    )
    _require(c.model.lora_rank >= 0, "model.lora_rank", "must be >= 0 (0 = full fine-tune)")
    _require(c.model.lora_alpha > 0, "model.lora_alpha", "must be > 0")
    experts = model_experts(model_dir)
    names = ", ".join(experts)
    if c.model.trained_experts is not None:
        trained = list(c.model.trained_experts)
        _require(bool(trained) and set(trained) <= set(experts), "model.trained_experts",
                 f"{trained}: choose from the model's experts ({names}), or null for all")
        _require(len(set(trained)) == len(trained), "model.trained_experts", f"{trained}: an expert named twice")
    if c.model.guidance_scale_2 is not None:
        _require(len(experts) > 1, "model.guidance_scale_2", f"the model has one transformer ({names}); use null")
        _require(c.model.guidance_scale_2 >= 1, "model.guidance_scale_2",
                 f"{c.model.guidance_scale_2:g}: must be >= 1 (1: no guidance on transformer_2), or null")
    _require(not (len(experts) > 1 and c.trainer.fsdp), "trainer.fsdp",
             "not for two-expert models yet (shards one transformer); use false")

    r = c.rollout
    _choice(r.engine, "rollout.engine", ("diffusers", "vllm_omni"))
    if r.engine == "vllm_omni":  # found here, not after Ray has started an actor that cannot import it
        _require(importlib.util.find_spec("vllm_omni") is not None, "rollout.engine",
                 "vllm-omni is not installed (pip install 'async_flowgrpo[gpu]' on a GPU machine, or use rollout.engine=diffusers)")
    _require(r.num_workers >= 1, "rollout.num_workers", "must be >= 1")
    _require(r.gpus_per_worker >= 0, "rollout.gpus_per_worker", "must be >= 0")
    _require(r.cpus_per_worker > 0, "rollout.cpus_per_worker", "must be > 0")
    _require(all(v > 0 for v in r.resources.values()), "rollout.resources", "amounts must be > 0")
    _require(r.group_size >= 2, "rollout.group_size", "a group of 1 has advantage 0 under group normalisation (nothing to learn); use >= 2")
    _require(r.groups_per_step >= 1, "rollout.groups_per_step", "must be >= 1")
    _require(r.num_steps >= 2, "rollout.num_steps", "must be >= 2 (the last step is never trained)")
    _require(r.guidance_scale >= 0, "rollout.guidance_scale", "must be >= 0")
    _require(0 < r.noise_level <= 2, "rollout.noise_level", "must be in (0, 2]")
    _choice(r.sde_type, "rollout.sde_type", ("sde", "cps"))
    if r.sampler == "sde":  # an ODE sample (rollout.sampler ode) has no window
        _require(r.sde_window_size >= 0, "rollout.sde_window_size", "must be >= 0 (0 = all but the last step)")
        _require(
            r.sde_window_size <= r.num_steps - 1,
            "rollout.sde_window_size",
            f"window of {r.sde_window_size} steps does not fit in {r.num_steps} steps (the last step is never trained)",
        )
        if r.sde_window_range is not None:
            lo_hi = list(r.sde_window_range)
            _require(len(lo_hi) == 2, "rollout.sde_window_range", "must be [lo, hi]")
            lo, hi = lo_hi
            anywhere = "; rollout.sde_window_range=null lets the window start anywhere"
            _require(0 <= lo < hi <= r.num_steps - 1, "rollout.sde_window_range",
                     f"need 0 <= lo < hi <= num_steps-1 = {r.num_steps - 1}{anywhere}")
            window = r.sde_window_size or r.num_steps - 1
            _require(window <= hi - lo, "rollout.sde_window_size", f"window of {window} steps does not fit in range [{lo}, {hi}){anywhere}")
    _require(r.resolution >= 0 and r.resolution % 16 == 0, "rollout.resolution", "must be 0 (model default) or a multiple of 16")
    _require(r.num_frames >= 0, "rollout.num_frames", "must be >= 0 (0 = the model's own)")
    if c.model.family in VIDEO_FAMILIES:
        frames, k = video_frames(model_dir, r.num_frames)
        _require((frames - 1) % k == 0, "rollout.num_frames",
                 f"{frames} frames: num_frames - 1 must be a multiple of the VAE's temporal factor {k} "
                 f"(e.g. {(frames - 1) // k * k + 1} or {(frames - 1) // k * k + k + 1})")
    else:
        _require(r.num_frames == 0, "rollout.num_frames", f"model.family {c.model.family} makes images; use 0")

    t = c.trainer
    _require(t.num_workers >= 1, "trainer.num_workers", "must be >= 1")
    _require(t.gpus_per_worker >= 0, "trainer.gpus_per_worker", "must be >= 0")
    _require(t.cpus_per_worker > 0, "trainer.cpus_per_worker", "must be > 0")
    _require(all(v > 0 for v in t.resources.values()), "trainer.resources", "amounts must be > 0")
    _require(t.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    _require(bool(t.output_dir), "trainer.output_dir", "must not be empty")
    _require(t.lr > 0, "trainer.lr", "must be > 0")
    _require(t.lr_schedule in LR_SCHEDULES, "trainer.lr_schedule", f"must be one of {', '.join(LR_SCHEDULES)}")
    _require(t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
    _require(0 <= t.lr_min_ratio <= 1, "trainer.lr_min_ratio", "must be in [0, 1]")
    _require(t.lr_decay_steps == 0 or t.lr_decay_steps > t.warmup_steps, "trainer.lr_decay_steps",
             "must be 0 (decay until total_steps) or > trainer.warmup_steps")
    _require(t.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
    _require(t.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
    _require(t.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
    _require(t.mini_batches >= 1, "trainer.mini_batches", "must be >= 1")
    _require(t.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _require(t.keep_checkpoints >= 0, "trainer.keep_checkpoints", "must be >= 0 (0 = keep all)")
    _require(t.max_nonfinite_steps >= 1, "trainer.max_nonfinite_steps", "must be >= 1")
    reserve = stop.SHUTDOWN_RESERVE_S
    _require(t.stop_grace_s >= 2 * reserve, "trainer.stop_grace_s", f"must be >= {2 * reserve:g} (its last {reserve:g} s shut Ray down)")
    _require(t.min_step_time_s >= 0, "trainer.min_step_time_s", "must be >= 0 (0 = off)")
    for key, backend in (("rollout.compile", r.compile), ("trainer.compile", t.compile)):
        if backend is not None:
            import torch._dynamo

            _require(backend in torch._dynamo.list_backends(exclude_tags=()), key,
                     f"{backend!r}: not a torch.compile backend (inductor, aot_eager, ...); null = eager")
    _require(r.compile is None or r.engine == "diffusers", "rollout.compile",
             "compiles the diffusers engine's blocks; vllm-omni compiles by its own settings: use null")
    if t.compile is not None:
        _require(not t.fsdp and t.sequence_parallel == 1, "trainer.compile",
                 "not with trainer.fsdp or trainer.sequence_parallel > 1 yet (untried together); use null")
    _require(0 <= t.ema_decay < 1, "trainer.ema_decay", "must be in [0, 1) (0 = no weight average)")
    existing = os.path.abspath(t.output_dir)  # the directory itself or the nearest ancestor that exists
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    _require(os.path.isdir(existing), "trainer.output_dir", f"{existing} exists and is not a directory")
    _require(t.sample_every >= 0, "trainer.sample_every", "must be >= 0")
    sp = t.sequence_parallel
    _require(sp >= 1, "trainer.sequence_parallel", "must be >= 1 (1 = off)")
    _require(t.num_workers % sp == 0, "trainer.sequence_parallel",
             f"{sp} does not divide trainer.num_workers = {t.num_workers} (groups of {sp} trainers share a micro-batch)")
    if sp > 1:
        _require(c.model.family in SEQUENCE_PARALLEL_FAMILIES, "trainer.sequence_parallel",
                 f"model.family {c.model.family} has no context-parallel plan in diffusers (families: "
                 f"{', '.join(SEQUENCE_PARALLEL_FAMILIES)}); use 1")
        heads = transformer_heads(model_dir)
        _require(heads % sp == 0, "trainer.sequence_parallel",
                 f"Ulysses attention splits the {heads} attention heads over {sp} ranks; use a divisor of {heads}")
        # found here, not by diffusers' assert in the trainers' first forward pass (the step-0 evaluation)
        for what, count in split_token_counts(model_dir, c.model.family, r.resolution, r.num_frames).items():
            _require(count % sp == 0, "trainer.sequence_parallel",
                     f"a sample's {count} {what} cannot be split evenly over {sp} ranks; use a divisor of {count}, "
                     f"or a rollout.resolution (or rollout.num_frames) that gives a multiple of {sp}")
    # Data-parallel groups split a batch by whole groups; each splits its share into mini-batches of samples.
    data_parallel = t.num_workers // sp
    _require(
        r.groups_per_step % data_parallel == 0,
        "rollout.groups_per_step",
        f"{r.groups_per_step} groups per step cannot be split evenly over {data_parallel} data-parallel trainers "
        f"(trainer.num_workers = {t.num_workers} / trainer.sequence_parallel = {sp})",
    )
    per_worker = c.batch_size // data_parallel
    _require(
        per_worker % t.mini_batches == 0,
        "trainer.mini_batches",
        f"{per_worker} samples per trainer are not divisible into {t.mini_batches} mini-batches",
    )
    if t.resume is not None and t.resume not in ("latest", "auto"):
        _require(os.path.isdir(t.resume), "trainer.resume", f"not a directory: {t.resume}")

    a = c.algorithm
    _require(a.max_staleness >= 0, "algorithm.max_staleness", "must be >= 0")
    _require(a.adv_clip > 0, "algorithm.adv_clip", "must be > 0")
    _require(a.beta >= 0, "algorithm.beta", "must be >= 0")
    _choice(a.stale_policy, "algorithm.stale_policy", ("block", "drop"))
    _require(not a.resample_flat_groups or c.mode == "fully_async", "algorithm.resample_flat_groups",
             f"fully_async only ({c.mode} hands out a batch's tickets up front); algorithm.drop_zero_std=true "
             "drops those groups in any mode")
    _choice(a.name, "algorithm.name", ALGORITHMS)
    _choice(r.sampler, "rollout.sampler", ("sde", "ode"))
    _choice(r.after_window_solver, "rollout.after_window_solver", ("euler", "dpm2"))
    _require(0 < r.after_window_steps <= 1, "rollout.after_window_steps", "must be in (0, 1]: the fraction of the steps after the window taken")
    if (r.after_window_solver, r.after_window_steps) != ("euler", 1.0):
        _require(r.sampler == "sde", "rollout.after_window_solver",
                 "an ODE sampler has no SDE window to sample after; use euler and rollout.after_window_steps=1.0")
        _require(r.engine == "diffusers", "rollout.after_window_solver",
                 f"the {r.engine} engine takes every step by Euler; use euler and rollout.after_window_steps=1.0")
    algorithm = algorithms.ALGORITHMS[a.name]
    needs = {"sde": "the log-probs of an SDE window", "ode": "final latents of ODE samples"}[algorithm.SAMPLER]
    _require(r.sampler == algorithm.SAMPLER, "rollout.sampler", f"{a.name} trains on {needs}; use {algorithm.SAMPLER}")
    if algorithm.SAMPLER == "ode":
        _require(not r.shared_initial_noise, "rollout.shared_initial_noise",
                 "an ODE sample is fixed by its initial noise: a group would be n copies of one image; use false")
        _require(r.engine == "diffusers", "rollout.engine", f"{a.name} rollouts need the diffusers engine for now")
        _require(not t.fsdp, "trainer.fsdp", f"{a.name} trains replicated weights for now; use false")
        _require(c.mode != "fully_async" or c.sync.update_point == "between_groups", "sync.update_point",
                 f"{a.name} in fully_async needs between_groups: a sample made by two weight versions has no "
                 "exact sampling-policy score")
    algorithm.validate(getattr(a, a.name), c, _require)
    _require(not (a.beta > 0 and c.model.lora_rank == 0), "algorithm.beta",
             f"{a.beta:g}: KL to the reference needs LoRA (model.lora_rank > 0); with model.lora_rank=0 set algorithm.beta=0")
    if c.mode == "sync":
        _require(a.max_staleness == 0, "algorithm.max_staleness", "sync mode is max_staleness 0")
    if c.mode == "one_step_off":
        _require(a.max_staleness == 1, "algorithm.max_staleness", "one_step_off mode is max_staleness 1")
    if c.mode in ("sync", "one_step_off"):
        _require(c.sync.every == 1, "sync.every", f"{c.mode} publishes weights after every step; use 1")
    else:
        # Groups admitted at version v may be trained up to sync.every - 1 updates later.
        _require(c.sync.every <= a.max_staleness + 1, "sync.every", "must be <= algorithm.max_staleness + 1 in fully_async")

    s = c.sync
    _choice(s.transport, "sync.transport", ("collective", "object_store"))
    _require(s.every >= 1, "sync.every", "must be >= 1")
    _require(s.bucket_mb > 0, "sync.bucket_mb", "must be > 0")
    _choice(s.update_point, "sync.update_point", ("between_steps", "between_groups"))
    _require(s.timeout_s > 0, "sync.timeout_s", "must be > 0")

    w = c.reward
    _require(len(w.weights) > 0, "reward.weights", "name at least one reward")
    for name, weight in w.weights.items():
        _require(name in available_rewards(), f"reward.weights.{name}", f"unknown reward (available: {', '.join(available_rewards())})")
        _require(math.isfinite(weight), f"reward.weights.{name}", f"must be a finite number, got {weight!r}")
        video = c.model.family in VIDEO_FAMILIES
        _require(takes_video(name) == video, f"reward.weights.{name}",
                 f"scores {'videos' if takes_video(name) else 'images'} but model.family {c.model.family} makes "
                 + (f"videos: use {FRAMES_PREFIX}{name} (its mean over frames) or a video reward" if video else "images"))
    _require(any(weight != 0 for weight in w.weights.values()), "reward.weights",
             "every weight is 0: nothing to learn from (a negative weight minimises that reward)")
    for name in w.options:
        _require(name in w.weights, f"reward.options.{name}", "has no weight in reward.weights")
        try:
            check_options(name, dict(w.options[name] or {}))
        except ValueError as e:
            raise ConfigError(f"reward.options.{name}: {e}") from None
        if not (c.ray.address or os.environ.get("RAY_ADDRESS")):  # a local cluster: the reward loads its files here
            for key, value in (w.options[name] or {}).items():
                if key.endswith("path") and isinstance(value, str):
                    _require(os.path.exists(os.path.expanduser(value)), f"reward.options.{name}.{key}",
                             f"'{value}' does not exist on this machine (nothing is downloaded)")
    _require(w.num_workers >= 0, "reward.num_workers", "must be >= 0")
    _require(w.cpus_per_worker > 0, "reward.cpus_per_worker", "must be > 0")
    _require(w.gpus_per_worker >= 0, "reward.gpus_per_worker", "must be >= 0")
    _require(all(v > 0 for v in w.resources.values()), "reward.resources", "amounts must be > 0")
    _require(w.num_workers > 0 or (w.gpus_per_worker == 0 and not w.resources), "reward.gpus_per_worker",
             "reward.gpus_per_worker and reward.resources place reward actors: set reward.num_workers > 0")
    _require(w.batch_size >= 0, "reward.batch_size", "must be >= 0 (0: one group per call)")
    _require(w.batch_size == 0 or w.num_workers > 0, "reward.batch_size", "batches form in reward actors: set reward.num_workers > 0")
    _require(w.batch_wait_s >= 0, "reward.batch_wait_s", "must be >= 0")
    _require(w.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _require(w.max_consecutive_failures >= 1, "reward.max_consecutive_failures", "must be >= 1")
    _require(w.max_pending >= 1, "reward.max_pending", "must be >= 1 (reward.overlap=false scores each group before the next)")

    e = c.eval
    _require(e.every >= 0, "eval.every", "must be >= 0")
    _require(e.num_steps >= 1, "eval.num_steps", "must be >= 1")
    _require(e.samples_per_prompt >= 1, "eval.samples_per_prompt", "must be >= 1")
    _require(e.guidance_scale >= 0, "eval.guidance_scale", "must be >= 0")
    _choice(c.logging.wandb_mode, "logging.wandb_mode", ("online", "offline", "disabled"))
    _choice(c.logging.actor_output, "logging.actor_output", ("file", "console"))
    for key in ("connect_timeout_s", "start_timeout_s", "restart_timeout_s", "call_timeout_s", "work_timeout_s", "poll_s", "batch_wait_s"):
        _require(getattr(c.ray, key) > 0, f"ray.{key}", "must be > 0")
    for key in ("num_cpus", "num_gpus"):
        _require(getattr(c.ray, key) is None or getattr(c.ray, key) >= 0, f"ray.{key}", "must be >= 0, or null for all the machine's")
    loaded = {}
    from async_flowgrpo.models import adapter_class  # (the adapter modules import no model library)

    size = r.resolution or read_model_settings(model_dir).get("resolution")  # input images must match the samples
    for key, prompts in (("rollout.prompts", r.prompts), ("eval.prompts", e.prompts)):
        try:  # read now: a bad file is one line here, not a traceback from inside a Ray actor
            loaded[key] = load_prompts(prompts, image_size=(size, size) if size else None)
            check_count = getattr(adapter_class(c.model.family), "check_image_count", None)  # Qwen-Image-Edit: one
            if check_count and loaded[key][0].images:
                check_count(len(loaded[key][0].images))
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"{key}: {err}") from None
        takes = image_inputs(model_dir, c.model.family)  # "required", "optional" (Wan2.2 TI2V-5B) or "none"
        has = bool(loaded[key][0].images)
        _require(has or takes != "required", key,
                 f"model.family {c.model.family} edits images: use a JSONL prompt file whose rows carry \"images\""
                 if c.model.family in IMAGE_FAMILIES else "the model makes videos from images (Wan image-to-video): "
                 "use a JSONL prompt file whose rows carry \"images\" (the first frame)")
        _require(not has or takes != "none", key,
                 f"its rows carry \"images\", but model.family {c.model.family} takes none, as {model_dir} holds it "
                 f"(image-conditioned: families {', '.join(IMAGE_FAMILIES)}, and wan with Wan2.2 I2V or TI2V models)")
        _require(not has or r.engine == "diffusers", "rollout.engine", "input images need the diffusers engine")
    if r.prompt_mix is not None:
        _require(bool(r.prompt_mix) and all(w >= 0 for w in r.prompt_mix.values()) and sum(r.prompt_mix.values()) > 0,
                 "rollout.prompt_mix", "must map kinds to weights >= 0, not all 0")
        kinds = {p.metadata.get("kind") for p in loaded["rollout.prompts"]}
        unknown = sorted(set(r.prompt_mix) - kinds)
        _require(not unknown, "rollout.prompt_mix", f"kinds {unknown} not in {r.prompts} (its kinds: {sorted(map(str, kinds))}); "
                 "rollout.prompt_mix=null samples it uniformly")


def usage(mode: str, command: str | None = None) -> str:
    """What an entry point prints for -h/--help."""
    command = command or f"python launch/{mode}.py"
    return (f"usage: {command} [extra.yaml ...] [key=value ...]\n\n"
            f"Merges config/base.yaml, config/{mode}.yaml, the YAML files given, then the key=value overrides\n"
            "(OmegaConf dot-list, e.g. trainer.total_steps=20 rollout.num_workers=2). Every key, its default\n"
            "and what it does: docs/config.md. A bad key or value exits 2 with one line naming it.")


def config_or_exit(mode: str, argv: list[str], command: str | None = None) -> Config:
    """load_config for an entry point: a mistake is one line on stderr and exit 2; -h/--help prints
    the usage (of `command`, default the mode's launcher) and exits 0."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage(mode, command))
        raise SystemExit(0)
    try:
        return load_config(mode, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
