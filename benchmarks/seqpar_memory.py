"""Trainer memory per rank with sequence parallelism (trainer.sequence_parallel) against one rank, on
the same sample: a Wan twin whose video is long enough for the token activations to dominate.

    python benchmarks/seqpar_memory.py                      # 17 frames of 64 x 64: 2304 tokens
    python benchmarks/seqpar_memory.py --frames 33 --sp 1 2 --repeats 2

For each N in --sp, N gloo processes form one sequence group and run one Flow-GRPO train_step
(LoRA, one sample, one recorded step, micro-batch 1) on the same recorded group. Per rank it
reports the bytes autograd saves for the backward (activations, counted by storage, parameters
left out: what sequence parallelism divides), and the growth of the process's peak RSS over the
train_step (allocator, communication buffers and all: noisy on a shared machine). Prints a table,
writes benchmarks/results/seqpar_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from async_flowgrpo import seqpar  # noqa: E402
from async_flowgrpo.builders import build_learner  # noqa: E402
from async_flowgrpo.config import load_config  # noqa: E402
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir  # noqa: E402


def parse_args(argv=None):
    ap = common.argument_parser(__doc__)
    ap.add_argument("--frames", type=int, default=17, help="video frames (the twin's VAE: (F - 1) / 2 + 1 latent frames)")
    ap.add_argument("--resolution", type=int, default=64, help="frame side in pixels (latent / 2, patch 2: tokens (res / 4)^2 per latent frame)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="sequence-parallel sizes to measure")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats of the whole --sp list")
    ap.add_argument("--out", default=os.path.join(common.RESULTS, "seqpar_memory.json"))
    return ap.parse_args(argv)


def config(model_dir: str, sp: int):
    return load_config("sync", [
        f"model.path={model_dir}", "model.family=wan", "model.lora_rank=4", "model.lora_alpha=8",
        "reward.weights={temporal_consistency: 1.0}", "reward.options={}", "algorithm.beta=0",
        "trainer.micro_batch_size=1", "rollout.groups_per_step=1", f"trainer.num_workers={sp}",
        f"trainer.sequence_parallel={sp}"])


def saved_activation_bytes(model: torch.nn.Module):
    """A context counting the bytes autograd saves for backward, each storage once, parameters
    (and their LoRA copies' storages) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def measure_rank(rank: int, sp: int, port: int, model_dir: str, groups_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=sp)
    learner = build_learner(config(model_dir, sp), grad_all_reduce=seqpar.grad_reduce(sp, sp, sharded=False))
    groups = torch.load(groups_path, weights_only=False)
    hooks, seen = saved_activation_bytes(learner.policy.adapter.transformer)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with hooks:
        metrics = learner.train_step(groups, version=0)
    seconds = time.perf_counter() - start
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save({"saved_mb": sum(seen.values()) / 2**20, "rss_growth_mb": (rss1 - rss0) / 1024, "seconds": seconds,
                "loss": metrics["loss/policy"]}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def measure(sp: int, model_dir: str, groups_path: str, workdir: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(workdir, f"sp{sp}")
    mp.start_processes(measure_rank, args=(sp, port, model_dir, groups_path, out_path), nprocs=sp, join=True,
                       start_method="spawn")
    return [torch.load(f"{out_path}.{rank}", weights_only=False) for rank in range(sp)]


def main(argv=None) -> None:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="seqpar_memory_")
    model_dir = make_tiny_wan_dir(os.path.join(workdir, "wan"), resolution=args.resolution, num_frames=args.frames,
                                  layers=args.layers, heads=args.heads)
    learner = build_learner(config(model_dir, 1))
    groups = learner.policy.generate(["a red circle moving left"], 1, num_steps=3, guidance_scale=4.0, noise_level=0.7,
                                     sde_type="sde", window_size=1, seed=0)  # one sample, one recorded step
    groups[0].advantages = torch.ones(1)
    groups_path = os.path.join(workdir, "groups.pt")
    torch.save(groups, groups_path)
    c, f, h, w = learner.policy.adapter.latent_shape(args.resolution, args.resolution)
    tokens = f * (h // 2) * (w // 2)
    common.log(f"Wan twin: {args.frames} frames of {args.resolution}px, {tokens} tokens, {args.layers} layers, {args.heads} heads")
    del learner

    runs = {sp: [] for sp in args.sp}
    for r in range(args.repeats):
        for sp in args.sp:  # interleaved: 1, 2, 1, 2, ...
            ranks = measure(sp, model_dir, groups_path, workdir)
            runs[sp].append(ranks)
            common.log(f"repeat {r} sp {sp}: " + ", ".join(f"rank {k} saved {x['saved_mb']:.1f} MB rss +{x['rss_growth_mb']:.0f} MB "
                                                            f"{x['seconds']:.2f}s" for k, x in enumerate(ranks)))

    print(f"\n| trainer.sequence_parallel | tokens per rank | saved activations per rank (MB) | peak RSS growth per rank (MB, min-max) | train_step (s, min-max) | loss/policy |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for sp, reps in runs.items():
        every = [x for ranks in reps for x in ranks]
        saved = max(x["saved_mb"] for x in every)
        rss = [x["rss_growth_mb"] for x in every]
        secs = [x["seconds"] for x in every]
        rows.append({"sequence_parallel": sp, "tokens_per_rank": tokens // sp, "saved_mb": saved, "rss_growth_mb": rss,
                     "seconds": secs, "loss": every[0]["loss"]})
        print(f"| {sp} | {tokens // sp} | {saved:.1f} | {min(rss):.0f}-{max(rss):.0f} | {min(secs):.2f}-{max(secs):.2f} | "
              f"{every[0]['loss']:.6g} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "tokens": tokens, "rows": rows}, fh, indent=1)
    common.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
