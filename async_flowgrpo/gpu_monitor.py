"""GPU utilisation sampled in a background thread via NVML (package nvidia-ml-py, module `pynvml`).

    mon = GpuMonitor(interval_s=1.0).start()
    ...
    metrics.update(mon.read())   # {"perf/gpu_util": 87.5, "perf/gpu_mem_gb": 21.3}, or {} without a GPU
    mon.stop()

On machines without NVIDIA GPUs (pynvml missing, libnvidia-ml absent, nvmlInit failing) the
monitor is silently inert: `read()` returns {} and nothing is logged, so CPU runs and tests
carry no GPU noise. NVML calls go through an injectable `nvml` object so the averaging is
testable on CPU.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

_GIB = float(1 << 30)


def _import_pynvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py

        return pynvml
    except Exception:  # ImportError, or a broken install: both mean "no GPU metrics"
        return None


def _cuda_visible_entry(index: int) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES entry for logical device `index` (an int index or a GPU-/MIG- UUID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if 0 <= index < len(entries) else None


def _torch_current_device() -> Optional[Any]:
    """torch's current CUDA device, only if CUDA is already initialised in this process.

    Never initialise CUDA ourselves: the monitor also runs in the driver, which must not grab a
    GPU context, and in a forked process an early CUDA init breaks later use.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:
        pass
    return None


def _resolve_handle(nvml: Any, device_index: Optional[int]) -> Any:
    """The NVML handle of the GPU this process uses.

    NVML numbers physical GPUs while CUDA numbers the visible ones (a Ray actor with one GPU sees
    device 0 whatever card it got), so an explicit index is physical, and otherwise we go through
    CUDA_VISIBLE_DEVICES (torch's current device picks the entry when CUDA is initialised).
    """
    if device_index is not None:
        return nvml.nvmlDeviceGetHandleByIndex(device_index)
    current = _torch_current_device()
    torch = sys.modules.get("torch")
    if current is not None and torch is not None:
        # The device UUID is exact even under CUDA_DEVICE_ORDER differences between CUDA and NVML.
        try:
            uuid = str(torch.cuda.get_device_properties(current).uuid)
            return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except Exception:
            pass
    entry = _cuda_visible_entry(current or 0)
    if entry is not None:
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(current or 0)


class GpuMonitor:
    """Mean GPU utilisation (%) and peak memory used (GiB) between `read()` calls.

    Samples every `interval_s` seconds in a daemon thread. `read()` returns
    {"perf/gpu_util": mean of the samples since the last read, "perf/gpu_mem_gb": the highest
    memory-used sample since the last read (peaks matter for OOM headroom)} and starts a new
    window; with no sample in the window it samples once on the spot. {} when NVML is unavailable.
    """

    def __init__(self, interval_s: float = 1.0, device_index: Optional[int] = None, *, nvml: Any = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.device_index = device_index
        self._nvml = nvml if nvml is not None else _import_pynvml()
        self._handle: Any = None
        self._initialised = False
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._util_sum = 0.0
        self._util_n = 0
        self._mem_max: Optional[float] = None
        self._util_supported = True

    @property
    def available(self) -> bool:
        """True when NVML initialised and a device handle was found."""
        return self._open()

    def _open(self) -> bool:
        with self._open_lock:  # the sampling thread and read() may race on the first call
            return self._open_locked()

    def _open_locked(self) -> bool:
        if self._initialised:
            return self._handle is not None
        self._initialised = True
        if self._nvml is None:
            return False
        try:
            self._nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU machines
            logger.debug("NVML unavailable: %s", e)
            return False
        try:
            self._handle = _resolve_handle(self._nvml, self.device_index)
        except Exception as e:
            logger.debug("no NVML device handle: %s", e)
            self._shutdown()
        return self._handle is not None

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()  # NVML refcounts init/shutdown, so this pairs with our nvmlInit
        except Exception:
            pass
        self._handle = None

    def sample(self) -> None:
        """Take one sample now (the thread calls this every interval_s)."""
        if not self._open():
            return
        util: Optional[float] = None
        mem: Optional[float] = None
        if self._util_supported:
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception as e:
                # e.g. NVML_ERROR_NOT_SUPPORTED on MIG slices: stop asking, keep memory.
                self._util_supported = False
                logger.debug("GPU utilisation not available: %s", e)
        try:
            mem = float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / _GIB
        except Exception as e:
            logger.debug("GPU memory info not available: %s", e)
        with self._lock:
            if util is not None:
                self._util_sum += util
                self._util_n += 1
            if mem is not None:
                self._mem_max = mem if self._mem_max is None else max(self._mem_max, mem)

    def read(self) -> dict[str, float]:
        if not self._open():
            return {}
        with self._lock:
            empty = self._util_n == 0 and self._mem_max is None
        if empty:
            self.sample()
        with self._lock:
            out: dict[str, float] = {}
            if self._util_n:
                out["perf/gpu_util"] = self._util_sum / self._util_n
            if self._mem_max is not None:
                out["perf/gpu_mem_gb"] = self._mem_max
            self._util_sum, self._util_n, self._mem_max = 0.0, 0, None
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)  # an Event, not sleep: stop() returns at once

    def start(self) -> "GpuMonitor":
        """Start the sampling thread (a no-op without NVML or when already running)."""
        if self._thread is not None or not self._open():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and release NVML. Final: `read()` afterwards returns {}, `start()` is a no-op."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
        if self._handle is not None:
            self._shutdown()

    def __enter__(self) -> "GpuMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
