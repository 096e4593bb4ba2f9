"""Sequence parallelism for the trainers: the ranks form a data x sequence mesh, and the N ranks of a
sequence group take the same micro-batch, each running 1/N of its tokens through the transformer.

Selected by `trainer.sequence_parallel` (N). The attention exchange is diffusers' context
parallelism (`ModelMixin.enable_parallelism` with a `ContextParallelConfig`): each transformer's
`_cp_plan` splits the token axis after the embedders, Ulysses attention (an all-to-all to whole
sequences on heads / N heads, and back, with its autograd backward) joins the shards inside every
attention, and the output projection is all-gathered, so every rank of the group gets the whole
velocity. The log-probs, the KL term and DiffusionNFT's regression are then computed on whole
samples, the same on every rank of the group: nothing in the learners changes.

Ring attention (diffusers' other kind) is not offered: it needs an attention backend that returns
the log-sum-exp (flash-attn, cuDNN); PyTorch's native one, the CPU's and the trainers' (cuDNN
attention is off in training, builders.avoid_cudnn_attention_backward), does not.

Gradients. The gather's backward hands each rank the gradient of its own token shard only, so a
rank's parameter gradients hold its shard's part of the update: they are SUMMED over the sequence
group (tests/test_seqpar.py checks this against one process), then averaged over the data axis as
without it. Both at once: one all-reduce (sum) over every trainer, divided by the data-parallel size
(`all_reduce_grads`). Under FSDP, whose reduce-scatter averages over every rank, each rank's shard
of the mean is multiplied by N (`scale_grads`; FSDP's own divide factor is a PREMUL_SUM reduction,
which gloo lacks).

Ranks r = d * N + s: consecutive ranks share a micro-batch (data rank d, sequence rank s). The
ranks of a group must draw the same random numbers (DiffusionNFT's noise and timesteps): seed by d.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

# the families whose diffusers transformer has a `_cp_plan` (SD3's has none). The edit models join
# their input images' tokens after the noisy ones (Kontext, Qwen-Image-Edit: `torch.cat([x, tokens], 1)`
# before the transformer), so the plan splits the joined sequence; Wan's image to video conditions
# on channels or a held first frame, not on more tokens.
FAMILIES = ("flux", "flux_kontext", "qwen_image", "qwen_image_edit", "qwen_image_edit_plus", "wan")


def split_token_counts(model_dir: str, family: str, resolution: int, num_frames: int) -> dict[str, int]:
    """What the family's `_cp_plan` splits over a sequence group, by name, in tokens per sample,
    read from the model's JSON files without loading it (config validation): the image or video
    tokens, Flux's text tokens (Qwen-Image pads its text to a multiple itself, Wan's is not split)
    and an edit model's tokens of one input image (the split sequence holds the output's and each
    input's: each count divisible makes their sum divisible). Kontext's input images have the
    output's size (the prompt file check); Qwen-Image-Edit resizes each to `vae_image_area` at the
    output's (square) aspect, to multiples of 32 (diffusers' calculate_dimensions).
    resolution / num_frames 0: the model's own, as the adapters and pipelines default."""
    from async_flowgrpo.models import video_frames
    from async_flowgrpo.models.common import read_model_settings

    def read(component: str) -> dict:
        file = os.path.join(model_dir, component, "config.json")
        if not os.path.isfile(file):
            return {}
        with open(file) as f:
            return json.load(f)

    vae, settings = read("vae"), read_model_settings(model_dir)
    if family == "wan":  # WanPipeline's vae_scale_factor_spatial; the transformer's (t, h, w) patch
        factor, default = vae.get("scale_factor_spatial", 8), 480  # WanAdapter.default_resolution
        patch_t, patch_h, patch_w = read("transformer").get("patch_size", (1, 2, 2))
    else:  # Flux and Qwen-Image pack 2 x 2 latents; their pipelines' vae_scale_factor, default_sample_size 128
        flux = family.startswith("flux")
        blocks = len(vae["block_out_channels"]) - 1 if flux else len(vae.get("temperal_downsample", [0] * 3))
        factor, default, patch_t, patch_h, patch_w = 2 ** blocks, 128 * 2 ** blocks, 1, 2, 2
    side = (resolution or settings.get("resolution") or default) // factor
    frames = 1
    if family == "wan":
        count, temporal = video_frames(model_dir, num_frames)
        frames = (count - 1) // temporal + 1
    counts = {"image tokens": (frames // patch_t) * (side // patch_h) * (side // patch_w)}
    if family.startswith("flux"):
        counts["text tokens"] = settings.get("max_sequence_length", 512)  # FluxAdapter.default_max_sequence_length
    if family.startswith("qwen_image_edit"):  # QwenImageEditAdapter.vae_image_area
        input_side = round(math.sqrt(settings.get("vae_image_area", 1024 * 1024)) / 32) * 32 // factor
        counts["tokens of an input image"] = (input_side // patch_h) * (input_side // patch_w)
    return counts


def data_rank(rank: int, sequence_parallel: int) -> int:
    return rank // sequence_parallel


def sequence_group(sequence_parallel: int):
    """Collective: this rank's sequence group (the N consecutive ranks that share a shard) as a
    process group of its own, for the calls only they make together."""
    group, _ = dist.new_subgroups(group_size=sequence_parallel)
    return group


def all_true(flags: list[bool], device: torch.device, group=None) -> list[bool]:
    """Collective over `group` (default: every trainer): each flag True where it is True on every rank."""
    agreed = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in agreed.tolist()]


def make_mesh(sequence_parallel: int):
    """Collective (every trainer calls it): the (dp, ring, ulysses) mesh over the trainers' default
    process group, with the sequence axis on ulysses (diffusers wants both named axes)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % sequence_parallel:
        raise ValueError(f"{world} trainers cannot form groups of {sequence_parallel}")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // sequence_parallel, 1, sequence_parallel),
                            mesh_dim_names=("dp", "ring", "ulysses"))


def parallelize(transformers: list[nn.Module], mesh) -> None:
    """Turn on context parallelism in each diffusers transformer of `transformers` (a two-expert
    module's children count one by one), on the mesh's ulysses axis."""
    from diffusers import ContextParallelConfig, ModelMixin

    models = [m for t in transformers for m in ([t] if isinstance(t, ModelMixin) else t.children())]
    for model in models:
        if getattr(model, "_cp_plan", None) is None:
            raise ValueError(f"{type(model).__name__} has no context-parallel plan (_cp_plan)")
        config = ContextParallelConfig(ulysses_degree=mesh["ulysses"].size(), mesh=mesh["ring", "ulysses"])
        # diffusers records the device as rank % accelerator count, a division by zero on a CPU-only
        # machine; the device it records is never used on CPU
        cpu_only = torch.accelerator.device_count() == 0
        with mock.patch.object(torch.accelerator, "device_count", return_value=1) if cpu_only else nullcontext():
            model.enable_parallelism(config=config)


def splits_tokens(policy) -> bool:
    """Whether the policy's transformers run with context parallelism on (`parallelize`): a rank's
    gradients then hold its token shard's share of the update only."""
    return any(getattr(m, "_parallel_config", None) is not None for t in policy.transformers() for m in t.modules())


def grad_reduce(world_size: int, sequence_parallel: int, sharded: bool) -> Callable[[list[torch.Tensor]], None] | None:
    """The Learner's `grad_all_reduce` for `world_size` trainers in groups of `sequence_parallel`:
    a flat all-reduce of replicated gradients, a rescale of FSDP's mean, or nothing to do."""
    if sharded:
        return functools.partial(scale_grads, factor=sequence_parallel) if sequence_parallel > 1 else None
    if world_size == 1:
        return None
    return functools.partial(all_reduce_grads, data_parallel=world_size // sequence_parallel)


def scale_grads(params: list[torch.Tensor], factor: float) -> None:
    for p in params:
        p.grad.mul_(factor)


def all_reduce_grads(params: list[torch.Tensor], data_parallel: int) -> None:
    """Sum the gradients over the sequence groups and average them over the data axis: one flat
    all-reduce (sum) over every trainer, divided by the number of data-parallel groups. A parameter
    with .grad None (no backward reached it here) counts as zeros; one that no rank reached stays
    None on every rank (a flag per parameter rides in the same all-reduce), so no rank steps it."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    reached = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [reached])
    dist.all_reduce(flat)
    reached_by_any = (flat[-len(params):] > 0).tolist()
    flat /= data_parallel
    offset = 0
    for p, g, reached_somewhere in zip(params, grads, reached_by_any):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone() if reached_somewhere else None
        offset += n
