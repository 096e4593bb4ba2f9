"""Run outputs (metrics.jsonl, config.yaml, sample grids, summary.json), metric reduction across
ranks, busy/idle accounting, and the GPU monitor (absent here; its arithmetic via a fake NVML)."""

import json
import math
import os
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from PIL import Image

from async_flowgrpo import gpu_monitor
from async_flowgrpo.config import load_config
from async_flowgrpo.gpu_monitor import GpuMonitor
from async_flowgrpo.metrics import BusyTracker, RunLogger, make_grid, reduce_metrics, reduction_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Config validation only needs a directory with model_index.json; building the real tiny SD3
    # (tiny_model_dir) costs ~17 s of imports that nothing here uses.
    d = tmp_path_factory.mktemp("model")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return str(d)


@pytest.fixture
def config(model_dir, tmp_path):
    return load_config("fully_async", [f"model.path={model_dir}", f"trainer.output_dir={tmp_path / 'run'}"])


def strict_loads(line):
    # Python's json accepts NaN/Infinity; real JSON readers (jq, JS) do not. Reject them here.
    def bad(token):
        raise ValueError(f"non-JSON constant {token}")

    return json.loads(line, parse_constant=bad)


# ------------------------------------------------------------------------------------------------
# RunLogger
# ------------------------------------------------------------------------------------------------


def test_output_layout_and_config_round_trip(config, tmp_path):
    out = tmp_path / "run"
    with RunLogger(str(out), config, total_steps=3, progress=False):
        pass
    for sub in ("samples", "checkpoints"):
        assert (out / sub).is_dir()
    again = load_config("fully_async", [str(out / "config.yaml")])
    assert again == config


def test_metrics_jsonl_lines_nan_null_and_append_on_reopen(config, tmp_path):
    out = str(tmp_path / "run")
    logger = RunLogger(out, config, total_steps=4, progress=False)
    logger.log(1, {"reward/mean": 0.5, "loss/policy": float("nan"), "is/weight_max": float("inf"),
                   "version": 1, "staleness/mean": torch.tensor(0.25), "queue/size": np.int64(3)})
    logger.log(2, {"reward/mean": 0.75, "version": 2})
    # The line is on disk before close: a crash after log() loses nothing.
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        assert len(f.readlines()) == 2
    logger.close()

    resumed = RunLogger(out, config, total_steps=4, progress=False)
    resumed.log(3, {"reward/mean": 1.0})
    resumed.close()

    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = [strict_loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert list(rows[0])[0] == "step"
    first = rows[0]
    assert first["loss/policy"] is None and first["is/weight_max"] is None
    assert first["reward/mean"] == 0.5 and first["version"] == 1
    assert first["staleness/mean"] == 0.25 and first["queue/size"] == 3
    assert all(isinstance(r["time_s"], float) and r["time_s"] >= 0 for r in rows)
    keys = [k for k in first if k != "step"]
    assert keys == sorted(keys)


def test_log_images_of_videos_writes_a_gif_and_a_frame_grid(config, tmp_path):
    out = str(tmp_path / "run")
    videos = torch.zeros(2, 3, 32, 32, 3, dtype=torch.uint8)  # [N, F, H, W, 3]
    for f in range(3):
        videos[:, f, :, :, 1] = 80 * (f + 1)  # each frame its own green level
    with RunLogger(out, config, total_steps=1, progress=False) as logger:
        path = logger.log_images(3, "rollout", videos, captions=["a red circle", "a blue square"])
    gif = Image.open(os.path.join(out, "samples", "rollout_step00003.gif"))
    assert gif.n_frames == 3
    for f in range(3):  # frame f of the GIF is the grid of the videos' frame f
        gif.seek(f)
        assert np.asarray(gif.convert("RGB"))[10, 10, 1] == 80 * (f + 1)
    grid = Image.open(path)  # one video per row, its frames left to right, each caption under the first frame
    assert grid.width == 3 * 128 + 4 * 2
    px = np.asarray(grid)
    assert [px[10, 2 + f * 130 + 10, 1] for f in range(3)] == [80, 160, 240]


def test_log_images_writes_upscaled_grid(config, tmp_path):
    out = str(tmp_path / "run")
    images = torch.zeros(5, 32, 32, 3, dtype=torch.uint8)
    for i in range(5):
        images[i, :, :, 0] = 40 * (i + 1)  # each tile its own red level
    checker = (torch.arange(32)[:, None] + torch.arange(32)[None, :]) % 2
    images[4, :, :, 1] = (checker * 255).to(torch.uint8)  # pixel-level detail that blur would smear
    with RunLogger(out, config, total_steps=1, progress=False) as logger:
        path = logger.log_images(7, "rollout", images, nrow=3)
        captioned = logger.log_images(8, "eval", images, captions=[f"a red square number {i}" for i in range(5)], nrow=3)
    assert path == os.path.join(out, "samples", "rollout_step00007.png")
    grid = Image.open(path)
    # 32 px tiles are upscaled x4 (nearest) with a 2 px border: 3 columns, 2 rows.
    assert grid.size == (3 * 128 + 4 * 2, 2 * 128 + 3 * 2)
    px = np.asarray(grid)
    # Tile 4 (row 1, col 1): its far corner is still its own colour (nearest, no blur).
    y0, x0 = 2 + 130, 2 + 130
    assert px[y0, x0, 0] == 200 and px[y0 + 127, x0 + 127, 0] == 200
    assert px[y0 + 128, x0 + 128].tolist() == [255, 255, 255]  # the padding
    # Each source pixel became an exact 4x4 block: green 0 / 255 checkerboard, nothing in between.
    tile_g = px[y0 : y0 + 128, x0 : x0 + 128, 1]
    assert set(np.unique(tile_g).tolist()) == {0, 255}
    assert (tile_g == np.kron(checker.numpy() * 255, np.ones((4, 4), dtype=np.int64))).all()
    cap = Image.open(captioned)
    assert cap.size[0] == grid.size[0] and cap.size[1] > grid.size[1]  # caption rows under the tiles
    # Some dark caption text pixels in the first caption band.
    band = np.asarray(cap)[2 + 128 : 2 + 128 + 10, 2 : 2 + 128]
    assert (band < 100).any()


def test_make_grid_sizes_and_validation():
    imgs = np.full((4, 64, 48, 3), 7, dtype=np.uint8)
    assert make_grid(imgs, nrow=2, scale=1, pad=0).size == (96, 128)
    assert make_grid(imgs, nrow=4, pad=0).size == (4 * 96, 128)  # auto scale: 64 px -> x2
    assert make_grid(imgs[:1], scale=1, pad=0).size == (48, 64)
    assert make_grid(np.zeros((2, 256, 256, 3), np.uint8), pad=0).size == (512, 256)  # big: x1
    with pytest.raises(ValueError):
        make_grid(imgs.astype(np.float32))
    with pytest.raises(ValueError):
        make_grid(imgs, captions=["only one"])


def test_summary_json_and_line(config, tmp_path, capsys):
    out = tmp_path / "run"
    with RunLogger(str(out), config, total_steps=3, progress=False) as logger:
        logger.log(1, {"reward/mean": 0.2, "staleness/mean": 0.0, "staleness/max": 0, "perf/samples_per_s": 10.0,
                       "samples/dropped_stale": 0, "reward/errors": 1, "eval/accuracy": 0.25})
        logger.log(2, {"reward/mean": 0.4, "staleness/mean": 1.0, "staleness/max": 2, "perf/samples_per_s": 20.0,
                       "samples/dropped_stale": 3, "reward/errors": 1})
        logger.log(3, {"reward/mean": 0.6, "staleness/mean": 0.5, "staleness/max": 1, "perf/samples_per_s": 30.0,
                       "samples/dropped_stale": 4, "reward/errors": 2, "rollout/errors": 1, "eval/accuracy": 0.75})
        line = logger.summary({"note": "ok"})
    data = json.loads((out / "summary.json").read_text())
    assert data["steps"] == 3 and data["wall_time_s"] >= 0
    assert (data["reward_first"], data["reward_last"]) == (0.2, 0.6)
    assert (data["eval_accuracy_first"], data["eval_accuracy_last"]) == (0.25, 0.75)
    assert data["samples_per_s"] == pytest.approx(20.0)
    assert data["staleness_mean"] == pytest.approx(0.5) and data["staleness_max"] == 2
    assert data["dropped"] == 4 and data["errors"] == 3  # counters are cumulative: last values, summed
    assert data["note"] == "ok"
    assert "\n" not in line and "0.2->0.6" in line and "0.25->0.75" in line
    assert line in capsys.readouterr().out


def test_progress_bar_postfix(config, tmp_path, capsys):
    with RunLogger(str(tmp_path / "run"), config, total_steps=2, progress=True) as logger:
        logger.log(1, {"reward/mean": 0.5, "staleness/mean": 1.0, "eval/accuracy": 0.25})
        logger.log(2, {"reward/mean": 0.625, "staleness/mean": 1.0})
    err = capsys.readouterr().err
    assert "2/2" in err
    assert "reward=0.625" in err and "eval=0.25" in err and "stale=1" in err


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls = []
        self.run = None

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        self.run = types.SimpleNamespace(summary={})

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def Image(self, image, caption=None):  # noqa: N802 - mirrors wandb.Image
        return ("image", image.size, caption)

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_calls_only_when_enabled(model_dir, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    disabled = load_config("fully_async", [f"model.path={model_dir}"])
    with RunLogger(str(tmp_path / "a"), disabled, total_steps=1, progress=False) as logger:
        logger.log(1, {"reward/mean": 1.0})
    assert fake.calls == []

    cfg = load_config("fully_async", [f"model.path={model_dir}", "logging.wandb_mode=offline", "logging.run_name=r1"])
    with RunLogger(str(tmp_path / "b"), cfg, total_steps=1, progress=False) as logger:
        logger.log(1, {"reward/mean": 1.0})
        logger.log_images(1, "rollout", torch.zeros(2, 32, 32, 3, dtype=torch.uint8), captions=["a", "b"])
        logger.summary()
    kind, init = fake.calls[0]
    assert kind == "init"
    assert init["project"] == cfg.logging.wandb_project and init["name"] == "r1" and init["mode"] == "offline"
    assert init["dir"] == str(tmp_path / "b") and init["config"]["rollout"]["group_size"] == cfg.rollout.group_size
    assert fake.calls[1][0] == "log" and fake.calls[1][2] == 1 and fake.calls[1][1]["reward/mean"] == 1.0
    kind, data, step = fake.calls[2]
    assert kind == "log" and step == 1
    tag, size, caption = data["samples/rollout"]
    assert tag == "image" and size[0] == 2 * 128 + 3 * 2 and size[1] > 128 and caption == "a | b"
    assert fake.calls[-1] == ("finish",)
    assert fake.run.summary["steps"] == 1


# ------------------------------------------------------------------------------------------------
# reduce_metrics
# ------------------------------------------------------------------------------------------------


def test_reduce_metrics_rules():
    ranks = [
        {"loss/policy": 1.0, "is/weight_max": 1.5, "staleness/max": 1, "logp/max_abs_diff": 1e-6, "grad_norm_max": 3.0,
         "samples/consumed": 8, "trainer/skipped_groups": 1, "reward/errors": 2, "step": 5, "version": 5, "only_a": 2.0},
        {"loss/policy": 3.0, "is/weight_max": 2.0, "staleness/max": 3, "logp/max_abs_diff": 1e-4, "grad_norm_max": 1.0,
         "samples/consumed": 8, "trainer/skipped_groups": 0, "reward/errors": 1, "step": 5, "version": 5},
    ]
    out = reduce_metrics(ranks)
    assert out["loss/policy"] == 2.0
    assert out["is/weight_max"] == 2.0 and out["staleness/max"] == 3 and out["logp/max_abs_diff"] == 1e-4
    assert out["grad_norm_max"] == 3.0
    assert out["samples/consumed"] == 16 and out["trainer/skipped_groups"] == 1 and out["reward/errors"] == 3
    assert out["step"] == 5 and isinstance(out["step"], int) and out["version"] == 5
    assert out["only_a"] == 2.0  # a key some ranks lack is reduced over those that have it
    assert math.isnan(reduce_metrics([{"loss/kl": 1.0}, {"loss/kl": float("nan")}])["loss/kl"])
    assert reduce_metrics([{"x": torch.tensor(1.0)}, {"x": np.float32(3.0)}]) == {"x": 2.0}
    assert [reduction_for(k) for k in ("policy/clip_frac", "a/max", "samples/produced")] == ["mean", "max", "sum"]


# ------------------------------------------------------------------------------------------------
# Stopwatches
# ------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_busy_tracker_fractions_and_windows():
    clock = FakeClock()
    tracker = BusyTracker(clock=clock)
    with tracker.busy():
        clock.t += 3
        with tracker.busy():  # nested: counted once
            clock.t += 1
    clock.t += 6  # idle
    assert tracker.fractions() == pytest.approx((0.4, 0.6))
    # A section running across the read is split between windows.
    with tracker.busy():
        clock.t += 2
        assert tracker.idle_frac() == pytest.approx(0.0)
        clock.t += 1
    clock.t += 3
    assert tracker.idle_frac() == pytest.approx(0.75)
    assert tracker.idle_frac() == 0.0  # an empty window reads 0


# ------------------------------------------------------------------------------------------------
# GpuMonitor
# ------------------------------------------------------------------------------------------------


def test_gpu_monitor_is_silent_without_nvml(monkeypatch, caplog):
    mon = GpuMonitor(interval_s=0.01)  # the real pynvml here: no libnvidia-ml, nvmlInit fails
    t0 = time.monotonic()
    mon.start()
    assert mon.read() == {} and not mon.available
    mon.stop()
    assert time.monotonic() - t0 < 2.0

    monkeypatch.setattr(gpu_monitor, "_import_pynvml", lambda: None)  # pynvml not installed
    with GpuMonitor() as missing:
        assert missing.read() == {}
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


class FakeNvml:
    """Just the pynvml calls GpuMonitor uses; utilisation / memory come from scripted lists."""

    def __init__(self, utils, mems_gib, fail_init=False):
        self.utils, self.mems = list(utils), list(mems_gib)
        self.fail_init = fail_init
        self.opened = []
        self.shutdowns = 0
        self.lock = threading.Lock()

    def nvmlInit(self):  # noqa: N802
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        self.opened.append(("index", i))
        return f"h{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        self.opened.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        with self.lock:
            u = self.utils.pop(0) if len(self.utils) > 1 else self.utils[0]
        return types.SimpleNamespace(gpu=u, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        with self.lock:
            m = self.mems.pop(0) if len(self.mems) > 1 else self.mems[0]
        return types.SimpleNamespace(used=int(m * (1 << 30)), total=80 << 30, free=0)


def test_gpu_monitor_averages_between_reads(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(utils=[10, 20, 60, 50], mems_gib=[1.0, 4.0, 2.0, 3.0])
    mon = GpuMonitor(nvml=nvml)
    for _ in range(3):
        mon.sample()
    assert mon.read() == {"perf/gpu_util": pytest.approx(30.0), "perf/gpu_mem_gb": pytest.approx(4.0)}
    # Empty window: read() samples once itself rather than returning stale or empty numbers.
    assert mon.read() == {"perf/gpu_util": pytest.approx(50.0), "perf/gpu_mem_gb": pytest.approx(3.0)}
    assert nvml.opened == [("index", 0)]
    mon.stop()
    assert nvml.shutdowns == 1 and mon.read() == {}

    assert GpuMonitor(nvml=FakeNvml([1], [1], fail_init=True)).read() == {}


def test_gpu_monitor_thread_samples_and_stops(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(utils=[40], mems_gib=[2.5])
    mon = GpuMonitor(interval_s=0.01, nvml=nvml).start()
    deadline = time.monotonic() + 5.0
    while mon._util_n < 2 and time.monotonic() < deadline:  # poll: a loaded CI box may be slow
        time.sleep(0.01)
    assert mon._util_n >= 2  # the background thread took several samples on its own
    assert mon.read() == {"perf/gpu_util": pytest.approx(40.0), "perf/gpu_mem_gb": pytest.approx(2.5)}
    t0 = time.monotonic()
    mon.stop()
    assert time.monotonic() - t0 < 1.0 and mon._thread is None


def test_gpu_monitor_device_from_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nvml = FakeNvml([1], [1])
    GpuMonitor(nvml=nvml).read()
    assert nvml.opened == [("index", 3)]  # logical device 0 is physical GPU 3

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234-abcd")
    nvml = FakeNvml([1], [1])
    GpuMonitor(nvml=nvml).read()
    assert nvml.opened == [("uuid", "GPU-1234-abcd")]

    nvml = FakeNvml([1], [1])
    GpuMonitor(device_index=2, nvml=nvml).read()  # explicit index wins
    assert nvml.opened == [("index", 2)]
