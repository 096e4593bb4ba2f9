"""The embedded edit task: instructions, procedural pairs, the verifiable reward, the shipped prompt
sets and the edit grid."""

import random

import numpy as np
import pytest
import torch

from async_flowgrpo.shapes.edit_reward import score_edit, shapes_edit_reward
from async_flowgrpo.shapes.edit_scenes import (EditSpec, all_edits, edit_pair, instruction, parse_instruction,
                                               render_pair, split_edits)
from async_flowgrpo.shapes.scenes import draw


def test_every_instruction_parses_back_and_held_out_ones_are_never_trained():
    edits = [e for es in all_edits().values() for e in es]
    assert all(parse_instruction(instruction(e)) == e for e in edits)
    assert instruction(EditSpec("recolor", "red", "circle", "blue")) == "make the red circle blue"
    assert instruction(EditSpec("move", "green", "square", "to the left")) == "move the green square to the left"
    train, held = split_edits()
    assert not set(train) & set(held) and len(train) + len(held) == len(edits)
    assert {e.op for e in held} == {"recolor", "move", "remove", "add"}
    with pytest.raises(ValueError, match="not an edit instruction"):
        parse_instruction("a red circle")


@pytest.mark.parametrize("op", ["recolor", "move", "remove", "add"])
def test_a_pair_changes_only_the_named_object(op):
    rng = random.Random(0)
    edit = next(e for e in split_edits()[0] if e.op == op)
    for _ in range(10):
        source, target = edit_pair(edit, rng)
        key = lambda p: (p.color, p.shape, p.x, p.y, p.size)  # noqa: E731
        untouched = [p for p in source if (p.color, p.shape) != (edit.color, edit.shape)]
        assert all(key(p) in map(key, target) for p in untouched)  # the rest drawn identically
        named = [p for p in source if (p.color, p.shape) == (edit.color, edit.shape)]
        assert len(named) == (0 if op == "add" else 1)


def _pair(op):
    edit = next(e for e in split_edits()[0] if e.op == op)
    rng = random.Random(1)
    while True:  # a pair with a second object, so "the rest is unchanged" has something to check
        source, target = edit_pair(edit, rng)
        if len(source) + len(target) >= 3:
            return edit, source, target


@pytest.mark.parametrize("op", ["recolor", "move", "remove", "add"])
def test_reward_checks_the_edit_and_the_rest(op):
    edit, source, target = _pair(op)
    src, tgt = draw(source), draw(target)
    assert score_edit(src, tgt, edit)["correct"] == 1.0
    unedited = score_edit(src, src, edit)
    assert unedited["edit_ok"] == 0.0 and unedited["rest_ok"] == 1.0 and unedited["correct"] == 0.0
    # the edit made, but the untouched object moved away: the rest check fails
    other = next(p for p in target if (p.color, p.shape) != (edit.color, edit.shape) and p.color != edit.arg)
    shifted = [type(p)(p.color, p.shape, 1 if p.x > 12 else 22, p.y, p.size) if p is other else p for p in target]
    broken = score_edit(src, draw(shifted), edit)
    assert broken["edit_ok"] == 1.0 and broken["rest_ok"] == 0.0 and broken["correct"] == 0.0
    assert broken["partial"] < 1.0


def test_reward_reads_the_source_from_metadata_and_needs_it():
    edit, source, target = _pair("recolor")
    src, tgt = torch.from_numpy(draw(source)), torch.from_numpy(draw(target))
    out = shapes_edit_reward(torch.stack([tgt, src]), [instruction(edit)] * 2, [{"source_images": [src]}] * 2)
    assert out["score"].tolist() == [1.0, 0.0] and out["correct"].tolist() == [1.0, 0.0]
    partial = shapes_edit_reward(torch.stack([src]), [instruction(edit)], [{"source_images": [src]}], score="partial")
    assert 0 < partial["score"].item() < 1
    with pytest.raises(ValueError, match="source image"):
        shapes_edit_reward(tgt[None], [instruction(edit)], [{}])


def test_shipped_prompt_sets_carry_valid_images_and_hold_out_the_eval_instructions():
    from async_flowgrpo.prompts import load_prompts

    train = load_prompts("shapes_edit_train", image_size=(32, 32))
    evals = load_prompts("shapes_edit_eval", image_size=(32, 32))
    _, held = split_edits()
    assert {p.text for p in evals} == {instruction(e) for e in held}
    assert not {p.text for p in train} & {p.text for p in evals}
    assert all(len(p.images) == 1 for p in train + evals)
    assert {p.metadata["kind"] for p in evals} == {"recolor", "move", "remove", "add"}


def test_edit_grid_puts_each_source_beside_its_result():
    from async_flowgrpo.conditioning import side_by_side

    srcs = [[torch.full((4, 4, 3), i, dtype=torch.uint8)] for i in range(3)]
    results = torch.stack([torch.full((4, 4, 3), 100 + i, dtype=torch.uint8) for i in range(3)])
    grid = side_by_side(results, srcs, ["a", "b", "c"], pairs_per_row=2)
    assert [int(t[0, 0, 0]) for t in grid["images"]] == [0, 100, 1, 101, 2, 102]
    assert grid["captions"] == ["a", "-> result", "b", "-> result", "c", "-> result"] and grid["nrow"] == 4


def test_shipped_edit_model_edits_a_held_out_prompt():
    from async_flowgrpo.conditioning import with_sources
    from async_flowgrpo.config import EMBEDDED_EDIT_MODEL
    from async_flowgrpo.models.common import read_model_settings
    from async_flowgrpo.policy import DiffusionPolicy
    from async_flowgrpo.prompts import load_prompts

    assert read_model_settings(EMBEDDED_EDIT_MODEL)["family"] == "flux_kontext"
    policy = DiffusionPolicy(EMBEDDED_EDIT_MODEL, lora_rank=0)
    prompt = load_prompts("shapes_edit_eval")[0]
    meta = with_sources(prompt)
    (group,) = policy.generate([prompt.text], 2, num_steps=10, guidance_scale=1.0, noise_level=0.7, sde_type="sde",
                               window_size=0, seed=0, metadata=[meta])
    result = shapes_edit_reward(group.images, [prompt.text] * 2, [meta] * 2)
    assert group.images.shape == (2, 32, 32, 3)
    # the pretrained model keeps most of the scene: some source object survives in place
    assert result["rest"].max() > 0 or result["edit"].max() > 0


def test_edit_pretraining_runs_and_saves_a_kontext_pipeline(tmp_path, monkeypatch):
    from async_flowgrpo.models.common import read_model_settings
    from async_flowgrpo.shapes import edit_pretrain

    monkeypatch.setattr(edit_pretrain, "held_out_accuracy", lambda pipe: 0.0)  # (the real one samples 72 edits)
    edit_pretrain.main(["--out", str(tmp_path / "m"), "--pool", "16", "--steps", "2", "--batch", "4", "--eval-every", "0"])
    settings = read_model_settings(str(tmp_path / "m"))
    assert settings["family"] == "flux_kontext" and settings["trained"]["steps"] == 2
    from async_flowgrpo.policy import DiffusionPolicy

    assert DiffusionPolicy(str(tmp_path / "m"), lora_rank=0).adapter.image_conditioned
