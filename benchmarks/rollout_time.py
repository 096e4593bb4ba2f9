#!/usr/bin/env python
"""Seconds a rollout takes to make one group, for several settings of the same model, interleaved, and what its samples score.

Each setting is a quoted list of YAML files and key=value overrides as the launchers take them (on
top of the default recipe); its rollout sampling (`sampling.rollout_sampling`, then the algorithm's
own, e.g. MixGRPO's window at --version) makes `--prompts` groups in one `policy.generate` call,
one torch thread, in the order A B A B ... for `--rounds` rounds after a warm-up of each. Reported per
setting: the median seconds per group, the min and max, the transformer calls per call, the median
against the first setting's, and with --reward the mean reward of every group it made (the
setting's own reward, on the training prompts: what a cheaper sampler costs in sample quality).
One process, no Ray: it measures the sampler, not the actors.

    python benchmarks/rollout_time.py config/mixgrpo.yaml config/mixgrpo_flash.yaml
    python benchmarks/rollout_time.py config/mixgrpo.yaml config/mixgrpo_flash.yaml --reward --prompts 16 --rounds 3
    python benchmarks/rollout_time.py "rollout.num_steps=10" "rollout.num_steps=20" --rounds 3
"""

from __future__ import annotations

import shlex
import statistics
import time

from common import argument_parser, load_mode_config, log, write_json


def main(argv: list[str] | None = None) -> dict:
    ap = argument_parser(__doc__)
    ap.add_argument("settings", nargs="+", help='each a quoted list of YAML files and key=value, e.g. "config/mixgrpo.yaml"')
    ap.add_argument("--prompts", type=int, default=4, help="groups per generate call (default 4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=0, help="samples a group (default: each setting's rollout.group_size)")
    ap.add_argument("--version", type=int, default=0, help="the weight version the rollout holds (places MixGRPO's window)")
    ap.add_argument("--reward", action="store_true", help="also score every group with the setting's reward")
    ap.add_argument("--out", help="JSON path (default: none written)")
    args = ap.parse_args(argv)

    import torch

    from async_flowgrpo import algorithms
    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.prompts import load_prompts
    from async_flowgrpo.rewards import CombinedReward
    from async_flowgrpo.sampling import rollout_sampling

    torch.set_num_threads(1)
    cfgs = [load_mode_config("sync", shlex.split(s)) for s in args.settings]
    if len({(c.model.path, c.model.family) for c in cfgs}) != 1:
        raise SystemExit("every setting must use the same model: the settings differ in their sampling only")
    policy = build_policy(cfgs[0])
    prompts = [p.text for p in load_prompts(cfgs[0].rollout.prompts)[: args.prompts]]
    samplings = [algorithms.rollout_sampling(c.algorithm, rollout_sampling(c.rollout), args.version) for c in cfgs]
    calls = []
    velocity = policy.adapter.velocity
    policy.adapter.velocity = lambda *a, **k: calls.append(1) or velocity(*a, **k)

    sizes = [args.group_size or c.rollout.group_size for c in cfgs]
    rewards = [CombinedReward(c.reward.weights, c.reward.options) if args.reward else None for c in cfgs]
    scores = [[] for _ in cfgs]  # each group's mean reward

    def one(k: int, seed: int) -> tuple[float, int]:
        calls.clear()
        t0 = time.perf_counter()
        groups = policy.generate(prompts, sizes[k], seed=seed, **samplings[k])
        seconds = (time.perf_counter() - t0) / len(prompts)
        for g in groups if rewards[k] is not None else ():
            scores[k].append(float(rewards[k](g.images, [g.prompt] * g.size, [g.metadata] * g.size)[0].mean()))
        return seconds, len(calls)

    for k in range(len(cfgs)):
        one(k, seed=0)  # warm-up (its groups scored too: the same seed for every setting)
    per_group = [[] for _ in cfgs]
    nfe = [0] * len(cfgs)
    for r in range(args.rounds):
        for k in range(len(cfgs)):
            seconds, nfe[k] = one(k, seed=1 + r)
            per_group[k].append(seconds)
        log(f"round {r + 1}: " + "  ".join(f"{s[-1]:.3f}" for s in per_group))
    base = statistics.median(per_group[0])
    rows = [{"setting": s, "sampling": {k: v for k, v in samp.items() if k not in ("height", "width")},
             "group_size": size, "transformer_calls": n, "seconds_per_group": t,
             "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "vs_first": statistics.median(t) / base,
             **({"mean_reward": sum(sc) / len(sc), "groups_scored": len(sc)} if sc else {})}
            for s, samp, size, n, t, sc in zip(args.settings, samplings, sizes, nfe, per_group, scores)]
    for row in rows:
        quality = f", mean reward {row['mean_reward']:.3f} ({row['groups_scored']} groups)" if "mean_reward" in row else ""
        print(f"{row['setting']!r}: {row['median_s']:.3f} s a group (min {row['min_s']:.3f}, max {row['max_s']:.3f}), "
              f"{row['transformer_calls']} transformer calls, x{row['vs_first']:.2f} of the first{quality}")
    result = {"prompts": len(prompts), "rounds": args.rounds, "version": args.version, "reward": args.reward, "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
