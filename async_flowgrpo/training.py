"""Trainer actors: data-parallel Learners plus, on rank 0, the weight sender and evaluation.

`TrainerActor` is a thin Ray shell around `trainer.Learner`. Trainers form their own process group
(gloo on CPU, NCCL on CUDA) for the gradient all-reduce; the weight-sync group with the rollout
actors is a separate one (async_flowgrpo.sync), so the two never interfere.
"""

from __future__ import annotations

import os
import time

import ray
import torch
import torch.distributed as dist

from async_flowgrpo.config import Config
from async_flowgrpo.gpu_monitor import GpuMonitor
from async_flowgrpo.builders import build_policy, set_cpu_threads
from async_flowgrpo.trainer import Learner
from async_flowgrpo.types import Group


def all_reduce_mean_grads(params: list[torch.Tensor]) -> None:
    """Average gradients over the trainers' group in one flat all-reduce (DDP's result, no wrapper)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def build_learner(cfg: Config, grad_all_reduce=None) -> Learner:
    a, t = cfg.algorithm, cfg.trainer
    policy = build_policy(cfg, reference_copy=a.beta > 0 and cfg.model.lora_rank == 0)
    return Learner(
        policy,
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        clip_range=a.clip_range,
        adv_clip=a.adv_clip,
        is_cap=a.is_cap,
        beta=a.beta,
        prox_mode=a.prox_mode,
        micro_batch_size=t.micro_batch_size,
        mini_batches=t.mini_batches,
        grad_all_reduce=grad_all_reduce,
    )


@ray.remote
class TrainerActor:
    def __init__(self, cfg: Config, rank: int, world_size: int, dp_address: tuple[str, int], transport):
        set_cpu_threads(cfg.trainer.cpus_per_worker)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        torch.manual_seed(cfg.trainer.seed + rank)
        if world_size > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            host, port = dp_address
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
        self.learner = build_learner(cfg, grad_all_reduce=all_reduce_mean_grads if world_size > 1 else None)
        self.sender = transport.sender() if rank == 0 else None
        self.gpu = GpuMonitor().start()  # perf/gpu_util on NVIDIA GPUs; nothing elsewhere
        self._busy = 0.0
        self._window_start = time.perf_counter()

    def ready(self) -> bool:
        return True

    # -- training ----------------------------------------------------------------------------
    def train_step(self, groups: list[Group], version: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.learner.train_step(groups, version)
        self._busy += time.perf_counter() - start
        return {**metrics, **self.gpu.read()}

    def idle_fraction(self) -> float:
        now = time.perf_counter()
        frac = 1.0 - min(self._busy / max(now - self._window_start, 1e-9), 1.0)
        self._busy, self._window_start = 0.0, now
        return frac

    # -- weight sync (rank 0) ------------------------------------------------------------------
    def sync_address(self):
        return self.sender.new_address()

    def sync_connect(self, address, world_size: int) -> None:
        self.sender.connect(address, world_size)

    def push(self, version: int):
        start = time.perf_counter()
        result = self.sender.send(self.learner.policy.trainable_state(), version)
        self._busy += time.perf_counter() - start
        return result

    def weights_digest(self) -> str:
        from async_flowgrpo.sync import digest

        return digest(self.learner.policy.trainable_state())

    # -- evaluation and checkpoints (rank 0) ---------------------------------------------------
    def evaluate(self, step: int) -> dict:
        from async_flowgrpo.evaluation import evaluate_policy

        return evaluate_policy(self.learner.policy, self.cfg)

    def state_dict(self) -> dict:
        return {**self.learner.state_dict(), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state)
        if "rng" in state:
            torch.set_rng_state(state["rng"])

    def save_weights(self, path: str) -> None:
        """LoRA: diffusers/peft format, loadable by `pipe.load_lora_weights(path)`; full: the transformer."""
        policy = self.learner.policy
        transformer = policy.adapter.transformer
        os.makedirs(path, exist_ok=True)
        if policy.lora_rank > 0:
            from peft.utils import get_peft_model_state_dict

            pipeline_class = type(policy.adapter.pipeline)  # each family's own LoRA format
            pipeline_class.save_lora_weights(path, transformer_lora_layers=get_peft_model_state_dict(transformer))
        else:
            transformer.save_pretrained(os.path.join(path, "transformer"))
