#!/usr/bin/env python
"""RL probe: what the FlowGRPO update learns on the embedded model, in one process (no Ray).

The target of eval/accuracy +0.15 within the 10-minute default run is not met; this is how
we measure why. It runs the synchronous update (the trainers' Learner, policy.generate, group
advantages) on a chosen slice of the training prompts and evaluates, at the start, every
--eval-every steps and at the end, on the held-out prompts and on 64 fixed training prompts
(the launcher's evaluation: ODE sampling, fixed seeds, eval.* settings).

    python benchmarks/rl_probe.py                           # the embedded default's prompt mix, 100 steps
    python benchmarks/rl_probe.py --kinds count --steps 40 trainer.lr=1e-3
    python benchmarks/rl_probe.py --prompt "a red circle left of a green triangle" --steps 25 \\
        rollout.group_size=16 rollout.groups_per_step=2 trainer.lr=1e-3
    python benchmarks/rl_probe.py --reward side --steps 60 trainer.lr=1e-3

Rewards: "shapes" (the launcher's; accuracy = all checks right) or "side": colour mass on the
left half of the image for prompts whose first colour is red, green or blue, on the right half
otherwise. "side" is a one-bit rule conditioned on the prompt and shared by every prompt, which
no base model knows (chance 0.5): it tells whether the update can learn a prompt-conditioned
behaviour that carries over to held-out prompts, which is what a rise in held-out accuracy needs.
"left" is its control: every prompt asks for the left half, a change that ignores the prompt.

Overrides are key=value config keys (config/base.yaml and config/sync.yaml apply). One torch
thread by default, so two probes can run side by side on 2 cores. Writes
benchmarks/results/rl_probe/<name>.json (every evaluation and the training curve).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository on sys.path, sets the offline environment)
from common import RESULTS, argument_parser, log, set_group_advantages  # noqa: E402

import torch  # noqa: E402

from async_flowgrpo.evaluation import evaluate_policy  # noqa: E402
from async_flowgrpo.prompts import load_prompts  # noqa: E402
from async_flowgrpo.rewards import CombinedReward, register_reward  # noqa: E402
from async_flowgrpo.sampling import rollout_sampling  # noqa: E402
from async_flowgrpo.shapes.scenes import COLORS  # noqa: E402
from async_flowgrpo.builders import build_learner  # noqa: E402

LEFT_COLORS = ("red", "green", "blue")


@register_reward("side")
def side_reward(images: torch.Tensor, prompts: list[str], metadata: list[dict], left_colors=LEFT_COLORS) -> dict:
    """score = how far the colour mass's centre is toward the asked side (0..1); correct = past the middle."""
    x = images.float()
    column_mass = (x.max(-1).values - x.min(-1).values).sum(1)  # chroma per column: white and grey weigh 0
    where = torch.linspace(0, 1, column_mass.shape[1])
    centre = (column_mass * where).sum(1) / column_mass.sum(1).clamp_min(1e-6)  # 0 = left edge
    wants_left = torch.tensor([m["spec"]["objects"][0]["color"] in left_colors for m in metadata])
    score = torch.where(wants_left, 1 - centre, centre)
    return {"score": score, "correct": (score > 0.5).float()}


@register_reward("left")
def left_reward(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict:
    """The control for "side": every prompt asks for the left half (a change that ignores the prompt)."""
    return side_reward(images, prompts, metadata, left_colors=COLORS)


def parse_args(argv):
    ap = argument_parser(__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50, help="0 = start and end only")
    ap.add_argument("--reward", choices=("shapes", "side", "left"), default="shapes")
    ap.add_argument("--kinds", default=None, help="train on these prompt kinds only, equally weighted (e.g. count)")
    ap.add_argument("--prompt", default=None, help="train on this one training prompt")
    ap.add_argument("--model", default="embedded", help="model.path (default: the shipped shapes model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--also-eval-guidance", type=float, default=None,
                    help="also evaluate the held-out prompts at this guidance scale (e.g. 4.5 for a CFG-free run)")
    ap.add_argument("--name", default="probe", help="results file name")
    ap.add_argument("--out", default=os.path.join(RESULTS, "rl_probe"))
    ap.add_argument("overrides", nargs="*", help="config key=value")
    return ap.parse_args(argv)


def training_prompts(cfg, kinds: str | None, prompt: str | None):
    """(prompts by kind, kind weights): --prompt, else --kinds, else rollout.prompt_mix, else all."""
    rows = load_prompts(cfg.rollout.prompts)
    if prompt is not None:
        rows = [p for p in rows if p.text == prompt]
        if not rows:
            raise SystemExit(f"--prompt {prompt!r} is not a training prompt of {cfg.rollout.prompts}")
    by_kind: dict[str, list] = {}
    for p in rows:
        by_kind.setdefault(p.metadata.get("kind", "all"), []).append(p)
    if prompt is not None:
        return by_kind, {k: 1.0 for k in by_kind}
    weights = {k: 1.0 for k in kinds.split(",")} if kinds else (cfg.rollout.prompt_mix or {k: 1.0 for k in by_kind})
    missing = sorted(set(weights) - set(by_kind))
    if missing:
        raise SystemExit(f"no training prompts of kind {', '.join(missing)} (kinds: {', '.join(sorted(by_kind))})")
    return by_kind, weights


def generate_with_sampling_weights(learner, prompts, group_size, sampling, *, seed, version, metadata):
    """What a rollout actor does: sample with the weights the trainer publishes (DiffusionNFT's
    old copy; Flow-GRPO's trained weights) stamped with their version, then restore the trained ones."""
    policy = learner.policy
    trained = {k: v.clone() for k, v in policy.trainable_state().items()}
    policy.load_trainable_state(learner.sampling_state())
    try:
        return policy.generate(prompts, group_size, **sampling, seed=seed, version_fn=lambda: version, metadata=metadata)
    finally:
        policy.load_trainable_state(trained)


def evaluate(policy, cfg, train_probe_path: str, other_guidance: float | None = None) -> dict:
    held_out = evaluate_policy(policy, cfg)["metrics"]
    train = evaluate_policy(policy, replace(cfg, eval=replace(cfg.eval, prompts=train_probe_path)))["metrics"]
    out = {"held_out": _accuracies(held_out), "train": _accuracies(train)}
    if other_guidance is not None and other_guidance != cfg.eval.guidance_scale:
        other = evaluate_policy(policy, replace(cfg, eval=replace(cfg.eval, guidance_scale=other_guidance)))["metrics"]
        out[f"held_out_guidance_{other_guidance:g}"] = _accuracies(other)
    return out


def _accuracies(metrics: dict) -> dict:
    return {k.removeprefix("eval/"): round(v, 4) for k, v in metrics.items() if k != "eval/time_s"}


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = [f"model.path={args.model}", f"reward.weights={{{args.reward}: 1.0}}", *args.overrides]
    cfg = common.load_mode_config("sync", overrides)
    with tempfile.TemporaryDirectory(prefix="rl_probe_") as workdir:
        return run(args, cfg, os.path.join(workdir, "train_probe.jsonl"))


def run(args, cfg, probe_path: str) -> dict:
    r, a = cfg.rollout, cfg.algorithm
    by_kind, weights = training_prompts(cfg, args.kinds, args.prompt)
    kinds, kind_weights = list(weights), list(weights.values())
    rng = random.Random(r.seed)

    # 64 fixed training prompts (drawn by the same weights) to tell learning from generalising
    probe_rng = random.Random(1)
    probe = [probe_rng.choice(by_kind[probe_rng.choices(kinds, kind_weights)[0]]) for _ in range(64)]
    with open(probe_path, "w") as f:
        f.writelines(json.dumps({"prompt": p.text, **p.metadata}) + "\n" for p in probe)

    learner = build_learner(cfg)
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    sampling = rollout_sampling(r)
    log(f"rl_probe {args.name}: {a.name}, reward {args.reward} {cfg.reward.options}, kinds {weights}, "
        f"{r.groups_per_step} x {r.group_size} samples a step, lr {cfg.trainer.lr}, lora_rank {cfg.model.lora_rank}, "
        f"window {sampling['window_size']} in {sampling['window_range']}, shared noise {r.shared_initial_noise}, "
        f"guidance {r.guidance_scale} (eval {cfg.eval.guidance_scale})")
    t0 = time.perf_counter()
    evals = [{"step": 0, **evaluate(learner.policy, cfg, probe_path, args.also_eval_guidance)}]
    log(f"step 0: {evals[-1]}")
    curve = []
    for step in range(1, args.steps + 1):
        batch = [rng.choice(by_kind[rng.choices(kinds, kind_weights)[0]]) for _ in range(r.groups_per_step)]
        groups = generate_with_sampling_weights(learner, [p.text for p in batch], r.group_size, sampling,
                                                seed=r.seed * 1_000_003 + step, version=step - 1,
                                                metadata=[p.metadata for p in batch])
        corrects = []
        for g, p in zip(groups, batch):
            score, components = reward(g.images, [p.text] * g.size, [p.metadata] * g.size)
            g.rewards = score
            corrects.append(components.get("correct", torch.zeros(g.size)))
        rewards = set_group_advantages(groups, a)
        learner.train_step(groups, version=step - 1)
        curve.append({"step": step, "reward": rewards.mean().item(), "correct": torch.cat(corrects).mean().item()})
        if step % 10 == 0:
            last = curve[-10:]
            log(f"step {step}: reward {sum(c['reward'] for c in last) / 10:.3f} "
                f"correct {sum(c['correct'] for c in last) / 10:.3f} ({time.perf_counter() - t0:.0f} s)")
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            evals.append({"step": step, **evaluate(learner.policy, cfg, probe_path, args.also_eval_guidance)})
            log(f"step {step}: {evals[-1]}")

    result = {"name": args.name, "overrides": args.overrides, "reward": args.reward, "kinds": weights, "prompt": args.prompt,
              "seconds": round(time.perf_counter() - t0, 1), "evals": evals, "curve": curve}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"held-out accuracy {evals[0]['held_out']['accuracy']:.3f} -> {evals[-1]['held_out']['accuracy']:.3f}, "
        f"training prompts {evals[0]['train']['accuracy']:.3f} -> {evals[-1]['train']['accuracy']:.3f}; wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
