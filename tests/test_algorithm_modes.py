"""Each added algorithm (AWM, MixGRPO, GRPO-Guard, by their shipped config files; MixGRPO-Flash's
rollouts in MixGRPO's one_step_off run) for 3 steps in
sync, one_step_off and fully_async through the Ray pipeline on 2 cores, on the embedded SD3 model
and the tiny Qwen-Image twin: the run finishes, every step trains with a finite loss, the
algorithm's own metrics are there, staleness stays within the mode's bound. A run costs about 40 s
of actor start-up here, so the nine runs cover every algorithm in every mode and on both models,
and every mode on both models, without the full product (CASES); DGPO, added after them, has one run
(fully_async, where its stale scoring acts). One Ray cluster for the module."""

import json
import math
import os

import pytest

from async_flowgrpo.config import CONFIG_DIR, MODES, load_config
from async_flowgrpo.modes import run

PROMPTS = ["a red circle", "a blue square", "a red square", "a blue circle"]
FILES = ("awm", "mixgrpo", "grpo_guard")
CASES = [("awm", "sync", "embedded"), ("awm", "one_step_off", "qwen_image"), ("awm", "fully_async", "embedded"),
         ("mixgrpo", "sync", "qwen_image"), ("mixgrpo", "one_step_off", "embedded"), ("mixgrpo", "fully_async", "qwen_image"),
         ("grpo_guard", "sync", "embedded"), ("grpo_guard", "one_step_off", "qwen_image"),
         ("grpo_guard", "fully_async", "qwen_image"),
         ("dgpo", "fully_async", "embedded")]  # DGPO (the fifth): its one run, the mode that tests its stale scoring
# what each file's run must log besides the common keys
OWN = {"awm": ("awm/stale_frac", "awm/old_missing_frac", "policy/ratio_mean"),
       "mixgrpo": ("samples/window_start",),
       "grpo_guard": ("policy/ratio_step0_mean", "policy/ratio_norm_step0_std"),
       "dgpo": ("dgpo/weight_mean", "dgpo/stale_frac", "dgpo/old_missing_frac", "policy/clip_frac")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from async_flowgrpo.config import EMBEDDED_MODEL
    from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir

    return {"embedded": EMBEDDED_MODEL, "qwen_image": make_tiny_qwen_image_dir(str(tmp_path_factory.mktemp("qwen")))}


def small_config(file, mode, family, model_dir, tmp, *extra):
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return load_config(mode, [
        os.path.join(CONFIG_DIR, f"{file}.yaml"), f"model.path={model_dir}",
        f"model.family={'sd3' if family == 'embedded' else family}",
        "model.lora_rank=4", "model.lora_alpha=8",
        f"rollout.prompts={prompts}", f"eval.prompts={prompts}", "rollout.prompt_mix=null",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=4", "rollout.sde_window_range=null",
        "rollout.cpus_per_worker=0.25", "trainer.cpus_per_worker=0.25",
        "trainer.micro_batch_size=8", "trainer.lr=1e-2", "trainer.lr_schedule=constant", "trainer.warmup_steps=0",
        "trainer.total_steps=3", "trainer.sample_every=0", "trainer.checkpoint_every=0",
        f"trainer.output_dir={tmp / 'out'}", "eval.every=0", "eval.at_start_and_end=false",
        "logging.progress=false", "sync.timeout_s=120", "reward.options={shapes: {score: partial}}",
        *extra,
    ])


def test_the_cases_cover_every_algorithm_and_mode_on_both_models():
    assert {(f, m) for f, m, _ in CASES if f in FILES} == {(f, m) for f in FILES for m in MODES}
    assert all({fam for f, _, fam in CASES if f == file} == {"embedded", "qwen_image"} for file in FILES)
    assert all({fam for _, m, fam in CASES if m == mode} == {"embedded", "qwen_image"} for mode in MODES)


@pytest.mark.parametrize("file, mode, family", CASES)
def test_three_steps_train_in_every_mode(ray_cluster, model_dirs, tmp_path, file, mode, family):
    # MixGRPO's window moves every version here, so three steps see it move; GRPO-Guard's window is
    # all but the last of the 4 steps
    extra = {"mixgrpo": ["algorithm.flow_grpo.window_shift_every=1"], "grpo_guard": ["rollout.sde_window_size=0"],
             "dgpo": ["algorithm.dgpo.timesteps=2"]}  # of the 3 levels 0.6 of 4 steps leaves
    if (file, mode) == ("mixgrpo", "one_step_off"):  # MixGRPO-Flash's rollouts (its ODE after the window) on Ray
        extra["mixgrpo"] = [os.path.join(CONFIG_DIR, "mixgrpo_flash.yaml"), *extra["mixgrpo"]]
    cfg = small_config(file, mode, family, model_dirs[family], tmp_path, *extra.get(file, []))
    run(cfg)
    with open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and r["train/skipped_nonfinite"] == 0, r
        assert r["staleness/max"] <= cfg.algorithm.max_staleness + cfg.sync.every - 1
        for key in OWN[file]:
            assert key in r, key
    assert rows[-1]["samples/consumed"] == 3 * 4
    if file in ("awm", "dgpo"):  # every stale group had its version's copy
        assert all(r[f"{file}/old_missing_frac"] == 0.0 for r in rows)
    if file == "mixgrpo" and mode == "sync":
        # the window walks with the version (0, 1, 2); a batch's first group is placed by the version
        # the rollout held before the publication is swapped in at its first step, so it lags by one
        starts = [r["samples/window_start"] for r in rows]
        assert starts[0] == 0 and starts[1] in (0.5, 1) and starts[2] in (1.5, 2)
