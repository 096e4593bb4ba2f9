"""Prompt files and the deterministic, resumable prompt stream."""

import collections

import pytest

from async_flowgrpo.prompts import Prompt, PromptStream, load_prompts


def test_stream_is_a_pure_function_of_the_index_and_covers_each_epoch():
    prompts = [Prompt(f"p{i}") for i in range(7)]
    a = PromptStream(prompts, seed=3)
    first = [a.next()[1].text for _ in range(14)]
    assert sorted(first[:7]) == sorted(p.text for p in prompts)  # an epoch is a permutation
    assert first[:7] != first[7:]  # reshuffled per epoch
    resumed = PromptStream(prompts, seed=3)
    resumed.load_state_dict({"cursor": 5})
    assert [resumed.next()[1].text for _ in range(9)] == first[5:]


def test_mix_samples_kinds_by_weight_and_is_reproducible():
    rows = load_prompts("shapes_train")
    stream = PromptStream(rows, seed=0, mix={"single": 1.0, "count": 1.0, "position": 2.0})
    drawn = [stream.prompt_at(i) for i in range(2000)]
    kinds = collections.Counter(p.metadata["kind"] for p in drawn)
    assert abs(kinds["position"] / 2000 - 0.5) < 0.05 and abs(kinds["count"] / 2000 - 0.25) < 0.05
    assert len({p.text for p in drawn if p.metadata["kind"] == "count"}) == 18  # every count prompt appears
    again = PromptStream(rows, seed=0, mix={"single": 1.0, "count": 1.0, "position": 2.0})
    assert [again.prompt_at(i).text for i in range(50)] == [p.text for p in drawn[:50]]
    zero = PromptStream(rows, seed=0, mix={"single": 0.0, "count": 1.0})
    assert {zero.prompt_at(i).metadata["kind"] for i in range(100)} == {"count"}


def test_mix_with_a_kind_the_file_lacks_is_an_error():
    with pytest.raises(ValueError, match="zebra"):
        PromptStream(load_prompts("shapes_train"), mix={"zebra": 1.0})
