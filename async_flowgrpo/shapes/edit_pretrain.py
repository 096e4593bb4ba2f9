"""Pretrain the embedded edit model (a tiny FLUX.1 Kontext: Flux architecture, the source image's
tokens joined to the sequence) on procedural edit pairs.

    python -m async_flowgrpo.shapes.edit_pretrain --out async_flowgrpo/assets/shapes_edit [--steps 6000]

The shipped model is its 6,000-step default: 28.6 CPU minutes, held-out edit accuracy 0.625 by its
own evaluation (1,000 steps: 0.153; 3,000: 0.472).

On CPU, one torch thread by default (see shapes/pretrain.py for why). Stages:
 1. draw a pool of (source, instruction, target) pairs from the *train* instructions
    (`edit_scenes.split_edits`; held-out instructions are never drawn);
 2. reuse the shipped shapes model's trained VAE (32x32x3 <-> 16x16x4, frozen) and encode every
    source and target once (posterior mean, normalised as FluxKontextPipeline does);
 3. train the transformer and both text encoders with the rectified-flow objective on the target
    (x_t = (1 - s) x0 + s eps, target eps - x0, s ~ logit-normal), the source tokens appended after
    the noisy tokens with position ids (1, row, col) exactly as `FluxKontextAdapter._forward` runs
    it; instructions dropped to "" 10% of the time so classifier-free guidance works; EMA weights;
 4. save the EMA weights (transformer in fp16) as a FluxKontextPipeline directory.
Every --eval-every steps it logs the edit accuracy of the EMA weights on held-out instructions.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time

import numpy as np
import torch

from ..checkpoint import output_dir_arg
from ..models.common import pack_latents
from ..models.tiny import save_tiny
from ..models.tiny_flux import TinyFluxSpec
from ..models.tiny_kontext import build_tiny_kontext
from .edit_scenes import instruction, render_pair, split_edits, vocabulary
from .pretrain import Progress, cpu, log, lr_at, update_with_ema

SHAPES_VAE = os.path.join(os.path.dirname(__file__), "..", "assets", "shapes_sd3", "vae")
OUT = os.path.join(os.path.dirname(__file__), "..", "assets", "shapes_edit")


def edit_spec(seed: int) -> TinyFluxSpec:
    return TinyFluxSpec(vocab=vocabulary(), resolution=32, clip_hidden=32, clip_max_length=10, t5_hidden=32,
                        t5_max_length=10, vae_channels=(16, 32), latent_channels=4, layers=3, single_layers=2,
                        heads=4, head_dim=16, axes_dims_rope=(4, 6, 6), guidance_embeds=False, seed=seed)


def make_pairs(n: int, seed: int, res: int = 32) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    train, _ = split_edits()
    rng = random.Random(seed)
    src = np.empty((n, res, res, 3), dtype=np.uint8)
    tgt = np.empty_like(src)
    texts = []
    for i in range(n):
        edit = rng.choice(train)
        src[i], tgt[i] = render_pair(edit, rng, res)
        texts.append(instruction(edit))
    to_t = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)  # noqa: E731
    return to_t(src), to_t(tgt), texts


@torch.no_grad()
def encode(vae, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Packed, normalised latent tokens [n, 64, 16] of images [n, 3, 32, 32] in [-1, 1]."""
    c = vae.config
    out = [pack_latents((vae.encode(x[i:i + batch]).latent_dist.mode() - c.shift_factor) * c.scaling_factor)
           for i in range(0, len(x), batch)]
    return torch.cat(out)


def forward(pipe, xt, src, sig, texts, ids):
    """The transformer on noisy target tokens with the source tokens joined (FluxKontextAdapter._forward's layout)."""
    embeds, pooled, _ = pipe.encode_prompt(prompt=texts, prompt_2=None, max_sequence_length=pipe.tokenizer_2.model_max_length)
    txt_ids = torch.zeros(embeds.shape[1], 3)
    out = pipe.transformer(hidden_states=torch.cat([xt, src], 1), timestep=sig, guidance=None, pooled_projections=pooled,
                           encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
    return out[:, :xt.shape[1]]


@torch.no_grad()
def held_out_accuracy(pipe, n_per_edit: int = 2, steps: int = 10, seed: int = 7) -> float:
    """Edit accuracy (shapes_edit reward's "correct") of ODE samples on held-out instructions, no CFG."""
    from .edit_reward import shapes_edit_reward

    _, held = split_edits()
    rng = random.Random(seed)
    pairs = [(e, render_pair(e, rng)) for e in held for _ in range(n_per_edit)]
    src = torch.stack([torch.from_numpy(s) for _, (s, _) in pairs])
    tokens = encode(pipe.vae, src.permute(0, 3, 1, 2).float().div(127.5).sub(1.0))
    texts = [instruction(e) for e, _ in pairs]
    ids = kontext_ids(pipe)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens.shape, generator=g)
    sig = torch.linspace(1, 0, steps + 1)
    for i in range(steps):
        v = forward(pipe, x, tokens, sig[i].expand(len(x)), texts, ids)
        x = x + (sig[i + 1] - sig[i]) * v
    c = pipe.vae.config
    from ..models.common import unpack_latents

    img = pipe.vae.decode(unpack_latents(x, 16, 16) / c.scaling_factor + c.shift_factor).sample
    img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    r = shapes_edit_reward(img, texts, [{"source_images": [s]} for s in src])
    return r["correct"].mean().item()


def kontext_ids(pipe) -> torch.Tensor:
    ids = pipe._prepare_latent_image_ids(None, 8, 8, "cpu", torch.float32)
    src_ids = ids.clone()
    src_ids[:, 0] = 1
    return torch.cat([ids, src_ids])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_dir_arg, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=12000)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--minutes", type=float, default=0.0, help="optional wall-clock cap on the training stage")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()

    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(SHAPES_VAE, torch_dtype=torch.float32).eval().requires_grad_(False)
    spec = edit_spec(args.seed)
    pipe = build_tiny_kontext(spec, vae=vae)
    pipe.set_progress_bar_config(disable=True)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    log(f"built tiny Kontext: transformer {n_params} parameters")
    src, tgt, texts = make_pairs(args.pool, args.seed)
    src_tok, tgt_tok = encode(vae, src), encode(vae, tgt)
    log(f"drew and encoded {len(texts)} pairs in {time.time() - t0:.0f}s; target token std {tgt_tok.std():.3f}")

    modules = torch.nn.ModuleList([pipe.transformer, pipe.text_encoder, pipe.text_encoder_2])
    ema = copy.deepcopy(modules).requires_grad_(False)
    opt = torch.optim.AdamW(modules.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    prog = Progress(args.steps, args.minutes * 60)
    rng = random.Random(args.seed)
    ids = kontext_ids(pipe)
    step, ema_loss = 0, None
    modules.train()
    while prog(step) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(prog(step), step, args.lr, warmup=100)
        idx = torch.randint(0, len(texts), (args.batch,), generator=gen)
        x0, cond = tgt_tok[idx], src_tok[idx]
        prompts = ["" if rng.random() < args.caption_dropout else texts[i] for i in idx.tolist()]
        sig = torch.sigmoid(torch.randn(args.batch, generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        s = sig.view(-1, 1, 1)
        pred = forward(pipe, (1 - s) * x0 + s * noise, cond, sig, prompts, ids)
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        update_with_ema(loss, opt, modules, ema, step)
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        step += 1
        if step % 50 == 0:
            log(f"step {step} progress {prog(step):.2f} loss {ema_loss:.4f} cpu {cpu():.0f}s")
        if args.eval_every and step % args.eval_every == 0:
            live = copy.deepcopy(modules.state_dict())
            modules.load_state_dict(ema.state_dict())
            modules.eval()
            log(f"held-out edit accuracy at step {step} (EMA, ODE, no CFG): {held_out_accuracy(pipe):.3f}")
            os.makedirs(args.out + ".snapshots", exist_ok=True)
            torch.save(ema.state_dict(), os.path.join(args.out + ".snapshots", f"ema{step}.pt"))
            modules.load_state_dict(live)
            modules.train()
    modules.load_state_dict(ema.state_dict())
    modules.eval()
    acc = held_out_accuracy(pipe)
    log(f"done: {step} steps, loss {ema_loss:.4f}, held-out accuracy {acc:.3f}, {cpu() / 60:.1f} CPU min")
    pipe.transformer.to(torch.float16)
    pipe.vae.to(torch.float16)
    save_tiny(pipe, args.out, "flux_kontext", spec, resolution=32, max_sequence_length=spec.t5_max_length,
              trained={"seed": args.seed, "steps": step, "pool": args.pool, "batch": args.batch, "lr": args.lr,
                       "held_out_accuracy": round(acc, 3), "cpu_minutes": round(cpu() / 60, 1),
                       "vae": "shapes_sd3's, frozen"})
    log(f"saved to {args.out}")


if __name__ == "__main__":
    main()
