"""Config loading: defaults, YAML + dot-list merging, and one-line errors (exit code 2) for bad input."""

import os

import pytest

from async_flowgrpo.config import config_or_exit
from async_flowgrpo.config import CONFIG_DIR, MODES, ConfigError, load_config, to_yaml


@pytest.fixture
def model(tiny_model_dir):
    return f"model.path={tiny_model_dir}"


def test_modes_load_with_overrides(model):
    for mode, eta in (("sync", 0), ("one_step_off", 1), ("fully_async", 1)):
        cfg = load_config(mode, [model, "trainer.total_steps=3", "rollout.num_workers=2"])
        assert cfg.mode == mode
        assert cfg.algorithm.max_staleness == eta
        assert cfg.trainer.total_steps == 3 and cfg.rollout.num_workers == 2
        assert cfg.batch_size == cfg.rollout.group_size * cfg.rollout.groups_per_step


def test_yaml_file_argument_and_round_trip(model, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("rollout:\n  group_size: 4\nsync:\n  bucket_mb: 8\n")
    cfg = load_config("fully_async", [str(extra), model, "rollout.group_size=6", "rollout.groups_per_step=2"])
    assert cfg.rollout.group_size == 6  # the dot-list wins over the file
    assert cfg.sync.bucket_mb == 8.0
    dumped = tmp_path / "config.yaml"
    dumped.write_text(to_yaml(cfg))
    again = load_config("fully_async", [str(dumped)])
    assert again == cfg


BAD_CONFIGS = [
    # (overrides, text the one-line message must contain)
    (["rollout.group_sise=4"], "group_sise"),
    (["nonsense.key=1"], "nonsense"),
    (["rollout.group_size=abc"], "rollout.group_size"),
    (["trainer.total_steps=1.5"], "trainer.total_steps"),
    (["rollout.num_workers=0"], "rollout.num_workers"),
    (["rollout.num_workers=-1"], "rollout.num_workers"),
    (["trainer.num_workers=0"], "trainer.num_workers"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rollout.group_size=0"], "rollout.group_size"),
    (["rollout.groups_per_step=0"], "rollout.groups_per_step"),
    (["rollout.num_steps=1"], "rollout.num_steps"),
    (["rollout.num_steps=10", "rollout.sde_window_size=10"], "rollout.sde_window_size"),
    (["rollout.sde_window_size=-2"], "rollout.sde_window_size"),
    (["rollout.sde_window_range=[3,2]"], "rollout.sde_window_range"),
    (["rollout.sde_window_size=4", "rollout.sde_window_range=[0,2]"], "rollout.sde_window_size"),
    (["rollout.sde_type=ode"], "rollout.sde_type"),
    (["rollout.after_window_solver=heun"], "rollout.after_window_solver"),
    (["rollout.after_window_steps=0"], "rollout.after_window_steps"),
    (["rollout.after_window_steps=1.5"], "rollout.after_window_steps"),
    (["algorithm.name=diffusion_nft", "rollout.after_window_solver=dpm2"], "no SDE window"),
    (["rollout.noise_level=0"], "rollout.noise_level"),
    (["rollout.engine=tensorrt"], "rollout.engine"),
    (["rollout.resolution=30"], "rollout.resolution"),
    (["rollout.prompts=/no/such/prompts.txt"], "rollout.prompts"),
    (["rollout.prompt_mix={zebra: 1.0}"], "rollout.prompt_mix"),
    (["rollout.prompt_mix={single: 0.0}"], "rollout.prompt_mix"),
    (["rollout.groups_per_step=3", "trainer.num_workers=2"], "cannot be split evenly"),
    (["rollout.group_size=3", "rollout.groups_per_step=1", "trainer.mini_batches=2"], "trainer.mini_batches"),
    (["sync.every=3", "algorithm.max_staleness=1"], "sync.every"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    (["trainer.lr=0"], "trainer.lr"),
    (["trainer.lr=-1e-4"], "trainer.lr"),
    (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps"),
    (["trainer.lr_min_ratio=1.5"], "trainer.lr_min_ratio"),
    (["trainer.lr_decay_steps=5", "trainer.warmup_steps=10"], "trainer.lr_decay_steps"),
    (["trainer.resume=/no/such/run"], "trainer.resume"),
    (["trainer.max_grad_norm=0"], "trainer.max_grad_norm"),
    (["algorithm.max_staleness=-1"], "algorithm.max_staleness"),
    (["algorithm.flow_grpo.clip_range=0"], "algorithm.flow_grpo.clip_range"),
    (["algorithm.flow_grpo.is_cap=0.5"], "algorithm.flow_grpo.is_cap"),
    (["algorithm.flow_grpo.prox_mode=magic"], "algorithm.flow_grpo.prox_mode"),
    (["algorithm.flow_grpo.is_correction=sum"], "algorithm.flow_grpo.is_correction"),
    (["algorithm.flow_grpo.is_mode=clip"], "algorithm.flow_grpo.is_mode"),
    (["algorithm.stale_policy=ignore"], "algorithm.stale_policy"),
    (["algorithm.beta=0.04", "model.lora_rank=0"], "algorithm.beta"),
    (["model.lora_rank=-4"], "model.lora_rank"),
    (["model.dtype=float8"], "model.dtype"),
    (["trainer.compile=turbo"], "trainer.compile: 'turbo': not a torch.compile backend"),
    (["rollout.compile=turbo"], "rollout.compile: 'turbo': not a torch.compile backend"),
    (["trainer.compile=inductor", "trainer.fsdp=true"], "trainer.compile: not with trainer.fsdp"),
    (["model.family=sdxl"], "model.family"),
    (["sync.transport=carrier_pigeon"], "sync.transport"),
    (["sync.every=0"], "sync.every"),
    (["sync.bucket_mb=0"], "sync.bucket_mb"),
    (["sync.update_point=mid_air"], "sync.update_point"),
    (["algorithm.name=diffusion_nft", "sync.update_point=between_steps"], "between_groups"),
    (["reward.weights={nonexistent_reward: 1.0}"], "nonexistent_reward"),
    (["reward.weights={jpeg_incompressibility: nan}"], "reward.weights.jpeg_incompressibility: must be a finite number, got nan"),
    (["reward.weights={jpeg_incompressibility: inf}"], "reward.weights.jpeg_incompressibility: must be a finite number"),
    (["reward.weights={jpeg_incompressibility: 0.0}"], "reward.weights: every weight is 0"),
    (["trainer.lr=inf"], "trainer.lr: must be a finite number, got inf"),
    (["algorithm.name=awm", "algorithm.awm.timestep_fraction=nan"], "algorithm.awm.timestep_fraction: must be a finite number, got nan"),
    (["algorithm.name=dgpo", "algorithm.dgpo.beta_dpo=-inf"], "algorithm.dgpo.beta_dpo: must be a finite number, got -inf"),
    (["eval.guidance_scale=nan"], "eval.guidance_scale: must be a finite number"),
    (["eval.guidance_scale=-1"], "eval.guidance_scale: must be >= 0"),
    (["ray.num_cpus=-1"], "ray.num_cpus: must be >= 0"),
    (["ray.num_gpus=-2"], "ray.num_gpus: must be >= 0"),
    (["reward.max_consecutive_failures=0"], "reward.max_consecutive_failures"),
    (["logging.wandb_mode=loud"], "logging.wandb_mode"),
    (["mode=turbo"], "mode"),
    (["trainer.total_steps"], "expected key=value"),
]


@pytest.mark.parametrize("overrides,needle", BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line(overrides, needle, model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_or_exit("fully_async", [model, *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def test_mode_specific_staleness(model):
    with pytest.raises(ConfigError, match="algorithm.max_staleness"):
        load_config("sync", [model, "algorithm.max_staleness=2"])


def test_missing_and_invalid_model_path(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        load_config("fully_async", [f"model.path={tmp_path / 'missing'}"])
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(ConfigError, match="model_index.json"):
        load_config("fully_async", [f"model.path={tmp_path / 'not_a_model'}"])


@pytest.mark.parametrize("name", ["sd35_medium", "flux_dev", "qwen_image"])
def test_model_family_file_requires_a_real_path(name, tiny_model_dir):
    family_file = os.path.join(os.path.dirname(__file__), "..", "config", "model", f"{name}.yaml")
    with pytest.raises(ConfigError, match="model.path"):
        load_config("fully_async", [family_file])
    assert load_config("fully_async", [family_file, f"model.path={tiny_model_dir}"]).model.path == tiny_model_dir


# -- bad input files and paths: one line naming the key, before Ray starts -------------------------
BAD_PROMPT_FILES = {
    "empty.txt": (b"", "has no prompts"),
    "comments_only.txt": (b"# nothing\n\n", "has no prompts"),
    "malformed.jsonl": (b'{"prompt": "a red circle"}\n{"prompt": \n', "malformed.jsonl:2: not valid JSON"),
    "missing_key.jsonl": (b'{"text": "a red circle"}\n', "missing_key.jsonl:1: expected a JSON object"),
    "not_an_object.jsonl": (b'["a red circle"]\n', "not_an_object.jsonl:1: expected a JSON object"),
    "latin1.txt": ("a red circle\nun carré rouge\n".encode("latin-1"), "latin1.txt:2: not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(BAD_PROMPT_FILES))
@pytest.mark.parametrize("key", ["rollout.prompts", "eval.prompts"])
def test_bad_prompt_file_is_one_line_naming_key_and_file(name, key, model, tmp_path, capsys):
    content, needle = BAD_PROMPT_FILES[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        config_or_exit("sync", [model, f"{key}={path}", "rollout.prompt_mix=null"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"config error: {key}: ") and needle in err, err


def test_prompt_path_that_is_a_directory(model, tmp_path):
    with pytest.raises(ConfigError, match="rollout.prompts: .* is a directory"):
        load_config("sync", [model, f"rollout.prompts={tmp_path}", "rollout.prompt_mix=null"])


def test_output_dir_that_is_a_file(model, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="trainer.output_dir: .* is not a directory"):
        load_config("sync", [model, f"trainer.output_dir={tmp_path / 'file'}"])
    with pytest.raises(ConfigError, match="trainer.output_dir"):  # a path through a file
        load_config("sync", [model, f"trainer.output_dir={tmp_path / 'file' / 'run'}"])


def test_an_engine_that_is_not_installed(model, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # as if not installed, even where it is
    with pytest.raises(ConfigError, match="rollout.engine: vllm-omni is not installed"):
        load_config("fully_async", [model, "rollout.engine=vllm_omni"])


def test_staleness_correction_settings(model):
    """The off switch and the per-step weight load from the dot-list; the default is today's."""
    cfg = load_config("fully_async", [model, "algorithm.is_correction=none"])
    assert (cfg.algorithm.flow_grpo.is_correction, cfg.algorithm.flow_grpo.is_mode) == ("none", "truncate")
    cfg = load_config("fully_async", [model, "algorithm.is_correction=step", "algorithm.is_mode=mask"])
    assert (cfg.algorithm.flow_grpo.is_correction, cfg.algorithm.flow_grpo.is_mode) == ("step", "mask")
    assert load_config("sync", [model]).algorithm.flow_grpo.is_correction == "element_mean"  # today's, the default


def test_new_safety_settings_are_validated(model):
    for override, key in (("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints"),
                          ("trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps")):
        with pytest.raises(ConfigError, match=key):
            load_config("sync", [model, override])
    assert load_config("sync", [model, "sync.host=10.0.0.5"]).sync.host == "10.0.0.5"


def test_reward_stage_settings_are_validated(model):
    cfg = load_config("fully_async", [model])
    assert (cfg.reward.overlap, cfg.reward.max_pending) == (True, 2)  # overlap is the default
    for overrides, key in ((["reward.max_pending=0"], "reward.max_pending"),
                           (["reward.gpus_per_worker=-1", "reward.num_workers=1"], "reward.gpus_per_worker"),
                           (["reward.resources={judge: 0}", "reward.num_workers=1"], "reward.resources"),
                           (["reward.gpus_per_worker=1"], "reward.gpus_per_worker: .*set reward.num_workers > 0"),
                           (["reward.batch_size=8"], "reward.batch_size: .*set reward.num_workers > 0"),
                           (["reward.batch_size=-1", "reward.num_workers=1"], "reward.batch_size"),
                           (["reward.batch_wait_s=-1"], "reward.batch_wait_s")):
        with pytest.raises(ConfigError, match=key):
            load_config("sync", [model, *overrides])
    cfg = load_config("sync", [model, "reward.overlap=false", "reward.num_workers=1", "reward.gpus_per_worker=0.5",
                               "reward.resources={judge: 1}"])
    assert (cfg.reward.overlap, cfg.reward.gpus_per_worker, cfg.reward.resources) == (False, 0.5, {"judge": 1})


@pytest.mark.parametrize("option, message", [
    ("score=bogus", r"reward.options.shapes: .*score must be one of partial, checks, correct, graded, got 'bogus'"),
    ("scroe=partial", r"reward.options.shapes: .*does not take option\(s\) scroe"),
])
def test_a_bad_reward_option_is_a_config_error_not_a_failure_at_the_first_rollout(option, message):
    with pytest.raises(ConfigError, match=message):
        load_config("sync", [f"reward.options.shapes.{option}"])
    assert load_config("sync", ["reward.options.shapes.score=graded"]).reward.options["shapes"]["score"] == "graded"


def test_a_model_rewards_missing_file_is_a_config_error_on_a_local_cluster(tmp_path, monkeypatch):
    """A reward's local file named in its options (path, clip_path, ...) that does not exist stops the
    launcher (exit 2) instead of failing the first group after Ray, an evaluation and a step-0
    checkpoint that leaves the output directory used. Joining a cluster, the file may be on the
    node the reward runs on: not checked there."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    missing = str(tmp_path / "PickScore_v1")
    args = ["reward.weights={pickscore: 1.0}", f"reward.options.pickscore.path={missing}"]
    with pytest.raises(ConfigError, match=f"reward.options.pickscore.path: '{missing}' does not exist on this machine"):
        load_config("sync", args)
    with pytest.raises(ConfigError, match="reward.options.aesthetic.clip_path: "):
        load_config("sync", ["reward.weights={aesthetic: 1.0}", f"reward.options.aesthetic.path={tmp_path}",
                             f"reward.options.aesthetic.clip_path={missing}"])
    load_config("sync", [*args, "ray.address=auto"])  # another machine's file: the reward says so when it loads
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    load_config("sync", args)


SHIPPED = sorted(f for f in os.listdir(CONFIG_DIR)
                 if f.endswith(".yaml") and f not in ("base.yaml", *(f"{mode}.yaml" for mode in MODES)))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_file_loads_in_fully_async_and_is_valid_or_one_line_in_the_others(name):
    """What the README tells users to run (`python launch/MODE.py config/NAME.yaml`) loads, with the
    file's values in the result; a file that needs fully_async (resampling) is refused with the key named."""
    path = os.path.join(CONFIG_DIR, name)
    cfg = load_config("fully_async", [path])
    with open(path) as f:
        resampled = "resample_flat_groups: true" in f.read()
    if resampled:
        assert cfg.algorithm.resample_flat_groups
    for mode in ("sync", "one_step_off"):  # fully_async loaded above
        try:
            assert load_config(mode, [path]).mode == mode
        except ConfigError as e:
            assert cfg.algorithm.resample_flat_groups and "algorithm.resample_flat_groups: fully_async only" in str(e), str(e)
