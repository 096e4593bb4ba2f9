"""What the per-phase speed work changed, checked for the math rather than the time.

- the adapters look their transformer's device and dtype up once (diffusers' lookup walks every
  module), and again if the transformer object is replaced;
- generate keeps the window on the device until the end and hands out groups whose tensors own
  their storage;
- Learner.train_step replays (sample, step) rows in calls of micro_batch_size and clears its
  gradients with set_to_none: the accumulated gradient still equals the per-(sample, step)
  reference, also with windows of different lengths in one call and across two updates;
- benchmarks/phases.py runs end to end on a tiny model and writes its JSON.
"""

import json

import pytest
from conftest import load_benchmark
import torch

from async_flowgrpo import algo
from async_flowgrpo.algorithms import flow_grpo
from async_flowgrpo.algorithms.flow_grpo import FlowGRPOLearner as Learner
from async_flowgrpo.policy import DiffusionPolicy

STEPS = 5
CFG = 4.5
BACKWARD = torch.Tensor.backward


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    policy = DiffusionPolicy(tiny_model_dir, lora_rank=4, lora_alpha=8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at 0, where every gradient of A vanishes: move it
        for name, p in policy.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def test_adapter_placement_is_looked_up_once_and_follows_a_replaced_transformer(policy, monkeypatch):
    adapter = policy.adapter
    transformer = adapter.transformer
    assert adapter.device == transformer.device and adapter.dtype == transformer.dtype == torch.float32
    calls = []
    cls = type(transformer)
    real = cls.device.fget
    monkeypatch.setattr(cls, "device", property(lambda self: calls.append(1) or real(self)))
    for _ in range(3):
        assert adapter.device == torch.device("cpu")
    assert calls == []  # cached: diffusers' lookup is not called again
    replacement = cls.from_config(transformer.config).to(torch.float64)
    monkeypatch.setattr(adapter.pipeline, "transformer", replacement)
    assert adapter.transformer is replacement
    assert adapter.dtype == torch.float64 and len(calls) == 1  # a new object is looked up afresh
    monkeypatch.undo()
    assert adapter.transformer is transformer and adapter.dtype == torch.float32


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_groups_are_on_cpu_and_own_their_storage(policy):
    groups = policy.generate(
        ["a red circle", "a blue square"], 3, num_steps=STEPS, guidance_scale=CFG, noise_level=0.7,
        sde_type="sde", window_size=3, seed=1,
    )
    for g in groups:
        tensors = [g.latents, g.log_probs, g.sigmas, g.images, g.prompt_embeds, g.pooled_prompt_embeds,
                   g.negative_prompt_embeds, g.negative_pooled_prompt_embeds]
        for t in tensors:
            assert t.device.type == "cpu"
            # pickled through Ray, a view would carry the whole batch's storage
            assert _storage_bytes(t) == t.numel() * t.element_size()
        assert g.latents.shape[:2] == (3, 4) and g.log_probs.shape == (3, 3)
        assert g.latents.dtype == g.log_probs.dtype == torch.float32
    # the recorded window is what the steps made: x_{j+1} is scored by recompute with the same log-prob
    g = groups[1]
    with torch.no_grad():
        lp, *_ = policy.recompute(
            g.latents[:, 1], g.latents[:, 2], g.sigmas[1].expand(3), g.sigmas[2].expand(3),
            g.prompt_embeds.expand(3, -1, -1), g.pooled_prompt_embeds.expand(3, -1),
            g.negative_prompt_embeds.expand(3, -1, -1), g.negative_pooled_prompt_embeds.expand(3, -1),
            guidance_scale=CFG, noise_level=0.7, sde_type="sde",
        )
    torch.testing.assert_close(lp, g.log_probs[:, 1], rtol=0, atol=1e-4)


def _groups(policy, seed: int, windows: tuple[int, int], prompts: list[str]):
    out = []
    gen = torch.Generator().manual_seed(seed)
    for k, (prompt, window) in enumerate(zip(prompts, windows)):
        (g,) = policy.generate(
            [prompt], 3, num_steps=STEPS, guidance_scale=CFG, noise_level=0.7, sde_type="sde",
            window_size=window, seed=seed + k, prompt_indices=[k],
        )
        g.advantages = torch.randn(3, generator=gen)
        out.append(g)
    return out


def _reference_grads(policy, groups, params, **loss_kw):
    """Mean over (sample, step) of the clipped loss, each pair scored alone (batch of 1)."""
    for p in params:
        p.grad = None
    pairs = [(g, k, j) for g in groups for k in range(g.size) for j in range(g.log_probs.shape[1])]
    for g, k, j in pairs:
        neg = (g.negative_prompt_embeds[None], g.negative_pooled_prompt_embeds[None])
        log_prob, *_ = policy.recompute(
            g.latents[k, j][None], g.latents[k, j + 1][None], g.sigmas[j][None], g.sigmas[j + 1][None],
            g.prompt_embeds[None], g.pooled_prompt_embeds[None], *neg,
            guidance_scale=CFG, noise_level=0.7, sde_type="sde",
        )
        pg, _ = flow_grpo.policy_loss(log_prob, log_prob.detach(), g.log_probs[k, j][None], g.advantages[k][None], **loss_kw)
        (pg / len(pairs)).backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


PROMPTS = ["a red circle", "a blue square"]
UPDATES = {
    # calls of 4 rows over windows of 4 and 2 steps: the rows of a call come from different
    # samples, steps and prompts
    "mixed_windows": (4, [(10, (4, 2), PROMPTS), (20, (2, 4), PROMPTS)]),
    # the same 6 samples in both updates, prompts swapped in the second: the second update must
    # not reuse the first one's conditioning
    "same_selection_next_update": (8, [(10, (3, 3), PROMPTS), (20, (3, 3), PROMPTS[::-1])]),
}


@pytest.mark.parametrize("case", list(UPDATES))
def test_train_step_gradient_matches_the_per_pair_reference_across_updates(policy, case):
    micro_batch_size, updates = UPDATES[case]
    loss_kw = dict(clip_range=1e-4, adv_clip=5.0, is_cap=2.0)
    seen = []
    learner = Learner(
        policy, lr=1e-3, micro_batch_size=micro_batch_size, max_grad_norm=1e6,
        grad_all_reduce=lambda params: seen.append([p.grad.clone() for p in params]), **loss_kw,
    )
    params = learner.params
    for update, (seed, windows, prompts) in enumerate(updates):
        groups = _groups(policy, seed, windows, prompts)
        expected = _reference_grads(policy, groups, params, **loss_kw)
        metrics = learner.train_step(groups, version=0)
        assert metrics["samples/trained"] == 6 and metrics["train/skipped_nonfinite"] == 0
        got = seen[update]
        assert sum(float(e.abs().sum()) for e in expected) > 0
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-7)
        assert all(p.grad is None for p in params)  # cleared with set_to_none after the step


@pytest.fixture(scope="module")
def phases():
    return load_benchmark("phases")


@pytest.mark.slow  # the benchmark run whole: 3-5 s
def test_phases_benchmark_runs_and_writes_json(phases, tiny_model_dir, tmp_path):
    out = tmp_path / "tiny.json"
    phases.main([
        "--model", tiny_model_dir, "--prompts", "2", "--group-size", "2", "--steps", "3", "--lora-rank", "4",
        "--micro-batch", "2", "--rounds", "2", "--warmup", "0", "--top", "3", "--out", str(out),
    ])
    result = json.loads(out.read_text())
    assert result["samples"] == 4 and set(result["phases"]) == {"rollout", "train"}
    train = result["phases"]["train"]
    assert train["forward_backward_passes"] == 2 * 2  # 2 micro-batches x window of 2 steps
    for phase in result["phases"].values():
        assert len(phase["ours"]["times_s"]) == len(phase["plain"]["times_s"]) == 2
        assert phase["ratio_of_medians"] > 0 and len(phase["paired_ratios"]) == 2
        prof = phase["profile"]["ours"]
        assert prof["buckets_s"]["transformer forward"] > 0 and len(prof["top_tottime"]) == 3
    assert result["phases"]["train"]["profile"]["ours"]["buckets_s"]["backward"] > 0
    assert len(result["phases"]["rollout"]["cpu"]["ours"]["times_s"]) == 2
    # the passes' own CPU time, per round: inside the transformer's forward calls and inside backward,
    # part of the round's CPU time; a rollout runs no backward
    for name in ("ours", "plain"):
        fwd, bwd = train["cpu_forward"][name]["times_s"], train["cpu_backward"][name]["times_s"]
        assert len(fwd) == len(bwd) == 2 and min(fwd) > 0 and min(bwd) > 0
        assert all(f + b <= c for f, b, c in zip(fwd, bwd, train["cpu"][name]["times_s"]))
        assert result["phases"]["rollout"]["cpu_forward"][name]["times_s"][0] > 0
    assert "cpu_backward" not in result["phases"]["rollout"]
    assert torch.Tensor.backward is BACKWARD  # the clock is taken off again
    # the sequential step: each round's rollout + train step, as samples/s (no "plain": it has no whole step)
    step = result["sequential_step"]
    assert set(step) == {"ours"}
    sums = [a + b for a, b in zip(result["phases"]["rollout"]["ours"]["times_s"], train["ours"]["times_s"])]
    assert step["ours"]["wall"]["times_s"] == pytest.approx(sums)
    assert step["ours"]["wall"]["samples_per_s"] == pytest.approx(4 / (sum(sums) / 2))  # median of two = mean
    pooled = phases.main(["--pool", str(out), str(out), "--out", str(tmp_path / "pooled.json")])
    assert len(pooled["phases"]["train"]["plain"]["times_s"]) == len(pooled["phases"]["train"]["cpu"]["ours"]["times_s"]) == 4
    assert pooled["phases"]["train"]["ratio_of_medians"] == pytest.approx(train["ratio_of_medians"])
    assert len(pooled["phases"]["train"]["cpu_forward"]["ours"]["times_s"]) == 4


FAKE_PIPELINE = '''
import torch

calls = []


def pipeline_with_logprob(self, prompt=None, **kw):
    calls.append(len(prompt))
    return self(prompt=prompt, num_inference_steps=kw["num_inference_steps"], guidance_scale=kw["guidance_scale"],
                height=kw["height"], width=kw["width"], output_type=kw["output_type"], generator=kw["generator"],
                max_sequence_length=kw["max_sequence_length"]), [], []
'''
FAKE_SDE = '''
calls = []


def sde_step_with_logprob(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None):
    calls.append(int(model_output.shape[0]))
    mean = sample + 0.1 * model_output
    return prev_sample, -((prev_sample - mean) ** 2).mean(dim=(1, 2, 3)), mean, 0.1
'''


def test_the_flow_grpo_contenders_call_its_two_functions_per_sample_and_per_pass(phases, tiny_model_dir, tmp_path):
    """--flow-grpo: a stand-in checkout with the two patch modules; the rollout passes one prompt
    per sample, the trainer calls its SDE step once per micro-batch and trained step, and the
    result has ours/flow_grpo ratios."""
    patch = tmp_path / "flow_grpo" / "flow_grpo" / "diffusers_patch"
    patch.mkdir(parents=True)
    (patch / "sd3_pipeline_with_logprob.py").write_text(FAKE_PIPELINE)
    (patch / "sd3_sde_with_logprob.py").write_text(FAKE_SDE)
    result = phases.main([
        "--model", tiny_model_dir, "--prompts", "2", "--group-size", "2", "--steps", "3", "--lora-rank", "4",
        "--micro-batch", "2", "--rounds", "1", "--warmup", "0", "--no-profile", "--no-uncond-grad",
        "--flow-grpo", str(tmp_path / "flow_grpo"),
    ])
    import flow_grpo.diffusers_patch.sd3_pipeline_with_logprob as fake_pipeline
    import flow_grpo.diffusers_patch.sd3_sde_with_logprob as fake_sde

    assert fake_pipeline.calls == [4]  # 2 prompts x 2 images, one prompt per sample
    assert fake_sde.calls == [2] * 4  # 2 micro-batches x 2 trained steps, each micro-batch of 2
    for phase in result["phases"].values():
        assert len(phase["flow_grpo"]["times_s"]) == 1 and phase["vs_flow_grpo"]["ratio_of_medians"] > 0
    with pytest.raises(SystemExit, match="not a flow_grpo checkout"):
        phases.main(["--model", tiny_model_dir, "--flow-grpo", str(tmp_path)])


@pytest.mark.slow  # the benchmark run whole: 3-5 s
def test_phases_benchmark_times_the_video_family_against_wan_pipeline(phases, tmp_path):
    """--tiny-wan: ours against WanPipeline.__call__ and a bare loop of Wan transformer passes."""
    out = tmp_path / "wan.json"
    phases.main(["--tiny-wan", "--prompts", "2", "--group-size", "2", "--steps", "3", "--lora-rank", "4",
                 "--micro-batch", "2", "--rounds", "1", "--warmup", "0", "--top", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["model"]["family"] == "wan" and result["samples"] == 4
    assert result["phases"]["train"]["forward_backward_passes"] == 2 * 2
    for phase in result["phases"].values():
        for contender in ("ours", "plain"):
            assert phase["profile"][contender]["buckets_s"]["transformer forward"] > 0
    assert result["phases"]["train"]["profile"]["plain"]["buckets_s"]["backward"] > 0


def test_phases_benchmark_times_the_diffusion_nft_step(phases, tiny_model_dir):
    """--algorithm diffusion_nft: NFTLearner.train_step against a bare loop over the same points."""
    result = phases.main(["--model", tiny_model_dir, "--phases", "train", "--algorithm", "diffusion_nft", "--cfg", "1",
                          "--prompts", "2", "--group-size", "2", "--steps", "3", "--lora-rank", "4", "--micro-batch", "4",
                          "--rounds", "1", "--warmup", "0", "--no-profile"])
    train = result["phases"]["train"]
    assert train["forward_backward_passes"] == 2  # 4 samples x 2 of 3 noise levels (fraction 0.99) in calls of 4
    assert len(train["ours"]["times_s"]) == len(train["plain"]["times_s"]) == 1
    with pytest.raises(SystemExit):
        phases.main(["--model", tiny_model_dir, "--algorithm", "diffusion_nft"])  # the rollout phase is Flow-GRPO's


@pytest.mark.slow  # the benchmark run whole: 3-5 s
def test_phases_benchmark_times_a_baseline_checkouts_learner(phases, tiny_model_dir, tmp_path):
    """--baseline DIR: the learner module of another checkout (here this one) as a third contender."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for algorithm, cfg in (("flow_grpo", "4.5"), ("diffusion_nft", "1")):
        result = phases.main(["--model", tiny_model_dir, "--phases", "train", "--algorithm", algorithm, "--cfg", cfg,
                              "--prompts", "2", "--group-size", "2", "--steps", "3", "--lora-rank", "4",
                              "--micro-batch", "8", "--baseline", root, "--baseline-micro-batch", "2",
                              "--rounds", "1", "--warmup", "0", "--no-profile"])
        train = result["phases"]["train"]
        assert len(train["baseline"]["times_s"]) == 1 and train["vs_baseline"]["ratio_of_medians"] > 0
    with pytest.raises(SystemExit, match="no async_flowgrpo/algorithms/flow_grpo.py"):
        phases.main(["--model", tiny_model_dir, "--phases", "train", "--baseline", str(tmp_path)])
