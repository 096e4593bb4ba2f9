#!/usr/bin/env python
"""Per-phase speed: our rollout and our trainer step against plain diffusers / torch doing the same work.

Two phases, each with two contenders run interleaved in one process on one model:

rollout   ours  = ``DiffusionPolicy.generate`` (Flow-GRPO sampling: SDE window with per-step
                  log-probs recorded, ODE steps outside it, VAE decode to uint8 images)
          plain = ``StableDiffusion3Pipeline.__call__`` (``WanPipeline.__call__`` for a Wan model,
                  videos instead of images) on the *same* pipeline object (same
                  transformer, LoRA adapters included, same text encoders and VAE), same prompts,
                  images per prompt, steps, CFG, resolution and T5 length, progress bar off,
                  ``output_type`` pt (decoded; ``--output-type latent`` skips the VAE)
train     ours  = ``Learner.train_step`` on a batch of groups generated once by ours
          plain = a bare loop over the same transformer forward+backward passes on the same
                  tensors: the batch's (sample, step) pairs in calls of --micro-batch rows, each
                  row at its own step (one CFG-batched forward [uncond; cond] per pass, the CFG
                  combine, a squared error to the recorded next latent as the loss, backward),
                  then one AdamW step on the same trainable parameters and zero_grad(set_to_none=True)
          with ``--algorithm diffusion_nft``: ours = ``NFTLearner.train_step`` on ODE groups, plain
                  = the same points in calls of --micro-batch, a no-grad and a gradient forward each

With ``--flow-grpo DIR`` (a local checkout of github.com/yifan123/flow_grpo; nothing of it is in
this repository) each phase has a third contender, the original Flow-GRPO code on the same
pipeline object: its ``pipeline_with_logprob`` for the rollout, and its train_sd3.py inner loop
(``compute_log_prob`` around its ``sde_step_with_logprob``, clipped-ratio loss, backward; re-typed
in ``flow_grpo_train``) for the trainer step. That loop differentiates both CFG halves, as
flow_grpo's did before its commit 2d76907 (and ours with ``algorithm.uncond_grad=true``);
``--no-uncond-grad`` detaches the unconditional half in all three, as flow_grpo's
``compute_log_prob`` now does and as our default does.

Every round runs every contender, alternating which goes first (ABBA), after ``--warmup``
unrecorded rounds. Reported per contender: median, min, max and the interquartile range of the
wall time, of the process's CPU time (with one thread, CPU time leaves out the time other
processes take the core away: on a shared machine the steadier clock) and of the CPU time inside
the transformer's forward calls and inside backward (the passes themselves; the rest is what a
contender does around them); per phase: ours/plain as
the ratio of medians and as the median of the per-round ratios (paired, less sensitive to the
machine's drift). Then each contender of each phase runs
once more under cProfile (timed by CPU time): the time split into transformer forward, backward, text encoding, VAE
decode, optimizer step and the rest, and ours' top functions by own time.

    python benchmarks/phases.py                                   # embedded model, the default work: ~2 min
    python benchmarks/phases.py --out benchmarks/results/phases/after.json
    python benchmarks/phases.py --real-size                       # random-init wider SD3, ~5 min
    python benchmarks/phases.py --model /path/to/sd3 --prompts 2 --group-size 4 --window 2
    python benchmarks/phases.py --tiny-wan --steps 10 --window 4                 # the video family
    python benchmarks/phases.py --pool run1.json run2.json --out pooled.json   # rounds of runs as one
    python benchmarks/phases.py --flow-grpo ../flow_grpo --no-uncond-grad       # and the original code
    # the trainer step of the embedded default (config/base.yaml), each algorithm
    python benchmarks/phases.py --phases train --window 4 --micro-batch 64 --no-uncond-grad --beta 0.04
    python benchmarks/phases.py --phases train --algorithm diffusion_nft --cfg 1 --micro-batch 64
    # against the trainer of an earlier commit, interleaved in one process (contender "baseline")
    git worktree add /tmp/before <commit>
    python benchmarks/phases.py --phases train ... --baseline /tmp/before --baseline-micro-batch 16

The default work: 4 prompts x 8 images = 32 samples a step, 10 denoising steps,
CFG 4.5, an SDE window of 9 trained steps, LoRA r16, fp32, micro-batch 8 rows (36 forward+backward
passes per train step), one torch thread.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (offline / no-wandb environment defaults)
from common import argument_parser, log  # noqa: E402

PROMPTS = (
    "a red circle",
    "two blue squares",
    "a green triangle left of a yellow circle",
    "three purple circles",
    "a cyan square above a red triangle",
    "two yellow triangles",
    "a blue circle below a green square",
    "a purple square",
)

# --real-size: a random-init SD3 with the real architecture (16 latent channels, CLIP pair, T5
# slot), wider and longer than the embedded model (hidden 64, 4 blocks, 64 image + 13 text tokens)
# at sizes where one denoising step of the 16-sample CFG batch (32 rows) takes about 0.8 s on one
# CPU thread: 48 px images through a 2-level VAE -> 24x24 latents, 144 image tokens + 48 text
# tokens, hidden 256 = 4 heads x 64, 4 MMDiT blocks, ~9M transformer parameters.
REAL_SIZE_SPEC = dict(
    resolution=48,
    text_hidden=128,
    text_layers=2,
    text_max_length=32,
    t5_max_length=16,
    vae_channels=(32, 64),
    latent_channels=16,
    layers=4,
    heads=4,
    head_dim=64,
    pooled_dim=256,
)
# the work scaled down so that the whole benchmark stays at a few minutes
REAL_SIZE_WORK = dict(prompts=2, group_size=8, window=4, rounds=3)


# ------------------------------------------------------------------------------------------ stats
CONTENDERS = ("ours", "plain", "flow_grpo", "baseline")


def summarize(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "iqr_s": q[2] - q[0],
        "times_s": times,
    }


def compare(ours: list[float], plain: list[float]) -> dict:
    return {
        "ratio_of_medians": statistics.median(ours) / statistics.median(plain),
        "median_paired_ratio": statistics.median(o / p for o, p in zip(ours, plain)),
        "paired_ratios": [o / p for o, p in zip(ours, plain)],
    }


def phase_entry(times: dict[str, list[float]]) -> dict:
    """Each contender's statistics, ours/plain, and ours/flow_grpo when it ran."""
    entry = {name: summarize(t) for name, t in times.items()}
    entry.update(compare(times["ours"], times["plain"]))
    for other in ("flow_grpo", "baseline"):
        if other in times:
            entry[f"vs_{other}"] = compare(times["ours"], times[other])
    return entry


class PassClock:
    """CPU time spent inside the transformer's forward calls and inside backward calls, summed
    until reset: installed around a phase's rounds, it splits each contender's time into the
    passes themselves and everything around them (did a contender run the same passes dearer,
    or do more around them?)."""

    def __init__(self, transformer):
        self.forward_s = self.backward_s = 0.0
        self._transformer = transformer

    def __enter__(self):
        import torch

        forward, backward = self._transformer.forward, torch.Tensor.backward

        def timed_forward(*args, **kwargs):
            c0 = time.process_time()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward_s += time.process_time() - c0

        def timed_backward(tensor, *args, **kwargs):
            c0 = time.process_time()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                self.backward_s += time.process_time() - c0

        self._restore = lambda: (setattr(torch.Tensor, "backward", backward), self._transformer.__dict__.pop("forward", None))
        self._transformer.forward, torch.Tensor.backward = timed_forward, timed_backward
        return self

    def __exit__(self, *exc):
        self._restore()

    def take(self) -> tuple[float, float]:
        out = (self.forward_s, self.backward_s)
        self.forward_s = self.backward_s = 0.0
        return out


def run_rounds(contenders: dict, rounds: int, warmup: int, clock: PassClock | None = None):
    """Both contenders per round, alternating which runs first; warm-up rounds not recorded.
    Returns wall times and CPU times (this process's, all threads): with one torch thread the
    CPU time leaves out the time other processes took the core from us, the main noise on a
    shared 2-core machine. With a `clock`, also the CPU time inside the transformer's forward
    calls and inside backward, per contender and round (a third dict, {"forward": ..., "backward": ...})."""
    names = list(contenders)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    passes = {"forward": {n: [] for n in names}, "backward": {n: [] for n in names}}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if clock is not None:
                clock.take()
            t0, c0 = time.perf_counter(), time.process_time()
            contenders[name](r)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                wall[name].append(dt)
                cpu[name].append(dc)
                if clock is not None:
                    fwd, bwd = clock.take()
                    passes["forward"][name].append(fwd)
                    passes["backward"][name].append(bwd)
        if r >= warmup:
            log("  round %d: %s" % (r - warmup, ", ".join(
                f"{n} {wall[n][-1]:.3f}s (cpu {cpu[n][-1]:.3f}s)" for n in names)))
    return (wall, cpu) if clock is None else (wall, cpu, passes)


# ------------------------------------------------------------------------------------------ profile
# (file suffix, function name) -> bucket; cumulative times, the buckets never nest in each other
BUCKETS = {
    "transformer forward": [("transformer_sd3.py", "forward"), ("transformer_wan.py", "forward")],
    "backward": [("autograd/__init__.py", "backward")],
    "text encoding": [("pipeline_stable_diffusion_3.py", "encode_prompt"), ("pipeline_wan.py", "encode_prompt")],
    "vae decode": [("autoencoder_kl.py", "decode"), ("autoencoder_kl_wan.py", "decode")],
    "optimizer step": [("adamw.py", "step"), ("optimizer.py", "wrapper")],
}


def profile(fn, top: int) -> dict:
    prof = cProfile.Profile(time.process_time)  # CPU time: steadier than wall time on a shared machine
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    total = max(v[3] for v in stats.stats.values())  # the outermost call's cumulative time
    buckets = {}
    for bucket, keys in BUCKETS.items():
        cum = 0.0
        for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
            if any(file.endswith(f) and func == name for f, name in keys):
                # nested entries (the optimizer's wrapper around step; Wan's block forwards inside the
                # model's, same file): the outermost's cumulative time, not their sum
                cum = max(cum, ct) if bucket in ("optimizer step", "transformer forward") else cum + ct
        buckets[bucket] = cum
    buckets["rest"] = total - sum(buckets.values())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    top_rows = [
        {
            "function": f"{os.path.relpath(file, common.REPO) if file.startswith(common.REPO) else _short(file)}:{line}({func})",
            "calls": nc,
            "tottime_s": tt,
            "cumtime_s": ct,
        }
        for (file, line, func), (_, nc, tt, ct, _) in rows
    ]
    ours_rows = sorted(
        (kv for kv in stats.stats.items() if "async_flowgrpo" in kv[0][0]), key=lambda kv: -kv[1][3]
    )[:top]
    ours_top = [
        {"function": f"{_short(file)}:{line}({func})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
        for (file, line, func), (_, nc, tt, ct, _) in ours_rows
    ]
    return {"wall_s_profiled": wall, "total_s": total, "buckets_s": buckets, "top_tottime": top_rows,
            "top_ours_cumtime": ours_top}


def _short(file: str) -> str:
    for marker in ("site-packages/", "async_flowgrpo/"):
        if marker in file:
            return (("async_flowgrpo/" if marker == "async_flowgrpo/" else "") + file.split(marker, 1)[1])
    return file


# ------------------------------------------------------------------------------------------ setup
def make_real_size_model(workdir: str) -> str:
    from async_flowgrpo.models.tiny_sd3 import TinySD3Spec, build_tiny_sd3, save_pipeline

    words = sorted({w for p in PROMPTS for w in p.split()})
    spec = TinySD3Spec(vocab=tuple(words), **REAL_SIZE_SPEC)
    path = os.path.join(workdir, "real_size_sd3")
    save_pipeline(build_tiny_sd3(spec), path, spec)
    return path


def rollout_contenders(policy, prompts, args, flow_grpo=None):
    pipe = policy.adapter.pipeline
    res = policy.adapter.resolution
    import torch

    def ours(r):
        policy.generate(
            prompts, args.group_size, num_steps=args.steps, guidance_scale=args.cfg, noise_level=args.noise_level,
            sde_type="sde", window_size=args.window, seed=r,
        )

    per_prompt = ({"num_videos_per_prompt": args.group_size, "num_frames": policy.adapter.num_frames}
                  if policy.adapter.family == "wan" else {"num_images_per_prompt": args.group_size})

    def plain(r):
        pipe(
            prompt=list(prompts), **per_prompt, num_inference_steps=args.steps,
            guidance_scale=args.cfg, height=res, width=res, output_type=args.output_type,
            max_sequence_length=policy.adapter.max_sequence_length, generator=torch.Generator().manual_seed(r),
        )

    contenders = {"ours": ours, "plain": plain}
    if flow_grpo is not None:
        contenders["flow_grpo"] = flow_grpo_rollout(flow_grpo, policy, prompts, args)
    return contenders


def train_contenders(policy, prompts, args, flow_grpo=None):
    if args.algorithm == "diffusion_nft":
        return nft_train_contenders(policy, prompts, args)
    import torch

    from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner

    groups = policy.generate(
        prompts, args.group_size, num_steps=args.steps, guidance_scale=args.cfg, noise_level=args.noise_level,
        sde_type="sde", window_size=args.window, seed=12345,
    )
    gen = torch.Generator().manual_seed(0)
    for g in groups:
        g.advantages = torch.randn(g.size, generator=gen)
    learner = Learner(policy, micro_batch_size=args.micro_batch, uncond_grad=not args.no_uncond_grad, beta=args.beta)

    # the bare loop's tensors, on the device, built once (they are "the same tensors")
    dev, dt = policy.device, policy.dtype
    adapter = policy.adapter
    tr = adapter.transformer
    n = args.group_size
    lat = torch.cat([g.latents for g in groups]).to(dev)  # [N, W+1, C, H, W] ([N, W+1, C, F, h, w] for video)
    sig = groups[0].sigmas.to(dev)

    def per_sample(attr):
        return torch.stack([getattr(g, attr) for g in groups]).repeat_interleave(n, 0).to(dev, dt)

    emb, pooled = per_sample("prompt_embeds"), per_sample("pooled_prompt_embeds")
    cfg = args.cfg > 1
    if cfg:
        nemb, npooled = per_sample("negative_prompt_embeds"), per_sample("negative_pooled_prompt_embeds")
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
    n_samples, w = lat.shape[0], lat.shape[1] - 1
    mb = args.micro_batch
    # the rows ours replays: every (sample, step) pair, sample-major
    x_rows, x_next = lat[:, :-1].flatten(0, 1), lat[:, 1:].flatten(0, 1)
    step = torch.arange(w, device=dev).repeat(n_samples)
    sample = torch.arange(n_samples, device=dev).repeat_interleave(w)
    n_rows = n_samples * w

    def bare(_r):
        for m in range(0, n_rows, mb):
            sl = slice(m, m + mb)
            x, j, i = x_rows[sl], step[sl], sample[sl]
            b = x.shape[0]
            e, p = (torch.cat([nemb[i], emb[i]]), torch.cat([npooled[i], pooled[i]])) if cfg else (emb[i], pooled[i])
            xx = torch.cat([x, x]) if cfg else x
            t = (sig[j] * adapter.timestep_scale).repeat(2 if cfg else 1)
            # the family's one transformer call (SD3: + pooled projections; Wan: text sequence only)
            v = adapter._forward(tr, xx, t, e, p, shape=xx.shape, guidance_scale=args.cfg).float()
            if cfg:  # flow_grpo's way: one batch [uncond; cond], the uncond half detached (or not)
                v_uncond, v_cond = v.chunk(2)
                v_uncond = v_uncond.detach() if args.no_uncond_grad else v_uncond
                v = v_uncond + args.cfg * (v_cond - v_uncond)
            dt_rows = (sig[j + 1] - sig[j]).reshape(-1, *[1] * (x.ndim - 1))
            loss = ((x + dt_rows * v - x_next[sl]) ** 2).mean()
            (loss * (b / n_rows)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ours(r):
        learner.train_step(groups, version=0)

    contenders = {"ours": ours, "plain": bare}
    if args.baseline:
        contenders["baseline"] = baseline_train(args, policy, groups)
    if flow_grpo is not None:
        contenders["flow_grpo"] = flow_grpo_train(flow_grpo, policy, args, lat, (emb, pooled, nemb, npooled), params, groups)
    return contenders, len(groups) * n, -(-n_rows // mb)


def nft_train_contenders(policy, prompts, args):
    """DiffusionNFT: ours = NFTLearner.train_step on ODE groups; plain = a bare loop over the same
    points in calls of --micro-batch: a no-grad forward (v_old; ours swaps in the old weights
    first), a forward with gradient and a squared error to the flow target, backward; one AdamW step."""
    import torch

    from async_flowgrpo.algorithms.diffusion_nft import NFTLearner

    groups = policy.generate(prompts, args.group_size, num_steps=args.steps, guidance_scale=args.cfg, noise_level=0.0,
                             sde_type="sde", window_size=0, seed=12345)
    gen = torch.Generator().manual_seed(0)
    for g in groups:
        g.advantages = torch.randn(g.size, generator=gen)
    learner = NFTLearner(policy, micro_batch_size=args.micro_batch, beta=args.beta)
    # the points as NFTLearner draws them: a sample at int(0.99 steps) distinct levels, fresh noise each
    dev, dt, adapter, tr = policy.device, policy.dtype, policy.adapter, policy.adapter.transformer
    levels = max(1, int(args.steps * 0.99))
    sigmas = policy.sigmas(args.steps)[: args.steps]
    x0 = torch.cat([g.latents[:, -1] for g in groups]).repeat_interleave(levels, 0).to(dev)
    sigma = torch.cat([sigmas[torch.randperm(args.steps, generator=gen)[:levels]] for _ in range(len(x0) // levels)]).to(dev)
    s_col = sigma.reshape(-1, *[1] * (x0.ndim - 1))
    x_t = (1 - s_col) * x0 + s_col * torch.randn(x0.shape, generator=gen).to(dev)
    group = torch.arange(len(groups), device=dev).repeat_interleave(args.group_size * levels)
    emb = torch.stack([g.prompt_embeds for g in groups]).to(dev, dt)
    pooled = torch.stack([g.pooled_prompt_embeds for g in groups]).to(dev, dt)
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
    n_points, mb = len(x0), args.micro_batch

    def forward(sl):
        g = group[sl]
        return adapter._forward(tr, x_t[sl], sigma[sl] * adapter.timestep_scale, emb[g], pooled[g],
                                shape=x_t[sl].shape, guidance_scale=args.cfg).float()

    def bare(_r):
        with torch.no_grad():
            for m in range(0, n_points, mb):
                forward(slice(m, m + mb))
        for m in range(0, n_points, mb):
            sl = slice(m, m + mb)
            v = forward(sl)
            loss = ((v - (x_t[sl] - x0[sl]) / sigma[sl].reshape(-1, *[1] * (v.ndim - 1))) ** 2).mean()
            (loss * (v.shape[0] / n_points)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ours(r):
        learner.train_step(groups, version=0)

    contenders = {"ours": ours, "plain": bare}
    if args.baseline:
        contenders["baseline"] = baseline_train(args, policy, groups)
    return contenders, len(groups) * args.group_size, -(-n_points // mb)


def baseline_train(args, policy, groups):
    """--baseline DIR: the train step of the learner module of another checkout of this project
    (a `git worktree` of an earlier commit), on the same policy and groups, interleaved with ours
    in this process. Only that one file comes from DIR; what it imports (policy, adapters, algo)
    is this checkout's."""
    import importlib.util

    nft = args.algorithm == "diffusion_nft"
    # the algorithms/ layout, then the one before it (a learner module each, at the package's top)
    layouts = [(f"algorithms/{args.algorithm}.py", "NFTLearner" if nft else "FlowGRPOLearner"),
               ("nft_learner.py" if nft else "learner.py", "NFTLearner" if nft else "Learner")]
    found = [(os.path.join(args.baseline, "async_flowgrpo", f), cls) for f, cls in layouts
             if os.path.isfile(os.path.join(args.baseline, "async_flowgrpo", f))]
    if not found:
        raise SystemExit(f"--baseline: {args.baseline} has no async_flowgrpo/{layouts[0][0]} (nor {layouts[1][0]})")
    path, cls = found[0]
    spec = importlib.util.spec_from_file_location(f"baseline_{args.algorithm}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    micro = args.baseline_micro_batch or args.micro_batch
    if nft:
        learner = getattr(module, cls)(policy, micro_batch_size=micro, beta=args.beta)
    else:
        learner = getattr(module, cls)(policy, micro_batch_size=micro, uncond_grad=not args.no_uncond_grad, beta=args.beta)
    return lambda r: learner.train_step(groups, version=0)


# -- the original Flow-GRPO code, from a local checkout (--flow-grpo) ------------------------------
def import_flow_grpo(path: str):
    """github.com/yifan123/flow_grpo's two diffusers patches (they need only torch and diffusers)."""
    import importlib

    if not os.path.isdir(os.path.join(path, "flow_grpo", "diffusers_patch")):
        raise SystemExit(f"--flow-grpo: {path} is not a flow_grpo checkout (no flow_grpo/diffusers_patch)")
    sys.path.insert(0, os.path.abspath(path))
    patch = "flow_grpo.diffusers_patch."
    return (importlib.import_module(patch + "sd3_pipeline_with_logprob").pipeline_with_logprob,
            importlib.import_module(patch + "sd3_sde_with_logprob").sde_step_with_logprob)


def flow_grpo_rollout(flow_grpo, policy, prompts, args):
    """Its `pipeline_with_logprob` (SDE on every step, log-probs recorded, decoded to a tensor), on
    our pipeline object, one prompt per sample as its train_sd3.py passes them."""
    import torch

    pipeline_with_logprob, _ = flow_grpo
    pipe, res = policy.adapter.pipeline, policy.adapter.resolution
    per_sample = [p for p in prompts for _ in range(args.group_size)]

    def run(r):
        pipeline_with_logprob(pipe, prompt=per_sample, num_inference_steps=args.steps, guidance_scale=args.cfg,
                              output_type="pt", height=res, width=res, noise_level=args.noise_level,
                              max_sequence_length=policy.adapter.max_sequence_length,
                              generator=torch.Generator().manual_seed(r))

    return run


def flow_grpo_train(flow_grpo, policy, args, lat, embeds, params, groups):
    """Its train_sd3.py inner loop, re-typed: per micro-batch of --micro-batch samples and per trained step
    (its loop has no (sample, step) rows), `compute_log_prob`
    (one CFG batch [uncond; cond], differentiated through both halves as its trainer did before its
    commit 2d76907, or with the unconditional half detached under --no-uncond-grad, as its
    `compute_log_prob` does now: `noise_pred_uncond = noise_pred_uncond.detach()`; its `sde_step_with_logprob`
    against the recorded next latent), the clipped-ratio policy loss (beta 0) and backward; one
    clipped AdamW step per batch (its accelerate accumulation spans the batch)."""
    import torch

    _, sde_step_with_logprob = flow_grpo
    pipe, tr = policy.adapter.pipeline, policy.adapter.transformer
    emb, pooled, nemb, npooled = embeds
    pipe.scheduler.set_timesteps(args.steps, device=lat.device)
    n_samples, w, mb = lat.shape[0], lat.shape[1] - 1, args.micro_batch
    timesteps = pipe.scheduler.timesteps[:w].repeat(n_samples, 1)
    old_log_probs = torch.cat([g.log_probs for g in groups]).to(lat.device)
    advantages = torch.randn(n_samples, generator=torch.Generator().manual_seed(0)).to(lat.device)
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)

    def run(_r):
        for m in range(0, n_samples, mb):
            sl = slice(m, m + mb)
            e, p = torch.cat([nemb[sl], emb[sl]]), torch.cat([npooled[sl], pooled[sl]])
            for j in range(w):
                x = lat[sl, j]
                v = tr(hidden_states=torch.cat([x, x]), timestep=torch.cat([timesteps[sl, j]] * 2), encoder_hidden_states=e,
                       pooled_projections=p, return_dict=False)[0]
                v_uncond, v_cond = v.chunk(2)
                v_uncond = v_uncond.detach() if args.no_uncond_grad else v_uncond
                v = v_uncond + args.cfg * (v_cond - v_uncond)
                _, log_prob, _, _ = sde_step_with_logprob(pipe.scheduler, v.float(), timesteps[sl, j], x.float(),
                                                          prev_sample=lat[sl, j + 1].float(), noise_level=args.noise_level)
                ratio = torch.exp(log_prob - old_log_probs[sl, j])
                adv = advantages[sl]
                loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)))
                loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    return run


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("--model", default=None, help="diffusers SD3 or Wan directory (default: the embedded shapes model)")
    ap.add_argument("--tiny-wan", action="store_true", help="the tiny random Wan twin (5 frames of 32 x 32), built here")
    ap.add_argument("--real-size", action="store_true",
                    help="a random-init wider SD3 (REAL_SIZE_SPEC) and scaled-down work (REAL_SIZE_WORK) "
                         "unless given explicitly")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per batch (default 4)")
    ap.add_argument("--group-size", type=int, default=None, help="images per prompt (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps")
    ap.add_argument("--cfg", type=float, default=4.5, help="guidance scale")
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--window", type=int, default=None, help="SDE window = trained steps (default steps - 1)")
    ap.add_argument("--lora-rank", type=int, default=16, help="0 = full fine-tuning")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="trainer micro-batch: rows per transformer call, (sample, step) pairs (diffusion_nft: "
                         "(sample, noise level) points); the flow_grpo contender's own loop: samples per step")
    ap.add_argument("--algorithm", default="flow_grpo", choices=("flow_grpo", "diffusion_nft"),
                    help="the trainer step timed (diffusion_nft: ODE groups, train phase only; pass --cfg 1)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (config/base.yaml: 0.04 for flow_grpo)")
    ap.add_argument("--no-uncond-grad", action="store_true", help="differentiate the conditional CFG half only")
    ap.add_argument("--output-type", default="pt", choices=("pt", "latent"), help="the plain pipeline's output")
    ap.add_argument("--rounds", type=int, default=None, help="recorded rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first")
    ap.add_argument("--phases", default="rollout,train")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--top", type=int, default=12, help="profile rows")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--flow-grpo", default=None, metavar="DIR",
                    help="also time the original Flow-GRPO code from this checkout of github.com/yifan123/flow_grpo")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also time the trainer step of DIR's learner module (a checkout of an earlier commit): before/after in one process")
    ap.add_argument("--baseline-micro-batch", type=int, default=None,
                    help="the baseline learner's micro_batch_size (default --micro-batch; before the row replay it counted samples)")
    ap.add_argument("--out", default=None, help="JSON path (e.g. benchmarks/results/phases/<name>.json)")
    ap.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: pool the rounds of earlier runs (same settings) into one table")
    args = ap.parse_args(argv)
    if args.pool:
        return write(pool(args.pool), args.out)

    defaults = dict(prompts=4, group_size=8, window=None, rounds=5)
    if args.real_size:
        defaults.update(REAL_SIZE_WORK)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.window is None:
        args.window = args.steps - 1
    phases = [p for p in args.phases.split(",") if p]
    if set(phases) - {"rollout", "train"}:
        ap.error("--phases: rollout and/or train")
    if args.baseline and phases != ["train"]:
        ap.error("--baseline: --phases train only")
    if args.algorithm == "diffusion_nft" and (phases != ["train"] or args.flow_grpo):
        ap.error("--algorithm diffusion_nft: --phases train only, without --flow-grpo")

    import torch

    torch.set_num_threads(args.threads)
    flow_grpo = import_flow_grpo(args.flow_grpo) if args.flow_grpo else None
    from async_flowgrpo.config import EMBEDDED_MODEL
    from async_flowgrpo.policy import DiffusionPolicy

    workdir = tempfile.mkdtemp(prefix="phases_")
    try:
        if args.tiny_wan:
            from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir

            model, model_desc = make_tiny_wan_dir(os.path.join(workdir, "tiny_wan")), {"path": "tiny Wan twin"}
        elif args.real_size and args.model is None:
            log("building the random-init real-size model")
            model, model_desc = make_real_size_model(workdir), {"real_size_spec": REAL_SIZE_SPEC}
        else:
            model = args.model or EMBEDDED_MODEL
            model_desc = {"path": "embedded" if model == EMBEDDED_MODEL else model}
        policy = DiffusionPolicy(model, dtype=torch.float32, lora_rank=args.lora_rank, lora_alpha=2 * max(args.lora_rank, 1))
        if policy.adapter.family not in ("sd3", "wan"):
            raise SystemExit(f"phases.py compares against StableDiffusion3Pipeline or WanPipeline; {model} is "
                             f"{policy.adapter.family}")
        if flow_grpo is not None and policy.adapter.family != "sd3":
            raise SystemExit("--flow-grpo: the original code's pipeline is SD3's; leave it out for Wan")
        model_desc["family"] = policy.adapter.family
        model_desc["transformer_params_M"] = sum(p.numel() for p in policy.adapter.transformer.parameters()) / 1e6
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
        result = {
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
            "model": model_desc,
            "machine": common.machine_info(),
            "samples": args.prompts * args.group_size,
            "phases": {},
        }
        log(f"model {model_desc}, {result['samples']} samples, {args.steps} steps, window {args.window}, "
            f"CFG {args.cfg}, LoRA r{args.lora_rank}, {args.threads} thread(s)")
        for phase in phases:
            if phase == "rollout":
                contenders = rollout_contenders(policy, prompts, args, flow_grpo)
                extra = {}
            else:
                contenders, n_samples, passes = train_contenders(policy, prompts, args, flow_grpo)
                extra = {"forward_backward_passes": passes}
            log(f"{phase}: {args.warmup} warm-up + {args.rounds} rounds")
            with PassClock(policy.adapter.transformer) as clock:
                wall, cpu, passes = run_rounds(contenders, args.rounds, args.warmup, clock)
            entry = {**phase_entry(wall), **extra, "cpu": phase_entry(cpu),
                     **{f"cpu_{part}": phase_entry(times) for part, times in passes.items()
                        if any(t for contender in times.values() for t in contender)}}  # a rollout: no backward
            if not args.no_profile:
                entry["profile"] = {name: profile(lambda f=f: f(10_000), args.top) for name, f in contenders.items()}
            result["phases"][phase] = entry
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    add_sequential_step(result)
    return write(result, args.out)


def add_sequential_step(result: dict) -> None:
    """With both phases: each contender's rollout + train step of the same round, the step of a
    synchronous loop without orchestration (Flow-GRPO's train_sd3.py is one), as samples/s."""
    phases = result["phases"]
    if not {"rollout", "train"} <= set(phases):
        return
    step = {}
    for clock in ("wall", "cpu"):
        roll, train = (phases[p] if clock == "wall" else phases[p]["cpu"] for p in ("rollout", "train"))
        for name in [n for n in CONTENDERS if n in roll and n in train and n not in ("plain", "baseline")]:
            sums = [a + b for a, b in zip(roll[name]["times_s"], train[name]["times_s"])]
            step.setdefault(name, {})[clock] = {**summarize(sums), "samples_per_s": result["samples"] / statistics.median(sums)}
    result["sequential_step"] = step


def write(result: dict, out: str | None) -> dict:
    print(report(result))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {out}")
    return result


def pool(files: list[str]) -> dict:
    """The rounds of several runs as one: times concatenated, statistics recomputed; settings,
    model and profiles from the first file (the settings must agree, except the round counts)."""
    runs = []
    for path in files:
        with open(path) as f:
            runs.append(json.load(f))
    ignore = {"rounds", "warmup", "top", "no_profile", "pool"}
    first = {k: v for k, v in runs[0]["settings"].items() if k not in ignore}
    for path, run in zip(files, runs):
        if {k: v for k, v in run["settings"].items() if k not in ignore} != first:
            raise SystemExit(f"--pool: {path} was run with other settings than {files[0]}")
    result = {k: v for k, v in runs[0].items() if k != "phases"}
    result["pooled_from"] = [os.path.basename(p) for p in files]
    result["machine"]["load_average_per_run"] = [[r["machine"].get("load_average_at_start"),
                                                  r["machine"].get("load_average_at_end")] for r in runs]
    result["phases"] = {}
    for phase, e0 in runs[0]["phases"].items():
        entry = {}
        for clock in ["wall", "cpu"] + [k for k in ("cpu_forward", "cpu_backward") if all(k in r["phases"][phase] for r in runs)]:
            names = [n for n in CONTENDERS if n in e0]
            times = {n: [t for r in runs for t in (r["phases"][phase] if clock == "wall" else r["phases"][phase][clock])[n]["times_s"]]
                     for n in names}
            d = phase_entry(times)
            if clock == "wall":
                entry.update(d)
            else:
                entry[clock] = d
        for key in ("forward_backward_passes", "profile"):
            if key in e0:
                entry[key] = e0[key]
        result["phases"][phase] = entry
    add_sequential_step(result)
    return result


def report(result: dict) -> str:
    out = io.StringIO()
    w = out.write
    w("\nphase    contender clock     median_s   min_s   max_s   iqr_s   ours/this (medians | paired)\n")
    for phase, e in result["phases"].items():
        clocks = [("wall", e), ("cpu", e["cpu"])] + [(part, e[f"cpu_{part}"]) for part in ("forward", "backward")
                                                      if f"cpu_{part}" in e]
        for clock, d in clocks:
            for name in [n for n in CONTENDERS if n in d]:
                s = d[name]
                c = d if name == "plain" else d.get(f"vs_{name}")
                ratio = f"{c['ratio_of_medians']:.3f} | {c['median_paired_ratio']:.3f}" if c else ""
                w(f"{phase:8s} {name:9s} {clock:8s} {s['median_s']:8.3f} {s['min_s']:7.3f} {s['max_s']:7.3f} "
                  f"{s['iqr_s']:7.3f}   {ratio}\n")
    if result.get("sequential_step"):
        w("\nsequential step (rollout + train step of each round; a synchronous loop without orchestration):\n")
        for name, clocks in result["sequential_step"].items():
            w("  " + f"{name:9s} " + ", ".join(f"{clock} median {d['median_s']:.3f} s = {d['samples_per_s']:.2f} samples/s"
                                              for clock, d in clocks.items()) + "\n")
    for phase, e in result["phases"].items():
        if "profile" not in e:
            continue
        w(f"\nprofile, {phase} (cProfile on CPU time, one run each; seconds, inflated by the profiler):\n")
        names = list(e["profile"])
        w(f"  {'bucket':22s}" + "".join(f"{n:>10s}" for n in names) + "\n")
        for bucket in list(BUCKETS) + ["rest"]:
            w(f"  {bucket:22s}" + "".join(f"{e['profile'][n]['buckets_s'][bucket]:10.3f}" for n in names) + "\n")
        w(f"  {'total':22s}" + "".join(f"{e['profile'][n]['total_s']:10.3f}" for n in names) + "\n")
        w("  ours, top by own time:\n")
        for row in e["profile"]["ours"]["top_tottime"]:
            w(f"    {row['tottime_s']:7.3f} {row['cumtime_s']:7.3f} {row['calls']:7d}  {row['function']}\n")
    return out.getvalue()


if __name__ == "__main__":
    main()
