"""benchmarks/gpu.py on CPU with its tiny shape: every section's bookkeeping (no timing asserted),
the full fine-tuning fix it found (fp32 master weights under bf16 autocast) and the plain classes
importing without Ray (the GPU machine has no Ray)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu():
    return load_benchmark("gpu")


@pytest.mark.slow  # the whole benchmark on CPU, its engine and embedded loop included: about 20 s
def test_tiny_run_fills_every_section(gpu, tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    # the rollout is timed with the attention backends a rollout actor has, whatever the learner set
    # for the process (build_learner turns cuDNN's attention off on a GPU)
    generate, cudnn_attention = gpu.generate, []
    monkeypatch.setattr(gpu, "generate", lambda *a, **k: cudnn_attention.append(torch.backends.cuda.cudnn_sdp_enabled())
                        or generate(*a, **k))
    monkeypatch.setattr(gpu, "build_learner", lambda *a, build=gpu.build_learner, **k:
                        torch.backends.cuda.enable_cudnn_sdp(False) or build(*a, **k))
    try:
        result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--embedded-steps", "1",
                           "--prompts", "1", "--group-size", "4", "--out", str(out)])
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert result["errors"] == {}
    assert True in cudnn_attention and False in cudnn_attention  # the timed rollouts; the fused comparison's
    assert json.loads(out.read_text())["shape"] == "tiny"  # saved as it went
    n = 1 * 4
    for key in ("pipeline", "rollout", "train_lora_micro4_checkpointing", "train_lora_micro4", "train_lora_micro16",
                "train_full"):
        r = result[key]
        assert r["images"] == n and r["images_per_s"] > 0 and len(r["seconds"]) == 1, key
    assert result["rollout"]["flops_per_image"] > result["pipeline"]["flops_per_image"] > 0  # + the adapters
    assert result["rollout_adapters_off"]["images_per_s"] > 0
    # bf16 here too: the trainer's adapters under autocast replay the unfolded rollout to the bit,
    # the folded one (weights rounded with the deltas in) to a small difference
    fused = result["rollout_fused"]
    assert fused["images_per_s"] > 0 and fused["trainer_logp_max_abs_diff_adapters"] == 0
    assert 0 < fused["trainer_logp_max_abs_diff_fused"] < 1e-2
    assert fused["no_autocast"]["images_per_s"] > 0 and 0 < fused["trainer_logp_max_abs_diff_fused_no_autocast"] < 1e-1
    # model FLOPs are counted once, without checkpointing, and shared by the LoRA measurements
    flops = {result[k]["model_flops_per_step"] for k in ("train_lora_micro4_checkpointing", "train_lora_micro4",
                                                          "train_lora_micro16")}
    assert len(flops) == 1 and flops.pop() > 0
    full = result["train_full"]
    assert full["master_dtype"] == "torch.float32" and full["autocast_dtype"] == "torch.bfloat16" and full["weights_changed"]
    engine = result["engine"]
    assert engine["bit_exact"] and engine["backend"] == "gloo" and engine["bytes"] > 0
    assert result["embedded"]["cpu"]["samples_per_s"] > 0 and result["embedded"]["cpu"]["steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny_flux", "tiny_qwen_image", "tiny_wan", "tiny_wan22_a14b", "tiny_wan22_ti2v_5b_image"])
def test_every_family_runs_the_rollout_and_trainer_sections(gpu, tmp_path, shape):
    """Each family's pipeline call takes the conditioning our adapter made, and our rollout and
    trainer run on the model built in memory (full fine-tuning only where the shape allows it).
    TI2V-5B given a first frame: a WanPipeline checkpoint, timed against diffusers' image-to-video
    pipeline over the same modules."""
    result = gpu.main(["--shape", shape, "--device", "cpu", "--repeats", "1", "--skip-embedded", "--skip-fused",
                       "--prompts", "1", "--group-size", "4", "--train-rows", "16", "--out", str(tmp_path / "gpu.json")])
    assert result["errors"] == {}
    assert result["pipeline"]["images_per_s"] > 0 and result["rollout"]["images_per_s"] > 0
    # the same model and steps: with the adapters off, FLOPs per image agree within what encoding the
    # prompts adds (the pipeline is handed their embeddings; measured 1.00); the LoRA adds to that
    # (rank 16 on 24-wide layers: 0.31 of the pipeline's on the tiny TI2V twin, 0.02 on tiny Wan2.1)
    off, pipeline = result["rollout_adapters_off"]["flops_per_image"], result["pipeline"]["flops_per_image"]
    assert 0.95 < off / pipeline < 1.1
    assert off < result["rollout"]["flops_per_image"] < 1.5 * pipeline
    assert result["train_lora_micro16"]["model_flops_per_image"] > 0 and result["engine"]["bit_exact"]
    assert ("train_full" in result) == gpu.SHAPES[shape].get("full_fine_tuning", True)


def test_real_shapes_build_on_the_meta_device(gpu):
    """The real-size configs are valid for their diffusers classes (no memory: meta tensors), and
    the sizes are the public ones (parameters of the transformer, billions)."""
    expected = {"sd35_medium": 2.2, "flux_dev": 11.9, "qwen_image": 20.4, "wan21_1_3b": 1.4,
                "wan22_a14b": 14.3, "wan22_ti2v_5b": 5.0,  # A14B: each of its two experts
                "flux_kontext": 11.9, "qwen_image_edit": 20.4, "wan22_i2v_a14b": 14.3, "wan22_ti2v_5b_image": 5.0}
    import diffusers

    classes = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel",
               "qwen_image": "QwenImageTransformer2DModel", "wan": "WanTransformer3DModel",
               "flux_kontext": "FluxTransformer2DModel", "qwen_image_edit": "QwenImageTransformer2DModel"}
    for name, billions in expected.items():
        shape = gpu.SHAPES[name]
        with torch.device("meta"):
            transformer = getattr(diffusers, classes[shape["family"]])(**shape["transformer"])
        assert sum(p.numel() for p in transformer.parameters()) / 1e9 == pytest.approx(billions, rel=0.05), name


def test_image_conditioned_shapes_build_into_their_pipelines_and_adapters_on_the_meta_device(gpu):
    """Each image-conditioned shape becomes the diffusers pipeline its contender calls and the
    adapter a run would load for it (Wan2.2 I2V-A14B: the image-to-video one, whose transformer takes
    the mask of the real VAE's 4 temporal frames and the image latents beside the latents), and
    its source images reach our rollout as a run's prompt file hands them over."""
    expected = {"flux_kontext": ("FluxKontextPipeline", "FluxKontextAdapter"),
                "qwen_image_edit": ("QwenImageEditPipeline", "QwenImageEditAdapter"),
                "wan22_i2v_a14b": ("WanImageToVideoPipeline", "WanImageToVideoAdapter")}
    for name, (pipeline, adapter_name) in expected.items():
        shape = gpu.SHAPES[name]
        adapter = gpu.make_adapter(shape, torch.device("meta"), torch.bfloat16)
        assert (type(adapter.pipeline).__name__, type(adapter).__name__) == (pipeline, adapter_name), name
        assert adapter.image_conditioned and adapter.resolution == shape["resolution"], name
    assert adapter.condition_channels == 16 + 4 and adapter.experts == ("transformer", "transformer_2")
    assert adapter.num_frames == 33
    processor = gpu.make_adapter(gpu.SHAPES["qwen_image_edit"], torch.device("meta"), torch.bfloat16).pipeline.processor
    assert processor.image_processor.patch_size * processor.image_processor.merge_size == 28  # Qwen2.5-VL's


def test_image_conditioned_prompts_reach_the_rollout_as_a_runs_do(gpu, tmp_path):
    """The benchmark's prompt file for a source-image shape passes config validation at the shape's
    size and loads into `generate`'s metadata as a rollout worker's `with_sources` does."""
    from types import SimpleNamespace

    shape = gpu.SHAPES["tiny_wan22_i2v_a14b"]
    args = SimpleNamespace(prompts=2, group_size=2, prompt_file=gpu.source_prompts(shape, str(tmp_path), 2), overrides=[])
    cfg = gpu.bench_config(args, shape, gpu.validation_model(shape, str(tmp_path)))
    prompts, metadata = gpu.batch_prompts(args, cfg)
    assert prompts == gpu.PROMPTS[:2] and cfg.rollout.prompts == cfg.eval.prompts == args.prompt_file
    assert [tuple(m["source_images"][0].shape) for m in metadata] == [(64, 64, 3)] * 2
    assert gpu.source_prompts(gpu.SHAPES["tiny_wan"], str(tmp_path), 2) is None
    assert gpu.batch_prompts(SimpleNamespace(prompts=2, prompt_file=None), cfg) == (gpu.PROMPTS[:2], None)


def test_full_fine_tuning_keeps_fp32_master_weights_when_the_model_is_bf16(tmp_path):
    """Adam's updates of bf16 weights round away: with model.dtype bfloat16 and LoRA off, the
    learner's weights are fp32 and the forward runs under bf16 autocast (before: bf16 weights)."""
    from async_flowgrpo.builders import build_learner
    from async_flowgrpo.config import load_config
    from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
    from async_flowgrpo.policy import DiffusionPolicy

    model = make_tiny_model_dir(str(tmp_path / "m"))
    cfg = load_config("sync", [f"model.path={model}", "model.lora_rank=0", "model.dtype=bfloat16", "algorithm.beta=0",
                               "trainer.lr=1e-6", "rollout.sde_window_range=null"])
    learner = build_learner(cfg)
    policy = learner.policy
    assert policy.dtype == torch.float32 and policy.autocast_dtype == torch.bfloat16
    groups = policy.generate(["a red circle", "a blue square"], 2, num_steps=4, guidance_scale=4.5, noise_level=0.7,
                             sde_type="sde", window_size=2, seed=0)
    for g in groups:
        g.advantages = torch.tensor([1.0, -1.0])
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    learner.train_step(groups, version=0)
    after = policy.trainable_state()
    # a 1e-6 step moves fp32 weights; in bf16 (8 bits of mantissa) nearly all of it would round away
    changed = sum(int((after[k] != v).sum()) for k, v in before.items())
    assert changed > 0.5 * sum(v.numel() for v in before.values())

    # published in the rollout actors' dtype: half the bytes, and an actor loads the same values
    published = learner.sampling_state()
    assert all(v.dtype == torch.bfloat16 for v in published.values())
    rollout = DiffusionPolicy(model, dtype=torch.bfloat16, lora_rank=0)
    rollout.load_trainable_state(after)
    from_master = {k: v.clone() for k, v in rollout.trainable_state().items()}
    rollout.load_trainable_state(published)
    assert all(torch.equal(from_master[k], v) for k, v in rollout.trainable_state().items())


@pytest.mark.slow  # a fresh interpreter importing torch and diffusers: about 7 s
def test_plain_classes_import_without_ray():
    code = ("import sys; sys.modules['ray'] = None; sys.modules['wandb'] = None\n"
            "import async_flowgrpo.sync, async_flowgrpo.builders, async_flowgrpo.algorithms, async_flowgrpo.policy\n"
            "import async_flowgrpo.rollout.worker\n"
            "async_flowgrpo.sync.make_transport('collective').sender()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow  # the LoRA policy timed with and without autocast, interleaved: about 9 s
def test_autocast_ab_interleaves_both_settings(gpu, tmp_path):
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "2", "--autocast-ab", "--prompts", "1",
                       "--group-size", "4", "--out", str(tmp_path / "ab.json")])
    ab = result["autocast_ab"]
    assert result["errors"] == {} and set(ab) == {"torch.bfloat16", "None"}
    assert all(len(row["rollout_s"]) == len(row["train_s"]) == 2 for row in ab.values())
    assert "rollout" not in result and "train_full" not in result  # that section alone


@pytest.mark.slow  # the benchmark run whole on a tiny twin: 5-15 s
def test_train_only_runs_the_chosen_rows_and_names_the_layer_of_a_failure(gpu, tmp_path, monkeypatch):
    """--train-only measures just --train-rows; a row that fails (not out of memory) is recorded with
    the last nn.Linear entered when CUDA_LAUNCH_BLOCKING=1 (how a failing GEMM was traced on a GPU)."""
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--train-only", "--prompts", "1",
                       "--group-size", "4", "--train-rows", "2c,4", "--out", str(tmp_path / "a.json")])
    assert result["errors"] == {} and "pipeline" not in result and "train_full" not in result
    assert result["train_lora_micro2_checkpointing"]["images"] == 4 and result["train_lora_micro4"]["images_per_s"] > 0
    assert gpu.train_rows("4c,16,8b,8bk") == [(True, 4, False, False), (False, 16, False, False),
                                              (False, 8, True, False), (False, 8, True, True)]

    def broken(args, learner, *rest):
        learner.train_step(rest[0], version=0)  # runs the transformer's layers, then fails as a kernel would
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(gpu, "measure_train", broken)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--train-only", "--prompts", "1",
                       "--group-size", "2", "--train-rows", "2", "--out", str(tmp_path / "b.json")])
    row = result["train_lora_micro2"]
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in row["error"] and "train_only" in result["errors"]
    assert row["last_linear"]["name"] and len(row["last_linear"]["input"]) == 3


@pytest.mark.slow  # the benchmark run whole on a tiny twin: 5-15 s
def test_a_bf16_row_computes_without_autocast_and_restores_the_fp32_learner(gpu, tmp_path, monkeypatch):
    """A 'b' trainer row times and profiles the step with bf16 adapters and no autocast; the rows
    after it get the fp32 adapters and the optimizer state back as they were."""
    timed, profiled, learners = [], [], []
    measure = gpu.measure_train

    def setting(learner):
        return ({p.dtype for p in learner.policy.trainable_parameters()}, learner.policy.autocast_dtype,
                len(learner.optimizer.state))

    def spy(args, learner, *rest):
        learners.append(learner)
        timed.append(setting(learner))
        return measure(args, learner, *rest)

    monkeypatch.setattr(gpu, "measure_train", spy)
    monkeypatch.setattr(gpu, "profile_step", lambda fn, device: profiled.append(setting(learners[-1])) or {"summary": ""})
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--train-only", "--prompts", "1",
                       "--group-size", "2", "--train-rows", "2,2b,2", "--profile", "--out", str(tmp_path / "b.json")])
    assert result["errors"] == {} and result["train_lora_micro2_bf16"]["images_per_s"] > 0
    assert [p[:2] for p in profiled] == [t[:2] for t in timed]  # each row profiled in its own setting
    (first, _, before), (bf16, autocast, fresh), (after, autocast_after, restored) = timed
    assert first == after == {torch.float32} and bf16 == {torch.bfloat16}
    assert autocast is None and autocast_after == torch.bfloat16
    assert before == 0 and fresh == 0 and restored > 0  # the first row's Adam state, back after the bf16 row


@pytest.mark.slow  # the benchmark run whole on a tiny twin, a compile included: about 30 s
def test_a_compiled_row_compiles_each_block_and_undoes_it(gpu, tmp_path, monkeypatch):
    """A 'k' trainer row times the step with every block of the transformer compiled (aot_eager here:
    the graph capture without a C++ build) and leaves the blocks as they were for the next row."""
    compiled, measure = [], gpu.measure_train

    def spy(args, learner, *rest):
        transformer = learner.policy.adapter.transformer
        compiled.append([b._compiled_call_impl is not None for b in transformer.transformer_blocks])
        return measure(args, learner, *rest)

    monkeypatch.setattr(gpu, "measure_train", spy)
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--train-only", "--prompts", "1",
                       "--group-size", "2", "--train-rows", "2,2k,2", "--compile-backend", "aot_eager",
                       "--out", str(tmp_path / "k.json")])
    assert result["errors"] == {} and result["train_lora_micro2_compiled"]["images_per_s"] > 0
    assert compiled[0] == compiled[2] == [False] * len(compiled[0]) and compiled[1] == [True] * len(compiled[0])


@pytest.mark.slow  # the rollout section on a tiny twin, a compile included: about 20 s
def test_rollout_compile_times_the_rollout_with_its_blocks_compiled(gpu, tmp_path, monkeypatch):
    generate, compiled = gpu.generate, []
    monkeypatch.setattr(gpu, "generate", lambda policy, *a, **k: compiled.append(
        [b._compiled_call_impl is not None for b in policy.adapter.transformer.transformer_blocks]) or generate(policy, *a, **k))
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--skip-full", "--skip-embedded",
                       "--skip-fused", "--prompts", "1", "--group-size", "2", "--train-rows", "", "--rollout-compile",
                       "--compile-backend", "aot_eager", "--out", str(tmp_path / "r.json")])
    assert result["errors"] == {} and result["rollout_compiled"]["images_per_s"] > 0
    assert result["rollout_compiled"]["vs_pipeline"] > 0
    assert not any(compiled[0]) and all(compiled[-1])  # eager rows first, then every block compiled


@pytest.mark.slow  # a rollout worker and a tiny reward model: about 20 s
def test_reward_section_times_a_worker_with_its_reward_model_overlapped_and_not(gpu, tmp_path):
    """--reward-model: PickScore's code scores the worker's groups (a random CLIP saved as a local
    PickScore directory), with reward.overlap on and off, interleaved."""
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "2", "--prompts", "1", "--group-size", "2",
                       "--reward-model", "tiny", "--reward-groups", "2", "--out", str(tmp_path / "reward.json")])
    assert result["errors"] == {} and "rollout" not in result  # that section alone
    r = result["reward_overlap"]
    assert len(r["samples_per_s"]["on"]) == len(r["samples_per_s"]["off"]) == 2
    assert all(v > 0 for v in r["samples_per_s"]["on"] + r["samples_per_s"]["off"])
    assert r["reward_s_per_group"] > 0 and r["generate_s_per_group"] > 0 and r["overlap_speedup"] > 0


@pytest.mark.slow  # the benchmark run whole on a tiny twin: 5-15 s
def test_set_overrides_train_another_algorithm(gpu, tmp_path):
    """--set reaches every section's config: AWM's rows train on ODE samples with its loss."""
    result = gpu.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--train-only", "--prompts", "1",
                       "--group-size", "2", "--train-rows", "2", "--set", "algorithm.name=awm",
                       "--out", str(tmp_path / "awm.json")])
    assert result["errors"] == {} and result["overrides"] == ["algorithm.name=awm"]
    assert result["train_lora_micro2"]["images_per_s"] > 0


def test_profile_sorts_kernels_into_classes_and_reports_host_time(gpu):
    """--profile's step summary: kernel names land in their class, and on a device without kernels
    the whole step is host time (kernel share 0), not an error."""
    assert gpu.kernel_class("void pytorch_flash::flash_bwd_kernel<...>") == "attention"
    assert gpu.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert gpu.kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert gpu.kernel_class("void at::native::(anonymous namespace)::layer_norm_kernel") == "norm"
    assert gpu.kernel_class("some_custom_kernel") == "other"
    x = torch.randn(64, 64)
    out = gpu.profile_step(lambda: [x @ x for _ in range(2000)], torch.device("cpu"))
    assert out["wall_s"] > 0 and out["kernel_s"] == 0 and out["kernel_share_of_wall"] == 0


def test_wan22_vae_builds_under_another_default_device():
    """gpu.py builds pipelines under the GPU as default device; the Wan2.2 VAE's random latent
    statistics come from a CPU generator, which must not follow that default (it failed on an H200)."""
    from async_flowgrpo.models.tiny_wan import VARIANTS, TinyWanSpec, _vae

    with torch.device("meta"):
        vae = _vae(TinyWanSpec(**VARIANTS["wan22_ti2v_5b"]))
    assert len(vae.config.latents_mean) == vae.config.z_dim
