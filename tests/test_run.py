"""The modes end to end on Ray (async_flowgrpo.driver + modes) on 2 cores: sync, one_step_off and fully_async with a tiny model.

One Ray cluster for the module; each run is a few steps of a tiny random SD3 model. The runs are
shared between tests (module-scoped fixtures), since starting actors dominates the cost.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch

from async_flowgrpo.config import load_config
from async_flowgrpo.modes import run
from async_flowgrpo.driver.cluster import RunError
from async_flowgrpo.driver.run import Run

PROMPTS = ["a red circle", "a blue square", "a red square", "a blue circle"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "shapes.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


def small_config(mode, model_dir, prompts, output_dir, *extra):
    return load_config(mode, small_argv(model_dir, prompts, output_dir, *extra))


def small_argv(model_dir, prompts, output_dir, *extra):
    return [
        f"model.path={model_dir}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        f"rollout.prompts={prompts}",
        "rollout.prompt_mix=null",
        "rollout.sde_window_range=null",
        f"eval.prompts={prompts}",
        "rollout.group_size=2",
        "rollout.groups_per_step=2",
        "rollout.num_steps=4",
        "rollout.sde_window_size=0",
        "rollout.cpus_per_worker=0.25",
        "trainer.cpus_per_worker=0.25",
        "trainer.micro_batch_size=4",
        "trainer.lr=1e-2",
        "trainer.lr_schedule=constant",  # these runs check mechanics: every step at the full lr
        "trainer.warmup_steps=0",
        "trainer.total_steps=3",
        "trainer.sample_every=0",
        f"trainer.output_dir={output_dir}",
        "eval.every=0",
        "eval.at_start_and_end=false",
        "logging.progress=false",
        "sync.timeout_s=120",
        # graded credit: a tiny random model gets nothing entirely right, and all-zero rewards
        # would leave nothing to learn (no gradient for the update tests to see)
        "reward.options={shapes: {score: partial}}",
        *extra,
    ]


def one_batch(run):
    """Generate one batch (batch modes' tickets) and return its group records."""
    return run.batches.collect(run.batches.start(run.cfg.rollout.groups_per_step))


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def alive_actors(settle_s: float = 10.0) -> list[str]:
    """The classes of the actors alive in this process's Ray cluster (the GCS's actor table), once
    none is still on its way out (ray.kill is asynchronous) or `settle_s` has passed."""
    from ray._private import state

    deadline = time.monotonic() + settle_s
    while True:
        actors = state.actors().values()
        alive = sorted(a["ActorClassName"] for a in actors if a["State"] == "ALIVE")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, prompt_file, tmp_path_factory):
    """One short run per mode; returns {mode: (output_dir, metrics rows, actors alive after it)}."""
    out = {}
    for mode in ("sync", "one_step_off", "fully_async"):
        output_dir = str(tmp_path_factory.mktemp(mode))
        run(small_config(mode, tiny_model_dir, prompt_file, output_dir))
        out[mode] = (output_dir, read_metrics(output_dir), alive_actors())
    return out


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_finished_run_leaves_no_actor_behind(runs, mode):
    """A run in a process that goes on (a notebook, these tests) ends every actor it started,
    fully_async's queue actor included."""
    assert runs[mode][2] == []


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_every_mode_writes_outputs_and_steps_versions(runs, mode):
    output_dir, rows, _ = runs[mode]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3]  # one published update per step
    for key in ("reward/mean", "loss/policy", "policy/clip_frac", "is/ess", "staleness/mean", "sync/time_s",
                "perf/samples_per_s", "perf/trainer_idle_frac", "perf/rollout_idle_frac",
                "samples/produced", "samples/consumed", "queue/size", "driver/bytes_per_step"):
        assert key in rows[-1], key
    assert all(r["perf/generate_s_per_group"] > 0 for r in rows if "perf/generate_s_per_group" in r)
    assert any("perf/generate_s_per_group" in r for r in rows)  # a step with no new group leaves it out
    # the rollout's log-probs against the trainer's: logged on a step that trains fresh samples
    fresh = [r for r in rows if r["staleness/mean"] == 0]
    assert fresh and all(r["logp/max_abs_diff"] < 1e-5 for r in fresh)
    stale = [r for r in rows if r["staleness/mean"] >= 1]  # no fresh sample: nothing to compare, no 0.0
    assert all("logp/max_abs_diff" not in r for r in stale)
    assert rows[-1]["samples/consumed"] == 3 * 4
    assert os.path.exists(os.path.join(output_dir, "config.yaml"))
    assert os.listdir(os.path.join(output_dir, "checkpoints"))


def test_sync_has_zero_staleness_and_exact_logps(runs):
    _, rows, _ = runs["sync"]
    assert all(r["staleness/max"] == 0 for r in rows)
    assert all(r["samples/produced"] == r["samples/consumed"] for r in rows)
    # Fresh samples, same weights: the trainer's recomputed log-probs equal the rollout's.
    assert max(r["logp/max_abs_diff"] for r in rows) < 1e-4


def test_one_step_off_has_staleness_exactly_one_after_the_first_step(runs):
    _, rows, _ = runs["one_step_off"]
    assert rows[0]["staleness/max"] == 0
    assert all(r["staleness/mean"] == 1 and r["staleness/max"] == 1 for r in rows[1:])


def test_fully_async_stays_within_eta_and_counts_balance(runs):
    _, rows, _ = runs["fully_async"]
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert all(r["staleness/hist_over"] == 0 and r["staleness/hist_0"] + r["staleness/hist_1"] == 2 for r in rows)
    last = rows[-1]
    # Every produced sample is trained, dropped or still queued: nothing lost.
    assert last["samples/lost"] == 0
    assert last["samples/produced"] == last["samples/consumed"] + last["samples/dropped_stale"] + last["queue/size_samples"]


def test_fully_async_eta_zero_is_sync(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    cfg = small_config("fully_async", tiny_model_dir, prompt_file, str(tmp_path), "algorithm.max_staleness=0", "trainer.total_steps=2")
    run(cfg)
    rows = read_metrics(str(tmp_path))
    assert all(r["staleness/max"] == 0 for r in rows)


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_failing_reward_skips_its_group_and_the_run_goes_on(ray_cluster, tiny_model_dir, tmp_path, mode):
    prompts = tmp_path / "mixed.txt"
    prompts.write_text("a red circle\na blue zebra\na blue square\n")  # "zebra" fails to parse
    cfg = small_config(mode, tiny_model_dir, str(prompts), str(tmp_path / "run"), "rollout.groups_per_step=3")
    run(cfg)
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 3
    assert rows[-1]["rewards/errors"] >= 1
    assert rows[-1]["rewards/skipped_groups"] == rows[-1]["rewards/errors"]


def test_reward_that_always_fails_stops_the_run(ray_cluster, tiny_model_dir, tmp_path):
    prompts = tmp_path / "bad.txt"
    prompts.write_text("a blue zebra\n")
    cfg = small_config("sync", tiny_model_dir, str(prompts), str(tmp_path / "run"), "reward.max_consecutive_failures=2")
    with pytest.raises(RunError, match="consecutive reward failures") as error:
        run(cfg)
    assert len(str(error.value).splitlines()) == 1
    assert os.listdir(tmp_path / "run" / "checkpoints")  # stopped with a checkpoint of the good state


def test_a_diverging_run_stops_loudly(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """trainer.lr=1e6: the weights blow up after the first update, every later update is non-finite
    and skipped; after trainer.max_nonfinite_steps such steps in a row the run stops."""
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "trainer.lr=1e6", "trainer.total_steps=8",
                       "trainer.max_nonfinite_steps=2")
    with pytest.raises(RunError, match="training diverged: .*max_nonfinite_steps=2.*trainer.lr") as error:
        run(cfg)
    assert len(str(error.value).splitlines()) == 1
    rows = read_metrics(str(tmp_path))
    assert rows[-1]["train/nonfinite_steps"] >= 1 and len(rows) < 8


def test_an_update_that_outlasts_its_timeout_stops_the_run_with_one_line(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """A hung trainer (here: an update held to 8 s against ray.work_timeout_s=3) is an error with one
    line naming the timeouts and the last checkpoint, not a GetTimeoutError traceback."""
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "ray.work_timeout_s=3",
                       "trainer.min_step_time_s=8", "trainer.total_steps=3")
    with pytest.raises(RunError, match=r"at step 0 .*ray\.work_timeout_s=3 .*last checkpoint: none") as error:
        run(cfg)
    assert len(str(error.value).splitlines()) == 1
    assert alive_actors() == []


def test_data_parallel_trainers_match_a_single_trainer(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """M = 2 trainers on a split batch give the same update as M = 1 on the whole batch. Without the
    KL term: at the first update its gradient is float noise (the reference forward batches the CFG
    halves, the trained one does not), which depends on the batch split, and AdamW's first step
    turns a noise-sized gradient into a full lr-sized update."""
    digests, weights = {}, {}
    for m in (1, 2):
        cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path / f"m{m}"), f"trainer.num_workers={m}", "algorithm.beta=0")
        p = Run(cfg)
        try:
            groups = one_batch(p)  # same tickets, seeds and weights for both
            p.train(groups)
            state = ray.get(p.trainers[0].state_dict.remote(), timeout=60)["trainable"]
            weights[m] = state
            digests[m] = ray.get([t.weights_digest.remote() for t in p.trainers], timeout=60)
        finally:
            p.shutdown()
    assert digests[2][0] == digests[2][1]  # both data-parallel ranks hold the same weights
    for name in weights[1]:
        torch.testing.assert_close(weights[2][name], weights[1][name], rtol=1e-5, atol=1e-6)


def test_unreachable_ray_address_fails_fast(tiny_model_dir, prompt_file, tmp_path):
    from async_flowgrpo.driver.cluster import init_ray

    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "ray.address=127.0.0.1:1", "ray.connect_timeout_s=2")
    with pytest.raises(RunError, match="ray.address"):
        init_ray(cfg)


@pytest.mark.parametrize("gpus, transport, device", [
    (0.5, "collective", "cpu"),  # two actors on one GPU: NCCL refuses, gloo over CPU buffers
    (1.0, "collective", None),  # one GPU each: NCCL on each member's own GPU
    (0.0, "collective", None),  # CPU actors: the members' default (gloo on CPU)
    (0.5, "object_store", None),  # no group at all
])
def test_weight_sync_leaves_nccl_when_actors_share_a_gpu(gpus, transport, device):
    from async_flowgrpo.driver.cluster import sync_device

    cfg = load_config("fully_async", [f"rollout.gpus_per_worker={gpus}", f"trainer.gpus_per_worker={gpus}", f"sync.transport={transport}"])
    assert sync_device(cfg) == device


@pytest.mark.slow  # starts Ray in a subprocess
def test_a_sigterm_in_the_last_moments_of_ray_init_reaches_the_drivers_handler(tmp_path):
    """ray.init would take SIGTERM twice over: a Python handler that exits 15 without a word, and
    its core worker's C++ crash handler, which dumps a stack and aborts. A SIGTERM sent right after
    the driver's core worker starts (inside ray.init) must reach the handler the driver installed
    before (the run's graceful stop), and one after init_ray too."""
    script = (
        "import os, signal, time\n"
        "import ray\n"
        "import ray._private.worker as worker\n"
        "from async_flowgrpo.config import load_config\n"
        "from async_flowgrpo.driver.cluster import init_ray\n"
        "connect = worker.connect\n"
        "def connect_then_signal(*args, **kwargs):\n"
        "    result = connect(*args, **kwargs)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    return result\n"
        "worker.connect = connect_then_signal\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))\n"
        f"init_ray(load_config('sync', ['ray.num_cpus=1', 'trainer.output_dir={tmp_path}']))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.2)\n"
        "ray.shutdown()\n"
        "print('handled', len(got))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0 and "handled 2" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_impossible_resource_request_fails_fast(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "rollout.gpus_per_worker=1")
    with pytest.raises(RunError, match="GPUs requested"):
        Run(cfg)
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "rollout.num_workers=9", "rollout.cpus_per_worker=1")
    with pytest.raises(RunError, match="CPUs requested"):
        Run(cfg)
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "rollout.resources={rollout_node: 1}")
    with pytest.raises(RunError, match="rollout.resources: 1 of 'rollout_node' requested, the cluster has 0"):
        Run(cfg)
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "reward.num_workers=2",
                       "reward.resources={judge_node: 1}")
    with pytest.raises(RunError, match="reward.resources: 2 of 'judge_node' requested, the cluster has 0"):
        Run(cfg)
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "reward.num_workers=1", "reward.gpus_per_worker=1")
    with pytest.raises(RunError, match=r"GPUs requested \(1 rollout \+ 1 trainer \+ 1 reward actors\)"):
        Run(cfg)


def test_actors_that_do_not_load_in_time_stop_the_run_with_one_line_naming_the_key(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "ray.start_timeout_s=0.001")
    with pytest.raises(RunError, match=r"did not load .* within ray.start_timeout_s=0.001 s"):
        Run(cfg)


def test_a_call_that_times_out_during_start_up_stops_the_run_with_one_line(ray_cluster, tiny_model_dir, prompt_file,
                                                                            tmp_path, monkeypatch):
    """After the actors loaded: the first weight push (or loading a checkpoint) times out."""
    def push_times_out(self):
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(Run, "publish_weights", push_times_out)
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "ray.work_timeout_s=7")
    with pytest.raises(RunError, match=r"did not answer in time during start-up \(ray.work_timeout_s=7 s.*nothing was trained"):
        Run(cfg)
    assert alive_actors() == []


def copy_of(runs, mode: str, to: str) -> str:
    """A copy of the `runs` fixture's 3-step run of `mode` (its output_dir becomes `to`), to resume."""
    shutil.copytree(runs[mode][0], to)
    return to


def test_resume_continues_exactly_like_a_straight_run(runs, tiny_model_dir, prompt_file, tmp_path):
    """sync: 3 steps + resume + 3 steps == 6 straight steps (steps, versions, weights, prompt cursor)."""
    straight, resumed = str(tmp_path / "straight"), copy_of(runs, "sync", str(tmp_path / "resumed"))
    run(small_config("sync", tiny_model_dir, prompt_file, straight, "trainer.total_steps=6"))
    run(small_config("sync", tiny_model_dir, prompt_file, resumed, "trainer.total_steps=6", "trainer.resume=latest"))

    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    from async_flowgrpo import checkpoint

    a = checkpoint.load(os.path.join(straight, "checkpoints", "step_000006"))
    b = checkpoint.load(os.path.join(resumed, "checkpoints", "step_000006"))
    assert a["next_ticket"] == b["next_ticket"] == 6 * 2  # every group trained once, none skipped
    for name, value in a["learner"]["trainable"].items():
        torch.testing.assert_close(b["learner"]["trainable"][name], value, rtol=0, atol=1e-7)
    # The checkpoint's LoRA weights load with diffusers' own loader.
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_model_dir, text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(os.path.join(resumed, "checkpoints", "step_000006", "weights"))


def test_the_weight_average_is_saved_evaluated_and_resumed(ray_cluster, tiny_model_dir, prompt_file, tmp_path, capsys):
    """trainer.ema_decay: the checkpoint keeps the live weights (to train on) and the average; the
    saved weights are the average, and what the evaluation command takes (the live ones with
    --live); a resumed run goes on averaging from the saved one."""
    from async_flowgrpo import evaluation
    from safetensors.torch import load_file

    from async_flowgrpo import checkpoint

    out = str(tmp_path)
    ema = ["trainer.ema_decay=0.5", "eval.at_start_and_end=true", "eval.num_steps=4", "eval.samples_per_prompt=1"]
    run(small_config("sync", tiny_model_dir, prompt_file, out, *ema))
    step3 = os.path.join(out, "checkpoints", "step_000003")
    state = checkpoint.load(step3)["learner"]
    live, average = state["trainable"], state["ema"]["average"]
    assert state["ema"]["updates"] == 3 and live.keys() == average.keys()
    assert any(not torch.equal(live[k], average[k]) for k in live)  # lr 1e-2: the two differ
    saved = load_file(os.path.join(step3, "weights", "pytorch_lora_weights.safetensors"))
    assert len(saved) == len(average)
    for name, value in average.items():  # peft's names: "transformer." + name without the adapter
        torch.testing.assert_close(saved["transformer." + name.replace(".default", "")], value, rtol=0, atol=0)
    rows = read_metrics(out)
    assert "eval/reward" in rows[0] and "eval/reward" in rows[-1]  # evaluated (on the average) at both ends
    for flag, which in (([], ", the weight average)"), (["--live"], ")")):
        capsys.readouterr()
        evaluation.main([*small_argv(tiny_model_dir, prompt_file, out, *ema, "trainer.resume=latest"), *flag])
        printed = capsys.readouterr().out
        assert f"weights: {step3} (step 3{which}" in printed and "eval/reward" in printed, printed

    run(small_config("sync", tiny_model_dir, prompt_file, out, *ema, "trainer.total_steps=4", "trainer.resume=latest"))
    resumed = checkpoint.load(os.path.join(out, "checkpoints", "step_000004"))["learner"]["ema"]
    assert resumed["updates"] == 4
    assert any(not torch.equal(resumed["average"][k], average[k]) for k in average)


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_resumes(
        ray_cluster, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """ENOSPC while writing checkpoint 4 (injected in the driver's tensor file): the run stops with
    one line naming the disk and the intact checkpoint 2, leaves no partial directory, and a resume
    once there is space again ends exactly like a straight run."""
    import errno

    import safetensors.torch

    from async_flowgrpo import checkpoint

    out = str(tmp_path)
    real_save_file, saves = safetensors.torch.save_file, []

    def save_file_on_a_filling_disk(tensors, filename, *args, **kwargs):
        saves.append(filename)
        if len(saves) == 2:  # checkpoint 2 fits, checkpoint 4 does not
            with open(filename, "wb") as f:
                f.write(b"\0" * 1000)  # what was written before the disk filled
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_on_a_filling_disk)
    cfg = small_config("sync", tiny_model_dir, prompt_file, out, "trainer.total_steps=6", "trainer.checkpoint_every=2")
    with pytest.raises(RunError, match=r"disk full: checkpoint step 4 .*No space left on device.*step_000002.*"
                                       r"trainer.resume=latest") as error:
        run(cfg)
    assert len(str(error.value).splitlines()) == 1
    root = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_000002"]  # no half-written directory
    assert checkpoint.load(os.path.join(root, "step_000002"))["step"] == 2

    monkeypatch.setattr(safetensors.torch, "save_file", real_save_file)  # space freed
    run(small_config("sync", tiny_model_dir, prompt_file, out, "trainer.total_steps=6", "trainer.checkpoint_every=2",
                     "trainer.resume=latest"))
    last = {r["step"]: r for r in read_metrics(out)}  # readers take the last row per step
    assert sorted(last) == [1, 2, 3, 4, 5, 6] and last[6]["version"] == 6
    assert checkpoint.load(os.path.join(root, "step_000006"))["next_ticket"] == 6 * 2  # each group trained once


def test_disk_full_finds_the_out_of_space_error_here_or_inside_an_actor():
    import errno

    from async_flowgrpo.driver.run import disk_full

    full = OSError(errno.ENOSPC, "No space left on device", "/x")
    assert disk_full(full) is full and disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert disk_full(ray.exceptions.RayTaskError("save_weights", "traceback", full)) is full  # a trainer's save
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full(ray.exceptions.RayTaskError("save_weights", "traceback", ValueError("x"))) is None


def test_a_paced_trainer_lets_fully_async_reach_its_staleness_bound(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """trainer.min_step_time_s: every update takes at least that long, and with the trainer the
    slower side the queue fills and each batch is as stale as max_staleness allows (what the
    staleness sweep needs on a rollout-bound machine; the tiny test model's trainer is the slower
    side even unpaced, so the pacing itself is checked by the clock)."""
    out = str(tmp_path)
    run(small_config("fully_async", tiny_model_dir, prompt_file, out, "algorithm.max_staleness=2",
                     "trainer.min_step_time_s=1.0", "trainer.total_steps=7"))
    rows = read_metrics(out)
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert [r["staleness/mean"] for r in rows[3:]] == [2.0] * 4  # once the queue has filled
    assert rows[-1]["time_s"] - rows[0]["time_s"] >= 6 * 1.0


def test_fully_async_resume_loses_no_finished_rollout(runs, tiny_model_dir, prompt_file, tmp_path):
    """The checkpoint holds the groups queued (and the tickets in flight) at the last step; the
    resumed run puts them back in the queue instead of dropping them, and its counters balance."""
    from async_flowgrpo import checkpoint

    out = copy_of(runs, "fully_async", str(tmp_path / "run"))
    saved = checkpoint.load(os.path.join(out, "checkpoints", "step_000003"))["queue"]
    assert len(saved["queued_groups"]) + len(saved["in_flight_tickets"]) >= 1  # producers run ahead (eta 1)
    assert all(g["latents"].ndim == 5 for g in saved["queued_groups"])  # whole trajectories, not records
    run(small_config("fully_async", tiny_model_dir, prompt_file, out, "trainer.total_steps=5", "trainer.resume=latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    resumed = rows[3]
    assert resumed["groups/drained"] == 0  # nothing queued at the checkpoint was thrown away
    assert resumed["groups/produced"] == resumed["groups/consumed"] + resumed["groups/dropped_stale"] + resumed["queue/size"]
    assert rows[-1]["samples/consumed"] == 5 * 4 and rows[-1]["staleness/max"] <= 1


def stop_after_step(monkeypatch, step: int, wait_for_rollouts: bool):
    """Ask the run to stop (as SIGTERM does) once `step` is logged; wait_for_rollouts: first let the
    batch in flight finish, so that the stop finds finished rollouts to save."""
    original = Run.end_step

    def end_step(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.step == step:
            if wait_for_rollouts and self.batches._started:
                shares = self.batches._started[0][1]
                refs = [s.refs[0] for s in shares if s.restored is None]
                ray.wait(refs, num_returns=len(refs), timeout=120)
            self.stop.request(signal.SIGTERM)

    monkeypatch.setattr(Run, "end_step", end_step)


def test_one_step_off_stop_saves_the_finished_batch_in_flight(ray_cluster, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """A stop after step 2 saves batch 3 (made while step 2 trained) with the checkpoint; the resumed
    run trains it first instead of regenerating it: every ticket is generated exactly once."""
    from async_flowgrpo import checkpoint
    from async_flowgrpo.stop import Stopped

    out = str(tmp_path)
    stop_after_step(monkeypatch, 2, wait_for_rollouts=True)
    with pytest.raises(Stopped):
        run(small_config("one_step_off", tiny_model_dir, prompt_file, out, "trainer.total_steps=6", "trainer.checkpoint_every=0"))
    saved = checkpoint.load(os.path.join(out, "checkpoints", "step_000002"))
    assert saved["next_ticket"] == 4  # batches 1 and 2 trained
    in_flight = saved["batch_in_flight"]
    assert in_flight["end"] == 6 and in_flight["tickets"] == []
    assert sorted(g["prompt_index"] for g in in_flight["groups"]) == [4, 5] and in_flight["skipped"] == 0
    monkeypatch.undo()

    run(small_config("one_step_off", tiny_model_dir, prompt_file, out, "trainer.total_steps=4", "trainer.checkpoint_every=0",
                     "trainer.resume=latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["samples/consumed"] == 4 * 4 and rows[-1]["samples/produced"] == 4 * 4
    assert rows[-1]["rollout/groups"] == 2  # the resumed process generated batch 4 only
    assert checkpoint.load(os.path.join(out, "checkpoints", "step_000004"))["next_ticket"] == 8
    assert all(r["staleness/max"] <= 1 for r in rows)


def test_an_update_that_ends_during_the_stops_staged_save_leaves_the_save_to_the_regular_checkpoint(
        ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """A stop during an update saves the step before it from the trainer's staged state; when the
    update ends in between (after the staged state is read, before its weights are written, so the
    staged copy is already the next version's), that save steps aside, writing nothing, and the
    stop's regular checkpoint has the step the update made. (Before: the run ended with `an actor
    failed after the signal: RuntimeError: staged state is of version 8, not 7`.)"""
    from async_flowgrpo import checkpoint

    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "trainer.checkpoint_every=0",
                       "trainer.min_step_time_s=3")  # the update is still in flight when the staged state is read
    p = Run(cfg)
    try:
        step = p.start_train(one_batch(p))
        p.before_staged_save = lambda: ray.get(step.calls, timeout=120)  # the update ends mid-save
        assert p.save_staged_checkpoint(step) is None
        assert p.checkpointer.latest_name() is None and not os.listdir(p.checkpointer.root)  # no debris either
        p.finish_train(step)
        saved = checkpoint.load(p.save_checkpoint(at_stop=True))
        assert saved["step"] == saved["version"] == 1
    finally:
        p.shutdown()


def test_fully_async_stop_saves_the_queue_before_it_is_drained(ray_cluster, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """The checkpoint a stop writes holds the groups queued at that moment (the producers are
    stopped and the queue drained only afterwards); the resumed run drains nothing and balances."""
    from async_flowgrpo import checkpoint
    from async_flowgrpo.stop import Stopped

    from async_flowgrpo.driver.run import checkpointer

    out = str(tmp_path)
    stop_after_step(monkeypatch, 2, wait_for_rollouts=False)
    cfg = small_config("fully_async", tiny_model_dir, prompt_file, out, "trainer.total_steps=6", "trainer.checkpoint_every=0")
    with pytest.raises(Stopped):
        run(cfg)
    path, _ = checkpointer(cfg).find("latest")  # step 2 or 3: the prefetched update 3 may have started
    stopped_at = int(os.path.basename(path).split("_")[1])
    saved = checkpoint.load(path)["queue"]
    assert len(saved["queued_groups"]) + len(saved["in_flight_tickets"]) >= 1  # producers run ahead (eta 1)
    assert saved["queue"]["drained"] == 0
    monkeypatch.undo()

    run(small_config("fully_async", tiny_model_dir, prompt_file, out, f"trainer.total_steps={stopped_at + 2}",
                     "trainer.checkpoint_every=0", "trainer.resume=latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 3))
    assert all(r["groups/drained"] == 0 for r in rows[stopped_at:])
    last = rows[-1]
    assert last["samples/consumed"] == 4 * (stopped_at + 2)
    assert last["groups/produced"] == last["groups/consumed"] + last["groups/dropped_stale"] + last["queue/size"]


def test_a_killed_rollout_actor_is_restarted_and_every_rollout_then_holds_the_trainers_weights_bit_for_bit(
        ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """Batch mode, two rollout actors: kill one's process while it generates; the batch still
    completes (its share regenerated). The update changes the weights, and both rollout actors, the
    restarted one too, then hold the trainer's weights bit for bit. (One run for both checks: each
    Run starts its actors, the larger part of a test's cost here.)"""
    cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "rollout.num_workers=2")
    with Run(cfg) as p:
        before = ray.get(p.trainers[0].weights_digest.remote(), timeout=60)
        pid = ray.get(p.rollouts[0].pid.remote(), timeout=60)
        pending = p.batches.start(2)
        os.kill(pid, signal.SIGKILL)
        groups = p.batches.collect(pending)
        assert sorted(g.prompt_index for g in groups) == [0, 1]  # nothing lost, nothing duplicated
        assert p.cluster.restarts == 1
        p.train(groups)
        p.publish_weights()  # the restarted actor is back in the sync group
        assert ray.get(p.rollouts[0].pid.remote(), timeout=60) != pid
        # The staged weights are swapped in at the next group start: generate one, then compare.
        one_batch(p)
        after = ray.get(p.trainers[0].weights_digest.remote(), timeout=60)
        rollout_digests = ray.get([r.weights_digest.remote() for r in p.rollouts], timeout=60)
    assert after != before
    assert rollout_digests == [after, after]


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_a_run_survives_a_killed_rollout_actor(ray_cluster, tiny_model_dir, prompt_file, tmp_path, mode):
    """Kill a rollout actor's process once training has started: the run finishes every step, the
    actor is restarted once, staleness stays bounded, and every trained sample is accounted for."""
    from async_flowgrpo.driver.cluster import rollout_actor_name

    output_dir = str(tmp_path)
    # 12 steps (about 6 s unloaded) so that a kill at the first metrics row always lands with steps
    # left to notice it: with 4 a loaded CI machine killed the actor after its last rollout
    # fully_async: with rewards scored while the next group generates (reward.overlap), groups can
    # reach the queue later than the admission bound assumes; after the restart they arrived one
    # version staler than max_staleness at some steps (2 runs in 3). The drop policy is what bounds
    # what reaches the trainer then (dropped groups are counted below).
    drop = ("algorithm.stale_policy=drop",) if mode == "fully_async" else ()
    cfg = small_config(mode, tiny_model_dir, prompt_file, output_dir, "rollout.num_workers=2", "trainer.total_steps=12", *drop)
    killed = {}

    def kill_one_when_running():
        deadline = time.time() + 120
        while time.time() < deadline and "pid" not in killed:
            try:
                actor = ray.get_actor(rollout_actor_name(output_dir, 1))
                if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):  # training has started
                    killed["pid"] = ray.get(actor.pid.remote(), timeout=30)
                    os.kill(killed["pid"], signal.SIGKILL)
            except ValueError:
                pass  # not created yet
            time.sleep(0.1)

    killer = threading.Thread(target=kill_one_when_running, daemon=True)
    killer.start()
    run(cfg)
    killer.join(timeout=5)
    rows = read_metrics(output_dir)
    assert "pid" in killed
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["rollout/restarts"] == 1
    assert all(r["staleness/max"] <= 1 for r in rows)
    if mode == "one_step_off":  # the dead actor's share is regenerated: every step trains a whole batch
        assert rows[-1]["samples/consumed"] == 12 * 4
    else:  # what died queued with the actor is counted, and the rest balances
        last = rows[-1]
        assert last["samples/produced"] == (last["samples/consumed"] + last["samples/lost"] + last["samples/dropped_stale"]
                                            + last["queue/size_samples"])


def scoring_server(scores_for):
    """A local reward service: POST {"prompts": [...]} -> {"scores": scores_for(prompts)}."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"scores": scores_for(body["prompts"])}).encode())  # NaN -> JSON's NaN

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def remote_reward_config(url, *extra):
    return ("reward.weights={remote: 1.0}", f"reward.options={{remote: {{url: '{url}', retries: 0}}}}", *extra)


def test_a_reward_that_keeps_answering_nan_stops_the_run_with_one_line_naming_it(
        ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    server, url = scoring_server(lambda prompts: [float("nan")] * len(prompts))
    try:
        cfg = small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), *remote_reward_config(url),
                           "reward.max_consecutive_failures=3")
        with pytest.raises(RunError, match="3 consecutive reward failures.*reward 'remote' failed.*non-finite score") as error:
            run(cfg)
    finally:
        server.shutdown()
    assert len(str(error.value).splitlines()) == 1


def test_fsdp_sharded_trainers_match_a_replicated_trainer(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """Full fine-tuning sharded over 2 trainers (FSDP2) gives the update of 1 unsharded trainer; the
    gathered weights reach the rollout actor (digest-verified), evaluate, and resume exactly."""
    from async_flowgrpo import checkpoint as checkpoint_io

    common = ("model.lora_rank=0", "algorithm.beta=0", "trainer.lr=1e-3", "eval.samples_per_prompt=1")
    layouts = {"replicated": ("trainer.num_workers=1",), "fsdp": ("trainer.num_workers=2", "trainer.fsdp=true")}
    weights, checkpoint = {}, None
    for name, extra in layouts.items():
        p = Run(small_config("sync", tiny_model_dir, prompt_file, str(tmp_path / name), *common, *extra))
        try:
            p.train(one_batch(p))  # same tickets, seeds and weights for both
            p.version += 1
            p.publish_weights()  # sync.verify: raises unless the rollout's digest equals the trainer's
            metrics = p.cluster.on_trainers("evaluate", 1, timeout=300)["metrics"]
            assert 0.0 <= metrics["eval/reward"] <= 1.0 and metrics["eval/time_s"] > 0
            p.step = 1
            checkpoint = p.save_checkpoint()
            weights[name] = checkpoint_io.load(checkpoint)["learner"]["trainable"]
            digest = p.cluster.on_trainers("weights_digest")
        finally:
            p.shutdown()
    from diffusers import SD3Transformer2DModel

    base = dict(SD3Transformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").named_parameters())
    assert weights["fsdp"].keys() == weights["replicated"].keys() == base.keys()
    assert any(not torch.equal(weights["fsdp"][n], base[n]) for n in base), "the update reached no weight"
    for n in weights["replicated"]:
        torch.testing.assert_close(weights["fsdp"][n], weights["replicated"][n], rtol=1e-5, atol=1e-6)
    saved = SD3Transformer2DModel.from_pretrained(os.path.join(checkpoint, "weights", "transformer"))
    for n, p in saved.named_parameters():
        torch.testing.assert_close(p, weights["fsdp"][n], rtol=0, atol=0)

    resumed = Run(small_config("sync", tiny_model_dir, prompt_file, str(tmp_path / "resumed"), *common,
                                    *layouts["fsdp"], f"trainer.resume={checkpoint}"))
    try:
        assert resumed.cluster.on_trainers("weights_digest") == digest
    finally:
        resumed.shutdown()
