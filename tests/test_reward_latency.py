"""benchmarks/reward_latency.py: the scoring service's set time per image, and the summary's
ratios on synthetic runs (no Ray)."""

import time

import pytest
import torch
from conftest import load_benchmark

from async_flowgrpo.rewards import remote


def test_the_scoring_service_takes_its_set_time_per_group():
    bench = load_benchmark("reward_latency")
    service = bench.ScoringService()
    try:
        service.seconds_per_group, service.group_size = 0.4, 8
        start = time.monotonic()
        out = remote.remote(torch.zeros(4, 8, 8, 3, dtype=torch.uint8), ["p"] * 4, [{}] * 4, url=service.url, retries=0)
        assert time.monotonic() - start >= 0.2 and out["score"].shape == (4,)  # half a group: half its time
        assert service.overrides() == [f"reward.options={{remote: {{url: '{service.url}', retries: 0}}}}"]
    finally:
        service.server.shutdown()


def test_the_judge_service_answers_each_image_in_the_groups_time():
    pytest.importorskip("openai")
    from async_flowgrpo.config import load_config
    from async_flowgrpo.rewards import get_reward

    bench = load_benchmark("reward_latency")
    service = bench.ScoringService("vlm_judge")
    try:
        service.seconds_per_group = 1.0
        cfg = load_config("fully_async", service.overrides())
        assert dict(cfg.reward.weights) == {"vlm_judge": 1.0}
        fn = get_reward("vlm_judge", **cfg.reward.options["vlm_judge"])
        start = time.monotonic()
        scores = fn(torch.zeros(4, 8, 8, 3, dtype=torch.uint8), ["p"] * 4, [{}] * 4)
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 3.0, elapsed  # the four requests at once: one group's time, not four (4 s)
        assert ((scores >= 0) & (scores <= 1)).all()
    finally:
        service.server.shutdown()


def test_the_summary_compares_overlap_with_blocking_and_with_a_zero_latency_reward():
    bench = load_benchmark("reward_latency")

    def runs(*rates):
        return [{"samples_per_s": r} for r in rates]

    summary = bench.summarize({
        "fully_async": {"zero_latency": runs(10, 12), "1x_blocking": runs(5, 6), "1x_overlap": runs(9, 11)},
        "sync": {"1x_blocking": runs(4), "1x_overlap": runs(6)},
    }, [1.0])
    fa = summary["fully_async"]
    assert fa["speedup_1x"] == 10 / 5.5 and fa["kept_1x"] == 10 / 11
    assert fa["samples_per_s"]["1x_overlap"] == {"mean": 10, "min": 9, "max": 11, "runs": [9, 11]}
    assert summary["sync"]["speedup_1x"] == 1.5 and "kept_1x" not in summary["sync"]
