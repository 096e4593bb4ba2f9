"""Image-conditioned prompts end to end on a tiny random FLUX.1 Kontext: the prompt file's images are
checked as it is read (bad ones exit 2 naming file and line), encoded once per group, replayed
exactly by the trainer, and handed to the reward (and a remote reward) with the output."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from async_flowgrpo.conditioning import SOURCE_IMAGES, with_sources
from async_flowgrpo.prompts import load_prompts

VOCAB = ("make", "the", "red", "blue", "circle", "square", "remove", "add", "a")


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    from async_flowgrpo.models.tiny_kontext import make_tiny_kontext_dir

    return make_tiny_kontext_dir(str(tmp_path_factory.mktemp("kontext")), vocab=VOCAB)


def _image(path, size=32, color=(220, 30, 30)):
    img = np.full((size, size, 3), 255, dtype=np.uint8)
    img[size // 4: size // 2, size // 4: size // 2] = color
    Image.fromarray(img).save(path)
    return img


def _prompt_file(folder, rows):
    path = os.path.join(folder, "edits.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def edit_prompts(tmp_path):
    (tmp_path / "src").mkdir()
    _image(tmp_path / "src" / "a.png")
    _image(tmp_path / "src" / "b.png", color=(35, 70, 225))
    return _prompt_file(str(tmp_path), [{"prompt": "make the red square blue", "images": ["src/a.png"], "kind": "recolor"},
                                        {"prompt": "remove the blue square", "images": "src/b.png"}])


def test_prompt_images_resolve_relative_to_the_file(edit_prompts):
    prompts = load_prompts(edit_prompts, image_size=(32, 32))
    folder = os.path.dirname(edit_prompts)
    assert prompts[0].images == (os.path.join(folder, "src", "a.png"),)
    assert prompts[1].images == (os.path.join(folder, "src", "b.png"),)  # a bare string is one image
    assert prompts[0].metadata == {"kind": "recolor"} and "images" not in prompts[1].metadata
    meta = with_sources(prompts[0])
    assert meta[SOURCE_IMAGES][0].shape == (32, 32, 3) and meta[SOURCE_IMAGES][0].dtype == torch.uint8
    assert tuple(meta[SOURCE_IMAGES][0][10, 10].tolist()) == (220, 30, 30)
    assert SOURCE_IMAGES not in prompts[0].metadata  # the stream's prompt keeps no pixels


@pytest.mark.parametrize("case, expected", [
    ("missing", "image 'src/gone.png' not found"),
    ("unreadable", "image 'src/bad.png' is not a readable image"),
    ("wrong_size", "image 'src/big.png' is 48x48, the model samples 32x32"),
    ("count", "1 images, but the first row has 2"),
])
def test_bad_prompt_images_name_file_and_line(tmp_path, case, expected):
    (tmp_path / "src").mkdir()
    _image(tmp_path / "src" / "ok.png")
    _image(tmp_path / "src" / "big.png", size=48)
    (tmp_path / "src" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    second = {"missing": ["src/gone.png"], "unreadable": ["src/bad.png"], "wrong_size": ["src/big.png"],
              "count": ["src/ok.png"]}[case]
    first = ["src/ok.png", "src/ok.png"] if case == "count" else ["src/ok.png"]
    path = _prompt_file(str(tmp_path), [{"prompt": "add a red circle", "images": first}, {"prompt": "x", "images": second}])
    with pytest.raises(ValueError) as err:
        load_prompts(path, image_size=(32, 32))
    assert str(err.value).startswith(f"{path}:2: ") and expected in str(err.value)


def _overrides(model, prompts):
    return [f"model.path={model}", "model.family=flux_kontext", f"rollout.prompts={prompts}", f"eval.prompts={prompts}",
            "algorithm.beta=0", "rollout.prompt_mix=null"]


def test_bad_image_exits_2_with_one_line_before_anything_starts(tmp_path, kontext_dir, capsys):
    from async_flowgrpo.config import config_or_exit

    (tmp_path / "src").mkdir()
    _image(tmp_path / "src" / "big.png", size=64)
    path = _prompt_file(str(tmp_path), [{"prompt": "add a red circle", "images": ["src/big.png"]}])
    with pytest.raises(SystemExit) as exit_info:
        config_or_exit("fully_async", _overrides(kontext_dir, path))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"rollout.prompts: {path}:1: image 'src/big.png' is 64x64" in err


def test_images_and_model_must_agree(kontext_dir, tiny_model_dir, edit_prompts):
    from async_flowgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rows carry \"images\", but model.family sd3 takes none"):
        load_config("sync", [f"model.path={tiny_model_dir}", f"rollout.prompts={edit_prompts}", "rollout.prompt_mix=null"])
    with pytest.raises(ConfigError, match="model.family flux_kontext edits images"):
        load_config("sync", _overrides(kontext_dir, "shapes_eval"))
    cfg = load_config("sync", _overrides(kontext_dir, edit_prompts))
    assert cfg.model.family == "flux_kontext"


@pytest.fixture(scope="module")
def policy(kontext_dir):
    from async_flowgrpo.policy import DiffusionPolicy

    return DiffusionPolicy(kontext_dir, lora_rank=4, lora_alpha=8)


def _sources(colors):
    out = []
    for c in colors:
        img = torch.full((32, 32, 3), 255, dtype=torch.uint8)
        img[8:16, 8:16] = torch.tensor(c, dtype=torch.uint8)
        out.append({SOURCE_IMAGES: [img]})
    return out


def test_recorded_log_probs_replay_within_1e4_with_true_cfg(policy):
    with torch.no_grad():  # move the LoRA off zero so that the adapters count in both passes
        for p in policy.trainable_parameters():
            p.normal_(0, 0.05)
    groups = policy.generate(["make the red square blue", "remove the blue square"], 2, num_steps=4, guidance_scale=2.0,
                             noise_level=0.7, sde_type="sde", window_size=2, seed=3,
                             metadata=_sources([(220, 30, 30), (35, 70, 225)]))
    worst = 0.0
    for g in groups:
        assert g.negative_pooled_prompt_embeds is not None  # true CFG: the negative branch sees the image too
        for j in range(g.params.window_size):
            n = g.size
            logp, *_ = policy.recompute(
                g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n), g.sigmas[j + 1].expand(n),
                g.prompt_embeds.expand(n, -1, -1), g.pooled_prompt_embeds.expand(n, -1),
                g.negative_prompt_embeds.expand(n, -1, -1), g.negative_pooled_prompt_embeds.expand(n, -1),
                guidance_scale=2.0, noise_level=0.7, sde_type="sde")
            worst = max(worst, (logp.detach() - g.log_probs[:, j]).abs().max().item())
    assert worst < 1e-4


def test_the_input_image_conditions_the_velocity(policy):
    x = torch.randn(1, *policy.adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    vs = []
    for meta in _sources([(220, 30, 30), (35, 70, 225)]):
        enc = policy._encode(["make the red square blue"], [meta], cfg=False)
        with torch.no_grad():
            vs.append(policy.velocity(x, torch.tensor([0.7]), enc.embeds, enc.pooled))
    assert (vs[0] - vs[1]).abs().max() > 1e-3


def test_missing_or_unexpected_images_fail_in_generate(policy, tiny_model_dir):
    from async_flowgrpo.policy import DiffusionPolicy

    kw = dict(num_steps=2, guidance_scale=1.0, noise_level=0.7, sde_type="sde", window_size=1, seed=0)
    with pytest.raises(ValueError, match="edits images: every prompt needs its input image"):
        policy.generate(["remove the red square"], 1, **kw)
    sd3 = DiffusionPolicy(tiny_model_dir, lora_rank=0)
    with pytest.raises(ValueError, match="takes no input images"):
        sd3.generate(["a red circle"], 1, metadata=_sources([(220, 30, 30)]), **kw)


def test_the_reward_receives_the_source_images(kontext_dir, edit_prompts):
    from async_flowgrpo.config import load_config
    from async_flowgrpo.rollout.worker import RolloutWorker

    cfg = load_config("sync", _overrides(kontext_dir, edit_prompts) + ["rollout.group_size=2", "rollout.num_steps=2",
                                                                       "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]"])
    seen = []

    def reward(images, prompts, metadata):
        seen.append((images.shape, prompts, metadata))
        return torch.zeros(len(prompts))

    from async_flowgrpo.rewards import register_reward

    register_reward("_test_sources", reward)
    cfg.reward.weights = {"_test_sources": 1.0}
    worker = RolloutWorker(cfg)
    (group,) = worker.generate([0])
    shape, prompts, metadata = seen[0]
    prompt = worker.prompts.prompt_at(0)
    assert shape[0] == 2 and prompts == [prompt.text] * 2
    expected = np.asarray(Image.open(prompt.images[0]).convert("RGB"))
    for meta in metadata:
        assert np.array_equal(meta[SOURCE_IMAGES][0].numpy(), expected)
    assert group.pooled_prompt_embeds.numel() > 32  # the image tokens travel in the group's conditioning
    # what generating a group took, since the last report (then nothing new to report)
    assert worker.stats()["perf/generate_s_per_group"] == group.time_generate_s > 0
    assert "perf/generate_s_per_group" not in worker.stats()


def test_remote_reward_gets_source_images_as_a_field():
    from async_flowgrpo.rewards.remote import _payload, decode_png

    src = torch.zeros(8, 8, 3, dtype=torch.uint8)
    src[2:4, 2:4] = 200
    body = json.loads(_payload(torch.zeros(1, 8, 8, 3, dtype=torch.uint8), ["p"], [{"kind": "x", SOURCE_IMAGES: [src]}]))
    assert body["metadata"] == [{"kind": "x"}]
    assert np.array_equal(decode_png(body["source_images"][0][0]), src.numpy())
    plain = json.loads(_payload(torch.zeros(1, 8, 8, 3, dtype=torch.uint8), ["p"], [{}]))
    assert "source_images" not in plain


def test_both_learners_train_on_edit_groups(kontext_dir):
    """The image tokens ride in the groups' conditioning, so Flow-GRPO's replay (within 1e-4 on
    fresh samples) and DiffusionNFT's forward-process loss train on them with finite gradients."""
    import math

    from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
    from async_flowgrpo.algorithms.diffusion_nft import NFTLearner
    from async_flowgrpo.policy import DiffusionPolicy

    metas = _sources([(220, 30, 30), (35, 70, 225)])
    prompts = ["make the red square blue", "remove the blue square"]
    for learner_cls, window in ((Learner, 2), (NFTLearner, 0)):
        policy = DiffusionPolicy(kontext_dir, lora_rank=4, lora_alpha=8)
        groups = policy.generate(prompts, 3, num_steps=3, guidance_scale=1.0, noise_level=0.7, sde_type="sde",
                                 window_size=window, seed=1, metadata=metas)
        for g in groups:
            g.advantages = torch.tensor([1.0, -1.0, 0.0])
        metrics = learner_cls(policy, micro_batch_size=4).train_step(groups, version=0)
        assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
        if learner_cls is Learner:
            assert metrics["logp/max_abs_diff"] < 1e-4


def test_evaluation_scores_edits_and_grids_source_beside_result(kontext_dir, edit_prompts):
    from async_flowgrpo.config import load_config
    from async_flowgrpo.evaluation import evaluate_policy
    from async_flowgrpo.policy import DiffusionPolicy

    cfg = load_config("sync", _overrides(kontext_dir, edit_prompts) + [
        "eval.num_steps=2", "eval.samples_per_prompt=2", "reward.weights={shapes_edit: 1.0}"])
    result = evaluate_policy(DiffusionPolicy(kontext_dir, lora_rank=0), cfg)
    assert 0.0 <= result["metrics"]["eval/accuracy"] <= 1.0 and "eval/accuracy_recolor" in result["metrics"]
    prompts = load_prompts(edit_prompts)
    assert result["images"].shape == (4, 32, 32, 3) and result["nrow"] == 8
    assert torch.equal(result["images"][0], with_sources(prompts[0])[SOURCE_IMAGES][0])  # the source, then its result
    assert result["captions"] == [prompts[0].text, "-> result", prompts[1].text, "-> result"]


def test_trained_lora_loads_into_flux_kontext_pipeline(policy, tmp_path, kontext_dir):
    from diffusers import FluxKontextPipeline

    state = {k: torch.randn_like(v) for k, v in policy.trainable_state().items()}  # (B != 0: a trained LoRA)
    policy.adapter.save_lora(str(tmp_path / "lora"), state)
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    name = next(k for k in state if "lora_B" in k)  # "<module>.lora_B.default.weight"; loaded as another adapter name
    module = name.split(".lora_B.")[0]
    loaded = [p for n, p in pipe.transformer.named_parameters() if n.startswith(module + ".lora_B.")]
    assert len(loaded) == 1 and torch.equal(loaded[0], state[name])


def test_a_queued_edit_group_survives_a_checkpoint(policy):
    """fully_async checkpoints its queued groups: the source images in their metadata are stored
    as tensors (no pickle) and come back equal."""
    from async_flowgrpo import checkpoint
    from async_flowgrpo.types import Group

    (group,) = policy.generate(["remove the red square"], 2, num_steps=2, guidance_scale=1.0, noise_level=0.7,
                               sde_type="sde", window_size=1, seed=0, metadata=_sources([(220, 30, 30)]))
    tree, tensors = checkpoint.encode(group.to_state())
    back = Group.from_state(checkpoint.decode(tree, {k: v.clone() for k, v in tensors.items()}))
    assert torch.equal(back.metadata[SOURCE_IMAGES][0], group.metadata[SOURCE_IMAGES][0])
    assert torch.equal(back.pooled_prompt_embeds, group.pooled_prompt_embeds)
