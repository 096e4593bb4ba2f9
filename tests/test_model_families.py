"""Flux and Qwen-Image adapters on tiny random instances of the real architectures, built offline.

For each family: the directory loads through `load_adapter` (picked from model_index.json), the
adapter's ODE sampler reproduces the diffusers pipeline (timestep convention, packing, position
ids, guidance, shift, decoding), recompute reproduces the rollout's log-probs on every recorded
step, and one Learner.train_step moves the LoRA weights, which sit on the named target modules.
"""

import os

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.models.common import pack_latents, unpack_latents
from async_flowgrpo.models.flux import FluxAdapter
from async_flowgrpo.models.qwen_image import QwenImageAdapter
from async_flowgrpo.models.tiny_flux import make_tiny_flux_dir
from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4
PROMPT = "a red circle"

# name -> (builder, builder kwargs, adapter class, guidance_scale, CFG batch expected)
FAMILIES = {
    "flux_dev": (make_tiny_flux_dir, {}, FluxAdapter, 3.5, False),  # guidance embedding, no CFG batch
    "flux_true_cfg": (make_tiny_flux_dir, {"guidance_embeds": False}, FluxAdapter, 3.0, True),
    "qwen_image": (make_tiny_qwen_image_dir, {}, QwenImageAdapter, 4.0, True),  # true CFG + norm rescale
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    build, kwargs, adapter_cls, guidance, cfg = FAMILIES[request.param]
    path = build(str(tmp_path_factory.mktemp(request.param)), **kwargs)
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    groups = policy.generate(
        [PROMPT], 2, num_steps=STEPS, guidance_scale=guidance, noise_level=0.7, sde_type="sde",
        window_size=STEPS - 1, seed=0,
    )
    return dict(name=request.param, path=path, policy=policy, adapter_cls=adapter_cls, guidance=guidance, cfg=cfg,
                groups=groups)


def test_loads_through_load_adapter_and_records_groups(family):
    policy, (g,) = family["policy"], family["groups"]
    assert type(policy.adapter) is family["adapter_cls"]
    c, h, w = policy.adapter.latent_shape(32, 32)
    assert (c, h, w) == (16, 16, 16)  # 16 VAE channels, stored unpacked
    assert g.latents.shape == (2, STEPS, c, h, w) and g.log_probs.shape == (2, STEPS - 1)
    assert g.images.shape == (2, 32, 32, 3) and g.images.dtype == torch.uint8
    assert torch.isfinite(g.log_probs).all()
    assert (g.negative_prompt_embeds is not None) == family["cfg"]
    assert g.sigmas[0] == 1.0 and len(g.sigmas) == STEPS
    if family["adapter_cls"] is QwenImageAdapter:
        from async_flowgrpo.models.tiny_qwen_image import template_prefix_length

        pipe = policy.adapter.pipeline  # the reloaded tokenizer still splits off exactly the dropped prefix
        assert template_prefix_length(pipe) == pipe.prompt_template_encode_start_idx == 34
        mask = g.pooled_prompt_embeds  # the "pooled" slot carries the text mask
        assert mask.shape == (policy.adapter.max_sequence_length,) and set(mask.tolist()) == {0.0, 1.0}


def test_adapter_device_and_dtype_are_the_transformers(family):
    """The adapters cache diffusers' (slow) device / dtype lookup; the answer must be the same."""
    adapter = family["policy"].adapter
    transformer = adapter.transformer
    assert adapter.device == transformer.device and adapter.dtype == transformer.dtype
    assert adapter._placement[0] is transformer  # cached after the first velocity call


def test_lora_targets_exist(family):
    transformer = family["policy"].adapter.transformer
    names = [n for n, _ in transformer.named_modules()]
    for target in family["policy"].adapter.lora_target_modules:
        assert any(n.endswith(f".{target}.lora_A") for n in names), f"no LoRA on {target}"


def test_recompute_reproduces_logprobs_on_every_step(family):
    policy, (g,) = family["policy"], family["groups"]
    n = g.size

    def rows(t):
        return None if t is None else t.unsqueeze(0).expand(n, *t.shape)

    cond = [rows(t) for t in (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds,
                              g.negative_pooled_prompt_embeds)]
    for j in range(g.log_probs.shape[1]):
        with torch.no_grad():
            log_prob, *_ = policy.recompute(
                g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n), g.sigmas[j + 1].expand(n), *cond,
                guidance_scale=family["guidance"], noise_level=0.7, sde_type="sde",
            )
        assert (log_prob.cpu() - g.log_probs[:, j]).abs().max() < 1e-5, f"step {j}"


def test_ode_sampler_matches_diffusers_pipeline(family):
    """The adapter's conventions (timestep scale, packing, ids, guidance, dynamic shift, the CFG
    rescale, the VAE's latent normalization) reproduce the family's own diffusers pipeline."""
    adapter = family["policy"].adapter
    pipe, guidance = adapter.pipeline, family["guidance"]
    x0 = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    kwargs = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=STEPS,
                  max_sequence_length=adapter.max_sequence_length, latents=pack_latents(x0))
    if family["adapter_cls"] is QwenImageAdapter:
        kwargs.update(true_cfg_scale=guidance, negative_prompt=adapter.negative_prompt)
    elif family["cfg"]:
        kwargs.update(true_cfg_scale=guidance, negative_prompt=adapter.negative_prompt, guidance_scale=None)
    else:
        kwargs.update(guidance_scale=guidance)
    ref_latents = pipe(output_type="latent", **kwargs).images
    ref_images = pipe(output_type="np", **kwargs).images

    enc = adapter.encode_prompts([PROMPT], cfg=guidance > 1)
    sigmas = adapter.sigmas(STEPS)
    x = x0
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(x, sigmas[i], enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled,
                                 guidance_scale=guidance)
            x = algo.ode_step(v, x, sigmas[i], sigmas[i + 1])
    torch.testing.assert_close(pack_latents(x), ref_latents.float(), atol=1e-4, rtol=1e-4)
    images = adapter.decode(x).float() / 255
    assert (images - torch.as_tensor(ref_images)).abs().max() <= 1.01 / 255


def test_one_train_step_changes_lora(family):
    policy, groups = family["policy"], family["groups"]
    for g in groups:
        g.rewards = torch.tensor([0.0, 1.0])
        g.advantages = torch.tensor([-1.0, 1.0])
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = Learner(policy, micro_batch_size=2, clip_range=1e-2).train_step(groups, version=0)
    after = policy.trainable_state()
    assert metrics["train/skipped_nonfinite"] == 0 and metrics["samples/trained"] == 2
    assert metrics["logp/max_abs_diff"] < 1e-5  # fresh samples: the recomputed logp is the rollout's
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("lora_B" in k for k in changed)
    assert all("lora_" in k for k in before)


def test_uncond_grad_false_keeps_the_forward_and_drops_the_unconditional_gradient(family):
    """uncond_grad=False (flow_grpo's update) leaves the guided velocity as it is and removes the
    unconditional branch's share of the gradient, which is then the conditional branch's alone."""
    if not family["cfg"]:
        pytest.skip("guidance-distilled: no CFG batch, nothing to detach")
    policy, g = family["policy"], family["groups"][0]
    adapter, guidance = policy.adapter, family["guidance"]
    x, sigma = g.latents[:, 0], g.sigmas[0].expand(g.size)
    cond = [t.expand(g.size, *t.shape) for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]
    lora_b = [p for n, p in policy.adapter.transformer.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for p in lora_b:  # B = 0 at init would make every LoRA gradient path but B's vanish
            p.normal_(0, 0.05)

    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))

    def grads(**kw):
        for p in lora_b:
            p.grad = None
        v = adapter.velocity(x, sigma, *cond, guidance_scale=guidance, **kw)
        (v * weights).sum().backward()  # not |v|^2: Qwen-Image rescales each row to |v_cond|
        return v.detach(), torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in lora_b])

    grad_enabled = []  # per transformer call: whether it builds a graph
    hook = adapter.transformer.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    try:
        v_both, g_both = grads()
        assert grad_enabled in ([True], [True, True])  # one batch [uncond; cond] (Qwen-Image: a call per text length)
        grad_enabled.clear()
        v_cond, g_cond = grads(uncond_grad=False)
        # the unconditional half on its own without a graph: backward covers the conditional half only
        assert grad_enabled == [False, True]
    finally:
        hook.remove()
    assert torch.allclose(v_both, v_cond, atol=1e-5)
    assert not torch.allclose(g_both, g_cond, rtol=1e-3, atol=1e-8)
    if family["name"] != "qwen_image":  # (Qwen-Image rescales by |v|, which involves the uncond half)
        # d/dθ [v_u + g (v_c - v_u)] with v_u constant = g dv_c/dθ
        for p in lora_b:
            p.grad = None
        v_c = adapter.velocity(x, sigma, cond[0], cond[1], guidance_scale=1.0)
        (guidance * v_c * weights).sum().backward()
        g_alone = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in lora_b])
        torch.testing.assert_close(g_cond, g_alone, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        for p in lora_b:
            p.zero_()


def test_pack_unpack_roundtrip_and_dynamic_shift(family):
    adapter = family["policy"].adapter
    x = torch.randn(2, 16, 8, 12)
    assert torch.equal(unpack_latents(pack_latents(x), 8, 12), x)
    # the shift depends on the image's token count (use_dynamic_shifting): bigger images, later sigmas
    small, big = adapter.sigmas(STEPS), adapter.sigmas(STEPS, height=128, width=128)
    assert small[0] == big[0] == 1 and small[-1] == big[-1] == 0
    assert (big >= small - 1e-6).all() and big[1] > small[1]  # (Qwen-Image's shift_terminal pins the last one)
    with pytest.raises(ValueError, match="multiples"):
        adapter.latent_shape(30, 32)


def test_config_accepts_the_families(family):
    name = {"flux_dev": "flux", "flux_true_cfg": "flux", "qwen_image": "qwen_image"}[family["name"]]
    cfg = load_config("sync", [f"model.path={family['path']}", f"model.family={name}"])
    assert cfg.model.family == name
    with pytest.raises(ConfigError, match="model.family"):
        load_config("sync", [f"model.path={family['path']}", "model.family=dalle"])
