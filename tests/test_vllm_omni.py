"""vllm-omni engine, CPU side: what runs without vllm-omni (it is an optional GPU extra and is not
installed here). Request building, the recording loop (checked against DiffusionPolicy),
output -> Group conversion, PEFT adapter dirs, LoRA swap / full-weight RPC bookkeeping and
version stamping through the engine with a fake AsyncOmni, and the missing-extra error.
The fakes follow the source of vllm-omni 0.30.0 (the `gpu` extra's pin; the lines they imitate are
quoted in their docstrings), failures included: AsyncOmni.add_lora's True for a worker's error, the
error dicts of collective_rpc, LoRA eviction with max_cpu_loras 1, outputs made in inference mode.
The real pipeline class and AsyncOmni are untested here (no GPU, no vllm-omni)."""

import asyncio
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from async_flowgrpo.config import Config
from async_flowgrpo.models.sd3 import SD3Adapter
from async_flowgrpo.models.tiny_sd3 import make_tiny_model_dir
from async_flowgrpo.policy import DiffusionPolicy
from async_flowgrpo.rollout import vllm_omni as vo

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAMPLING = dict(num_steps=4, guidance_scale=1.0, noise_level=0.7, sde_type="sde", window_size=2)
LATENT = (4, 8, 8)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return DiffusionPolicy(make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_sd3"))), lora_rank=4, lora_alpha=8)


@pytest.fixture
def no_vllm_omni(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # "import vllm_omni" raises ImportError


# ------------------------------------------------------------------ missing extra, update point


def test_missing_extra_gives_the_install_hint(no_vllm_omni):
    with pytest.raises(ImportError, match=r"pip install 'async_flowgrpo\[gpu\]' \(vllm-omni==0\.30\.0\)"):
        vo.VllmOmniEngine.from_config(Config())
    with pytest.raises(ImportError, match="async_flowgrpo\\[gpu\\]"):
        vo.FlowGRPOSD3Pipeline  # noqa: B018  (worker-side classes are built lazily)
    from async_flowgrpo.builders import build_engine

    cfg = Config()
    cfg.rollout.engine = "vllm_omni"
    with pytest.raises(ImportError, match="vllm-omni==0.30.0"):
        build_engine(cfg, "between_groups")
    with pytest.raises(AttributeError):
        vo.NoSuchThing  # noqa: B018


def test_between_steps_degrades_to_between_groups_with_a_warning():
    with pytest.warns(RuntimeWarning, match="between_steps"):
        assert vo.resolve_update_point("between_steps") == "between_groups"
    assert vo.resolve_update_point("between_groups") == "between_groups"
    with pytest.raises(ValueError, match="sync.update_point"):
        vo.resolve_update_point("sometimes")


def test_model_dir_check(tmp_path):
    with pytest.raises(ValueError, match="model_index.json"):
        vo.check_model_dir(str(tmp_path))
    d = tmp_path / "m"
    d.mkdir()
    (d / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline"):
        vo.check_model_dir(str(d))
    (d / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    with pytest.raises(ValueError, match="text_encoder_3"):  # e.g. the embedded tiny model
        vo.check_model_dir(str(d))


# ------------------------------------------------------------------ requests


def test_build_requests_one_per_prompt():
    reqs = vo.build_requests(
        ["a", "b"], 3, 11, **{**SAMPLING, "guidance_scale": 4.5}, window_range=(0, 3), height=64, width=32,
        prompt_indices=[7, 8], metadata=[{"k": 1}, {}], version=5,
    )
    assert [r.prompt for r in reqs] == [{"prompt": "a", "negative_prompt": ""}, {"prompt": "b", "negative_prompt": ""}]
    assert [r.prompt_index for r in reqs] == [7, 8] and reqs[0].metadata == {"k": 1}
    assert len({r.request_id for r in reqs}) == 2 and reqs[0].request_id.startswith("flowgrpo-v5-p7-s11-")
    s = reqs[1].sampling
    assert s["num_inference_steps"] == 4 and s["guidance_scale"] == 4.5 and s["num_outputs_per_prompt"] == 3
    assert s["height"] == 64 and s["width"] == 32 and s["seed"] == 11 and s["output_type"] == "pil"
    assert reqs[1].spec == {
        "seed": 11, "batch_index": 1, "batch_prompts": 2, "group_size": 3, "num_steps": 4, "noise_level": 0.7,
        "sde_type": "sde", "window_size": 2, "window_range": [0, 3], "shared_initial_noise": False, "version": 5,
    }
    # height/width None -> the pipeline's default resolution
    assert "height" not in vo.build_requests(["a"], 2, 0, **SAMPLING)[0].sampling


@pytest.mark.parametrize(
    "bad, match",
    [({"window_size": 4}, "window"), ({"sde_type": "ode"}, "sde_type"), ({"window_range": (0, 1)}, "window")],
)
def test_build_requests_rejects_bad_sampling(bad, match):
    with pytest.raises(ValueError, match=match):
        vo.build_requests(["a"], 2, 0, **{**SAMPLING, **bad})


# ------------------------------------------------------------------ the recording loop


@pytest.mark.parametrize(
    "prompts, sde_type, guidance, shared",
    [(["a red circle"], "sde", 1.0, False), (["a red circle"], "cps", 3.0, False),
     (["a red circle", "a blue square"], "sde", 1.0, False), (["a red circle", "a blue square"], "sde", 1.0, True)],
)
def test_recording_loop_reproduces_the_diffusers_policy(policy, prompts, sde_type, guidance, shared):
    """Same seed -> the pipeline's loop draws the same window and noise as DiffusionPolicy and
    records the same latents and log-probs (here with the same velocity function). Bit-exact for
    a one-prompt batch; for a prompt of a larger batch the transformer runs on fewer rows than the
    diffusers engine's, which changes float rounding only."""
    n, steps = 2, 5
    kw = dict(num_steps=steps, guidance_scale=guidance, noise_level=0.7, sde_type=sde_type, window_size=2,
              shared_initial_noise=shared)
    groups = policy.generate(prompts, n, seed=9, **kw)
    enc = policy.adapter.encode_prompts(prompts, cfg=guidance > 1)
    sigmas = policy.sigmas(steps)
    shape = policy.adapter.latent_shape(policy.adapter.resolution, policy.adapter.resolution)
    tol = dict(atol=0, rtol=0) if len(prompts) == 1 else dict(atol=1e-5, rtol=0)
    for g, req in enumerate(vo.build_requests(prompts, n, 9, **kw)):
        rows = [t[g : g + 1].repeat_interleave(n, 0) if t is not None else None
                for t in (enc.embeds, enc.pooled, enc.negative_embeds, enc.negative_pooled)]

        def velocity(x, i, rows=rows):
            return policy.adapter.velocity(x, sigmas[i], *rows, guidance_scale=guidance)

        with torch.no_grad():
            x, record = vo.denoise_and_record(velocity, shape, sigmas, req.spec)
        assert record["window_start"] == groups[g].params.window_start
        assert torch.equal(record["sigmas"], groups[g].sigmas)
        torch.testing.assert_close(record["latents"], groups[g].latents, **tol)
        torch.testing.assert_close(record["log_probs"], groups[g].log_probs, **tol)
        images = policy.adapter.decode(x).int()
        assert (images - groups[g].images.int()).abs().max() <= (0 if len(prompts) == 1 else 1)


def test_recording_loop_pure_ode_window():
    spec = vo.build_requests(["a"], 3, 0, **{**SAMPLING, "window_size": 0})[0].spec
    x, record = vo.denoise_and_record(lambda x, i: -x, LATENT, torch.linspace(1, 0, 5), spec)
    assert record["latents"].shape == (3, 0, *LATENT) and record["log_probs"].shape == (3, 0)
    assert record["sigmas"].numel() == 0 and x.shape == (3, *LATENT)
    with pytest.raises(ValueError, match="sigmas"):
        vo.denoise_and_record(lambda x, i: -x, LATENT, torch.linspace(1, 0, 4), spec)


# ------------------------------------------------------------------ output conversion


def fake_output(request, *, latent=LATENT, images=None, error=None, version=None, cond_dim=(5, 6)):
    """Shaped like vllm-omni's final OmniRequestOutput for our pipeline: PIL images plus the
    trajectory_* fields our pipeline sets (built by the same helper the pipeline uses)."""
    spec = dict(request.spec)
    if version is not None:
        spec["version"] = version
    n = spec["group_size"]
    _, record = vo.denoise_and_record(lambda x, i: -x, latent, torch.linspace(1, 0, spec["num_steps"] + 1), spec)
    cfg = request.sampling["guidance_scale"] > 1
    payload = vo.trajectory_payload(
        record, spec=spec, height=16, width=24,
        prompt_embeds=torch.randn(1, *cond_dim), pooled_prompt_embeds=torch.randn(1, 7),
        negative_prompt_embeds=torch.randn(1, *cond_dim) if cfg else None,
        negative_pooled_prompt_embeds=torch.randn(1, 7) if cfg else None,
    )
    rng = np.random.default_rng(spec["seed"])
    if images is None:
        images = [Image.fromarray(rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)) for _ in range(n)]
    return SimpleNamespace(request_id=request.request_id + "-x", finished=True, error=error, images=images, **payload)


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_group_from_output(guidance):
    sampling = {**SAMPLING, "guidance_scale": guidance}
    req = vo.build_requests(["a cat"], 3, 4, **sampling, prompt_indices=[12], version=2)[0]
    out = fake_output(req)
    g = vo.group_from_output(out, req, guidance_scale=guidance, elapsed_s=1.5)
    assert (g.prompt, g.prompt_index, g.seed, g.time_generate_s) == ("a cat", 12, 4, 1.5)
    assert g.latents.shape == (3, 3, *LATENT) and g.log_probs.shape == (3, 2) and g.sigmas.shape == (3,)
    assert g.latents.dtype == g.log_probs.dtype == torch.float32
    assert g.versions.tolist() == [2, 2] and g.min_version == 2 and g.staleness(4) == 2
    assert g.images.shape == (3, 16, 24, 3) and g.images.dtype == torch.uint8
    assert torch.equal(g.images[1], torch.from_numpy(np.array(out.images[1])))
    p = g.params
    assert (p.num_steps, p.window_size, p.height, p.width, p.sde_type) == (4, 2, 16, 24, "sde")
    assert p.window_start == out.trajectory_timesteps["window_start"] and p.guidance_scale == guidance
    assert g.prompt_embeds.shape == (5, 6) and g.pooled_prompt_embeds.shape == (7,)
    assert (g.negative_prompt_embeds is None) == (guidance <= 1)


def test_group_tensors_made_under_inference_mode_are_normal_tensors():
    """vllm-omni runs the pipeline under torch.inference_mode(); such tensors refuse in-place
    changes and autograd outside it, so the Group holds clones."""
    req = vo.build_requests(["a"], 2, 0, **{**SAMPLING, "guidance_scale": 4.5}, version=1)[0]
    with torch.inference_mode():
        out = fake_output(req)
    assert out.trajectory_latents.is_inference()
    g = vo.group_from_output(out, req, guidance_scale=4.5)
    tensors = [g.latents, g.log_probs, g.sigmas, g.prompt_embeds, g.pooled_prompt_embeds, g.negative_prompt_embeds,
               g.negative_pooled_prompt_embeds]
    assert not any(t.is_inference() for t in tensors)
    for t in tensors:
        t.mul_(1.0)
    weight = torch.ones((), requires_grad=True)
    (g.latents * weight).sum().backward()  # saved for backward: refused for an inference tensor
    assert weight.grad == g.latents.sum()


def test_group_from_output_errors():
    req = vo.build_requests(["a"], 2, 0, **SAMPLING, version=1)[0]
    with pytest.raises(RuntimeError, match="boom"):
        vo.group_from_output(fake_output(req, error="boom"), req, guidance_scale=1.0)
    with pytest.raises(RuntimeError, match="version 3"):
        vo.group_from_output(fake_output(req, version=3), req, guidance_scale=1.0)
    with pytest.raises(RuntimeError, match="1 images for a group of 2"):
        out = fake_output(req)
        vo.group_from_output(SimpleNamespace(**{**vars(out), "images": out.images[:1]}), req, guidance_scale=1.0)
    with pytest.raises(RuntimeError, match="no trajectory"):
        empty = SimpleNamespace(error=None, images=[], trajectory_timesteps=None, trajectory_latents=None,
                                trajectory_log_probs=None)
        vo.group_from_output(empty, req, guidance_scale=1.0)


# ------------------------------------------------------------------ PEFT adapter dirs


def test_adapter_dir_is_a_peft_adapter_of_the_policy(policy, tmp_path):
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    state = {k: v + 0.5 for k, v in policy.trainable_state().items()}
    book = vo.LoraAdapterBook(str(tmp_path), rank=4, alpha=8, target_modules=SD3Adapter.lora_target_modules, base_model="m")
    ref = book.write(state, version=6)
    assert (ref.version, ref.lora_int_id, ref.name) == (6, 1, "flowgrpo_v6_1")
    assert sorted(os.listdir(ref.path)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = LoraConfig.from_pretrained(ref.path)
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 8, set(SD3Adapter.lora_target_modules))
    saved = load_file(os.path.join(ref.path, "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
    # load it back the way PEFT loaders do: the live LoRA weights become the saved ones
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    try:
        stripped = {k.removeprefix("base_model.model."): v for k, v in saved.items()}
        set_peft_model_state_dict(policy.adapter.transformer, stripped, adapter_name="default")
        assert all(torch.equal(policy.trainable_state()[k], state[k]) for k in state)
    finally:
        policy.load_trainable_state(before)


def test_peft_key_and_adapter_swap_bookkeeping(tmp_path):
    key = vo.peft_key("blocks.0.attn.to_out.0.lora_B.default.weight")
    assert key == "base_model.model.blocks.0.attn.to_out.0.lora_B.weight"
    assert vo.peft_key("base_model.model.x.lora_A.weight") == "base_model.model.x.lora_A.weight"
    with pytest.raises(ValueError, match="LoRA"):
        vo.peft_key("transformer_blocks.0.attn.to_q.weight")
    book = vo.LoraAdapterBook(str(tmp_path), 2, 4, ("to_q",))
    a = book.write(lora_state(), 1)
    assert book.activate(a) is None and book.active == a
    b = book.write(lora_state(), 2)
    assert book.activate(b) == a and book.active == b
    book.discard(a)
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    c = book.write(lora_state(), 2)  # a version sent again: a new id and directory
    assert (c.lora_int_id, b.lora_int_id) == (3, 2) and c.path != b.path and book.activate(c) == b


# ------------------------------------------------------------------ the engine, with a fake AsyncOmni


def lora_state(scale=1.0):
    return {
        "transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.full((2, 8), scale),
        "transformer_blocks.0.attn.to_q.lora_B.default.weight": torch.full((8, 2), scale),
    }


class FakeDiffusionStage:
    """The one diffusion stage that serves SD3, as vllm-omni 0.30.0's RPCs see it.

    LoRA bookkeeping of diffusion/lora/manager.py:DiffusionLoRAManager:
      * add_adapter: an id already registered returns False ("Adapter %d already registered,
        skipping"); otherwise `self._evict_for_new_adapter()` runs before `self._load_adapter(...)`,
        so with max_cpu_loras 1 (diffusion/data.py: "if self.max_cpu_loras is None:
        self.max_cpu_loras = 1") the previous adapter is gone even when the new one fails to load;
      * remove_adapter: an id not registered returns False ("Adapter %d not found, cannot remove"),
        so removing the adapter that the last add evicted returns False;
      * set_active_adapter, for each request: "if adapter_id not in self._registered_adapters: ...
        self.add_adapter(lora_request)", i.e. an evicted adapter is loaded again from its path.
    A worker exception is returned to AsyncOmni as the stage's result, not raised:
      * diffusion/stage_diffusion_client.py:_drain_responses (a diffusion subprocess):
        self._rpc_results[rpc_id] = {"error": True, "reason": error_msg};
      * engine/stage_pool.py:StagePool.collective_rpc (an exception or a timeout in the client):
        return {"supported": False, "error": error}.
    Per-stage results (diffusion/stage_diffusion_proc.py:_handle_collective_rpc): add_lora and
    remove_lora "return all(results)" over the workers, list_loras "return sorted(merged)", any
    other method (our worker extension's) the list of the workers' results.
    """

    def __init__(self, max_cpu_loras=1, error_shape="subprocess"):
        self.max_cpu_loras, self.error_shape = max_cpu_loras, error_shape
        self.registered: dict[int, str] = {}  # id -> path, least recently used first
        self.fail_add = False  # the next add_adapter (only) raises while it loads
        self.fail_rpc = None  # our extension's RPC raises this message
        self.loaded = []  # state dicts our extension's RPC read

    def add_adapter(self, request):
        if request.lora_int_id in self.registered:
            return False
        while len(self.registered) > self.max_cpu_loras - 1:
            del self.registered[next(iter(self.registered))]
        if self.fail_add:
            self.fail_add = False
            raise RuntimeError(f"cannot load LoRA {request.lora_path}: target module not found")
        assert os.path.isfile(os.path.join(request.lora_path, "adapter_model.safetensors"))
        self.registered[request.lora_int_id] = request.lora_path
        return True

    def remove_adapter(self, adapter_id):
        return self.registered.pop(adapter_id, None) is not None

    def set_active_adapter(self, request):
        if request.lora_int_id in self.registered:
            self.registered[request.lora_int_id] = self.registered.pop(request.lora_int_id)  # touch (LRU)
        else:
            self.add_adapter(request)

    def rpc(self, method, args):
        try:
            if method == "add_lora":
                return all([self.add_adapter(args[0])])
            if method == "remove_lora":
                return all([self.remove_adapter(args[0])])
            if method == "list_loras":
                return sorted(self.registered)
            assert method == vo.LOAD_WEIGHTS_RPC, method
            if self.fail_rpc:
                raise RuntimeError(self.fail_rpc)
            from safetensors.torch import load_file

            self.loaded.append(load_file(args[0]))
            return [len(self.loaded[-1])]
        except Exception as e:  # noqa: BLE001  (what the stage client turns an exception into)
            if self.error_shape == "subprocess":
                return {"error": True, "reason": str(e)}
            return {"supported": False, "error": str(e)}


class FakeOmni:
    """The AsyncOmni 0.30.0 surface the engine may use, over one FakeDiffusionStage.

    collective_rpc returns one result per stage replica. add_lora / remove_lora reduce them as
    entrypoints/async_omni.py:AsyncOmni.add_lora does: "return all(self._coerce_stage_bool(r) for
    r in concrete_results) if concrete_results else False", where _coerce_stage_bool ends with
    "return bool(result)": an error dict counts as success. Neither passes a timeout to
    collective_rpc. generate yields one output, the finished one: async_omni_base.py
    `_process_orchestrator_results` yields each stage output and stops "if result.finished", and a
    single-stage diffusion request has one output. It runs our recording loop with a toy velocity."""

    def __init__(self, stage=None):
        self.stage = stage or FakeDiffusionStage()
        self.calls, self.rpc_timeouts = [], []
        self.closed_early = 0  # generate closed before its end: AsyncOmni then aborts the request

    @property
    def loaded(self):
        return self.stage.loaded

    async def generate(self, prompt, sampling_params=None, request_id=""):
        sp = sampling_params
        spec = dict(sp.extra_args[vo.EXTRA_KEY])
        lora = sp.lora_request
        self.calls.append((request_id, prompt["prompt"], None if lora is None else lora.lora_int_id, spec["version"]))
        if lora is not None:
            self.stage.set_active_adapter(lora)  # raises like a failed request if it cannot load
        req = SimpleNamespace(spec=spec, sampling={"guidance_scale": sp.guidance_scale}, request_id=request_id)
        with torch.inference_mode():  # the pipeline's mode; an inline stage hands its tensors over as they are
            output = fake_output(req)
        try:
            yield output
        except GeneratorExit:
            self.closed_early += 1
            raise

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None, stage_ids=None):
        shown = [a.lora_int_id if hasattr(a, "lora_int_id") else a for a in args]
        self.calls.append((method, *shown))
        self.rpc_timeouts.append(timeout)
        return [self.stage.rpc(method, args)]

    @staticmethod
    def _coerce_stage_bool(result):
        return all(bool(item) for item in result) if isinstance(result, list) else bool(result)

    async def add_lora(self, lora_request):
        results = await self.collective_rpc(method="add_lora", args=(lora_request,))
        return all(self._coerce_stage_bool(r) for r in results)

    async def remove_lora(self, adapter_id):
        results = await self.collective_rpc(method="remove_lora", args=(adapter_id,))
        return all(self._coerce_stage_bool(r) for r in results)

    async def list_loras(self):
        results = await self.collective_rpc(method="list_loras")
        return sorted({i for r in results if isinstance(r, list) for i in r})


def make_engine(omni, tmp_path, *, lora_rank=2, **kw):
    return vo.VllmOmniEngine(
        omni,
        loop=vo._LoopThread(),
        make_sampling_params=lambda **k: SimpleNamespace(**k),
        make_lora_request=lambda **k: SimpleNamespace(**k),
        lora_rank=lora_rank,
        lora_alpha=4,
        lora_target_modules=("to_q",),
        work_dir=str(tmp_path),
        **kw,
    )


def rpcs(omni):
    """The engine's control calls, in order (generate calls are (request_id, prompt, lora, version))."""
    return [c for c in omni.calls if c[0] in ("add_lora", "list_loras", "remove_lora", vo.LOAD_WEIGHTS_RPC)]


def test_engine_swaps_lora_adapters_between_groups_and_stamps_versions(tmp_path):
    omni = FakeOmni()
    with pytest.warns(RuntimeWarning, match="between_steps"):
        engine = make_engine(omni, tmp_path, update_point="between_steps", request_timeout_s=30)
    try:
        assert engine.update_point == "between_groups" and engine.version == 0
        groups = engine.generate(["p", "q"], 2, 5, **SAMPLING, prompt_indices=[3, 4])
        assert [g.prompt_index for g in groups] == [3, 4] and all(g.versions.tolist() == [0, 0] for g in groups)
        assert [c[2:] for c in omni.calls] == [(None, 0), (None, 0)]  # version 0: base model, no adapter

        engine.stage_weights(lora_state(1.0), 3)
        assert engine.version == 0 and rpcs(omni) == []  # staged, not applied yet
        engine.stage_weights(lora_state(2.0), 4)  # a newer staged state replaces the older one
        (g,) = engine.generate(["p"], 2, 6, **SAMPLING)
        assert engine.version == 4 and g.versions.tolist() == [4, 4]
        assert rpcs(omni) == [("add_lora", 1), ("list_loras",)] and omni.calls[-1][2:] == (1, 4)
        assert torch.equal(engine.trainable_state()["transformer_blocks.0.attn.to_q.lora_A.default.weight"],
                           torch.full((2, 8), 2.0))
        first = engine.adapters.active

        engine.load_weights(lora_state(3.0), 7)  # immediate load
        # the add evicted adapter 1 (max_cpu_loras 1), so remove_lora(1) answers False: not an error
        assert rpcs(omni)[2:] == [("add_lora", 2), ("list_loras",), ("remove_lora", 1)]
        assert list(omni.stage.registered) == [2]
        assert not os.path.exists(first.path) and os.path.exists(engine.adapters.active.path)
        (g,) = engine.generate(["p"], 2, 6, **SAMPLING)
        assert g.versions.tolist() == [7, 7] and omni.calls[-1][2:] == (2, 7)

        # every control call carried a timeout (AsyncOmni.add_lora and friends pass none), and
        # each request's output stream was read to its end (closing it early aborts the request)
        assert omni.rpc_timeouts and all(t == 30 for t in omni.rpc_timeouts)
        assert omni.closed_early == 0
        assert not g.latents.is_inference() and not g.log_probs.is_inference()  # made under inference mode
    finally:
        engine.close()


@pytest.mark.parametrize("error_shape", ["subprocess", "stage_pool"])
def test_a_lora_that_fails_to_load_leaves_the_previous_one_in_use(tmp_path, error_shape):
    """The real AsyncOmni.add_lora returns True for a worker's exception (an error dict); the
    engine must see the failure, keep the previous adapter (and its directory: the failed add
    has evicted it from the workers, and the next request loads it again from there), and not
    remove it."""
    omni = FakeOmni(FakeDiffusionStage(error_shape=error_shape))
    engine = make_engine(omni, tmp_path)
    try:
        engine.load_weights(lora_state(1.0), 1)
        good = engine.adapters.active
        omni.stage.fail_add = True
        with pytest.raises(RuntimeError, match="add_lora failed .*target module not found"):
            engine.load_weights(lora_state(2.0), 2)
        assert engine.version == 1 and engine.adapters.active == good and os.path.isdir(good.path)
        assert torch.equal(engine.trainable_state()["transformer_blocks.0.attn.to_q.lora_A.default.weight"],
                           torch.full((2, 8), 1.0))
        assert ("remove_lora", good.lora_int_id) not in omni.calls
        assert sorted(os.listdir(os.path.join(tmp_path, "adapters"))) == [os.path.basename(good.path)]
        assert omni.stage.registered == {}  # evicted by the failed add

        (g,) = engine.generate(["p"], 2, 0, **SAMPLING)  # the previous adapter, loaded again from its dir
        assert g.versions.tolist() == [1, 1] and omni.calls[-1][2] == good.lora_int_id
        assert list(omni.stage.registered) == [good.lora_int_id]

        engine.load_weights(lora_state(3.0), 3)
        (g,) = engine.generate(["p"], 2, 0, **SAMPLING)
        assert g.versions.tolist() == [3, 3] and not os.path.exists(good.path)
    finally:
        engine.close()


def test_a_lora_reported_loaded_but_not_listed_is_a_failure(tmp_path):
    class ForgetfulStage(FakeDiffusionStage):
        def add_adapter(self, request):
            super().add_adapter(request)
            self.registered.pop(request.lora_int_id)
            return True

    omni = FakeOmni(ForgetfulStage())
    engine = make_engine(omni, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="list_loras .* lacks it"):
            engine.load_weights(lora_state(), 1)
        assert engine.version == 0 and engine.adapters.active is None
        assert not os.listdir(os.path.join(tmp_path, "adapters"))
    finally:
        engine.close()


def test_the_active_version_sent_again_loads_as_a_new_adapter(tmp_path):
    """WeightSync.recover sends the current version to every rollout actor, also to those that
    hold it: vllm-omni refuses an id it holds (add_adapter returns False), so each load gets a
    new id."""
    omni = FakeOmni(FakeDiffusionStage(max_cpu_loras=2))
    engine = make_engine(omni, tmp_path)
    try:
        engine.load_weights(lora_state(1.0), 5)
        first = engine.adapters.active
        engine.load_weights(lora_state(1.0), 5)
        again = engine.adapters.active
        assert again.lora_int_id != first.lora_int_id and again.version == 5 and os.path.isdir(again.path)
        # max_cpu_loras 2: nothing was evicted, so this remove_lora really removed it
        assert list(omni.stage.registered) == [again.lora_int_id] and not os.path.exists(first.path)
        (g,) = engine.generate(["p"], 2, 0, **SAMPLING)
        assert g.versions.tolist() == [5, 5] and omni.calls[-1][2] == again.lora_int_id
    finally:
        engine.close()


def test_engine_full_weights_go_through_the_worker_extension(tmp_path):
    omni = FakeOmni()
    engine = make_engine(omni, tmp_path / "w", lora_rank=0, request_timeout_s=30)
    try:
        state = {"transformer_blocks.0.attn.to_q.weight": torch.ones(8, 8), "proj_out.bias": torch.zeros(4)}
        engine.load_weights(state, 1)
        (method, path1) = omni.calls[-1]
        assert method == vo.LOAD_WEIGHTS_RPC and os.path.isfile(path1) and omni.rpc_timeouts == [30]
        assert omni.loaded[-1].keys() == state.keys() and torch.equal(omni.loaded[-1]["proj_out.bias"], torch.zeros(4))
        engine.stage_weights(state, 2)
        (g,) = engine.generate(["p"], 2, 0, **SAMPLING)
        assert g.versions.tolist() == [2, 2] and omni.calls[-1][2] is None  # no LoRA request in full fine-tune
        assert not os.path.exists(path1)  # the previous weights file is removed
        for shape in ("subprocess", "stage_pool"):
            omni.stage.fail_rpc, omni.stage.error_shape = "bad key", shape
            with pytest.raises(RuntimeError, match="bad key"):
                engine.load_weights(state, 3)
            assert engine.version == 2
    finally:
        engine.close()


@pytest.mark.parametrize(
    "results, failed",
    [([True], False), ([[True, True]], False), ([False], True), ([{"error": True, "reason": "x"}], True),
     ([{"supported": False, "error": "x"}], True), ([{"todo": True}], True), ([], True)],
)
def test_add_lora_results_are_read_as_loaded_only_when_every_stage_says_true(results, failed):
    assert (vo.lora_add_problem(3, results) is not None) == failed


def test_a_call_that_times_out_stops_in_the_loop():
    loop = vo._LoopThread()
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(TimeoutError):
            loop.run(forever(), 0.2)
        assert cancelled.wait(5)
    finally:
        loop.stop()


def test_engine_close_removes_its_own_work_dir_and_shuts_down_on_the_loop_thread():
    omni = FakeOmni()
    shut_down_on = []
    omni.shutdown = lambda: shut_down_on.append(threading.current_thread().name)
    engine = vo.VllmOmniEngine(
        omni, loop=vo._LoopThread(), make_sampling_params=dict, make_lora_request=dict, lora_rank=2, lora_alpha=4
    )
    work_dir = engine.work_dir
    assert os.path.isdir(work_dir)
    engine.close()
    assert shut_down_on == ["vllm-omni-loop"]  # AsyncOmni.shutdown cancels tasks: not from another thread
    assert not os.path.exists(work_dir) and not engine._loop.thread.is_alive()


# ------------------------------------------------------------------ worker-side classes, on fake vllm-omni bases


def fake_vllm_omni_modules(monkeypatch):
    """Stand-ins for the three vllm-omni 0.30.0 modules our worker-side classes import, with the
    call contract we rely on:
      * diffusion/model_loader/diffusers_loader.py builds a custom pipeline with
        "model = model_cls(od_config=self.od_config)" (StableDiffusion3Pipeline.__init__(self, *,
        od_config, prefix=""));
      * StableDiffusion3Pipeline.forward reads req.sampling_params_list / req.prompts, encodes each
        prompt once (batch_size rows), passes "negative_prompt_embeds=negative_prompt_embeds if
        do_cfg else None" to self.diffuse(...), and returns one DiffusionOutput per request;
      * CFGParallelMixin.predict_noise_maybe_with_cfg -> predict_noise ("result =
        self.transformer(*args, **kwargs)"; "result[0]") -> combine_cfg_noise on tuples;
      * the transformer returns an output object whatever return_dict says
        (sd3_transformer.py: "return Transformer2DModelOutput(sample=output)").
    """
    from dataclasses import dataclass, field
    from types import ModuleType

    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    @dataclass
    class DiffusionOutput:
        output: object = None
        trajectory_timesteps: object = None
        trajectory_latents: object = None
        trajectory_log_probs: object = None

    @dataclass
    class DiffusionRequestBatch:
        requests: list = field(default_factory=list)

        @property
        def prompts(self):
            return [r.prompt for r in self.requests]

        @property
        def sampling_params_list(self):
            return [r.sampling_params for r in self.requests]

    class StableDiffusion3Pipeline:
        vae_scale_factor = 8

        def __init__(self, *, od_config, prefix=""):
            self.od_config = od_config
            self.device = torch.device("cpu")
            self.scheduler = SimpleNamespace(sigmas=None)
            self.seen = []  # (timestep dtype, rows of hidden states, rows of conditioning, timestep)
            self.transformer = self._transformer

        def _transformer(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, return_dict=True):
            self.seen.append(
                (timestep.dtype, hidden_states.shape[0], encoder_hidden_states.shape[0], timestep[0].item())
            )
            v = -hidden_states.float() + encoder_hidden_states.float().mean() + pooled_projections.float().mean()
            return Transformer2DModelOutput(sample=v.to(hidden_states.dtype))

        def predict_noise(self, **kwargs):
            return self.transformer(**kwargs)[0]

        def predict_noise_maybe_with_cfg(self, do_true_cfg, true_cfg_scale, positive_kwargs, negative_kwargs,
                                         cfg_normalize=True, output_slice=None, kwargs=None):
            if not do_true_cfg:
                return self.predict_noise(**positive_kwargs)
            positive, negative = (self.predict_noise(**positive_kwargs),), (self.predict_noise(**negative_kwargs),)
            return self.combine_cfg_noise(positive, negative, true_cfg_scale, cfg_normalize)

        def combine_cfg_noise(self, positive_noise_pred, negative_noise_pred, true_cfg_scale, cfg_normalize=False,
                              kwargs=None):
            (p,), (n,) = positive_noise_pred, negative_noise_pred
            return n + true_cfg_scale * (p - n)

        def diffuse(self, **kw):
            return kw["latents"]

        def forward(self, req):
            sp, batch_size = req.sampling_params_list[0], len(req.prompts)
            n, g = sp.num_outputs_per_prompt, sp.guidance_scale
            self.scheduler.sigmas = torch.linspace(1, 0, sp.num_inference_steps + 1)
            cond = torch.full((batch_size, 3, 5), 0.1), torch.full((batch_size, 7), 0.2)
            latents = self.diffuse(
                latents=torch.zeros(batch_size * n, *LATENT, dtype=self.od_config.dtype),
                timesteps=self.scheduler.sigmas[:-1] * 1000, prompt_embeds=cond[0], pooled_prompt_embeds=cond[1],
                negative_prompt_embeds=cond[0] * 0 if g > 1 else None,
                negative_pooled_prompt_embeds=cond[1] * 0 if g > 1 else None,
                do_true_cfg=g > 1, guidance_scale=g, cfg_normalize=False,
            )
            image = latents.float().mean(1, keepdim=True).expand(-1, 3, -1, -1)
            return [DiffusionOutput(output=image[i * n : (i + 1) * n]) for i in range(batch_size)]

    class CustomPipelineWorkerExtension:
        def re_init_pipeline(self, custom_pipeline_args):
            pass

    modules = {
        "vllm_omni": ModuleType("vllm_omni"),
        "vllm_omni.diffusion.models.sd3.pipeline_sd3": SimpleNamespace(
            StableDiffusion3Pipeline=StableDiffusion3Pipeline),
        "vllm_omni.diffusion.worker.diffusion_worker": SimpleNamespace(
            CustomPipelineWorkerExtension=CustomPipelineWorkerExtension),
        "vllm_omni.diffusion.worker.request_batch": SimpleNamespace(DiffusionRequestBatch=DiffusionRequestBatch),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vo, "_WORKER_CLASSES", {})
    return DiffusionRequestBatch


@pytest.mark.parametrize("guidance, n", [(1.0, 3), (2.0, 3), (2.0, 1)])  # n = 1: the encoded prompt is already per sample
def test_pipeline_records_trajectories_on_a_fake_upstream(monkeypatch, guidance, n):
    Batch = fake_vllm_omni_modules(monkeypatch)
    pipeline = vo.FlowGRPOSD3Pipeline(od_config=SimpleNamespace(dtype=torch.bfloat16))
    assert vo.FlowGRPOSD3Pipeline.__qualname__ == "FlowGRPOSD3Pipeline"
    assert vo.PIPELINE_QUALNAME == "async_flowgrpo.rollout.vllm_omni.FlowGRPOSD3Pipeline"
    ours = vo.build_requests(["p"], n, 7, **{**SAMPLING, "guidance_scale": guidance}, version=4)[0]

    def omni_request(rollout_request):
        sampling = SimpleNamespace(**rollout_request.sampling)
        return SimpleNamespace(sampling_params=sampling, prompt=rollout_request.prompt)

    plain = omni_request(ours)
    plain.sampling_params = SimpleNamespace(**{**ours.sampling, "extra_args": {}})  # e.g. the engine's warm-up run
    with torch.inference_mode():  # as vllm-omni's model runner calls it (diffusion_model_runner.py)
        out, out_plain = pipeline.forward(Batch(requests=[omni_request(ours), plain]))
    assert out_plain.trajectory_latents is None and out.output.shape == (n, 3, *LATENT[1:])
    # the loop saw fp32 timesteps sigma * 1000 and n rows of conditioning
    sigmas = torch.linspace(1, 0, SAMPLING["num_steps"] + 1)
    first = pipeline.seen[: SAMPLING["num_steps"] * (2 if guidance > 1 else 1)]
    assert all(dt == torch.float32 and rows == cond_rows == n for dt, rows, cond_rows, _ in first)
    assert first[0][3] == pytest.approx(1000.0) and first[-1][3] == pytest.approx(float(sigmas[-2] * 1000))

    def velocity(x, i):  # what the fake transformer computes, combined in fp32
        def v(c, p):
            return (-x.to(torch.bfloat16).float() + c + p).to(torch.bfloat16).float()

        return v(0.1, 0.2) if guidance <= 1 else v(0.0, 0.0) + guidance * (v(0.1, 0.2) - v(0.0, 0.0))

    _, record = vo.denoise_and_record(velocity, LATENT, sigmas, ours.spec)
    assert torch.equal(out.trajectory_latents, record["latents"])
    assert torch.equal(out.trajectory_log_probs, record["log_probs"])
    info = out.trajectory_timesteps
    assert (info["version"], info["height"], info["width"], info["window_start"]) == (4, 64, 64, record["window_start"])
    assert info["prompt_embeds"].shape == (3, 5) and info["pooled_prompt_embeds"].shape == (7,)
    assert (info["negative_prompt_embeds"] is None) == (guidance <= 1)
    images = [Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8))] * n
    omni_output = SimpleNamespace(error=None, images=images, trajectory_latents=out.trajectory_latents,
                                  trajectory_log_probs=out.trajectory_log_probs, trajectory_timesteps=info)
    g = vo.group_from_output(omni_output, ours, guidance_scale=guidance)
    assert g.versions.tolist() == [4, 4] and g.params.height == 64
    assert out.trajectory_latents.is_inference() and not g.latents.is_inference()


def test_worker_extension_loads_diffusers_named_weights(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    fake_vllm_omni_modules(monkeypatch)
    loaded = {}
    transformer = SimpleNamespace(load_weights=lambda items: set(loaded.update(dict(items)) or loaded))
    ext = vo.FlowGRPOWorkerExtension()
    ext.model_runner = SimpleNamespace(pipeline=SimpleNamespace(transformer=transformer))
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.ones(2, 2)}, str(tmp_path / "w.safetensors"))
    assert ext.flowgrpo_load_weights(str(tmp_path / "w.safetensors")) == 1
    assert torch.equal(loaded["transformer_blocks.0.attn.to_q.weight"], torch.ones(2, 2))
    assert hasattr(ext, "re_init_pipeline")  # the custom-pipeline hook stays available
