"""Wan2.2 in the wan family, on tiny random twins (models/tiny_wan.py VARIANTS): A14B's two experts
(transformer for high noise, transformer_2 for low, switched at boundary_ratio) and TI2V-5B's
per-token timesteps over the Wan2.2 VAE layout.

The adapter's ODE sampler reproduces WanPipeline (expert switch, both guidance scales, per-token
timesteps, the 48-channel latent normalisation); the trainer's recompute reproduces the rollout's
log-probs at every step, also on a batch whose rows straddle the boundary; LoRA goes on the trained
experts only (model.trained_experts); one update trains both experts, and the saved adapters load
into a real WanPipeline (load_into_transformer_2) and sample what our policy samples.
"""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
from async_flowgrpo.models import load_adapter
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir
from async_flowgrpo.policy import DiffusionPolicy

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4  # the A14B twin's sigmas * 1000: 1000, 961 (transformer) | 861, 126 (transformer_2)
PROMPT = "a red circle moving left"
GUIDANCE, GUIDANCE_2 = 4.0, 3.0  # A14B's high-noise and low-noise scales
FRAMES = 5


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return {v: make_tiny_wan_dir(str(tmp_path_factory.mktemp(v)), v) for v in ("wan22_a14b", "wan22_ti2v_5b")}


def cond_of(g, n=None):
    n = n or g.size
    return [t.unsqueeze(0).expand(n, *t.shape) if t is not None else None for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]


def ode_sample(adapter, x, guidance_scale, lora_scale=None):
    enc = adapter.encode_prompts([PROMPT], cfg=True)
    sigmas = adapter.sigmas(STEPS)
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=guidance_scale)
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    return x


def pipe_kwargs(adapter, x0, **kw):
    return dict(prompt=PROMPT, negative_prompt=adapter.negative_prompt, height=32, width=32, num_frames=FRAMES,
                num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=adapter.max_sequence_length,
                latents=x0, **kw)


@pytest.mark.parametrize("variant", ["wan22_a14b", "wan22_ti2v_5b"])
def test_ode_sampler_matches_wan_pipeline(twins, variant):
    adapter = load_adapter(twins[variant], device="cpu", dtype=torch.float32)
    two = variant == "wan22_a14b"
    if two:
        adapter.select_experts(guidance_scale_2=GUIDANCE_2)
        t = adapter.sigmas(STEPS)[:-1] * 1000
        assert (t >= adapter.boundary).sum() == 2 and (t < adapter.boundary).sum() == 2  # both experts denoise
    else:
        assert adapter.expand_timesteps and adapter.latent_shape(32, 32) == (48, 3, 8, 8)  # Wan2.2 VAE: 4x here
    pipe = adapter.pipeline
    x0 = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    kwargs = pipe_kwargs(adapter, x0, **({"guidance_scale_2": GUIDANCE_2} if two else {}))
    ref_latents = pipe(output_type="latent", **kwargs).frames
    ref_video = pipe(output_type="pt", **kwargs).frames  # [1, F, 3, H, W] in [0, 1]
    x = ode_sample(adapter, x0, GUIDANCE)
    torch.testing.assert_close(x, ref_latents.float(), atol=1e-4, rtol=1e-4)
    video = adapter.decode(x).float() / 255  # [1, F, H, W, 3], through latents_mean / latents_std
    assert video.shape == (1, FRAMES, 32, 32, 3)
    assert (video - ref_video.permute(0, 1, 3, 4, 2)).abs().max() <= 1.01 / 255
    if two:  # the second scale matters: with guidance_scale_2 = guidance_scale the result differs
        adapter.select_experts()
        assert (ode_sample(adapter, x0, GUIDANCE) - x).abs().max() > 1e-4


def rollout(path, seed=0, **policy_kw):
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8, **policy_kw)
    groups = policy.generate([PROMPT, "a blue square moving right"], 2, num_steps=STEPS, guidance_scale=GUIDANCE,
                             noise_level=0.7, sde_type="sde", window_size=STEPS - 1, seed=seed)
    return policy, groups


@pytest.mark.parametrize("variant,policy_kw", [
    ("wan22_a14b", dict(guidance_scale_2=GUIDANCE_2)),
    ("wan22_a14b", dict(trained_experts=["transformer_2"])),
    ("wan22_ti2v_5b", {}),
])
def test_recompute_reproduces_logprobs_on_every_step(twins, variant, policy_kw):
    """The window covers steps 0-2: step 1 by transformer, step 2 by transformer_2 on the A14B twin.
    A batch whose rows are different steps (the trainer's batched replay) gives each row its expert."""
    policy, groups = rollout(twins[variant], **policy_kw)
    g = groups[0]
    n, cond = g.size, cond_of(g)
    step = dict(guidance_scale=GUIDANCE, noise_level=0.7, sde_type="sde")
    for j in range(g.log_probs.shape[1]):
        with torch.no_grad():
            log_prob, *_ = policy.recompute(g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n),
                                            g.sigmas[j + 1].expand(n), *cond, **step)
        assert (log_prob.cpu() - g.log_probs[:, j]).abs().max() < 1e-5, f"step {j}"
    # rows: sample 0 at step 1, sample 1 at step 2, sample 0 at step 2 (one batch, both experts)
    rows = [(0, 1), (1, 2), (0, 2)]
    pick = lambda t, off=0: torch.stack([t[i, j + off] for i, j in rows])  # noqa: E731
    sig = lambda off: torch.stack([g.sigmas[j + off] for _, j in rows])  # noqa: E731
    with torch.no_grad():
        log_prob, *_ = policy.recompute(pick(g.latents), pick(g.latents, 1), sig(0), sig(1), *cond_of(g, 3), **step)
    assert (log_prob.cpu() - torch.stack([g.log_probs[i, j] for i, j in rows])).abs().max() < 1e-5


def test_lora_goes_on_the_trained_experts_only(twins):
    path = twins["wan22_a14b"]
    both = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    names = list(both.trainable_state())
    assert {n.split(".")[0] for n in names} == {"transformer", "transformer_2"} and all("lora_" in n for n in names)
    low = DiffusionPolicy(path, lora_rank=4, lora_alpha=8, trained_experts=["transformer_2"])
    assert list(low.trainable_state()) == [n for n in names if n.startswith("transformer_2.")]
    pipe = low.adapter.pipeline
    assert not any("lora_" in n for n, _ in pipe.transformer.named_parameters())
    assert pipe.transformer in low.adapter.frozen_modules and not any(p.requires_grad for p in pipe.transformer.parameters())
    # the same initial adapters in every process that builds the policy (no sync needed at start)
    again = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    assert all(torch.equal(v, again.trainable_state()[k]) for k, v in both.trainable_state().items())
    with pytest.raises(ValueError, match=r"model.trained_experts \['transformer_3'\]: choose from transformer, transformer_2"):
        DiffusionPolicy(path, lora_rank=4, trained_experts=["transformer_3"])


def test_update_trains_both_experts_and_the_saved_loras_load_into_wan_pipeline(twins, tmp_path):
    from diffusers import WanPipeline

    path = twins["wan22_a14b"]
    policy, groups = rollout(path, guidance_scale_2=GUIDANCE_2)
    for g in groups:
        g.advantages = torch.tensor([-1.0, 1.0])
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = Learner(policy, micro_batch_size=2, clip_range=1e-2, lr=1e-2).train_step(groups, version=0)
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["logp/max_abs_diff"] < 1e-5
    after = policy.trainable_state()
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k]) and "lora_B" in k}
    assert changed == {"transformer", "transformer_2"}  # one optimizer over both experts' adapters

    policy.adapter.save_lora(str(tmp_path), policy.trainable_state())  # as the trainer saves weights
    assert sorted(os.listdir(tmp_path)) == ["pytorch_lora_weights.safetensors", "transformer_2"]
    pipe = WanPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path))
    pipe.load_lora_weights(str(tmp_path / "transformer_2"), load_into_transformer_2=True)
    x0 = torch.randn((1, *policy.adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(2))
    ref = pipe(output_type="latent", guidance_scale_2=GUIDANCE_2, **{
        k: v for k, v in pipe_kwargs(policy.adapter, x0).items() if k != "negative_prompt"},
        negative_prompt=policy.adapter.negative_prompt).frames
    ours = ode_sample(policy.adapter, x0, GUIDANCE)
    torch.testing.assert_close(ours, ref.float(), atol=1e-4, rtol=1e-4)
    assert (ours - ode_sample(load_adapter(path, device="cpu", dtype=torch.float32), x0, GUIDANCE)).abs().max() > 0


def test_presets_load_and_the_expert_keys_are_validated(twins, capsys):
    from async_flowgrpo.builders import build_policy
    from async_flowgrpo.config import CONFIG_DIR, config_or_exit

    a14b, ti2v = twins["wan22_a14b"], twins["wan22_ti2v_5b"]
    preset = os.path.join(CONFIG_DIR, "model", "wan22_t2v_a14b.yaml")
    cfg = load_config("fully_async", [preset, f"model.path={a14b}"])
    assert (cfg.model.guidance_scale_2, cfg.rollout.guidance_scale, cfg.rollout.num_frames) == (3.0, 4.0, 81)
    cfg = load_config("fully_async", [os.path.join(CONFIG_DIR, "model", "wan22_ti2v_5b.yaml"), f"model.path={ti2v}"])
    assert (cfg.rollout.num_frames, cfg.rollout.resolution, cfg.rollout.guidance_scale) == (121, 704, 5.0)

    video = ["model.family=wan", "reward.weights={temporal_consistency: 1.0}", "model.lora_rank=4", "model.lora_alpha=8"]
    cfg = load_config("sync", [f"model.path={a14b}", *video, "model.trained_experts=[transformer_2]",
                               "model.guidance_scale_2=2.0"])
    policy = build_policy(cfg)  # the keys reach the policy and its adapter
    assert policy.adapter.trained == ("transformer_2",) and policy.adapter.guidance_scale_2 == 2.0
    assert all(k.startswith("transformer_2.") for k in policy.trainable_state())

    bad = [
        ([f"model.path={a14b}", "model.trained_experts=[transformer_3]"],
         r"^model.trained_experts: \['transformer_3'\]: choose from the model's experts \(transformer, transformer_2\)"),
        ([f"model.path={a14b}", "model.trained_experts=[]"], "^model.trained_experts: "),
        ([f"model.path={a14b}", "model.guidance_scale_2=0.5"], r"^model.guidance_scale_2: 0.5: must be >= 1"),
        ([f"model.path={ti2v}", "model.guidance_scale_2=3.0"], r"^model.guidance_scale_2: the model has one transformer"),
        ([f"model.path={ti2v}", "model.trained_experts=[transformer_2]"], "^model.trained_experts: "),
        ([f"model.path={a14b}", "trainer.fsdp=true"], "^trainer.fsdp: not for two-expert models"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_config("sync", [*video, *overrides])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("sync", [*video, f"model.path={ti2v}", "model.guidance_scale_2=3.0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("config error: model.guidance_scale_2")


@pytest.mark.parametrize("micro_batch_size", [1, 6])
def test_training_one_expert_on_a_window_that_spans_both(twins, micro_batch_size):
    """With only the low-noise expert trained, the window's high-noise steps carry no gradient: a
    call whose rows all belong to the frozen expert adds nothing (at micro-batch 1, steps 0-1), and
    the update moves the trained expert's adapters only."""
    policy, groups = rollout(twins["wan22_a14b"], trained_experts=["transformer_2"])
    for g in groups:
        g.advantages = torch.tensor([-1.0, 1.0])
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = Learner(policy, micro_batch_size=micro_batch_size, clip_range=1e-2, lr=1e-2).train_step(groups, version=0)
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["logp/max_abs_diff"] < 1e-5
    after = policy.trainable_state()
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k]) and "lora_B" in k}
    assert changed == {"transformer_2"}


def test_compile_finds_both_experts_blocks(twins):
    """trainer.compile / rollout.compile on A14B's layout: the wrapper holds two transformers, and
    each one's blocks are compiled (nn.Module.compile compiles lazily: nothing runs here)."""
    from async_flowgrpo.models import load_adapter
    from async_flowgrpo.policy import compile_blocks

    adapter = load_adapter(twins["wan22_a14b"], device="cpu", dtype=torch.float32)
    experts = list(adapter.transformer.children())
    expected = [block for expert in experts for block in expert.blocks]
    assert len(experts) == 2 and expected
    compiled = compile_blocks(adapter.transformer, "aot_eager")
    assert [id(b) for b in compiled] == [id(b) for b in expected]
    assert all(b._compiled_call_impl is not None for b in compiled)
    with pytest.raises(ValueError, match="no block list"):
        compile_blocks(torch.nn.Linear(2, 2), "aot_eager")
