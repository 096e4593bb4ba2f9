"""Evaluate a shapes model on a prompt set with the pixel reward (plain ODE sampling, fixed seeds).

    python -m async_flowgrpo.shapes.evaluate [--model async_flowgrpo/assets/shapes_sd3]
        [--prompts async_flowgrpo/assets/prompts/shapes_eval.jsonl] [--per-prompt 4]
        [--steps 20] [--cfg 4.5] [--seed 0] [--grid /tmp/shapes_base_grid.png]

Prints mean score, colour/shape/count/position accuracy and joint accuracy (all checks right),
overall and per prompt kind.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from .reward import shapes_reward, summarize
from .scenes import SceneSpec, read_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "assets", "shapes_sd3")
DEFAULT_PROMPTS = os.path.join(HERE, "..", "assets", "prompts", "shapes_eval.jsonl")


def load_pipeline(path: str = DEFAULT_MODEL):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def generate(pipe, prompts: list[str], per_prompt: int = 4, steps: int = 20, cfg: float = 4.5, seed: int = 0,
             batch: int = 64) -> torch.Tensor:
    """uint8 [len(prompts) * per_prompt, H, W, 3], prompt-major; image j of prompt i uses seed
    seed * 1_000_003 + i * per_prompt + j, so results do not depend on the batch size."""
    from ..models.common import read_model_settings

    settings = read_model_settings(pipe.config._name_or_path) if getattr(pipe.config, "_name_or_path", None) else {}
    res = settings.get("resolution", 32)
    msl = settings.get("max_sequence_length", 1)
    flat = [(p, seed * 1_000_003 + i * per_prompt + j) for i, p in enumerate(prompts) for j in range(per_prompt)]
    out = []
    for k in range(0, len(flat), batch):
        chunk = flat[k : k + batch]
        gens = [torch.Generator().manual_seed(s) for _, s in chunk]
        imgs = pipe([p for p, _ in chunk], num_inference_steps=steps, guidance_scale=cfg, height=res, width=res,
                    max_sequence_length=msl, output_type="pt", generator=gens).images
        out.append((imgs.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    return torch.cat(out)


def save_grid(images: torch.Tensor, path: str, cols: int = 4, scale: int = 4) -> None:
    from PIL import Image

    imgs = images.numpy()
    n = (len(imgs) // cols) * cols
    rows = [np.concatenate(list(imgs[r * cols : (r + 1) * cols]), 1) for r in range(n // cols)]
    g = np.concatenate(rows, 0)
    Image.fromarray(g).resize((g.shape[1] * scale, g.shape[0] * scale), Image.NEAREST).save(path)


def evaluate(pipe, rows: list[dict], per_prompt: int = 4, steps: int = 20, cfg: float = 4.5, seed: int = 0):
    prompts = [r["prompt"] for r in rows]
    images = generate(pipe, prompts, per_prompt, steps, cfg, seed)
    rep_prompts = [p for p in prompts for _ in range(per_prompt)]
    meta = [{"spec": r["spec"]} for r in rows for _ in range(per_prompt)]
    result = shapes_reward(images, rep_prompts, meta)
    kinds = [SceneSpec.from_dict(m["spec"]).kind for m in meta]
    summary = {"all": summarize(result, kinds)}
    for kind in dict.fromkeys(kinds):
        sel = torch.tensor([k == kind for k in kinds])
        summary[kind] = summarize({k: v[sel] for k, v in result.items()}, [kind] * int(sel.sum()))
    return summary, images, result


def position_given_objects(result: dict, rows: list[dict], per_prompt: int) -> float:
    """Among position-prompt images whose two objects are both drawn right (colour, shape, count),
    the fraction whose relation is right; 0.5 is chance."""
    kinds = torch.tensor([r["kind"] == "position" for r in rows for _ in range(per_prompt)])
    both = kinds & result["color_ok"].bool() & result["shape_ok"].bool() & result["count_ok"].bool()
    return result["position_ok"][both].float().mean().item() if both.any() else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--per-prompt", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grid", default=None, help="save a 4x4 PNG grid of the first 16 prompts' first samples")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    pipe = load_pipeline(args.model)
    rows = read_jsonl(args.prompts)
    summary, images, result = evaluate(pipe, rows, args.per_prompt, args.steps, args.cfg, args.seed)
    for kind, s in summary.items():
        print(f"{kind:9s} " + " ".join(f"{k} {v:.3f}" for k, v in s.items()))
    # the relation words' test: position right among images whose two objects are both drawn right
    relation = position_given_objects(result, rows, args.per_prompt)
    print(f"position right given both objects right: {relation:.3f} (chance 0.5)")
    print(json.dumps({"model": args.model, "prompts": args.prompts, "per_prompt": args.per_prompt,
                      "steps": args.steps, "cfg": args.cfg, "seed": args.seed, "n_images": len(images),
                      "seconds": round(time.time() - t0, 1), **summary["all"],
                      "count_prompts_joint_acc": summary.get("count", {}).get("joint_acc"),
                      "position_given_objects": relation}))
    if args.grid:
        # one sample for each of 16 prompts spread over the prompt set (all kinds)
        idx = np.linspace(0, len(rows) - 1, 16).round().astype(int) * args.per_prompt
        save_grid(images[torch.as_tensor(idx)], args.grid)
        print("grid:", args.grid, "prompts:", [rows[i // args.per_prompt]["prompt"] for i in idx])


if __name__ == "__main__":
    main()
