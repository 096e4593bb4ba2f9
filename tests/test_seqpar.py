"""Sequence parallelism without Ray: 2 gloo processes in one sequence group against one process on
the same batch. The update must be the same: the loss and the LoRA gradients (after the group's
reduce) equal within fp32 tolerance, for Flow-GRPO (with its KL term) and DiffusionNFT, on the Wan
twin (3 latent frames: 192 tokens) and the Flux twin (64 image + 8 text tokens), Flow-GRPO on the
Qwen-Image twin (its text trimmed per batch, padded to an even length and masked under the split,
with CFG's shorter negative prompt), on the Wan2.2 A14B twin (two experts, one of them trained), on
the FLUX.1 Kontext and Qwen-Image-Edit twins (an input image's tokens joined to the split sequence), and
with FSDP sharding the weights over the same ranks. The gradients are summed over the group (async_flowgrpo.seqpar); the test also
shows that a mean, the data-parallel rule, would be wrong (half of them).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_flowgrpo import fsdp, seqpar
from async_flowgrpo.builders import build_learner
from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.models.tiny_flux import make_tiny_flux_dir
from async_flowgrpo.models.tiny_kontext import make_tiny_kontext_dir
from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir
from async_flowgrpo.models.tiny_qwen_image_edit import make_tiny_qwen_image_edit_dir
from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4
# (twin, algorithm, trainer.fsdp): FSDP shards the weights over the same two ranks. wan22: Wan2.2
# A14B's two experts, the high-noise one trained (steps 0-1, the window's), the other frozen and
# split all the same (it runs steps 2-3 of every sample)
CASES = [("wan", "flow_grpo", False), ("wan", "diffusion_nft", False), ("flux", "flow_grpo", False),
         ("flux", "diffusion_nft", False), ("qwen_image", "flow_grpo", False), ("wan", "flow_grpo", True),
         ("wan22", "flow_grpo", False), ("kontext", "flow_grpo", False), ("qwen_edit", "flow_grpo", False)]
FAMILY = {"wan22": "wan", "kontext": "flux_kontext", "qwen_edit": "qwen_image_edit"}
EDITS = ("kontext", "qwen_edit")  # an input image's tokens joined to the split sequence
EDIT_PROMPTS = ("rollout.prompts=shapes_edit_train", "eval.prompts=shapes_edit_eval", "rollout.prompt_mix=null")
EXTRA = {"wan22": ("model.trained_experts=[transformer]",), "kontext": EDIT_PROMPTS, "qwen_edit": EDIT_PROMPTS}


def case_config(model_dir, twin, algorithm, *extra):
    nft, family = algorithm == "diffusion_nft", FAMILY.get(twin, twin)
    return load_config("sync", [
        f"model.path={model_dir}", f"model.family={family}", *EXTRA.get(twin, ()), "model.lora_rank=4", "model.lora_alpha=8",
        f"algorithm.name={algorithm}", "algorithm.beta=0.04", "trainer.micro_batch_size=2", "rollout.sde_window_range=null",
        "rollout.group_size=2", "rollout.groups_per_step=2", *(["algorithm.nft_timestep_fraction=0.5"] if nft else []),
        f"reward.weights={{{'frames_' if family == 'wan' else ''}jpeg_compressibility: 1.0}}", "reward.options={}", *extra])


def make_groups(learner, twin, algorithm):
    nft = algorithm == "diffusion_nft"
    window = {"window_size": 2, "window_range": (0, 2)} if twin == "wan22" else {"window_size": 0 if nft else 2}
    sources = None
    if twin in EDITS:  # a square of one colour on white, of the output's size
        side = learner.policy.adapter.resolution
        sources = [{SOURCE_IMAGES: [torch.full((side, side, 3), 255, dtype=torch.uint8).index_fill_(0, torch.arange(8, 16), k * 90)]}
                   for k in (1, 2)]
    groups = learner.policy.generate(["a red circle", "a blue square"], 2, num_steps=STEPS, guidance_scale=1.0 if nft else 3.0,
                                     noise_level=0.7, sde_type="sde", seed=0, metadata=sources, **window)
    rewards = torch.tensor([0.1, 0.7, 0.4, 0.2])
    adv = torch.tensor([1.0, -0.5, 0.3, 0.8])  # not zero-mean: Flow-GRPO's loss at ratio 1 is -mean(A), not 0
    for k, g in enumerate(groups):
        g.rewards, g.advantages = rewards[2 * k : 2 * k + 2], adv[2 * k : 2 * k + 2]
    return groups


def train(learner, groups, reduce=None, sharded=False):
    """One train_step from a fixed seed (DiffusionNFT's noise); the gradients after the reduce (FSDP:
    none, its reduce-scatter is inside backward; the grad norm is whole) and the updated weights."""
    grads = []

    def record(params):
        if reduce is not None:
            reduce(params)
        if not sharded:
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])  # None: unreached

    learner.grad_all_reduce = record
    torch.manual_seed(7)
    metrics = learner.train_step(groups, version=0)
    weights = fsdp.gather(learner.policy.trainable_state().items(), keep=True)
    return metrics, grads[0] if grads else None, weights


def sequence_rank(rank, world_size, port, cases, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    out = []
    for model_dir, twin, algorithm, sharded in cases:
        cfg = case_config(model_dir, twin, algorithm, "trainer.num_workers=2", "trainer.sequence_parallel=2",
                          f"trainer.fsdp={sharded}")
        learner = build_learner(cfg)  # parallelized on the (dp 1, sequence 2) mesh
        groups = torch.load(f"{out_path}.groups.{twin}.{algorithm}", weights_only=False)
        metrics, grads, weights = train(learner, groups, seqpar.grad_reduce(2, 2, sharded), sharded)
        components = learner.policy.adapter.pipeline.components.values()
        split = sum(getattr(m, "_parallel_config", None) is not None for m in components)  # transformers split
        out.append({"metrics": metrics, "grads": grads, "weights": weights, "split": split})
    torch.save(out, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {"wan": make_tiny_wan_dir(str(tmp_path_factory.mktemp("wan"))),
            "flux": make_tiny_flux_dir(str(tmp_path_factory.mktemp("flux"))),
            "qwen_image": make_tiny_qwen_image_dir(str(tmp_path_factory.mktemp("qwen_image"))),
            "wan22": make_tiny_wan_dir(str(tmp_path_factory.mktemp("wan22")), "wan22_a14b"),
            "kontext": make_tiny_kontext_dir(str(tmp_path_factory.mktemp("kontext"))),
            "qwen_edit": make_tiny_qwen_image_edit_dir(str(tmp_path_factory.mktemp("qwen_edit")))}


@pytest.mark.slow  # 2 spawned processes, 7 model loads each: about 60 s on 2 cores
def test_two_ranks_in_one_sequence_group_make_the_one_rank_update(model_dirs, tmp_path):
    out_path = str(tmp_path / "out.pt")
    expected, cases = [], []
    for twin, algorithm, sharded in CASES:
        learner = build_learner(case_config(model_dirs[twin], twin, algorithm))
        groups = make_groups(learner, twin, algorithm)
        torch.save(groups, f"{out_path}.groups.{twin}.{algorithm}")
        expected.append(train(learner, groups))
        cases.append((model_dirs[twin], twin, algorithm, sharded))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(sequence_rank, args=(2, port, cases, out_path), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out_path}.{rank}", weights_only=False) for rank in (0, 1)]

    for (twin, algorithm, sharded), (metrics, grads, weights), got0, got1 in zip(CASES, expected, *ranks):
        what = f"{twin} {algorithm}{' fsdp' if sharded else ''}"
        assert got0["split"] == (2 if twin == "wan22" else 1), what
        # the grad norm (before clipping) is scale-sensitive where Adam's first step is not
        for key in ("loss/policy", "loss/kl", "train/grad_norm"):
            assert got0["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-9), f"{what}: {key}"
            assert got1["metrics"][key] == pytest.approx(got0["metrics"][key], rel=1e-6), f"{what}: {key} differs between ranks"
        # a rank's gradient before the reduce is its tokens' share: no cosine of whole halves to report
        assert "grad/half_cos" not in got0["metrics"], \
            f"{what}: grad/half_cos {got0['metrics']['grad/half_cos']} (one process: {metrics.get('grad/half_cos')})"
        for name, w in weights.items():
            assert torch.allclose(got0["weights"][name], w, rtol=1e-5, atol=1e-6), f"{what}: {name}"
        if sharded:
            continue
        total = torch.cat([g.flatten() for g in grads])
        assert total.norm() > 0
        for got in (got0, got1):
            split = torch.cat([g.flatten() for g in got["grads"]])
            assert torch.allclose(split, total, rtol=1e-5, atol=1e-5 * float(total.abs().max())), \
                f"{what}: max diff {float((split - total).abs().max()):.3g} of {float(total.abs().max()):.3g}"
            assert not torch.allclose(split / 2, total, rtol=1e-2), what  # a mean over the group would halve them


@pytest.mark.parametrize("extra, message", [
    (("trainer.sequence_parallel=2",), "does not divide trainer.num_workers"),
    (("trainer.num_workers=2", "trainer.sequence_parallel=2", "model.family=sd3"), "no context-parallel plan"),
    (("trainer.num_workers=4", "trainer.sequence_parallel=4", "model.family=flux"), "splits the 2 attention heads"),
])
def test_bad_sequence_parallel_config_is_one_line_naming_the_key(model_dirs, tiny_model_dir, extra, message):
    model_dir = model_dirs["flux"] if "model.family=flux" in extra else tiny_model_dir
    with pytest.raises(ConfigError, match=f"trainer.sequence_parallel.*{message}") as e:
        load_config("sync", [f"model.path={model_dir}", "rollout.groups_per_step=2", *extra])
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_two_rank_sequence_group_trains_in_every_mode(ray_cluster, model_dirs, tmp_path):
    """Each mode, 2 steps of the Wan twin on trainer.num_workers=2 in one sequence group: the
    rollout's log-probs equal the split recompute on fresh samples, every publication is
    digest-checked, samples are counted once (not per rank), and evaluation runs on both ranks."""
    from test_run import read_metrics, small_config
    from test_wan_run import WAN

    from async_flowgrpo.config import MODES
    from async_flowgrpo.modes import run

    prompts = tmp_path / "moving.txt"
    prompts.write_text("a red circle moving left\na blue square moving right\n")
    for mode in MODES:
        out = str(tmp_path / mode)
        evaluated = ("eval.at_start_and_end=true", "eval.samples_per_prompt=1", "eval.num_steps=2") if mode == "sync" else ()
        cfg = small_config(mode, model_dirs["wan"], str(prompts), out, *WAN, "trainer.total_steps=2",
                           "trainer.num_workers=2", "trainer.sequence_parallel=2", *evaluated)
        assert cfg.sync.verify
        run(cfg)
        rows = read_metrics(out)
        if mode == "sync":  # evaluated at the start (its own row, step 0) and the end
            assert rows[0]["step"] == 0 and any(k.startswith("eval/") for k in rows[0]), rows[0]
            assert any(k.startswith("eval/") for k in rows[-1])
            rows = rows[1:]
        assert [r["step"] for r in rows] == [1, 2], mode
        assert rows[-1]["samples/consumed"] == 2 * 4 and all(r["samples/trained"] == 4 for r in rows), mode
        fresh = [r for r in rows if r["staleness/mean"] == 0]
        assert fresh and all(r["logp/max_abs_diff"] < 1e-4 for r in fresh), mode


def test_an_edit_models_split_counts_the_output_and_each_input_image(model_dirs):
    """Config validation's counts: Kontext's input images have the output's size (its image tokens
    stand for both), Qwen-Image-Edit's are resized to the model's vae_image_area (the twin's: 32 x 32)."""
    assert seqpar.split_token_counts(model_dirs["kontext"], "flux_kontext", 0, 0) == \
        seqpar.split_token_counts(model_dirs["flux"], "flux", 0, 0) == {"image tokens": 64, "text tokens": 8}
    assert seqpar.split_token_counts(model_dirs["qwen_edit"], "qwen_image_edit", 0, 0) == \
        {"image tokens": 64, "tokens of an input image": 64}
    # a larger output: its tokens grow, an input image's stay at the area's
    assert seqpar.split_token_counts(model_dirs["qwen_edit"], "qwen_image_edit", 64, 0) == \
        {"image tokens": 256, "tokens of an input image": 64}
