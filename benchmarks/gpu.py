#!/usr/bin/env python
"""GPU smoke and speed: a real-size SD3.5-Medium-shaped model with random weights, in one process.

No download: the transformer (24 MMDiT blocks, 1536 wide, dual attention in blocks 0-12, qk
RMSNorm), the 16-channel VAE and both CLIP text encoders are built from their configs with random
weights; T5 is left out, as the embedded model does, so the pipeline pads its 256 tokens with
zeros (the transformer still sees 77 + 256 text tokens). Settings are
config/model/sd35_medium.yaml's (512 px, 10 steps, CFG 4.5, SDE window 4, LoRA rank 32, beta
0.04, bf16) on a smaller batch. Measured, in this order:

1. the bf16 matmul ceiling of this device (8192^3, the MFU denominator beside the datasheet's);
2. a plain diffusers pipeline call (same model, steps, CFG and batch) against our rollout
   (`DiffusionPolicy.generate`, LoRA attached): images/s, their ratio, FLOPs and MFU;
3. the trainer step (`Learner.train_step`): LoRA at micro-batch 4 with gradient checkpointing, 4
   without, 16 without (the config's); full fine-tuning (fp32 master weights, bf16 autocast) at
   micro-batch 4 with checkpointing: trained images/s, MFU, peak memory;
4. the checkpoint engine on this one GPU: NCCL group of one rank (NCCL refuses two ranks on one
   device), GPU packing into buckets and unpacking, checked bit for bit;
5. the pynvml monitor (`perf/gpu_util`, `perf/gpu_mem_gb`) over the rollout;
6. the embedded default (the shapes model, its config) in one process, sync update, on this
   device and on its CPU: samples/s.

FLOPs are counted by torch's FlopCounterMode over one call (matmuls, attention, convolutions),
model FLOPs only: with gradient checkpointing off. Each section's result, or its error, is
written to the JSON as soon as it is known, so a failure loses nothing measured before it.

    python benchmarks/gpu.py                                   # on a GPU (~4 min on an H100)
    python benchmarks/gpu.py --shape tiny --device cpu --repeats 1 --skip-embedded   # the same code, tiny (tests)

Writes benchmarks/results/gpu/<shape>_<device name>.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository on sys.path, sets the offline environment)
from common import RESULTS, log, set_group_advantages, write_json  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from async_flowgrpo.builders import build_learner  # noqa: E402
from async_flowgrpo.config import load_config  # noqa: E402
from async_flowgrpo.models.sd3 import SD3Adapter  # noqa: E402
from async_flowgrpo.sampling import rollout_sampling  # noqa: E402

# Dense bf16 peaks from the vendors' datasheets (TFLOP/s, SXM parts); MFU is also given against
# the matmul rate measured on the device, which is what a kernel can reach.
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}

# name -> (transformer, VAE block widths, CLIP-L and CLIP-G (hidden, layers, heads), T5 tokens, pixels)
SHAPES = {
    "sd35_medium": dict(
        transformer=dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                         attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                         caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                         dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        vae_channels=(128, 256, 512, 512), clip=((768, 12, 12), (1280, 32, 20)), t5_tokens=256, resolution=512,
    ),
    "tiny": dict(
        transformer=dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                         caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=16,
                         dual_attention_layers=(0,), qk_norm="rms_norm"),
        vae_channels=(32, 32, 32, 32), clip=((32, 1, 2), (32, 1, 2)), t5_tokens=4, resolution=64,
    ),
}
PROMPTS = ["a red circle left of a blue square", "two green triangles", "a yellow star above a purple circle",
           "three blue squares"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="sd35_medium")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=8, help="images per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (after one warm-up)")
    ap.add_argument("--skip-full", action="store_true", help="no full fine-tuning measurement")
    ap.add_argument("--autocast-ab", action="store_true", help="only: the LoRA policy with and without autocast, interleaved")
    ap.add_argument("--skip-embedded", action="store_true", help="no embedded-default loop")
    ap.add_argument("--embedded-steps", type=int, default=6, help="timed sync steps of the embedded default per device")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu/<shape>_<device>.json)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- model

def build_pipeline(shape: dict, device: torch.device):
    """A StableDiffusion3Pipeline of `shape` with random weights, built on `device` in fp32."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from async_flowgrpo.models.tiny import build_tokenizer

    vocab = tuple(sorted({w for p in PROMPTS for w in p.split()}))
    tokenizers = [build_tokenizer(vocab, 77) for _ in shape["clip"]]

    def clip(hidden, layers, heads):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizers[0]), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=77, projection_dim=hidden, hidden_act="gelu",
            pad_token_id=0, bos_token_id=2, eos_token_id=3))

    torch.manual_seed(0)
    blocks = len(shape["vae_channels"])
    with torch.device(device):
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**shape["transformer"]),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * blocks,
                              up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=shape["vae_channels"],
                              layers_per_block=2, latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609,
                              use_quant_conv=False, use_post_quant_conv=False),
            text_encoder=clip(*shape["clip"][0]), tokenizer=tokenizers[0],
            text_encoder_2=clip(*shape["clip"][1]), tokenizer_2=tokenizers[1],
            text_encoder_3=None, tokenizer_3=None,
        )
    return pipe


def make_adapter(args, shape: dict, device: torch.device) -> SD3Adapter:
    return SD3Adapter(build_pipeline(shape, device), max_sequence_length=shape["t5_tokens"],
                      resolution=shape["resolution"])


def bench_config(args, shape: dict, *overrides: str):
    """config/model/sd35_medium.yaml on this benchmark's batch (model.path only satisfies validation:
    the model itself is built in memory)."""
    return load_config("sync", [
        "config/model/sd35_medium.yaml", "model.path=embedded",
        f"rollout.groups_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}", f"rollout.resolution={shape['resolution']}", *overrides,
    ])


# ---------------------------------------------------------------- measuring

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> list[float]:
    """Seconds per call of fn(), `repeats` calls after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def count_flops(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def rate(flops: float, seconds: list[float], peaks: dict) -> dict:
    """Achieved TFLOP/s of the mean call and its share of each peak (MFU)."""
    achieved = flops / (sum(seconds) / len(seconds)) / 1e12
    return {"tflops": round(achieved, 1), **{f"mfu_vs_{k}": round(achieved / v, 3) for k, v in peaks.items() if v}}


def peak_memory_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def matmul_ceiling(device: torch.device) -> float | None:
    """bf16 TFLOP/s of an 8192^3 matmul on random data (mean of 10 after 3 warm-ups)."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return round(2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)


def random_rewards(groups, cfg) -> None:
    """Rewards that give every group a spread (the trainer's cost does not depend on their values)."""
    gen = torch.Generator().manual_seed(0)
    for g in groups:
        g.rewards = torch.rand(g.size, generator=gen)
    set_group_advantages(groups, cfg.algorithm)


# ---------------------------------------------------------------- sections

def section_rollout(args, shape, device, peaks, result, save):
    """Plain pipeline call, then our rollout, on the same model and batch; then the LoRA trainer."""
    from async_flowgrpo.gpu_monitor import GpuMonitor

    cfg = bench_config(args, shape)
    sampling = rollout_sampling(cfg.rollout)
    n = args.prompts * args.group_size
    prompts = PROMPTS[: args.prompts]

    reset_memory(device)
    adapter = make_adapter(args, shape, device)
    adapter.to(device, torch.bfloat16)  # config/model/sd35_medium.yaml's model.dtype
    # the pipeline takes given embeddings as they are (num_images_per_prompt repeats only prompts it encodes)
    enc = adapter.encode_prompts(prompts, cfg=True)
    embeds = [t.repeat_interleave(args.group_size, 0)
              for t in (enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled)]
    pipe = adapter.pipeline
    pipe.set_progress_bar_config(disable=True)

    def pipeline_call():
        return pipe(prompt_embeds=embeds[0], pooled_prompt_embeds=embeds[1], negative_prompt_embeds=embeds[2],
                    negative_pooled_prompt_embeds=embeds[3], num_inference_steps=sampling["num_steps"], guidance_scale=sampling["guidance_scale"],
                    height=shape["resolution"], width=shape["resolution"], output_type="np").images

    secs = timed(pipeline_call, device, args.repeats)
    flops = count_flops(pipeline_call)
    result["pipeline"] = {"images": n, "seconds": secs, "images_per_s": round(n / (sum(secs) / len(secs)), 3),
                          "flops_per_image": flops / n, **rate(flops, secs, peaks), "peak_memory_gb": peak_memory_gb(device)}
    log(f"plain diffusers pipeline: {result['pipeline']['images_per_s']} images/s, {result['pipeline']['tflops']} TFLOP/s")
    save()

    # our rollout: the trainer's policy (LoRA attached) generating, as a rollout actor does
    reset_memory(device)
    learner = build_learner(cfg, adapter=adapter)
    policy = learner.policy
    monitor = GpuMonitor(interval_s=0.2) if device.type == "cuda" else None
    if monitor is not None:
        monitor.start()
    groups = []

    def rollout():
        groups[:] = policy.generate(prompts, args.group_size, **sampling, seed=len(groups))

    secs = timed(rollout, device, args.repeats)
    if monitor is not None:
        result["gpu_monitor"] = monitor.read()
        monitor.stop()
    flops = count_flops(rollout)
    r = result["rollout"] = {"images": n, "seconds": secs, "images_per_s": round(n / (sum(secs) / len(secs)), 3),
                             "flops_per_image": flops / n, **rate(flops, secs, peaks),
                             "peak_memory_gb": peak_memory_gb(device)}
    r["vs_pipeline"] = round(r["images_per_s"] / result["pipeline"]["images_per_s"], 3)
    log(f"rollout (LoRA attached): {r['images_per_s']} images/s = {r['vs_pipeline']} x the pipeline; "
        f"monitor {result.get('gpu_monitor')}")
    policy.adapter.transformer.disable_adapters()  # what the adapters cost, apart from our sampling loop
    secs = timed(rollout, device, args.repeats)
    policy.adapter.transformer.enable_adapters()
    result["rollout_adapters_off"] = {"seconds": secs, "images_per_s": round(n / (sum(secs) / len(secs)), 3)}
    log(f"rollout, adapters off: {result['rollout_adapters_off']['images_per_s']} images/s")
    save()

    random_rewards(groups, cfg)
    transformer = policy.adapter.transformer
    # micro-batch 4 with checkpointing (for GPUs under 80 GB), 4 without, 16 without (the config's)
    model_flops = None
    for checkpointing, micro in ((True, 4), (False, 4), (False, 16)):
        key = f"train_lora_micro{micro}" + ("_checkpointing" if checkpointing else "")
        try:
            if checkpointing:
                transformer.enable_gradient_checkpointing()
            else:
                transformer.disable_gradient_checkpointing()
            learner.micro_batch_size = micro
            result[key] = measure_train(args, learner, groups, device, peaks, model_flops)
            model_flops = result[key]["model_flops_per_step"]
            log(f"{key}: {result[key]['images_per_s']} trained images/s, {result[key].get('tflops')} TFLOP/s, "
                f"peak {result[key]['peak_memory_gb']} GB")
        except torch.OutOfMemoryError as e:
            result[key] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        save()

    section_engine(learner, device, result, save)
    del learner, policy, adapter, pipe, enc, embeds, groups
    return result


def section_autocast_ab(args, shape, device, result, save):
    """The LoRA policy with and without autocast, interleaved on one model: rollout and train step
    (micro-batch 4, no checkpointing) seconds per call."""
    cfg = bench_config(args, shape)
    sampling = rollout_sampling(cfg.rollout)
    learner = build_learner(cfg, adapter=make_adapter(args, shape, device))
    policy = learner.policy
    policy.adapter.transformer.disable_gradient_checkpointing()
    learner.micro_batch_size = 4
    prompts = PROMPTS[: args.prompts]
    groups = policy.generate(prompts, args.group_size, **sampling, seed=0)
    random_rewards(groups, cfg)
    out, on = {}, policy.autocast_dtype
    for rep in range(args.repeats):
        for autocast in (on, None):
            policy.autocast_dtype = autocast
            row = out.setdefault(str(autocast), {"rollout_s": [], "train_s": []})
            row["rollout_s"] += timed(lambda: policy.generate(prompts, args.group_size, **sampling, seed=1), device, 1)
            row["train_s"] += timed(lambda: learner.train_step(groups, version=0), device, 1)
    policy.autocast_dtype = on
    result["autocast_ab"] = out
    log(f"autocast A/B: {out}")
    save()


def measure_train(args, learner, groups, device, peaks, model_flops: float | None) -> dict:
    """Seconds per train_step on `groups`; model FLOPs counted with checkpointing off (counted here
    when model_flops is None, by switching it off for the one counted step)."""
    n = sum(g.size for g in groups)
    reset_memory(device)
    secs = timed(lambda: learner.train_step(groups, version=0), device, args.repeats)
    out = {"images": n, "seconds": secs, "images_per_s": round(n / (sum(secs) / len(secs)), 3),
           "peak_memory_gb": peak_memory_gb(device)}
    if model_flops is None:
        transformer = learner.policy.adapter.transformer
        was = transformer.is_gradient_checkpointing
        transformer.disable_gradient_checkpointing()
        model_flops = count_flops(lambda: learner.train_step(groups, version=0))
        if was:
            transformer.enable_gradient_checkpointing()
    out.update(model_flops_per_step=model_flops, model_flops_per_image=model_flops / n, **rate(model_flops, secs, peaks))
    return out


def section_engine(learner, device, result, save):
    """The checkpoint engine on this device: bucket packing and unpacking of the trainable state
    (bit for bit), and a send over a one-rank group (NCCL on a GPU)."""
    from async_flowgrpo.sync.buckets import pack_bucket, plan, unpack
    from async_flowgrpo.sync.engine import WeightSender

    state = learner.policy.trainable_state()
    layout = plan(state, 64 * 2**20)
    tensors = list(state.values())
    sync(device)
    t0 = time.perf_counter()
    buffers = [pack_bucket(tensors, layout, k, torch.empty(size, dtype=torch.uint8, device=device))
               for k, size in enumerate(layout.bucket_sizes)]
    back = unpack(buffers, layout)
    sync(device)
    pack_s = time.perf_counter() - t0
    exact = all(torch.equal(back[k], v) for k, v in state.items())
    out = {"tensors": len(state), "bytes": layout.nbytes, "buckets": len(layout.bucket_sizes),
           "pack_unpack_s": round(pack_s, 4), "bit_exact": exact, "buffer_device": str(buffers[0].device)}
    sender = WeightSender(device=str(device))
    try:
        sender.connect(sender.new_address(), world_size=1)
        sender.send(state, version=0)  # warm-up: buffers, communicator
        stats = sender.send(state, version=1).stats
        out.update(backend=sender.group.pg.name(), send_s=round(stats.seconds, 4),
                   send_gb_per_s=round(stats.bytes / stats.seconds / 1e9, 2))
    finally:
        sender.close()
    result["engine"] = out
    log(f"checkpoint engine: {out}")
    save()


def section_full(args, shape, device, peaks, result, save):
    """Full fine-tuning: fp32 master weights (and optimizer state), bf16 compute under autocast."""
    cfg = bench_config(args, shape, "model.lora_rank=0", "algorithm.beta=0", "trainer.lr=1e-5",
                       "trainer.micro_batch_size=4", "model.gradient_checkpointing=true")
    reset_memory(device)
    learner = build_learner(cfg, adapter=make_adapter(args, shape, device))
    policy = learner.policy
    groups = policy.generate(PROMPTS[: args.prompts], args.group_size, **rollout_sampling(cfg.rollout), seed=0)
    random_rewards(groups, cfg)
    before = {k: v.clone() for k, v in list(policy.trainable_state().items())[:4]}
    try:
        out = measure_train(args, learner, groups, device, peaks, model_flops=None)
        out["master_dtype"] = str(next(iter(policy.trainable_state().values())).dtype)
        out["autocast_dtype"] = str(policy.autocast_dtype)
        out["weights_changed"] = any(not torch.equal(v, policy.trainable_state()[k]) for k, v in before.items())
    except torch.OutOfMemoryError as e:
        out = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    result["train_full"] = out
    log(f"train_full: {out.get('images_per_s')} trained images/s, {out.get('tflops')} TFLOP/s, "
        f"peak {out.get('peak_memory_gb')} GB {out.get('error', '')}")
    save()
    del learner, policy, groups


def section_embedded(args, device, result, save):
    """The embedded default (its config, its shapes reward) as a sync loop in one process."""
    from async_flowgrpo.prompts import load_prompts
    from async_flowgrpo.rewards import CombinedReward

    out = {}
    for dev in dict.fromkeys([device.type, "cpu"]):
        cfg = load_config("sync", [])
        threads = torch.get_num_threads()
        if dev == "cpu":
            torch.set_num_threads(2)  # the 2-core machines every other number in the README comes from
        try:
            out[dev] = embedded_loop(cfg, torch.device(dev), args.embedded_steps, load_prompts, CombinedReward)
        finally:
            torch.set_num_threads(threads)
        log(f"embedded default, sync loop on {dev}: {out[dev]['samples_per_s']} samples/s")
    result["embedded"] = out
    save()


def embedded_loop(cfg, device: torch.device, steps: int, load_prompts, CombinedReward) -> dict:
    import async_flowgrpo.builders as builders

    real_cuda = torch.cuda.is_available
    if device.type == "cpu":
        torch.cuda.is_available = lambda: False  # build_learner places by availability
    try:
        learner = builders.build_learner(cfg)
    finally:
        torch.cuda.is_available = real_cuda
    r = cfg.rollout
    rows = load_prompts(r.prompts)[: r.groups_per_step]
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    sampling = rollout_sampling(r)
    times = []
    for step in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        groups = learner.policy.generate([p.text for p in rows], r.group_size, **sampling, seed=step,
                                         metadata=[p.metadata for p in rows])
        for g, p in zip(groups, rows):
            g.rewards = reward(g.images, [p.text] * g.size, [p.metadata] * g.size)[0]
        set_group_advantages(groups, cfg.algorithm)
        learner.train_step(groups, version=step)
        sync(device)
        if step:  # step 0 is the warm-up
            times.append(time.perf_counter() - t0)
    n = r.groups_per_step * r.group_size
    return {"samples_per_step": n, "steps": steps, "seconds_per_step": [round(t, 3) for t in times],
            "samples_per_s": round(n * len(times) / sum(times), 2), "device": str(learner.policy.device)}


# ---------------------------------------------------------------- main

def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_gb=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                    cuda=torch.version.cuda)
    return info


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    info = device_info(device)
    name = info.get("name", device.type).replace(" ", "_")
    path = args.out or os.path.join(RESULTS, "gpu", f"{args.shape}_{name}.json")
    result = {"shape": args.shape, "machine": info, "batch": {"prompts": args.prompts, "group_size": args.group_size},
              "repeats": args.repeats, "errors": {}}

    def save():
        write_json(path, result)

    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in info.get("name", "")), None)
    result["matmul_bf16_tflops"] = matmul_ceiling(device)
    peaks = {"datasheet": datasheet, "measured_matmul": result["matmul_bf16_tflops"]}
    log(f"{info}; bf16 matmul {result['matmul_bf16_tflops']} TFLOP/s (datasheet {datasheet})")
    sections = [("rollout_and_lora", lambda: section_rollout(args, shape, device, peaks, result, save))]
    if args.autocast_ab:
        sections = [("autocast_ab", lambda: section_autocast_ab(args, shape, device, result, save))]
    if not args.skip_full and not args.autocast_ab:
        sections.append(("full", lambda: section_full(args, shape, device, peaks, result, save)))
    if not args.skip_embedded and not args.autocast_ab:
        sections.append(("embedded", lambda: section_embedded(args, device, result, save)))
    for key, run in sections:
        t0 = time.perf_counter()
        try:
            run()
        except Exception as e:  # noqa: BLE001  (a smoke test: record what broke, go on to the next section)
            result["errors"][key] = traceback.format_exc(limit=8)
            log(f"section {key} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        result.setdefault("section_seconds", {})[key] = round(time.perf_counter() - t0, 1)
        reset_memory(device)
        save()
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
