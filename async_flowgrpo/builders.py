"""Config -> components: the one place that maps configuration onto the typed components
(policy, learner, engine), which themselves know nothing of config files or Ray."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from async_flowgrpo.config import Config, resolve_model_path

if TYPE_CHECKING:
    from async_flowgrpo.algorithms.base import Learner


def set_cpu_threads(cpus: float) -> None:
    """Match torch's intra-op threads to the CPUs Ray gave this actor (oversubscribing 2 cores
    with 2 actors x 2 threads makes small matmuls several times slower)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, int(cpus)))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(cfg: Config) -> torch.dtype | None:
    return DTYPES.get(cfg.model.dtype)  # "auto" -> None: the policy picks bf16 on CUDA, fp32 on CPU


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_policy(cfg: Config, adapter=None, **kwargs):
    """adapter: a model already built in memory, used instead of loading model.path."""
    from async_flowgrpo.policy import DiffusionPolicy

    kwargs.setdefault("dtype", model_dtype(cfg))
    kwargs.setdefault("device", default_device())
    policy = DiffusionPolicy(
        adapter if adapter is not None else resolve_model_path(cfg.model.path),
        lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha,
        lora_init_seed=cfg.trainer.seed,
        num_frames=cfg.rollout.num_frames,  # rollouts and evaluation both generate through this policy
        trained_experts=cfg.model.trained_experts,
        guidance_scale_2=cfg.model.guidance_scale_2,
        **kwargs,
    )
    if cfg.model.gradient_checkpointing:
        policy.adapter.transformer.enable_gradient_checkpointing()
    return policy


def build_engine(cfg: Config, update_point: str):
    """The rollout engine named by rollout.engine (vllm-omni is imported only when chosen)."""
    if cfg.rollout.engine == "vllm_omni":
        from async_flowgrpo.rollout.vllm_omni import VllmOmniEngine

        return VllmOmniEngine.from_config(cfg, update_point=update_point)
    from async_flowgrpo.rollout.engine import DiffusersEngine

    policy = build_policy(cfg)
    if should_fuse_lora(cfg, policy.autocast_dtype is not None):
        policy.fuse_lora()
    if cfg.rollout.compile:
        from async_flowgrpo.policy import compile_blocks

        for transformer in policy.transformers():
            compile_blocks(transformer, cfg.rollout.compile)
    return DiffusersEngine(policy, update_point=update_point)


def should_fuse_lora(cfg: Config, low_precision: bool) -> bool:
    """rollout.fuse_lora, its default resolved. Folded weights round differently from the
    trainer's separate adapters: its recompute of a rollout's mean log-prob moved by 1.3e-4 on
    SD3.5-M (docs/gpu.md). The default objective absorbs that (the clip is centred on the trainer's
    own log-prob; the staleness weight moves by 0.01 %), but not one that trusts the recorded
    log-probs to the bit: the `step` correction multiplies the difference by the latent's size,
    and `bypass` clips around them at clip_range 1e-4. Those keep the adapters apart by default."""
    if cfg.rollout.fuse_lora is not None:
        return cfg.rollout.fuse_lora
    a = cfg.algorithm
    exact = a.name == "flow_grpo" and (a.flow_grpo.is_correction == "step" or a.flow_grpo.prox_mode == "bypass")
    return low_precision and not exact


def avoid_cudnn_attention_backward() -> None:
    """Training processes take PyTorch's flash or memory-efficient attention, never cuDNN's: on an
    H200 (torch 2.11, CUDA 13) cuDNN's fused attention failed in the backward of the Flux shape at
    micro-batch 4 ("mha_graph.execute(...).is_good()", reported upstream as intermittent on H200;
    without CUDA_LAUNCH_BLOCKING it surfaced later as CUBLAS_STATUS_EXECUTION_FAILED). Rollout
    processes, which only run forwards, keep whichever backend PyTorch picks."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def build_learner(cfg: Config, grad_all_reduce=None, adapter=None, device: torch.device | None = None
                  ) -> Learner:
    """With trainer.fsdp or trainer.sequence_parallel > 1 the process group must exist already (their
    device meshes are built on it; every trainer calls this, in step).
    adapter: as in build_policy; device: the GPU when there is one, unless given."""
    from async_flowgrpo import algorithms, fsdp, seqpar
    from async_flowgrpo.algo import lr_factor
    from async_flowgrpo.policy import default_dtype

    a, t = cfg.algorithm, cfg.trainer
    # Trained weights are kept in fp32: Adam's small updates round away in bf16 (LoRA's adapters
    # are cast to fp32 by the policy). Full fine-tuning therefore holds fp32 master weights and
    # computes in the model dtype: FSDP casts them when it gathers, otherwise autocast does.
    device = device or default_device()
    if device.type == "cuda":
        avoid_cudnn_attention_backward()
    compute_dtype = model_dtype(cfg) or default_dtype(device)
    master = {}
    if t.fsdp:
        master = {"dtype": torch.float32}
    elif cfg.model.lora_rank == 0 and compute_dtype != torch.float32:
        master = {"dtype": torch.float32, "autocast_dtype": compute_dtype}
    policy = build_policy(cfg, adapter, reference_copy=a.beta > 0 and cfg.model.lora_rank == 0, device=device,
                          **master)
    if t.sequence_parallel > 1:
        # and a two-expert model's frozen expert (model.trained_experts), which still runs every sample
        frozen = [m for m in policy.adapter.frozen_modules if getattr(m, "_cp_plan", None) is not None]
        seqpar.parallelize(policy.transformers() + frozen, seqpar.make_mesh(t.sequence_parallel))
        policy.adapter.token_multiple = t.sequence_parallel
    if t.fsdp:
        for transformer in policy.transformers():
            fsdp.shard_transformer(transformer, None if compute_dtype == torch.float32 else compute_dtype)
    if t.compile:
        from async_flowgrpo.policy import compile_blocks

        for transformer in policy.transformers():
            compile_blocks(transformer, t.compile)
    # what every algorithm's learner takes: the optimizer, batching and the data-parallel reduce
    schedule = functools.partial(lr_factor, schedule=t.lr_schedule, total_steps=t.total_steps,
                                 warmup_steps=t.warmup_steps, min_ratio=t.lr_min_ratio, decay_steps=t.lr_decay_steps)
    shared = dict(lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, adv_clip=a.adv_clip,
                  beta=a.beta, micro_batch_size=t.micro_batch_size, mini_batches=t.mini_batches,
                  grad_all_reduce=grad_all_reduce, lr_schedule=schedule)
    return algorithms.ALGORITHMS[a.name].build(policy, algorithms.settings(a), cfg, shared)
