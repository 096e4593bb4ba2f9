"""FSDP2 (torch `fully_shard`) for the trainers: shard the transformer, gather it back for weight
sync, evaluation and checkpoints.

Selected by `trainer.fsdp`. Each transformer block is its own FSDP unit (parameters all-gathered
just before the block runs and freed after), the root wraps the rest. Gradients are averaged by
FSDP's reduce-scatter, so the Learner gets no `grad_all_reduce`; the optimizer holds sharded
DTensor parameters and moments, which is where full fine-tuning's memory goes (Adam: 2 fp32
moments + fp32 master weights + gradients per parameter, now divided by the number of trainers).

On CUDA the master weights stay fp32 and FSDP casts them to `compute_dtype` (bf16) for the
forward: the same bf16 values the rollout actors hold after a sync, so recomputed log-probs match.

Everything that needs whole tensors (sending weights, saving, digests) is collective: every rank
must call it, in the same order; rank 0 keeps the result (on CPU, so a sharded model is never
whole on one GPU), the others get an empty dict.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_transformer(transformer: nn.Module, compute_dtype: torch.dtype | None = None) -> None:
    """Shard in place: each block of every ModuleList child (SD3/Qwen `transformer_blocks`, Flux's
    two block lists) is one unit, the root holds the embedders and the output layer."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for child in transformer.children():
        if isinstance(child, nn.ModuleList):
            for block in child:
                fully_shard(block, mp_policy=mp)
    fully_shard(transformer, mp_policy=mp)


def reshard(module: nn.Module) -> None:
    """Free the whole weights a forward without backward left behind (FSDP keeps the root's
    unsharded until the next backward). Call after evaluation: an optimizer state_dict taken
    while they are registered cannot map its parameters to names."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather(named: Iterable[tuple[str, Tensor]], keep: bool) -> dict[str, Tensor]:
    """Collective. Whole tensors, one at a time (peak extra memory: one tensor), on CPU where
    `keep` (rank 0); {} elsewhere."""
    out = {}
    for name, t in named:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective. The optimizer state keyed by parameter name (loadable into any number of ranks)."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: dict[str, Tensor], optim_state: dict) -> None:
    """Collective. Every rank passes the same whole state; each keeps its own shards."""
    options = StateDictOptions(full_state_dict=True, strict=False)  # strict=False: LoRA saves only its own weights
    set_model_state_dict(model, trainable, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
