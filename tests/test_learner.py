"""Learner, single process: generate -> reward -> advantages -> train_step on the tiny SD3."""

import copy
import functools
import math
import os
import threading

import pytest
import torch

from async_flowgrpo import algo
from async_flowgrpo.algorithms import flow_grpo
from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner

# 2 shared cores: OpenMP threads spinning against other jobs make tiny matmuls ~20x slower
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red circle", "a blue square"]
STEPS = 5
METRIC_KEYS = {
    "loss/policy", "loss/kl", "policy/clip_frac", "policy/ratio_mean", "is/weight_mean", "is/weight_max",
    "is/ess", "is/capped_frac", "train/grad_norm", "logp/max_abs_diff", "staleness/mean", "staleness/max", "reward/mean",
    "reward/std", "samples/trained", "train/skipped_nonfinite",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3")))


def make_policy(model_dir):
    return DiffusionPolicy(model_dir, lora_rank=4, lora_alpha=8)


def rollout(policy, *, seed=0, guidance=1.0, version_fn=None):
    """2 groups of 4, rewarded by mean brightness, advantages set as on arrival in the queue."""
    groups = policy.generate(
        PROMPTS, 4, num_steps=STEPS, guidance_scale=guidance, noise_level=0.7, sde_type="sde",
        window_size=STEPS - 1, seed=seed, version_fn=version_fn,
    )
    rewards = torch.cat([g.images.float().mean(dim=(1, 2, 3)) / 255 for g in groups])
    ids = torch.arange(len(groups)).repeat_interleave(4)
    adv, _ = algo.group_advantages(rewards, ids, global_std=True)
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[4 * k : 4 * k + 4], adv[4 * k : 4 * k + 4]
    return groups


def snapshot(policy):
    modules = {"transformer": policy.adapter.transformer, "vae": policy.adapter.pipeline.vae,
               "text_encoder": policy.adapter.pipeline.text_encoder}
    return {f"{m}.{n}": p.detach().clone() for m, mod in modules.items() for n, p in mod.named_parameters()}


@pytest.fixture(scope="module")
def policy(model_dir):
    return make_policy(model_dir)


@pytest.fixture(scope="module")
def groups(policy):
    return rollout(policy, guidance=4.5)


def test_train_step_updates_lora_only(policy, groups):
    learner = Learner(policy, micro_batch_size=3, clip_range=1e-2)
    before = snapshot(policy)
    metrics = learner.train_step(groups, version=0)
    after = snapshot(policy)
    assert METRIC_KEYS <= metrics.keys() and all(isinstance(v, float) for v in metrics.values())
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    # fresh data, same weights: ratio 1, w = 1, the recorded log-probs reproduced
    assert metrics["logp/max_abs_diff"] < 1e-5
    assert metrics["policy/ratio_mean"] == 1.0 and abs(metrics["is/weight_mean"] - 1) < 1e-4
    assert metrics["samples/trained"] == 8 and metrics["train/skipped_nonfinite"] == 0
    assert metrics["staleness/max"] == 0 and metrics["train/grad_norm"] > 0
    policy.load_trainable_state({k[len("transformer."):]: v for k, v in before.items() if "lora_" in k})


def test_nan_advantage_is_skipped_and_counted(policy, groups):
    learner = Learner(policy)
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    saved = groups[0].advantages
    groups[0].advantages = saved.clone()
    groups[0].advantages[1] = float("nan")
    try:
        metrics = learner.train_step(groups, version=0)
    finally:
        groups[0].advantages = saved
    assert metrics["train/skipped_nonfinite"] == 1 and metrics["samples/trained"] == 0
    assert "loss/policy" not in metrics  # nothing trained, nothing to report (no NaN in the log)
    assert all(torch.equal(before[k], v) for k, v in policy.trainable_state().items())
    assert all(p.grad is None or not p.grad.any() for p in policy.trainable_parameters())
    with pytest.raises(ValueError, match="advantages"):
        saved, groups[1].advantages = groups[1].advantages, None
        try:
            learner.train_step(groups, version=0)
        finally:
            groups[1].advantages = saved


def test_bypass_and_recompute_weights_and_staleness(policy, groups):
    state = {k: v.clone() for k, v in policy.trainable_state().items()}
    for mode in ("bypass", "recompute"):
        metrics = Learner(policy, prox_mode=mode).train_step(groups, version=2)
        policy.load_trainable_state(state)
        assert abs(metrics["is/weight_mean"] - 1) < 1e-4 and abs(metrics["is/ess"] - 1) < 1e-6
        if mode == "bypass":
            assert metrics["is/weight_mean"] == 1.0 and metrics["is/weight_max"] == 1.0
        assert metrics["staleness/mean"] == 2 and metrics["staleness/max"] == 2
        assert "logp/max_abs_diff" not in metrics  # no fresh samples at version 2: nothing to compare


@torch.no_grad()
def rescored(policy, groups):
    """Copies of `groups` whose recorded log-probs are the policy's current ones: fresh data."""
    out = []
    for g in groups:
        n, cond = g.size, (g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds, g.negative_pooled_prompt_embeds)
        cond = [None if t is None else t.unsqueeze(0).expand(n, *t.shape) for t in cond]
        cols = [policy.recompute(g.latents[:, j], g.latents[:, j + 1], g.sigmas[j].expand(n), g.sigmas[j + 1].expand(n),
                                 *cond, guidance_scale=g.params.guidance_scale, noise_level=g.params.noise_level,
                                 sde_type=g.params.sde_type)[0] for j in range(g.log_probs.shape[1])]
        out.append(copy.copy(g))
        out[-1].log_probs = torch.stack(cols, 1).float()
    return out


def test_staleness_correction_options(model_dir):
    """Stale groups (sampled before two updates): is_correction=none gives w = 1 exactly and the
    update of the same data made fresh; step gives exp(D (prox - behav)) capped; mask drops the
    pairs above the cap."""
    policy = make_policy(model_dir)
    stale = rollout(policy, seed=7)
    for v in range(2):
        Learner(policy, lr=1e-2).train_step(stale, version=v)
    moved = {k: v.clone() for k, v in policy.trainable_state().items()}
    fresh = rescored(policy, stale)
    behav, prox = torch.cat([g.log_probs for g in stale]), torch.cat([g.log_probs for g in fresh])
    d = stale[0].latents[0, 0].numel()
    assert (d * (prox - behav)).abs().max() > 0.1  # the step-level weights are far from 1

    def update(groups, **kw):
        policy.load_trainable_state(moved)
        metrics = Learner(policy, lr=1e-3, **kw).train_step(groups, version=2)
        return metrics, {k: v.clone() for k, v in policy.trainable_state().items()}

    off, off_weights = update(stale, is_correction="none")
    same, same_weights = update(fresh)
    assert off["is/weight_mean"] == 1.0 and off["is/weight_max"] == 1.0 and off["is/capped_frac"] == 0.0
    assert off["loss/policy"] == same["loss/policy"] and off["staleness/mean"] == 2
    assert all(torch.equal(off_weights[k], same_weights[k]) for k in same_weights)

    for mode, cap in (("truncate", 2.0), ("mask", 1.0)):
        m, _ = update(stale, is_correction="step", is_mode=mode, is_cap=cap)
        w = flow_grpo.importance_weights(prox, behav, cap, correction="step", mode=mode, elements=d)
        assert m["is/weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
        assert m["is/weight_max"] == pytest.approx(float(w.max()), rel=1e-4) and m["is/weight_max"] <= cap
        above = float((d * (prox - behav) > math.log(cap)).float().mean())
        assert m["is/capped_frac"] == pytest.approx(above) and (mode == "truncate" or 0 < above < 1)
    element, _ = update(stale)  # today's default, the D-th root: near 1 even after two lr-1e-2 updates
    assert abs(element["is/weight_mean"] - 1) < 0.05 and element["is/capped_frac"] == 0.0


def test_mixed_version_trajectories_and_kl(model_dir):
    """A trajectory whose steps carry two versions trains step by step; the KL starts at 0."""
    policy = make_policy(model_dir)
    calls = []

    def version_fn():
        calls.append(1)
        return 3 if len(calls) <= 2 else 4

    groups = rollout(policy, version_fn=version_fn)
    assert groups[0].versions.tolist() == [3, 3, 4, 4]
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    metrics = Learner(policy, beta=0.04).train_step(groups, version=4)
    assert any(not torch.equal(before[k], v) for k, v in policy.trainable_state().items())
    assert metrics["staleness/max"] == 1 and "logp/max_abs_diff" not in metrics
    assert metrics["loss/kl"] == 0.0  # LoRA B = 0 at the start: policy mean == reference mean
    full = DiffusionPolicy(model_dir, lora_rank=0)
    with pytest.raises(ValueError, match="reference_copy"):
        Learner(full, beta=0.04)


def test_data_parallel_hook_matches_single_learner(model_dir):
    """Two learners on halves whose hook averages grads between them == one learner on all."""
    policies = [make_policy(model_dir) for _ in range(3)]
    groups = rollout(policies[0], seed=5)
    slots = [None, None]
    barrier = threading.Barrier(2, timeout=60)

    def hook_for(rank):
        def all_reduce_mean(params):
            slots[rank] = [p.grad.clone() for p in params]
            barrier.wait()
            mean = [torch.stack(gs).mean(0) for gs in zip(*slots)]
            barrier.wait()  # everyone has read the slots before anyone writes them again
            for p, g in zip(params, mean):
                p.grad.copy_(g)

        return all_reduce_mean

    init = {k: v.clone() for k, v in policies[2].trainable_state().items()}
    kw = dict(micro_batch_size=4, lr=1e-3, clip_range=1e-2)
    single = Learner(policies[2], **kw).train_step(groups, version=0)
    learners = [Learner(policies[r], grad_all_reduce=hook_for(r), **kw) for r in range(2)]
    results = [None, None]
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, learners[r].train_step([groups[r]], 0)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    whole = policies[2].trainable_state()
    assert any(not torch.equal(whole[k], v) for k, v in init.items())
    for r in range(2):
        for k, v in policies[r].trainable_state().items():
            torch.testing.assert_close(v, whole[k], rtol=0, atol=1e-6)
    assert abs(results[0]["train/grad_norm"] - single["train/grad_norm"]) < 1e-5


def test_second_mini_batch_sees_moved_policy_and_resume(model_dir):
    policy = make_policy(model_dir)
    groups = rollout(policy, seed=6)
    start = Learner(policy).state_dict()
    learner = Learner(policy, mini_batches=2, lr=1e-2)
    metrics = learner.train_step(groups, version=0)
    # mini-batch 1: ratio exactly 1 (prox recomputed with the same weights); mini-batch 2: moved
    assert metrics["policy/ratio_mean"] != 1.0 and metrics["policy/clip_frac"] > 0
    assert metrics["logp/max_abs_diff"] < 1e-5
    # resume: optimizer + weights from state_dict reproduce the next update exactly
    saved = learner.state_dict()
    learner.train_step(groups, version=1)
    expected = {k: v.clone() for k, v in policy.trainable_state().items()}
    Learner(policy).load_state_dict(start)
    assert all(torch.equal(v, start["trainable"][k]) for k, v in policy.trainable_state().items())
    resumed = Learner(policy, mini_batches=2, lr=1e-2)
    resumed.load_state_dict(saved)
    resumed.train_step(groups, version=1)
    for k, v in policy.trainable_state().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


def test_lr_schedule_drives_the_optimizer_and_resumes(model_dir):
    """The schedule's lr is the one each update uses; its clock is saved, so a resumed learner
    continues the schedule instead of starting it again."""
    policy = make_policy(model_dir)
    groups = rollout(policy, seed=3)
    start = {k: v.clone() for k, v in policy.trainable_state().items()}
    schedule = functools.partial(algo.lr_factor, schedule="linear", total_steps=5, warmup_steps=2)
    learner = Learner(policy, lr=1e-2, lr_schedule=schedule)
    lrs = [learner.train_step(groups, version=v)["train/lr"] for v in range(2)]
    assert lrs == pytest.approx([5e-3, 1e-2])  # the warm-up: 1/2, then 2/2
    state = learner.state_dict()
    assert state["steps"] == 2
    resumed = Learner(policy, lr=1e-2, lr_schedule=schedule)
    resumed.load_state_dict(state)
    assert [resumed.train_step(groups, version=v)["train/lr"] for v in (2, 3)] == pytest.approx([1e-2, 1e-2 * 2 / 3])
    # lr 0 at the schedule's end: the update leaves the weights where they are (AdamW's decay x lr too)
    zero = Learner(policy, lr=1e-2, lr_schedule=lambda step: 0.0)
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    zero.train_step(groups, version=3)
    assert all(torch.equal(before[k], v) for k, v in policy.trainable_state().items())
    policy.load_trainable_state(start)


def test_half_batch_gradient_cosine(model_dir):
    """grad/half_cos: the cosine between the gradients of the batch's two halves (different
    prompts). Identical halves give 1; the calls stop at the half whatever the micro-batch size,
    so the cosine does not depend on it; one sample has no halves."""
    policy = make_policy(model_dir)
    groups = rollout(policy, seed=4)
    start = {k: v.clone() for k, v in policy.trainable_state().items()}
    twin = copy.copy(groups[0])  # the same group twice: both halves are the same data
    metrics = Learner(policy, micro_batch_size=4).train_step([groups[0], twin], version=0)
    assert metrics["grad/half_cos"] == pytest.approx(1.0, abs=1e-5)
    policy.load_trainable_state(start)
    cos = Learner(policy, micro_batch_size=4).train_step(groups, version=0)["grad/half_cos"]
    assert -1.0 <= cos < 0.999
    policy.load_trainable_state(start)
    assert Learner(policy, micro_batch_size=64).train_step(groups, version=0)["grad/half_cos"] == pytest.approx(cos, abs=1e-5)
    policy.load_trainable_state(start)
    one = copy.copy(groups[0])
    one.latents, one.log_probs, one.advantages, one.rewards = (t[:1] for t in (one.latents, one.log_probs, one.advantages, one.rewards))
    assert "grad/half_cos" not in Learner(policy, micro_batch_size=8).train_step([one], version=0)
    policy.load_trainable_state(start)


def stepwise_update(policy, groups, *, micro, beta, uncond_grad):
    """The replay one step at a time, as the trainer did it before it batched (sample, step)
    pairs: per micro-batch of samples and per step j one `recompute`, the clipped loss and its
    KL scaled by (samples) / (pairs), backward. Returns (gradients, mean loss over the pairs)."""
    samples = [(g, k) for g in groups for k in range(g.size)]
    window = groups[0].log_probs.shape[1]
    n_pairs = len(samples) * window
    params = policy.trainable_parameters()
    g0 = groups[0].params
    total = 0.0
    for m in range(0, len(samples), micro):
        batch = samples[m : m + micro]
        cond = [None if getattr(groups[0], a) is None else torch.stack([getattr(g, a) for g, _ in batch])
                for a in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")]
        for j in range(window):
            sigma, sigma_next = torch.stack([g.sigmas[j] for g, _ in batch]), torch.stack([g.sigmas[j + 1] for g, _ in batch])
            log_prob, mean, std, ref_mean = policy.recompute(
                torch.stack([g.latents[k, j] for g, k in batch]), torch.stack([g.latents[k, j + 1] for g, k in batch]),
                sigma, sigma_next, *cond, guidance_scale=g0.guidance_scale, noise_level=g0.noise_level,
                sde_type=g0.sde_type, with_ref=beta > 0, uncond_grad=uncond_grad,
            )
            behav = torch.stack([g.log_probs[k, j] for g, k in batch])
            adv = torch.stack([g.advantages[k] for g, k in batch])
            loss, _ = flow_grpo.policy_loss(log_prob, log_prob.detach(), behav, adv, clip_range=1e-4, adv_clip=5.0, is_cap=2.0)
            if beta > 0:
                loss = loss + beta * algo.kl_penalty(mean, ref_mean, algo.kl_std(std.detach(), sigma, sigma_next, "sde")).mean()
            (loss * (len(batch) / n_pairs)).backward()
            total += float(loss.detach()) * len(batch)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads, total / n_pairs


@pytest.fixture(scope="module", params=["embedded", "qwen_image"])
def cfg_batch(request, tmp_path_factory):
    """A CFG batch of 2 prompts of different lengths x 3 samples, 3 trained steps of 5, on the
    embedded SD3 model and on the tiny Qwen-Image twin (true CFG, norm rescale, text mask)."""
    from async_flowgrpo.config import EMBEDDED_MODEL
    from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir

    path = EMBEDDED_MODEL if request.param == "embedded" else make_tiny_qwen_image_dir(str(tmp_path_factory.mktemp("qwen")))
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # B = 0 at init would make the KL and the two branches' gradients trivial
        for n, p in policy.adapter.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    groups = policy.generate(["a red circle", "two blue squares below a red circle"], 3, num_steps=5, guidance_scale=4.0,
                             noise_level=0.7, sde_type="sde", window_size=3, seed=1)
    for k, g in enumerate(groups):
        g.advantages = torch.tensor([1.0, -0.5, 0.25]) * (1 - 2 * k)
    return policy, groups


@pytest.mark.parametrize("micro, uncond_grad", [(4, True), (64, False)])
def test_batched_replay_equals_the_stepwise_loop(cfg_batch, micro, uncond_grad):
    """Rows of (sample, step) pairs in calls of `micro` rows (calls that split a sample's window
    and mix steps; the whole batch in two calls) give the stepwise loop's loss and gradient, with
    CFG and the KL to the reference."""
    policy, groups = cfg_batch
    start = {k: v.clone() for k, v in policy.trainable_state().items()}
    expected, expected_loss = stepwise_update(policy, groups, micro=2, beta=0.04, uncond_grad=uncond_grad)
    got = []
    learner = Learner(policy, micro_batch_size=micro, beta=0.04, uncond_grad=uncond_grad,
                      grad_all_reduce=lambda params: got.extend(  # a parameter no backward reached: None
                          torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params))
    m = learner.train_step(groups, version=0)
    policy.load_trainable_state(start)
    assert m["loss/policy"] + m["loss/kl"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    assert m["loss/kl"] > 0
    assert sum(float(g.abs().sum()) for g in expected) > 0
    for a, b in zip(got, expected, strict=True):  # fp32 sums in another order: 1e-4 of the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
