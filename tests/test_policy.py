"""DiffusionPolicy on the tiny SD3: the recorded log-probs are reproduced by the trainer's
recompute, generation is reproducible, versions are stamped per step, weights round-trip."""

import os

import pytest
import torch

from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.policy import DiffusionPolicy

# 2 shared cores: OpenMP threads spinning against other jobs make tiny matmuls ~20x slower
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red circle", "a blue square"]
STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3")))


@pytest.fixture(scope="module")
def policy(model_dir):
    return DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)


def gen(policy, *, seed=0, guidance=4.5, sde_type="sde", window_size=STEPS - 1, window_range=None, n=2, **kw):
    return policy.generate(
        PROMPTS, n, num_steps=STEPS, guidance_scale=guidance, noise_level=0.7, sde_type=sde_type,
        window_size=window_size, window_range=window_range, seed=seed, **kw,
    )


def recompute(policy, items, *, with_ref=False):
    """items: (group, sample k, step j) triples, scored as one micro-batch."""
    g0 = items[0][0]
    cfg = g0.negative_prompt_embeds is not None

    def stack(f):
        return torch.stack([f(g, k, j) for g, k, j in items])

    return policy.recompute(
        stack(lambda g, k, j: g.latents[k, j]),
        stack(lambda g, k, j: g.latents[k, j + 1]),
        stack(lambda g, k, j: g.sigmas[j]),
        stack(lambda g, k, j: g.sigmas[j + 1]),
        stack(lambda g, k, j: g.prompt_embeds),
        stack(lambda g, k, j: g.pooled_prompt_embeds),
        stack(lambda g, k, j: g.negative_prompt_embeds) if cfg else None,
        stack(lambda g, k, j: g.negative_pooled_prompt_embeds) if cfg else None,
        guidance_scale=g0.params.guidance_scale,
        noise_level=g0.params.noise_level,
        sde_type=g0.params.sde_type,
        with_ref=with_ref,
    )


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("guidance", [4.5, 1.0])
@pytest.mark.parametrize("window", ["all_but_last", "short"])
def test_recompute_reproduces_recorded_log_probs(policy, sde_type, guidance, window):
    size, rng = (STEPS - 1, None) if window == "all_but_last" else (2, (1, 5))
    groups = gen(policy, sde_type=sde_type, guidance=guidance, window_size=size, window_range=rng, seed=3)
    for g in groups:
        assert g.log_probs.shape == (2, size) and g.latents.shape[:2] == (2, size + 1)
        assert (g.negative_prompt_embeds is not None) == (guidance > 1)
        if window == "all_but_last":
            assert g.params.window_start == 0 and g.sigmas[0] == 1.0  # the s == 1 step is covered
    for j in range(size):  # every recorded step, the whole batch of both groups
        items = [(g, k, j) for g in groups for k in range(g.size)]
        log_prob = recompute(policy, items)[0]
        recorded = torch.stack([g.log_probs[k, j] for g, k, j in items])
        torch.testing.assert_close(log_prob.detach(), recorded, rtol=0, atol=1e-5)
    # another micro-batch composition: one sample of each group at different steps (per-sample sigmas)
    items = [(groups[1], 1, size - 1), (groups[0], 0, 0)]
    log_prob = recompute(policy, items)[0]
    recorded = torch.stack([g.log_probs[k, j] for g, k, j in items])
    torch.testing.assert_close(log_prob.detach(), recorded, rtol=0, atol=1e-5)


def test_recompute_has_gradients_and_lora_starts_at_reference(policy):
    g = gen(policy, seed=1)[0]
    log_prob, mean, std, ref_mean = recompute(policy, [(g, 0, 0), (g, 1, 2)], with_ref=True)
    assert log_prob.requires_grad and not ref_mean.requires_grad
    torch.testing.assert_close(mean.detach(), ref_mean, rtol=0, atol=1e-6)  # gaussian init: B = 0
    assert all(p.requires_grad for p in policy.trainable_parameters())  # adapters re-enabled


def test_generate_is_reproducible_per_seed(policy):
    a, b, c = gen(policy, seed=7), gen(policy, seed=7), gen(policy, seed=8)
    for ga, gb in zip(a, b):
        assert torch.equal(ga.latents, gb.latents) and torch.equal(ga.log_probs, gb.log_probs)
        assert torch.equal(ga.images, gb.images)
    assert not torch.equal(a[0].latents, c[0].latents)
    assert a[0].images.dtype == torch.uint8 and a[0].images.shape == (2, 32, 32, 3)
    assert a[0].prompt == PROMPTS[0] and a[1].prompt_index == 1 and a[0].seed == 7


def test_shared_initial_noise_differs_only_by_the_window_noise(policy):
    shared = gen(policy, seed=7, window_size=2, window_range=(0, 2), shared_initial_noise=True)
    independent = gen(policy, seed=7, window_size=2, window_range=(0, 2))
    for g in shared:  # the window starts at step 0: its first recorded latent is the initial noise
        assert torch.equal(g.latents[0, 0], g.latents[1, 0])
        assert not torch.equal(g.latents[0, -1], g.latents[1, -1])  # the window's noise differs
    assert not torch.equal(shared[0].latents[0, 0], shared[1].latents[0, 0])  # one noise per prompt
    assert not torch.equal(independent[0].latents[0, 0], independent[0].latents[1, 0])


def test_version_fn_is_called_before_each_step_and_stamped(policy):
    calls = []

    def version_fn():
        calls.append(len(calls))
        return 0 if len(calls) <= 2 else 1

    g = gen(policy, version_fn=version_fn, prompt_indices=[10, 11], metadata=[{"a": 1}, {"a": 2}])[0]
    assert len(calls) == STEPS
    assert g.versions.tolist() == [0, 0, 1, 1, 1]
    assert g.staleness(1) == 1 and g.prompt_index == 10 and g.metadata == {"a": 1}


def test_window_size_zero_is_a_pure_ode_sample_recording_the_final_latent(policy):
    """DiffusionNFT's group: the final latent (sigma 0) and every step's version, no log-probs."""
    steps = iter([0, 0, 1, 1, 1, 2])
    g = gen(policy, window_size=0, version_fn=lambda: next(steps))[0]
    assert g.log_probs.shape == (2, 0) and g.latents.shape[:2] == (2, 1) and g.sigmas.tolist() == [0.0]
    assert g.versions.tolist() == [0, 0, 1, 1, 1, 2] and g.staleness(2) == 2
    assert g.images.shape == (2, 32, 32, 3)
    # it is the latent the images were decoded from: decoding it again gives them back
    assert (policy.adapter.decode(g.latents[:, 0]).int() - g.images.int()).abs().max() <= 1


def test_trainable_state_round_trip_changes_output(policy):
    g = gen(policy, seed=2)[0]
    items = [(g, 0, 1)]
    state = {k: v.clone() for k, v in policy.trainable_state().items()}
    assert state and all("lora_" in k for k in state)
    before = recompute(policy, items)[1].detach()
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    policy.load_trainable_state(perturbed)
    try:
        assert not torch.allclose(recompute(policy, items)[1].detach(), before)
        assert all(torch.equal(policy.trainable_state()[k], v) for k, v in perturbed.items())
    finally:
        policy.load_trainable_state(state)
    torch.testing.assert_close(recompute(policy, items)[1].detach(), before, rtol=0, atol=0)
    with pytest.raises(KeyError, match="mismatch"):
        policy.load_trainable_state({"nope": torch.zeros(1)})


def test_lora_init_is_seeded(model_dir, policy):
    other = DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)
    for (k, a), b in zip(policy.trainable_state().items(), other.trainable_state().values()):
        if "lora_A" in k:  # B starts at 0 and may have been perturbed/restored above
            assert torch.equal(a, b)


def test_missing_or_bad_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        DiffusionPolicy(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="model.path .* not a diffusers model"):
        DiffusionPolicy(str(tmp_path))


def test_full_fine_tune_reference(model_dir):
    full = DiffusionPolicy(model_dir, lora_rank=0)
    names = list(full.trainable_state())
    assert names == [n for n, _ in full.adapter.transformer.named_parameters()] and not any("lora" in n for n in names)
    g = gen(full, seed=4, guidance=1.0)[0]
    with pytest.raises(ValueError, match="reference_copy"):
        recompute(full, [(g, 0, 0)], with_ref=True)
    ref = DiffusionPolicy(model_dir, lora_rank=0, reference_copy=True)
    _, mean, _, ref_mean = recompute(ref, [(g, 0, 0)], with_ref=True)
    torch.testing.assert_close(mean.detach(), ref_mean, rtol=0, atol=0)


def test_sd3_without_uncond_grad_runs_the_unconditional_half_without_a_graph(policy):
    """uncond_grad=False: the unconditional half is a separate no-grad forward, so backward covers
    the conditional half only; the velocity is unchanged and the gradient is g * d(v_cond)."""
    g = gen(policy, seed=3, n=2)[0]
    adapter, guidance = policy.adapter, 4.5
    x, sigma = g.latents[:, 1], g.sigmas[1].expand(g.size)
    cond = [t.expand(g.size, *t.shape) for t in
            (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)]
    lora_b = [p for n, p in adapter.transformer.named_parameters() if "lora_B" in n]
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    grad_enabled = []

    def grads(v_fn):
        for p in lora_b:
            p.grad = None
        (v_fn() * weights).sum().backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in lora_b])

    with torch.no_grad():
        saved = [p.clone() for p in lora_b]
        for p in lora_b:  # B = 0 at init would leave only B's own gradient
            p.normal_(0, 0.05)
    hook = adapter.transformer.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    try:
        g_split = grads(lambda: adapter.velocity(x, sigma, *cond, guidance_scale=guidance, uncond_grad=False))
        assert grad_enabled == [False, True]
        g_alone = grads(lambda: guidance * adapter.velocity(x, sigma, *cond[:2], guidance_scale=1.0))
        with torch.no_grad():
            v_split = adapter.velocity(x, sigma, *cond, guidance_scale=guidance, uncond_grad=False)
            v_batched = adapter.velocity(x, sigma, *cond, guidance_scale=guidance)
    finally:
        hook.remove()
        with torch.no_grad():
            for p, s in zip(lora_b, saved):
                p.copy_(s)
    torch.testing.assert_close(g_split, g_alone, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(v_split, v_batched, rtol=0, atol=0)  # no graph: one batched forward either way


def test_bf16_policy_computes_under_autocast_and_recompute_still_matches(model_dir):
    """bf16 weights imply autocast (the fp32 LoRA adapters then run as bf16 matmuls, not fp32 ones:
    10% of a rollout on an H200, docs/gpu.md); rollout and recompute go through the same forward."""
    policy = DiffusionPolicy(model_dir, dtype=torch.bfloat16, lora_rank=4, lora_alpha=8)
    assert policy.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())  # Adam's precision
    seen = []
    hook = policy.adapter.transformer.register_forward_hook(lambda m, a, out: seen.append(torch.is_autocast_enabled("cpu")))
    try:
        g = gen(policy, seed=5, n=2)[0]
        log_prob = recompute(policy, [(g, 0, 0), (g, 1, 3)])[0]
    finally:
        hook.remove()
    assert seen and all(seen)
    torch.testing.assert_close(log_prob.detach(), torch.stack([g.log_probs[0, 0], g.log_probs[1, 3]]), rtol=0, atol=1e-4)
    assert DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8).autocast_dtype is None  # fp32 on CPU: no autocast

    # peft's cast of the activations to the adapters' fp32 is off under autocast: same values
    lora_layers = [m for m in policy.adapter.transformer.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert lora_layers and not any(m.cast_input_dtype_enabled for m in lora_layers)
    with torch.no_grad():
        for p in policy.trainable_parameters():  # B = 0 at init would hide the adapters' path
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x, sigma = g.latents[:, 1], g.sigmas[1].expand(g.size)
    cond = (g.prompt_embeds.expand(g.size, *g.prompt_embeds.shape), g.pooled_prompt_embeds.expand(g.size, -1))
    with torch.no_grad():
        without_cast = policy.velocity(x, sigma, *cond)
        for m in lora_layers:
            m.cast_input_dtype_enabled = True
        with_cast = policy.velocity(x, sigma, *cond)
    assert torch.equal(without_cast, with_cast)


def test_fused_lora_generates_as_the_adapters_and_refolds_from_the_base_without_drift(model_dir):
    """fuse_lora (rollouts on GPUs): the LoRA deltas folded into the base weights give the
    adapters' log-probs (fp32 here: to rounding); every load refolds from the kept base weight, so
    loading the same state after many others gives the same weights bit for bit."""
    policy = DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)
    rng = torch.Generator().manual_seed(0)
    states = [{k: v + 0.05 * torch.randn(v.shape, generator=rng) for k, v in policy.trainable_state().items()}
              for _ in range(3)]
    policy.load_trainable_state(states[0])
    separate = gen(policy, seed=4)
    base = {n: p.detach().clone() for n, p in policy.adapter.transformer.named_parameters() if "lora_" not in n}

    policy.fuse_lora()
    fused = gen(policy, seed=4)
    for a, b in zip(separate, fused):
        torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.latents, a.latents, rtol=1e-4, atol=1e-4)
    folded = {n: p.detach().clone() for n, p in policy.adapter.transformer.named_parameters() if "lora_" not in n}
    assert any(not torch.equal(folded[n], base[n]) for n in base)  # the deltas are in the base weights now
    for state in states[1:] * 5 + states[:1]:  # new weights arrive: each load refolds
        policy.load_trainable_state(state)
    again = {n: p.detach() for n, p in policy.adapter.transformer.named_parameters() if "lora_" not in n}
    assert all(torch.equal(again[n], folded[n]) for n in folded)
    with pytest.raises(ValueError, match="KL reference"):
        recompute(policy, [(fused[0], 0, 0)], with_ref=True)

    policy.unfuse_lora()
    assert all(torch.equal(p.detach(), base[n]) for n, p in policy.adapter.transformer.named_parameters() if n in base)
    torch.testing.assert_close(gen(policy, seed=4)[0].log_probs, separate[0].log_probs, rtol=0, atol=0)


def test_policy_takes_an_adapter_built_in_memory(model_dir):
    """benchmarks/gpu.py builds real-size models without files: the adapter is moved and cast, and
    its cached device and dtype follow."""
    from async_flowgrpo.models import load_adapter

    adapter = load_adapter(model_dir, device="cpu", dtype=torch.float32)
    assert adapter.dtype == torch.float32  # cached now
    policy = DiffusionPolicy(adapter, dtype=torch.bfloat16, lora_rank=4, lora_alpha=8)
    assert policy.adapter is adapter and adapter.dtype == torch.bfloat16
    assert adapter.pipeline.transformer.dtype == torch.bfloat16
    assert adapter.pipeline.vae.dtype == torch.float32  # on a CPU the VAE stays fp32 (test_wan.py)
    g = gen(policy, seed=1, n=1)[0]
    assert g.images.shape == (1, 32, 32, 3)


def test_reference_forward_is_the_transformer_with_its_adapters_disabled(model_dir):
    """The KL reference switches peft's layers off directly: the same forward as diffusers'
    transformer.disable_adapters(), and the adapters (and their gradients) are back after it."""
    policy = DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # B = 0 at init would make the reference equal to the policy
        for n, p in policy.adapter.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    g = gen(policy, seed=2)[0]
    _, mean, _, ref_mean = recompute(policy, [(g, 0, 0), (g, 1, 1)], with_ref=True)
    policy.adapter.transformer.disable_adapters()
    try:
        _, base_mean, _, _ = recompute(policy, [(g, 0, 0), (g, 1, 1)])
    finally:
        policy.adapter.transformer.enable_adapters()
    torch.testing.assert_close(ref_mean, base_mean.detach())
    assert not torch.allclose(mean.detach(), ref_mean)
    _, again, _, _ = recompute(policy, [(g, 0, 0), (g, 1, 1)])
    torch.testing.assert_close(again, mean)
    assert all(p.requires_grad for p in policy.trainable_parameters()) and again.requires_grad
