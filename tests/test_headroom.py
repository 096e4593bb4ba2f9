"""benchmarks/headroom.py: the best-of-k estimator and a run on the tiny SD3 (a few ODE steps)."""

import json
import os

import pytest

from conftest import load_benchmark

headroom = load_benchmark("headroom")


def test_best_of_k_is_the_unbiased_any_right_share():
    # one prompt 1 right of 4, one 0 of 4, one 4 of 4
    assert headroom.best_of([1, 0, 4], 4, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert headroom.best_of([1, 0, 4], 4, 2) == pytest.approx((0.5 + 0 + 1) / 3)  # 1 - C(3,2)/C(4,2)
    assert headroom.best_of([1, 0, 4], 4, 4) == pytest.approx(2 / 3)  # best-of-n: any right


def test_a_run_writes_the_table_and_json(tiny_model_dir, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    monkeypatch.setattr(headroom.common, "RESULTS", str(tmp_path))
    headroom.main(["--cfg", "4.5,1", "--samples", "4", "--name", "t", f"model.path={tiny_model_dir}",
                   "model.lora_rank=4", "model.lora_alpha=8", f"eval.prompts={prompts}", "eval.num_steps=2"])
    out = json.load(open(os.path.join(tmp_path, "headroom", "t.json")))
    assert [r["guidance_scale"] for r in out["results"]] == [4.5, 1.0]
    for r in out["results"]:
        assert r["prompts"] == 2 and list(r["best_of"]) == ["1", "2", "4"]
        assert r["best_of"]["1"] == pytest.approx(r["pass@1"]) and r["best_of"]["1"] <= r["best_of"]["4"] <= 1
    assert "| CFG | pass@1 | best-of-1 | best-of-2 | best-of-4 |" in capsys.readouterr().out


def test_an_edit_model_gets_its_source_images_and_the_results_split_by_kind(tmp_path, monkeypatch):
    """The embedded edit task, one held-out prompt of each edit kind: each prompt's input image
    reaches the model and the reward (as the evaluation loads them; without, the model refuses)."""
    from async_flowgrpo.prompts import load_prompts

    first_of_kind = {}
    for p in load_prompts("shapes_edit_eval"):
        first_of_kind.setdefault(p.metadata["kind"], p)
    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(json.dumps({"prompt": p.text, "images": list(p.images), **p.metadata}) + "\n"
                             for p in first_of_kind.values()))
    monkeypatch.setattr(headroom.common, "RESULTS", str(tmp_path))
    headroom.main(["--cfg", "1", "--samples", "2", "--name", "edit", os.path.join(headroom.common.REPO, "config", "shapes_edit.yaml"),
                   f"eval.prompts={edits}", "eval.num_steps=2"])
    out = json.load(open(os.path.join(tmp_path, "headroom", "edit.json")))["results"][0]
    assert out["prompts"] == 4 and set(out["by_kind"]) == {"add", "move", "recolor", "remove"}
