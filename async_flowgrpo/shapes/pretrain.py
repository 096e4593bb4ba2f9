"""Pretrain the embedded "shapes" text-to-image model (real SD3 architecture, tiny sizes).

    python -m async_flowgrpo.shapes.pretrain --out async_flowgrpo/assets/shapes_sd3 [--seed 0] [--minutes 10]

Stages (all on CPU; one torch thread by default):
 1. draw a pool of procedural scenes from the *train* prompt split (eval prompts are never drawn);
 2. train the AutoencoderKL (32x32x3 <-> 16x16x4) on them: MSE + small KL;
    set vae scaling_factor / shift_factor so that latents are ~zero-mean, unit-std;
 3. train the SD3Transformer2DModel and both CLIP text encoders with the rectified-flow objective
    (x_t = (1 - s) x0 + s eps, target eps - x0, s ~ logit-normal(0, 1) with the scheduler's shift),
    captions dropped to "" 10% of the time so classifier-free guidance works; EMA of the weights;
 4. save with `save_pipeline` (transformer + VAE in fp16, the tiny text encoders in fp32 so a plain
    `from_pretrained` yields a consistent fp32 pipeline under both diffusers and transformers v5).

Reproducibility: everything is seeded and, by default (--minutes 0), each stage runs a fixed
number of steps (--vae-steps, --steps), so a rerun with the same --threads gives the same weights.
The shipped model was made with `--minutes 0 --vae-steps 1500 --steps 12000 --threads 1`
(54 CPU-minutes). The log prints CPU seconds, which mean more than wall time on a shared machine.
--minutes M adds a wall-clock cap (stages split 20/75): the learning-rate schedule then follows
whichever of steps or time is further along, so `--minutes M` alone adds no steps (pass a large
--steps to let the clock decide), and the log states the steps actually run.

Resuming: the run saves its state (weights, EMA, optimizer, random streams) to OUT.state.pt every
--save-every transformer steps; rerunning the same command continues from it on the same step
schedule (bit-equality with an uninterrupted run is intended but not tested). Every --eval-every
steps it logs the gate on held-out prompts
(EMA weights, 2 samples each): all checks right, count prompts right, and position right given both
objects right, which is what tells whether the relation words are followed (the loss does not).

Threads: one by default. On a busy 2-core machine two OpenMP threads ran 10-20x *slower* than one
(barrier stalls whenever a thread is descheduled); pass --threads 2 only on an idle machine, where
it is about 1.7x faster than one.
The VAE trains on random 16x16 crops (it is convolutional; 4x cheaper, same result).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import time

import numpy as np
import torch

from ..checkpoint import output_dir_arg
from ..models.tiny_sd3 import TinySD3Spec, build_tiny_sd3, save_pipeline
from .reward import shapes_reward
from .scenes import KINDS, caption_to_spec, render, spec_to_caption, split_prompts, vocabulary

# fraction of training scenes per kind
KIND_WEIGHTS = {"single": 0.35, "count": 0.25, "position": 0.40}


def cpu() -> float:
    """CPU seconds used by this process so far (on a busy machine, wall time says little)."""
    return time.process_time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_pool(n: int, seed: int, res: int, kind_weights: dict[str, float] = KIND_WEIGHTS) -> tuple[torch.Tensor, list[str]]:
    """n procedurally drawn train scenes: images float [-1, 1] [n, 3, res, res] and captions."""
    train, _ = split_prompts()
    by_kind = {k: [s for s in train if s.kind == k] for k in KINDS}
    rng = random.Random(seed)
    kinds, weights = zip(*kind_weights.items())
    imgs = np.empty((n, res, res, 3), dtype=np.uint8)
    caps = []
    for i in range(n):
        spec = rng.choice(by_kind[rng.choices(kinds, weights)[0]])
        imgs[i] = render(spec, rng, res)
        caps.append(spec_to_caption(spec))
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    return x, caps


class Progress:
    """progress in [0, 1] = max(step / steps, elapsed / budget)."""

    def __init__(self, steps: int, budget_s: float):
        self.steps, self.budget_s, self.t0 = steps, budget_s, time.time()

    def __call__(self, step: int) -> float:
        p = step / max(self.steps, 1)
        if self.budget_s > 0:
            p = max(p, (time.time() - self.t0) / self.budget_s)
        return min(p, 1.0)


def lr_at(progress: float, step: int, base: float, warmup: int = 50, floor: float = 0.05) -> float:
    w = min(1.0, (step + 1) / warmup)
    return base * w * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def update_with_ema(loss: torch.Tensor, opt: torch.optim.Optimizer, modules: torch.nn.Module, ema: torch.nn.Module,
                    step: int) -> None:
    """One optimizer step on `loss` (gradient norm clipped at 1), then the EMA copy moves toward the
    weights with a decay that warms up to 0.998 (the early steps would otherwise freeze the EMA)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
    opt.step()
    decay = min(0.998, (1 + step) / (10 + step))
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), modules.parameters()):
            p_ema.lerp_(p, 1 - decay)


def train_vae(vae, x: torch.Tensor, steps: int, budget_s: float, batch: int, lr: float, kl_weight: float, gen,
              crop: int = 16) -> int:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    prog = Progress(steps, budget_s)
    vae.train()
    step, ema_loss = 0, None
    while prog(step) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(prog(step), step, lr)
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        xb = x[idx]
        if crop and crop < xb.shape[-1]:  # the VAE is convolutional: random crops cost 1/4 and suffice
            oy, ox = torch.randint(0, xb.shape[-1] - crop + 1, (2,), generator=gen).tolist()
            xb = xb[..., oy : oy + crop, ox : ox + crop]
        if torch.rand((), generator=gen) < 0.5:  # flips keep shapes and colours (triangles: horizontal only)
            xb = xb.flip(-1)
        post = vae.encode(xb).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        mse = torch.nn.functional.mse_loss(rec, xb)
        kl = post.kl().mean() / xb[0].numel()
        loss = mse + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        ema_loss = mse.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * mse.item()
        step += 1
        if step % 50 == 0:
            log(f"vae step {step} progress {prog(step):.2f} mse {ema_loss:.5f} kl {kl.item():.3f} cpu {cpu():.0f}s")
    log(f"vae done: {step} steps, mse {ema_loss:.5f}")
    vae.eval()
    return step


@torch.no_grad()
def encode_pool(vae, x: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for i in range(0, len(x), batch):
        post = vae.encode(x[i : i + batch]).latent_dist
        means.append(post.mean)
        stds.append(post.std)
    return torch.cat(means), torch.cat(stds)


def save_state(path: str, state: dict) -> None:
    """Atomically write a resumable training state (tensors, numbers and strings only: it is read
    back with weights_only=True, so a state file cannot run code)."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=True)


@torch.no_grad()
def gate(pipe, rows: list[dict], per_prompt: int = 2) -> dict[str, float]:
    """The base-model gate on held-out prompts, cheaply (2 samples each): all checks right, count
    prompts right, and position right given both objects right (the relation words' test)."""
    from .evaluate import evaluate, position_given_objects

    summary, _, result = evaluate(pipe, rows, per_prompt=per_prompt)
    return {"all": summary["all"]["joint_acc"], "count": summary.get("count", {}).get("joint_acc", float("nan")),
            "position_given_objects": position_given_objects(result, rows, per_prompt)}


def train_dit(pipe, mean, std, caps, steps, budget_s, batch, lr, drop, shift, gen, state_path: str = "",
              save_every: int = 500, eval_rows: list[dict] | None = None, eval_every: int = 0) -> tuple[int, dict]:
    tr, te1, te2 = pipe.transformer, pipe.text_encoder, pipe.text_encoder_2
    modules = torch.nn.ModuleList([tr, te1, te2])
    ema = copy.deepcopy(modules).requires_grad_(False)
    opt = torch.optim.AdamW(modules.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    prog = Progress(steps, budget_s)
    modules.train()
    sf, shf = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    step, ema_loss, cpu0 = 0, None, 0.0
    saved = load_state(state_path) if state_path else None
    if saved is not None and "dit_step" in saved:
        modules.load_state_dict(saved["modules"])
        ema.load_state_dict(saved["ema"])
        opt.load_state_dict(saved["opt"])
        gen.set_state(saved["gen"])
        rng.seed(int(saved["rng_seed"]))
        step, ema_loss, cpu0 = int(saved["dit_step"]), float(saved["ema_loss"]), float(saved["cpu_s"])
        log(f"resumed the transformer stage at step {step} ({cpu0:.0f} CPU s before this process)")
    while prog(step) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(prog(step), step, lr, warmup=100)
        idx = torch.randint(0, len(mean), (batch,), generator=gen)
        x0 = (mean[idx] - shf) * sf  # posterior mean: the VAE is near-deterministic (small KL)
        prompts = ["" if rng.random() < drop else caps[i] for i in idx.tolist()]
        sig = torch.sigmoid(torch.randn(batch, generator=gen))
        sig = shift * sig / (1 + (shift - 1) * sig)
        noise = torch.randn(x0.shape, generator=gen)
        s = sig.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pe, _, pp, _ = pipe.encode_prompt(prompts, prompts, None, do_classifier_free_guidance=False, max_sequence_length=1)
        pred = tr(hidden_states=xt, encoder_hidden_states=pe, pooled_projections=pp, timestep=sig * 1000).sample
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        update_with_ema(loss, opt, modules, ema, step)
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        step += 1
        if step % 50 == 0:
            log(f"dit step {step} progress {prog(step):.2f} loss {ema_loss:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"cpu {cpu0 + cpu():.0f}s")
        if eval_every and eval_rows and step % eval_every == 0:
            live = copy.deepcopy(modules.state_dict())
            modules.load_state_dict(ema.state_dict())
            modules.eval()
            g = gate(pipe, eval_rows)
            modules.load_state_dict(live)
            modules.train()
            log(f"gate at step {step} (EMA, held-out x2): all {g['all']:.3f} count {g['count']:.3f} "
                f"position|objects {g['position_given_objects']:.3f}")
            if state_path:  # the EMA weights at each gate, to pick a base with room for RL
                save_state(f"{state_path}.ema{step}", ema.state_dict())
        if state_path and step % save_every == 0:
            # a fresh python-rng seed drawn from the torch generator keeps the resumed stream deterministic
            rng_seed = int(torch.randint(0, 2**31, (1,), generator=gen))
            rng.seed(rng_seed)
            save_state(state_path, {"vae": pipe.vae.state_dict(), "modules": modules.state_dict(),
                                    "ema": ema.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                                    "rng_seed": rng_seed, "dit_step": step, "ema_loss": ema_loss,
                                    "cpu_s": cpu0 + cpu()})
    with torch.no_grad():
        for pe_, pm in zip(ema.parameters(), modules.parameters()):
            pm.copy_(pe_)
    modules.eval()
    log(f"dit done: {step} steps, loss {ema_loss:.4f}, {cpu0 + cpu():.0f} CPU s in this stage and before")
    return step, {"dit_loss": ema_loss, "cpu_minutes": round((cpu0 + cpu()) / 60, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_dir_arg, default=os.path.join(os.path.dirname(__file__), "..", "assets", "shapes_sd3"))
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="optional wall-clock cap (stages split 20/75); 0 = fixed steps only (reproducible)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=16000, help="procedural images drawn once")
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=4990)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-crop", type=int, default=16, help="VAE trains on random crops of this side")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-3)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--mix", default=",".join(f"{v:g}" for v in KIND_WEIGHTS.values()),
                    help="weights of single,count,position scenes in the training pool")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is far faster on a shared machine (OpenMP barriers stall)")
    ap.add_argument("--state", default="", help="resumable training state (default: OUT.state.pt); a rerun of the "
                    "same command continues from it")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing state file and start over")
    ap.add_argument("--save-every", type=int, default=250, help="transformer steps between state saves")
    ap.add_argument("--eval-every", type=int, default=1000,
                    help="transformer steps between gate checks of the EMA weights on held-out prompts (0: never)")
    ap.add_argument("--export-ema", type=int, default=0, metavar="STEP",
                    help="write the run's EMA snapshot of gate step STEP to --out instead of training")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    budget = args.minutes * 60

    spec = TinySD3Spec(vocab=vocabulary(), seed=args.seed)
    pipe = build_tiny_sd3(spec)
    pipe.set_progress_bar_config(disable=True)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in
                [("transformer", pipe.transformer), ("vae", pipe.vae), ("text_encoder", pipe.text_encoder)]}
    log(f"built tiny SD3 {n_params}; seed {args.seed}, budget {args.minutes} min")

    mix = dict(zip(KINDS, (float(v) for v in args.mix.split(","))))
    x, caps = make_pool(args.pool, args.seed, spec.resolution, mix)
    assert all(caption_to_spec(c) for c in caps[:10])
    log(f"drew {len(x)} scenes in {time.time() - t0:.1f}s")

    state_path = args.state or args.out.rstrip("/") + ".state.pt"
    saved = load_state(state_path) if not args.fresh else None
    if saved is not None:  # the VAE stage is done; the transformer stage resumes inside train_dit
        pipe.vae.load_state_dict(saved["vae"])
        gen.set_state(saved["gen"])
        vae_steps = int(saved.get("vae_steps", args.vae_steps))  # the transformer stage's saves omit it
        log(f"resuming from {state_path}: VAE stage done ({vae_steps} steps)")
    else:
        vae_steps = train_vae(pipe.vae, x, args.vae_steps, 0.2 * budget, args.vae_batch, args.vae_lr, args.kl_weight,
                              gen, args.vae_crop)
        save_state(state_path, {"vae": pipe.vae.state_dict(), "vae_steps": vae_steps, "gen": gen.get_state()})
    mean, std = encode_pool(pipe.vae, x)
    shift_f, scale_f = mean.mean().item(), 1.0 / mean.std().item()
    pipe.vae.register_to_config(scaling_factor=scale_f, shift_factor=shift_f)
    log(f"latents: mean {shift_f:.3f} std {1 / scale_f:.3f} posterior std {std.mean().item():.4f}")
    with torch.no_grad():  # how well the checker reads VAE reconstructions (the ceiling for the model)
        rec = pipe.vae.decode(mean[:256]).sample.add(1).mul(127.5).round().clamp(0, 255).to(torch.uint8)
        r = shapes_reward(rec.permute(0, 2, 3, 1), caps[:256])
    log(f"vae reconstructions: reward {r['score'].mean():.3f} all-correct {r['correct'].mean():.3f}")

    remaining = max(budget - (time.time() - t0) - 10, 30) if budget > 0 else 0
    eval_rows = [{"prompt": spec_to_caption(s), "kind": s.kind, "spec": s.to_dict()} for s in split_prompts()[1]]
    if args.export_ema:  # a gate snapshot of a run (its EMA weights at that step) as a model directory
        snapshot = f"{state_path}.ema{args.export_ema}"
        if saved is None or not os.path.exists(snapshot):
            raise SystemExit(f"--export-ema {args.export_ema}: no {snapshot} beside the state {state_path}")
        torch.nn.ModuleList([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]).load_state_dict(
            load_state(snapshot))
        # the learning-rate schedule ran over --steps: pass the run's --steps to reproduce the snapshot
        dit_steps, stats = args.export_ema, {"exported_from": os.path.basename(snapshot), "schedule_steps": args.steps}
    else:
        dit_steps, stats = train_dit(pipe, mean, std, caps, args.steps, remaining, args.batch, args.lr,
                                     args.caption_dropout, spec.shift, gen, state_path, args.save_every,
                                     eval_rows, args.eval_every)

    pipe.transformer.to(torch.float16)
    pipe.vae.to(torch.float16)
    os.makedirs(args.out, exist_ok=True)
    save_pipeline(pipe, args.out, spec, trained={
        "seed": args.seed, "vae_steps": vae_steps, "steps": dit_steps, "pool": args.pool,
        "batch": args.batch, "vae_batch": args.vae_batch, "lr": args.lr, "mix": mix, "minutes": round((time.time() - t0) / 60, 2), **stats,
    }, sampling={"num_inference_steps": 20, "guidance_scale": 4.5})
    log(f"saved to {args.out} after {(time.time() - t0) / 60:.1f} min "
        f"(same steps without the clock: --minutes 0 --seed {args.seed} --vae-steps {vae_steps} --steps {dit_steps})")


if __name__ == "__main__":
    main()
