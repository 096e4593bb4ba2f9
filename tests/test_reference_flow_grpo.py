"""benchmarks/reference_flow_grpo.py, our side of it (no flow_grpo checkout needed):

- a PEFT LoRA adapter as flow_grpo's save_ckpt writes it (PeftModel.save_pretrained of its
  LoraConfig) loads into our policy and gives the PeftModel's own velocities, also when it adapts
  fewer modules than we do; pickled or differently-parameterised adapters are refused;
- `score` runs our evaluation on a run's checkpoints and the base model;
- the reward it is handed is our shapes reward on the same pixels, metadata rows less "prompt";
- the budget and the prompt file follow our sample budget and prompt mix.
"""

import json
import os

import pytest
import torch
from conftest import load_benchmark

ref = load_benchmark("reference_flow_grpo")

# flow_grpo's train_sd3.py LoRA (its target list; rank and alpha scaled down from 32 / 64)
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
RANK, ALPHA = 4, 8


def save_peft_adapter(model_dir, out, targets=TARGETS, seed=0):
    """What its save_ckpt does: get_peft_model(transformer, LoraConfig(gaussian)), trained (here: a
    random B), then save_pretrained. Returns the PeftModel."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(model_dir, "transformer"))
    torch.manual_seed(seed)
    peft_model = get_peft_model(transformer, LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian",
                                                        target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape))
    peft_model.save_pretrained(out)
    return peft_model.eval()


def our_policy(model_dir):
    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.config import load_config

    return build_policy(load_config("fully_async", [f"model.path={model_dir}", f"model.lora_rank={RANK}",
                                                    f"model.lora_alpha={ALPHA}"]))


def velocities(transformer, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    x = torch.randn(2, cfg.in_channels, 8, 8, generator=g)
    text = torch.randn(2, 3, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=torch.tensor([500.0, 900.0]), encoder_hidden_states=text,
                           pooled_projections=pooled, return_dict=False)[0]


def test_its_adapter_gives_the_peft_models_velocities_in_our_policy(tiny_model_dir, tmp_path):
    peft_model = save_peft_adapter(tiny_model_dir, str(tmp_path / "lora"))
    policy = our_policy(tiny_model_dir)
    base = velocities(policy.adapter.transformer)
    assert ref.load_peft_into_policy(policy, str(tmp_path / "lora")) == []
    ours = velocities(policy.adapter.transformer)
    theirs = velocities(peft_model)
    assert (ours - base).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_an_adapter_of_fewer_modules_leaves_the_others_as_the_base(tiny_model_dir, tmp_path):
    peft_model = save_peft_adapter(tiny_model_dir, str(tmp_path / "lora"), targets=["attn.to_q", "attn.to_k"])
    policy = our_policy(tiny_model_dir)
    with torch.no_grad():  # our own LoRA moved first: loading must reset what the adapter lacks
        for p in policy.trainable_parameters():
            p.add_(0.1)
    untouched = ref.load_peft_into_policy(policy, str(tmp_path / "lora"))
    assert untouched and all(not m.endswith(("to_q", "to_k")) for m in untouched)
    torch.testing.assert_close(velocities(policy.adapter.transformer), velocities(peft_model), rtol=1e-5, atol=1e-5)


def test_pickled_or_unsupported_adapters_are_refused(tiny_model_dir, tmp_path):
    save_peft_adapter(tiny_model_dir, str(tmp_path / "lora"))
    os.rename(tmp_path / "lora" / "adapter_model.safetensors", tmp_path / "lora" / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        ref.read_peft_adapter(str(tmp_path / "lora"))
    save_peft_adapter(tiny_model_dir, str(tmp_path / "dora"))
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        ref.read_peft_adapter(str(tmp_path / "dora"))
    policy = our_policy(tiny_model_dir)
    trainable = policy.trainable_state()
    name = next(iter(trainable)).replace(".default.weight", "")
    with pytest.raises(ValueError, match="shape"):  # another rank
        ref.adapter_state({name: torch.zeros(RANK + 1, 1)}, trainable)
    with pytest.raises(ValueError, match="does not adapt"):
        ref.adapter_state({"proj_out.lora_A": torch.zeros(1, 1)}, trainable)


def test_score_runs_our_evaluation_on_each_checkpoint_and_the_base(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        save_peft_adapter(tiny_model_dir, str(run / "checkpoints" / f"checkpoint-{step}" / "lora"), seed=step)
    out = tmp_path / "scores.json"
    result = ref.main(["score", str(run), "--all", "--base", "--eval-prompts", "2", "--cfg", "4.5,1",
                       "--out", str(out), f"model.path={tiny_model_dir}", "eval.samples_per_prompt=1", "eval.num_steps=2"])
    assert [e["step"] for e in result["adapters"]] == [0, 2, 4]
    assert json.loads(out.read_text())["eval"]["lora_rank"] == RANK
    for entry in result["adapters"]:
        assert set(entry["metrics"]) == {"4.5", "1.0"}
        assert 0.0 <= entry["metrics"]["1.0"]["eval/accuracy"] <= 1.0
    last = ref.main(["score", str(run), "--eval-prompts", "1", "--cfg", "1", f"model.path={tiny_model_dir}",
                     "eval.samples_per_prompt=1", "eval.num_steps=1"])
    assert [e["step"] for e in last["adapters"]] == [4]


def test_its_reward_is_our_shapes_reward_on_the_same_pixels():
    from async_flowgrpo.prompts import load_prompts
    from async_flowgrpo.rewards import CombinedReward

    prompts = load_prompts("shapes_eval")[:6]
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    fn = ref.reward_fn({"shapes": 1.0})("cpu", {"shapes": 1.0})
    details, meta = fn(images, [p.text for p in prompts], [{"prompt": p.text, **p.metadata} for p in prompts], only_strict=True)
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    score, components = CombinedReward({"shapes": 1.0})(pixels, [p.text for p in prompts], [p.metadata for p in prompts])
    assert meta == {}
    assert details["avg"].tolist() == score.tolist()
    assert details["correct"].tolist() == components["correct"].tolist()


def test_budget_and_dataset_follow_ours(tmp_path):
    b = ref.budget(300, 4, 8)
    assert (b["epochs"], b["samples"], b["sample.train_batch_size"], b["train.gradient_accumulation_steps"]) == (150, 9600, 16, 2)
    with pytest.raises(ValueError):
        ref.budget(300, 1, 8)  # half a step would split a group
    with pytest.raises(ValueError):
        ref.budget(3, 4, 8)  # its epochs make 2 steps
    written = ref.write_dataset(str(tmp_path), "shapes_train", "shapes_eval", {"single": 0.1, "count": 0.3, "position": 0.6}, 5)
    assert written["repeats"] == {"single": 14, "count": 29, "position": 1}
    assert all(abs(written["train_mix"][k] - w) < 0.005 for k, w in {"single": 0.1, "count": 0.3, "position": 0.6}.items())
    rows = [json.loads(line) for line in open(tmp_path / "train_metadata.jsonl")]
    assert len(rows) == sum(written["train_rows"].values()) and all("prompt" in r and "kind" in r for r in rows)
    assert len(open(tmp_path / "test_metadata.jsonl").readlines()) == 5
    assert ref.write_dataset(str(tmp_path / "file"), "shapes_train", "shapes_eval", None)["train_mix"]["position"] > 0.95


def test_wandb_recorder_keeps_scalars(tmp_path):
    rec = ref.WandbRecorder(str(tmp_path / "m.jsonl"))
    rec.init(project="flow_grpo")
    rec.log({"reward_avg": torch.tensor(0.5), "images": [rec.Image("x.jpg")], "epoch": 3}, step=7)
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["step"] == 7 and row["reward_avg"] == 0.5 and row["epoch"] == 3.0 and "images" not in row


def test_the_module_alias_answers_disable_adapter_and_changes_no_saved_name(tiny_model_dir, tmp_path):
    """Patch 5: its KL reference calls transformer.module.disable_adapter() (a DDP habit)."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    stats = {}
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_model_dir, "transformer"))
    model = ref.with_module_alias(get_peft_model, stats)(transformer, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    assert stats == {"module_alias": True} and model.module is model
    names = [n for n, _ in model.named_parameters()]
    assert not any(".module." in n or n.startswith("module.") for n in names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)
    with model.module.disable_adapter():
        off = velocities(model)
    assert not torch.allclose(off, velocities(model))
    model.save_pretrained(str(tmp_path / "lora"))
    _, tensors = ref.read_peft_adapter(str(tmp_path / "lora"))
    assert len(tensors) == sum("lora_" in n for n in names)


def test_the_zero_advantage_guard_acts_only_where_every_advantage_is_zero():
    import numpy as np

    class Tracker:  # what its PerPromptStatTracker.update returns: (reward - prompt mean) / global std
        def update(self, prompts, rewards, type="grpo"):
            rewards = np.asarray(rewards, dtype=np.float64)
            out = np.empty_like(rewards)
            for p in set(prompts):
                sel = np.array([q == p for q in prompts])
                out[sel] = rewards[sel] - rewards[sel].mean(axis=0)
            return out

    stats = {}
    guarded = ref.zero_advantage_guard(Tracker, stats)()
    mixed = guarded.update(["a", "a", "b", "b"], [[1.0], [0.0], [1.0], [1.0]])
    assert mixed.tolist() == [[0.5], [-0.5], [0.0], [0.0]] and stats == {}
    uniform = guarded.update(["a", "a", "b", "b"], [[1.0], [1.0], [0.0], [0.0]])
    assert (uniform == ref.ZERO_ADVANTAGE).all() and stats == {"all_zero_advantage_epochs": 1}
    assert (np.abs(uniform).sum(axis=1) != 0).all()  # its filter keeps every sample


def test_save_then_stop_saves_the_chosen_steps_and_ends_after_the_last():
    saved, stats = [], {}
    wrapped = ref.save_then_stop(lambda d, t, step, *a: saved.append(step), {4}, 8, stats)
    for step in (2, 4, 6):
        wrapped("dir", None, step)
    with pytest.raises(ref.Finished):
        wrapped("dir", None, 8)
    assert saved == [4, 8] and stats["checkpoints"] == [4, 8]
