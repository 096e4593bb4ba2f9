"""Evaluation: ODE sampling (no noise, nothing recorded) with fixed seeds on held-out prompts.

Used by the launchers every eval.every steps (on trainer rank 0, with the freshest weights) and
standalone:

    python -m async_flowgrpo.evaluation [model.path=DIR] [trainer.resume=CHECKPOINT_DIR] [eval.* ...]

Metrics: eval/reward (the combined reward), eval/<component> for every reward component, and
eval/accuracy when the reward reports a per-sample "correct" check (the shapes reward does: all of
colour, shape, count and position right), also per prompt kind as eval/accuracy_<kind> when the
prompt file's rows carry a "kind".
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from async_flowgrpo.conditioning import SOURCE_IMAGES, side_by_side, with_sources
from async_flowgrpo.config import Config
from async_flowgrpo.prompts import load_prompts
from async_flowgrpo.rewards import CombinedReward
from async_flowgrpo.sampling import eval_sampling

PROMPTS_PER_CALL = 16


class EvaluationCut(Exception):
    """`interrupted()` turned true: the evaluation was abandoned (a stop does not wait for it)."""


def agreed(interrupted: Callable[[], bool], device) -> Callable[[], bool]:
    """interrupted() as any rank of the default process group sees it (a MAX all-reduce per call): ranks
    whose forward passes are collective must leave an evaluation together."""

    def any_rank() -> bool:
        flag = torch.tensor([float(bool(interrupted()))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    return any_rank


def _cut_check(interrupted: Callable[[], bool], world_size: int, device) -> Callable[[], int]:
    """Raises EvaluationCut once `interrupted()`; called before every denoising step (as generate's
    version_fn, so returns the version 0) and before each chunk is scored. Sharded, the ranks agree."""
    if world_size > 1:
        interrupted = agreed(interrupted, device)

    def check() -> int:
        if interrupted():
            raise EvaluationCut("evaluation abandoned")
        return 0

    return check


@torch.no_grad()
def evaluate_policy(policy, cfg: Config, rank: int = 0, world_size: int = 1,
                    interrupted: Callable[[], bool] | None = None, sequence_parallel: int = 1) -> dict | None:
    """Returns {"metrics": {...}, "images": uint8 [N,H,W,3] (one per prompt, for a grid), "captions"}
    (an edit model's: each prompt's input image(s) beside its result, and the grid's "nrow").

    With world_size > 1 (trainers whose forward passes are collective: FSDP-sharded weights or
    sequence parallelism; the process group is up) the ranks split the prompt chunks, score their own
    and rank 0 gathers them: the same result as one process. Every rank makes the same number of
    generate calls, since each forward pass all-gathers the sharded blocks (or splits its tokens);
    the others return None. With sequence_parallel N the chunks go to the world_size / N sequence
    groups, whose N ranks generate them together and each score 1/N of their prompts: every prompt
    is scored once.

    interrupted: polled before every denoising step and before each chunk is scored; once true the
    evaluation raises EvaluationCut (a stopping run does not wait for it; the weights are untouched).
    """
    e = cfg.eval
    check = _cut_check(interrupted, world_size, policy.device) if interrupted is not None else None
    sampling = eval_sampling(cfg)
    start_time = time.perf_counter()
    prompts = load_prompts(e.prompts)
    reward = CombinedReward(cfg.reward.weights, cfg.reward.options)
    starts = list(range(0, len(prompts), PROMPTS_PER_CALL))
    data_rank, data_parallel = rank // sequence_parallel, world_size // sequence_parallel
    mine = starts[data_rank::data_parallel]
    scored = []  # one dict per prompt
    for call in range(-(-len(starts) // data_parallel)):
        start = mine[call] if call < len(mine) else starts[0]  # a rank short of chunks repeats one
        chunk = prompts[start : start + PROMPTS_PER_CALL]
        chunk_metadata = [with_sources(p) for p in chunk]  # an edit model's input images, loaded
        groups = policy.generate(
            [p.text for p in chunk],
            e.samples_per_prompt,
            seed=e.seed + start,  # fixed: the same noise at every evaluation, whichever rank draws it
            **sampling,
            metadata=chunk_metadata,
            version_fn=check,
        )
        if check is not None:
            check()  # before scoring, which may be a slow model or a remote service
        share = range(rank % sequence_parallel, len(chunk), sequence_parallel)  # the prompts this rank scores
        if call >= len(mine) or not share:
            continue  # only kept in step with the other ranks' forward passes
        images = torch.cat([groups[k].images for k in share])
        texts = [chunk[k].text for k in share for _ in range(groups[k].size)]
        metadata = [chunk_metadata[k] for k in share for _ in range(groups[k].size)]
        score, components = reward(images, texts, metadata)
        offset = 0
        for k in share:
            rows = slice(offset, offset + groups[k].size)
            offset = rows.stop
            scored.append({"index": start + k, "images": images[rows], "texts": texts[rows], "metadata": metadata[rows],
                           "score": score[rows], "components": {name: v[rows] for name, v in components.items()}})
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(scored, gathered, dst=0)
        if rank != 0:
            return None
        scored = sorted((c for part in gathered for c in part), key=lambda c: c["index"])

    images = torch.cat([c["images"] for c in scored])
    texts = [t for c in scored for t in c["texts"]]
    metadata = [m for c in scored for m in c["metadata"]]
    score = torch.cat([c["score"] for c in scored])
    components = {name: torch.cat([c["components"][name] for c in scored]) for name in scored[0]["components"]}
    metrics = {"eval/reward": score.mean().item()}
    for name, values in components.items():
        metrics[f"eval/{name}"] = values.mean().item()
    if "correct" in components:
        metrics["eval/accuracy"] = components["correct"].mean().item()
        # per prompt kind (JSONL "kind"), where the overall figure hides which kind moved
        kinds = [m.get("kind") for m in metadata]
        for kind in sorted({k for k in kinds if isinstance(k, str)}):
            sel = torch.tensor([k == kind for k in kinds])
            metrics[f"eval/accuracy_{kind}"] = components["correct"][sel].mean().item()
    metrics["eval/time_s"] = time.perf_counter() - start_time  # generation + scoring
    first = slice(None, None, e.samples_per_prompt)  # one image per prompt for the grid
    grid = {"images": images[first][:64], "captions": texts[first][:64]}
    sources = [m.get(SOURCE_IMAGES) for m in metadata[first][:32]]
    if sources[0] is not None:  # an edit model: each input beside its result, 32 prompts
        grid = side_by_side(grid["images"][:32], sources, grid["captions"][:32])
    return {"metrics": metrics, **grid}


def main(argv: list[str]) -> None:
    from async_flowgrpo import builders
    from async_flowgrpo.config import config_or_exit

    # --live: a checkpoint's live weights even where the run saved a weight average (trainer.ema_decay),
    # to compare the two on one run
    live = "--live" in argv
    cfg = config_or_exit("fully_async", [a for a in argv if a != "--live"], command="python -m async_flowgrpo.evaluation [--live]")
    state = None
    if cfg.trainer.resume:  # read first: a missing or bad checkpoint is one line, before the model loads
        from async_flowgrpo import checkpoint

        try:  # safetensors + JSON: a checkpoint file never runs code
            path, _ = checkpoint.Checkpointer(os.path.join(cfg.trainer.output_dir, "checkpoints")).find(cfg.trainer.resume)
            state = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    policy = builders.build_policy(cfg)
    if state is not None:
        learner = state["learner"]
        average = "ema" in learner and not live  # by default what the run evaluated (trainer.ema_decay)
        policy.load_trainable_state(learner["ema"]["average"] if average else learner["trainable"])
        print(f"weights: {path} (step {state['step']}{', the weight average' if average else ''})")
    result = evaluate_policy(policy, cfg)
    for key, value in sorted(result["metrics"].items()):
        print(f"{key:24s} {value:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
