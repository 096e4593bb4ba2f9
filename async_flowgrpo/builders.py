"""Config -> components: the one place that maps configuration onto the typed components
(policy, engine), which themselves know nothing of config files or Ray."""

from __future__ import annotations

import torch

from async_flowgrpo.config import Config, resolve_model_path


def set_cpu_threads(cpus: float) -> None:
    """Match torch's intra-op threads to the CPUs Ray gave this actor (oversubscribing 2 cores
    with 2 actors x 2 threads makes small matmuls several times slower)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, int(cpus)))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(cfg: Config) -> torch.dtype | None:
    return DTYPES.get(cfg.model.dtype)  # "auto" -> None: the policy picks bf16 on CUDA, fp32 on CPU


def build_policy(cfg: Config, **kwargs):
    from async_flowgrpo.policy import DiffusionPolicy

    kwargs.setdefault("dtype", model_dtype(cfg))
    policy = DiffusionPolicy(
        resolve_model_path(cfg.model.path),
        device="cuda" if torch.cuda.is_available() else "cpu",
        lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha,
        lora_init_seed=cfg.trainer.seed,
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

    return DiffusersEngine(build_policy(cfg), update_point=update_point)
