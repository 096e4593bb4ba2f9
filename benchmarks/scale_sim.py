#!/usr/bin/env python
"""Scale by simulation: the REAL driver loop (async_flowgrpo.modes.<mode>.run) with stand-in
rollout and trainer actors of set costs and no model, from 1 to 64 rollout actors and 1 to 8
trainers on one small machine. Where does the single driver become the bottleneck?

Stand-ins (`SimRollout`, `SimTrainer`) implement the interface of `actors.rollout.RolloutActor`
and `actors.trainer.TrainerActor` that the driver uses, with sleeps for work:

* a rollout actor takes `--gen-s` seconds per group of `--group-size` samples, and returns a
  group record with real reward tensors (seeded per ticket; the driver computes advantages and
  staleness from them as always) and the group itself as a `--payload-kb` buffer that goes to the
  object store (fully_async: ray.put by the rollout actor; batch modes: a return object of
  `generate`), so the trainers fetch it by reference as they fetch real groups;
* a trainer takes `--train-step-s` + `--train-s` seconds per sample of its shard (data-parallel
  trainers split the batch by groups), after fetching its shard's groups from the object store;
* a weight publication is a real push + one pull per rollout actor, each pull rendezvousing with
  trainer rank 0 directly (as the collective transport does; nothing passes through the driver),
  plus `--sync-s` seconds on the trainer; digests are checked (sync.verify).

Each stand-in takes 0.01 CPU, so 64 rollout actors fit on 2 cores, and none imports torch or
unpickles the run's config: the classes Cluster gets (`StandIn`) replace the driver's constructor
arguments (cfg, transport) with the set costs, and a record pickles into a real
`async_flowgrpo.types.GroupRecord` on the receiving side (`SimRecord`). A stand-in costs a Ray
worker process (~100 MB) and no model.

For every (mode, rollout actors N, trainers M) of the grid, one run of `--steps` steps with
groups_per_step = `--groups-per-actor` x N (rounded up to a multiple of M). Reported per run:

* samples/s over the steady window (steps `--warmup`+1 .. last-1; start-up, the first steps'
  pipeline fill, the last step, the final checkpoint and shutdown are left out; samples are the
  trained ones, Run.consumed_samples) and the bound from the set costs
  (fully_async: min(N G / gen_s, B / t_train); one_step_off: B / max(t_gen, t_train); sync:
  B / (t_gen + t_train); B = samples per step), efficiency = samples/s / bound;
* driver CPU (time.process_time() of this process, all its threads, i.e. Ray's core worker
  too) per step and per sample over the same window, the driver's share of one core, its split
  over Run.train / Run.publish_weights / Run.step_metrics / the mode's own loop (CPU during each
  call: approximate), and the CPU of every other process of the Ray cluster (raylet, GCS, the
  queue actor, the stand-ins) in cores;
* start-up time (Cluster + actors + first publish) and the first steps separately;
* driver/bytes_per_step (what the driver receives of the groups) and the payload bytes the
  trainers fetched per step.

The timestamps come from wrapping Run.__init__, Run.train, Run.publish_weights, Run.step_metrics
and RunLogger.log for the duration of a run (`Probe`); the driver's files are not changed.

Extrapolation: the driver saturates one core when CPU per step x steps/s = 1, i.e. at
1 / (driver CPU per sample) samples/s for the shape of the run (group size, groups per actor per
step). A least-squares fit of driver CPU per step = a + b N + c M over each mode's runs gives
the saturation point as the rollout fleet grows.

    python benchmarks/scale_sim.py                                   # the default grid: 14 runs, ~15 min on a busy 2-core machine
    python benchmarks/scale_sim.py --name trainers --modes fully_async --rollouts 8 --trainers 1,2,4,8 --train-s 0.016
    python benchmarks/scale_sim.py --name quick --modes fully_async --rollouts 2 --steps 5 --warmup 2   # a quick look

Writes benchmarks/results/scale_sim/<name>.json and prints a table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the repository on sys.path, the offline environment, before ray is imported)
from common import REPO, argument_parser  # noqa: E402

import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402

RESULTS = os.path.join(common.RESULTS, "scale_sim")

from async_flowgrpo.rollout.stream import stream_groups  # noqa: E402  (torch-free: the stand-ins use it)

# Loaded as a module (the test), the stand-in classes must still travel by value: the actors'
# processes cannot import this file.
if __name__ != "__main__" and __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------------------
# The stand-ins (these run in the actors: no torch; of async_flowgrpo only the torch-free stream protocol)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SimCosts:
    gen_s: float = 1.0  # seconds per group, one rollout actor
    group_size: int = 16
    train_s: float = 0.0005  # seconds per sample, one trainer
    train_step_s: float = 0.0  # fixed seconds per train_step call (each trainer)
    sync_s: float = 0.0  # seconds per weight push (trainer rank 0)
    payload_kb: float = 256.0  # the group's bytes in the object store (stands for latents etc.)
    jitter: float = 0.0  # generation time x uniform(1 - jitter, 1 + jitter)
    poll_s: float = 1.0  # rollout loop: re-check the stop flag this often (cfg.ray.poll_s)
    seed: int = 0


class _Import:
    """Pickles as `importlib.import_module(name)`: the receiving process imports the module."""

    def __init__(self, module: str):
        self.module = module

    def __reduce__(self):
        return importlib.import_module, (self.module,)


class _Remote:
    """Pickles as `getattr(<module>, name)`: a callable of a module this process never imports.
    (Made where it is pickled, never held in a global: a global would be pickled with the actor
    class and import the module in the actor.)"""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):  # pickle wants a callable in a reduce tuple
        raise RuntimeError(f"{self.module}.{self.name} is only available where it is unpickled")

    def __reduce__(self):
        return getattr, (_Import(self.module), self.name)


class _Tensor:
    """A list of floats that unpickles as a float32 torch tensor."""

    def __init__(self, values: list[float]):
        self.values = values

    def __reduce__(self):
        return _Remote("torch", "tensor"), (self.values,)


class SimRecord:
    """A group record made without torch: unpickles as a real `GroupRecord` (rewards as a tensor)
    in the queue actor and the driver. `ref`: the group's object ref (fully_async) or None."""

    def __init__(self, prompt: str, prompt_index: int, size: int, min_version: int, rewards: list[float], worker_id: int):
        self.fields = (prompt, prompt_index, size, min_version, rewards, worker_id)
        self.ref = None

    def __reduce__(self):
        prompt, index, size, min_version, rewards, worker_id = self.fields
        tensor = _Tensor(rewards)
        return _Remote("async_flowgrpo.types", "GroupRecord"), (prompt, index, size, min_version, tensor, {"sim": tensor}, worker_id, self.ref)


class SimGroup:
    """The group itself, in the object store: `--payload-kb` bytes standing for latents, embeddings
    and images. `to_state` is what a checkpoint stores of a queued group (fully_async)."""

    def __init__(self, data: bytes, size: int, prompt_index: int):
        self.data, self.size, self.prompt_index = data, size, prompt_index

    def to_state(self) -> dict:
        return {"sim_payload_bytes": len(self.data), "size": self.size, "prompt_index": self.prompt_index}


class _Busy:
    """Busy time since the last `idle_frac()` call (the stand-ins' perf/*_idle_frac)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.mark = time.monotonic()
        self.busy = 0.0
        self.since: float | None = None

    def start(self) -> None:
        with self.lock:
            self.since = time.monotonic()

    def stop(self) -> None:
        with self.lock:
            if self.since is not None:
                self.busy += time.monotonic() - self.since
            self.since = None

    def idle_frac(self) -> float:
        with self.lock:
            now = time.monotonic()
            busy = self.busy
            if self.since is not None:
                busy += now - self.since
                self.since = now
            elapsed, self.mark, self.busy = now - self.mark, now, 0.0
            return max(0.0, 1.0 - busy / elapsed) if elapsed > 0 else 0.0


def _digest(updates: int) -> str:
    """The stand-in trainer's 'weights' after `updates` updates."""
    return hashlib.sha256(f"scale_sim-weights-{updates}".encode()).hexdigest()


@ray.remote(concurrency_groups={"sync": 1, "control": 1}, max_restarts=0)
class SimRollout:
    """RolloutActor's interface with a set cost per group. Generation on the default thread,
    weight pulls on "sync", counters on "control", as in the real actor."""

    def __init__(self, costs: SimCosts, worker_id: int):
        self.costs, self.worker_id = costs, worker_id
        self.payload = bytes(int(costs.payload_kb * 1024))
        self.rng = random.Random(costs.seed * 1_000_003 + worker_id)
        self.version, self.digest = 0, _digest(0)
        self.staged: tuple[int, str] | None = None  # swapped in at the next group start
        self.sender = None  # trainer rank 0 (the "address" of the sync group)
        self.pushes_seen = 0
        self.groups = 0
        self.busy = _Busy()
        self._stop = threading.Event()

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="sync")
    def sync_connect(self, address, rank: int, world_size: int) -> None:
        self.sender, self.rank, self.world = address, rank, world_size

    @ray.method(concurrency_group="sync")
    def pull(self, handle: list) -> dict:
        """The collective receive: wait for rank 0's push, stage its version (`handle` unused)."""
        start = time.perf_counter()
        got = ray.get(self.sender.await_push.remote(self.pushes_seen))
        self.pushes_seen = got["count"]
        self.staged = (got["version"], got["digest"])
        return {"version": got["version"], "seconds": time.perf_counter() - start, "digest": got["digest"]}

    def _make(self, ticket: int) -> tuple[SimRecord, SimGroup]:
        self.busy.start()
        try:
            staged, self.staged = self.staged, None
            if staged is not None:
                self.version, self.digest = staged
            cost = self.costs.gen_s
            if self.costs.jitter:
                cost *= self.rng.uniform(1 - self.costs.jitter, 1 + self.costs.jitter)
            time.sleep(cost)
            r = random.Random(self.costs.seed * 1_000_003 + ticket)
            rewards = [r.random() for _ in range(self.costs.group_size)]
            self.groups += 1
            record = SimRecord(f"sim prompt {ticket}", ticket, self.costs.group_size, self.version, rewards, self.worker_id)
            return record, SimGroup(self.payload, self.costs.group_size, ticket)
        finally:
            self.busy.stop()

    def generate(self, tickets: list[int]) -> tuple:
        """Batch modes; called with num_returns=len(tickets) + 1: (records, *groups)."""
        made = [self._make(t) for t in tickets]
        return ([record for record, _ in made], *[payload for _, payload in made])

    def run(self, queue) -> dict:
        """fully_async: RolloutWorker.run's protocol with the queue actor."""

        def make_record(ticket: int):
            record, payload = self._make(ticket)
            record.ref = ray.put(payload)  # the group stays here; only the record goes to the queue
            return record

        stream_groups(queue, self.worker_id, make_record, self._stop, self.costs.poll_s)
        return self.stats()

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self._stop.set()

    @ray.method(concurrency_group="control")
    def stats(self) -> dict:
        return {
            "rollout/groups": self.groups,
            "rewards/errors": 0,
            "rollout/inflight_updates": 0,
            "rollout/version": self.version,
            "perf/rollout_idle_frac": self.busy.idle_frac(),
        }

    @ray.method(concurrency_group="control")
    def weights_digest(self) -> str:
        return self.digest


@ray.remote(max_restarts=0)
class SimTrainer:
    """TrainerActor's interface with a set cost per sample (an async actor: rank 0 also answers
    the rollout actors' pulls while the driver waits on its push)."""

    def __init__(self, costs: SimCosts, rank: int, world_size: int):
        import torch  # the advantages arrive as tensors: import it now, not in the first step

        torch.set_num_threads(1)
        self.costs, self.rank, self.world = costs, rank, world_size
        self.updates = 0
        self.pushes, self.pushed = 0, (0, _digest(0))
        self._cond = None
        self.busy = _Busy()

    @property
    def cond(self):
        import asyncio

        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def ready(self) -> bool:
        return True

    async def pid(self) -> int:  # the driver watches its trainers' processes (a signal to every pid)
        return os.getpid()

    async def train_step(self, shard: list, version: int) -> dict:
        import asyncio

        self.busy.start()
        try:
            start = time.perf_counter()
            groups = await asyncio.gather(*[refs[0] for refs, _ in shard])  # from the object store
            fetch_s = time.perf_counter() - start
            samples = sum(int(advantages.numel()) for _, advantages in shard)
            await asyncio.sleep(self.costs.train_step_s + self.costs.train_s * samples)
            self.updates += 1
        finally:
            self.busy.stop()
        return {
            "samples/lost": 0,
            "perf/trainer_fetch_s": fetch_s,
            "sim/trainer_payload_bytes": sum(len(g.data) for g in groups),
            "sim/trainer_groups": len(groups),
        }

    async def idle_fraction(self) -> float:
        return self.busy.idle_frac()

    async def sync_address(self, host=None):
        return ray.get_runtime_context().current_actor  # pulls rendezvous with this actor

    async def sync_connect(self, address, world_size: int) -> None:
        self.sync_world = world_size

    async def push(self, version: int):
        import asyncio

        self.busy.start()
        try:
            if self.costs.sync_s:
                await asyncio.sleep(self.costs.sync_s)
            async with self.cond:
                self.pushes += 1
                self.pushed = (version, _digest(self.updates))
                self.cond.notify_all()
        finally:
            self.busy.stop()
        stats = types.SimpleNamespace(digest=self.pushed[1], bytes=0, seconds=self.costs.sync_s)
        return types.SimpleNamespace(stats=stats, version=version)

    async def await_push(self, seen: int) -> dict:
        async with self.cond:
            await self.cond.wait_for(lambda: self.pushes > seen)
            return {"count": self.pushes, "version": self.pushed[0], "digest": self.pushed[1]}

    async def weights_digest(self) -> str:
        return _digest(self.updates)

    async def sample_images(self):
        return None

    async def evaluate(self, step: int) -> dict:
        import torch

        return {"metrics": {"eval/sim": 0.0}, "images": torch.zeros((1, 8, 8, 3), dtype=torch.uint8), "captions": ["sim"]}

    async def stop_evaluating(self) -> None:  # its evaluation is instant: nothing to abandon
        pass

    async def state_dict(self) -> dict:
        return {"trainable": {}, "optimizer": {"state": {}, "param_groups": []}, "sim_updates": self.updates}

    async def load_state_dict(self, state: dict) -> None:
        self.updates = int(state.get("sim_updates", 0))

    async def save_weights(self, path: str) -> None:
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "scale_sim_weights.json"), "w") as f:
                json.dump({"updates": self.updates, "digest": _digest(self.updates)}, f)


class StandIn:
    """What `Cluster` needs of an actor class, `.options(**placement).remote(*driver_args)`, with
    the driver's constructor arguments (cfg, transport, ...) replaced by the set costs, so the
    stand-ins never unpickle a Config or a transport (both import torch)."""

    def __init__(self, actor_class, make_args):
        self.actor_class, self.make_args = actor_class, make_args

    def options(self, **options):
        return _Bound(self.actor_class.options(**options), self.make_args)


class _Bound:
    def __init__(self, options, make_args):
        self._options, self.make_args = options, make_args

    def remote(self, *args):
        return self._options.remote(*self.make_args(*args))


def actor_classes(costs: SimCosts) -> dict:
    return {
        # Cluster: rollout_actor(cfg, index, transport, reward_actors); trainer_actor(cfg, rank, world, dp_address, transport)
        "rollout_actor": StandIn(SimRollout, lambda cfg, index, *_: (costs, index)),
        "trainer_actor": StandIn(SimTrainer, lambda cfg, rank, world, *_: (costs, rank, world)),
    }


# ------------------------------------------------------------------------------------------------
# The driver side: measuring one run
# ------------------------------------------------------------------------------------------------
def _role(cmdline: str) -> str:
    for key, role in (("SimRollout", "rollouts"), ("SimTrainer", "trainers"), ("QueueActor", "queue"),
                      ("raylet", "raylet"), ("gcs_server", "gcs")):
        if key in cmdline:
            return role
    return "other"


def cluster_cpu() -> dict[int, tuple[str, float]]:
    """{pid: (role, CPU seconds)} of every process of the local Ray cluster (the driver's children)."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = (_role(" ".join(p.cmdline())), t.user + t.system)
        except psutil.Error:
            continue
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, every process (others' jobs too), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    return sum(values[:8]) - idle, sum(values[:8])


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
    return roles


class Probe:
    """Wraps Run.__init__, RunLogger.log and the driver's phases (Run.train, or start_train and
    finish_train where the mode overlaps updates; Run.publish_weights; Run.step_metrics) for one
    run: wall and driver-CPU timestamps at the end of start-up and at every logged step, CPU per
    phase per step (a phase called inside another counts in the outer one), and the other
    processes' CPU at the window's two ends."""

    PHASES = ("train", "start_train", "finish_train", "publish_weights", "step_metrics")

    def __init__(self, window_start: int, last: int):
        self.window_start, self.last = window_start, last
        self.started: tuple[float, float] | None = None
        self.steps: dict[int, tuple[float, float]] = {}  # step -> (wall, cpu) when it was logged
        self.phase_cpu: dict[str, dict[int, float]] = {}  # phase -> {step: cpu}
        self.procs: dict[int, dict] = {}
        self.machine: dict[int, tuple[float, float]] = {}
        self.consumed: dict[int, int] = {}
        self.run = None
        self.logged = 0
        self.depth = 0

    @contextlib.contextmanager
    def installed(self):
        from async_flowgrpo.driver.run import Run
        from async_flowgrpo.metrics import RunLogger

        phases = [p for p in self.PHASES if callable(getattr(Run, p, None))]
        self.phase_cpu = {p: {} for p in phases}
        saved = {"init": Run.__init__, "log": RunLogger.log, **{p: getattr(Run, p) for p in phases}}
        probe = self

        def init(run, *args, **kwargs):
            saved["init"](run, *args, **kwargs)
            probe.run = run
            probe.started = (time.perf_counter(), time.process_time())

        def log(logger, step, metrics):
            probe.logged += 1
            if probe.logged == probe.window_start:  # others' CPU first: the snapshot stays out of the window
                probe.procs[0] = cluster_cpu()
                probe.machine[0] = machine_cpu()
            probe.steps[probe.logged] = (time.perf_counter(), time.process_time())
            # trained samples (the row's samples/consumed is the queue's count in fully_async, which
            # includes a prefetched batch when the queue answered before the prefetch)
            probe.consumed[probe.logged] = probe.run.consumed_samples
            if probe.logged == probe.last:
                probe.machine[1] = machine_cpu()
                probe.procs[1] = cluster_cpu()
            return saved["log"](logger, step, metrics)

        def timed(name):
            def call(run, *args, **kwargs):
                cpu = time.process_time()
                probe.depth += 1
                try:
                    return saved[name](run, *args, **kwargs)
                finally:
                    probe.depth -= 1
                    if probe.depth == 0:
                        per_step = probe.phase_cpu[name]
                        step = probe.logged + 1  # the step being worked on: the next one to be logged
                        per_step[step] = per_step.get(step, 0.0) + time.process_time() - cpu

            return call

        Run.__init__, RunLogger.log = init, log
        for p in phases:
            setattr(Run, p, timed(p))
        try:
            yield self
        finally:
            Run.__init__, RunLogger.log = saved["init"], saved["log"]
            for p in phases:
                setattr(Run, p, saved[p])


def bound(mode: str, n: int, m: int, gps: int, c: SimCosts) -> dict:
    """Samples/s the set costs allow (no overheads): see the module docstring."""
    batch = gps * c.group_size
    t_gen = math.ceil(gps / n) * c.gen_s  # a batch's generation, round-robin shares (batch modes)
    t_train = c.train_step_s + math.ceil(gps / m) * c.group_size * c.train_s + c.sync_s  # + the push on rank 0
    rollout_cap = n * c.group_size / c.gen_s
    trainer_cap = batch / t_train if t_train > 0 else math.inf
    if mode == "fully_async":
        value = min(rollout_cap, trainer_cap)
    elif mode == "one_step_off":
        value = batch / max(t_gen, t_train)
    else:
        value = batch / (t_gen + t_train)
    return {"bound": value, "rollout_capacity": rollout_cap, "trainer_capacity": trainer_cap,
            "limited_by": "rollout" if rollout_cap <= trainer_cap else "trainer"}


def groups_per_step(n: int, m: int, groups_per_actor: int) -> int:
    return math.ceil(groups_per_actor * n / m) * m  # trainers split the batch by whole groups


def staleness_mean(rows: list[dict]) -> float:
    """From make_batch's histogram (staleness/hist_<k>; the "over" bin counts as the largest k + 1)."""
    total = weighted = 0
    for r in rows:
        bins = {key.rsplit("_", 1)[1]: count for key, count in r.items() if key.startswith("staleness/hist_")}
        over = 1 + max((int(k) for k in bins if k.isdigit()), default=0)
        for k, count in bins.items():
            total += count
            weighted += (int(k) if k.isdigit() else over) * count
    return weighted / total if total else 0.0


def code_state() -> dict:
    """The driver code the numbers belong to: HEAD and whether the package differs from it."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    changed = git("status", "--short", "--", "async_flowgrpo")
    return {"commit": git("rev-parse", "HEAD"), "package_changed_files": changed.splitlines() if changed else [],
            "package_diff_sha256": hashlib.sha256((git("diff", "HEAD", "--", "async_flowgrpo") or "").encode()).hexdigest()}


def simulate(mode: str, rollouts: int, trainers: int, costs: SimCosts, *, steps: int = 12, warmup: int = 4,
             groups_per_actor: int = 1, max_staleness: int = 1, workdir: str | None = None,
             overrides: tuple = ()) -> dict:
    """One run of the real `mode` loop with stand-ins (Ray must be up). Returns its measurements."""
    from async_flowgrpo.config import load_config
    from async_flowgrpo.modes import run as run_mode

    if not 1 <= warmup <= steps - 2:
        raise ValueError(f"need 1 <= warmup <= steps - 2, got warmup {warmup}, steps {steps}")
    gps = groups_per_step(rollouts, trainers, groups_per_actor)
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="scale_sim_")
    output_dir = os.path.join(workdir, f"{mode}_r{rollouts}_t{trainers}")
    shutil.rmtree(output_dir, ignore_errors=True)
    eta = {"sync": 0, "one_step_off": 1}.get(mode, max_staleness)
    cfg = load_config(mode, [
        f"rollout.num_workers={rollouts}", f"trainer.num_workers={trainers}",
        f"rollout.groups_per_step={gps}", f"rollout.group_size={costs.group_size}",
        "rollout.cpus_per_worker=0.01", "trainer.cpus_per_worker=0.01", "reward.num_workers=0",
        f"trainer.total_steps={steps}", f"trainer.output_dir={output_dir}", "trainer.checkpoint_every=0",
        "trainer.keep_checkpoints=1", "trainer.sample_every=0", "eval.every=0", "eval.at_start_and_end=false",
        "logging.progress=false", f"algorithm.max_staleness={eta}", "sync.verify=true", "sync.timeout_s=300",
        f"ray.poll_s={costs.poll_s}", "ray.start_timeout_s=600", "ray.work_timeout_s=600", *overrides,
    ])
    # The window: logs warmup .. steps - 1. The last step is left out too: in fully_async step k is
    # logged once batch k + 1 has been taken from the queue (prefetch), except the last step.
    end = steps - 1
    probe = Probe(window_start=warmup, last=end)
    load_at_start = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        with probe.installed():
            run_mode(cfg, actor_classes=actor_classes(costs))
        t_end = time.perf_counter()
        with open(os.path.join(output_dir, "metrics.jsonl")) as f:
            rows = {r["step"]: r for r in map(json.loads, f)}
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    w, last = probe.steps[warmup], probe.steps[end]
    wall, cpu = last[0] - w[0], last[1] - w[1]
    window = range(warmup + 1, end + 1)
    samples = probe.consumed[end] - probe.consumed[warmup]
    sps = samples / wall
    periods = sorted(probe.steps[k][0] - probe.steps[k - 1][0] for k in window)
    median_period = periods[len(periods) // 2] if len(periods) % 2 else sum(periods[len(periods) // 2 - 1:][:2]) / 2
    produced = rows[end].get("samples/produced", 0) - rows[warmup].get("samples/produced", 0)
    b = bound(mode, rollouts, trainers, gps, costs)
    phases = {p: sum(per_step.get(s, 0.0) for s in window) for p, per_step in probe.phase_cpu.items() if per_step}
    phases["loop"] = cpu - sum(phases.values())
    others = cpu_by_role(probe.procs[0], probe.procs[1])
    (busy0, total0), (busy1, total1) = probe.machine[0], probe.machine[1]
    machine_busy = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
    mean = lambda key: sum(rows[s].get(key, 0.0) for s in window) / len(window)  # noqa: E731
    n_steps = len(window)
    result = {
        "mode": mode, "rollouts": rollouts, "trainers": trainers, "groups_per_step": gps,
        "batch": gps * costs.group_size, "steps": steps, "steps_logged": len(rows), "window_steps": n_steps,
        **b,
        "samples_per_s": sps,
        "efficiency": sps / b["bound"],
        # a step's median length: robust to a backlog the queue drains during the window
        "efficiency_median_step": gps * costs.group_size / median_period / b["bound"],
        "steps_per_s": n_steps / wall,
        "driver_cpu_s": cpu,
        "driver_cpu_ms_per_step": 1e3 * cpu / n_steps,
        "driver_cpu_us_per_sample": 1e6 * cpu / samples,
        "driver_core_frac": cpu / wall,  # share of one core: 1.0 = the driver is saturated
        "driver_saturates_at_samples_per_s": samples / cpu if cpu > 0 else math.inf,
        "driver_cpu_ms_per_step_by_phase": {k: 1e3 * v / n_steps for k, v in phases.items()},
        "cluster_cores": {k: v / wall for k, v in sorted(others.items())},  # other processes, in cores
        "machine_busy_frac": machine_busy,  # every core of the machine, every process (others' jobs too)
        "load_average_at_start": load_at_start,
        "startup_s": probe.started[0] - t0,
        "startup_driver_cpu_s": probe.started[1] - cpu0,
        "warmup_s": w[0] - probe.started[0],  # from start-up's end to the window (queue start, pipeline fill)
        "end_s": t_end - last[0],  # the last step, the last checkpoint, stopping the loops, shutdown
        "total_s": t_end - t0,
        "trainer_idle_frac": mean("perf/trainer_idle_frac"),
        "rollout_idle_frac": mean("perf/rollout_idle_frac"),
        # the limiting side's busy share: a second efficiency measure, free of the queue's backlog
        "limiting_busy_frac": 1.0 - mean("perf/rollout_idle_frac" if b["limited_by"] == "rollout" else "perf/trainer_idle_frac"),
        "staleness_mean": staleness_mean([rows[s] for s in window]),
        "driver_bytes_per_step": mean("driver/bytes_per_step"),
        "trainer_payload_bytes_per_step": mean("sim/trainer_payload_bytes") * trainers,  # mean over ranks x ranks
        "payload_bytes_per_step": gps * int(costs.payload_kb * 1024),
        "produced_per_s": produced / wall,  # what the rollout actors delivered in the window
        "samples_per_s_whole_run": rows[steps]["perf/samples_per_s"],
    }
    return result


# ------------------------------------------------------------------------------------------------
# Grid, fit, table
# ------------------------------------------------------------------------------------------------
def fit_driver_cost(points: list[dict]) -> dict | None:
    """Least squares driver CPU per step (ms) = a + b N + c M (N rollout actors, M trainers);
    terms without variation in the data are left out."""
    import numpy as np

    if len(points) < 2:
        return None
    cols, names = [np.ones(len(points))], ["a_ms"]
    for key, name in (("rollouts", "b_ms_per_rollout"), ("trainers", "c_ms_per_trainer")):
        x = np.array([p[key] for p in points], dtype=float)
        if len(set(x)) > 1:
            cols.append(x)
            names.append(name)
    if len(points) < len(cols):
        return None
    y = np.array([p["driver_cpu_ms_per_step"] for p in points])
    coef, *_ = np.linalg.lstsq(np.stack(cols, 1), y, rcond=None)
    pred = np.stack(cols, 1) @ coef
    fit = dict(zip(names, map(float, coef)))
    fit["max_rel_error"] = float(np.max(np.abs(pred - y) / y))
    return fit


def extrapolate(fit: dict, c: SimCosts, groups_per_actor: int, trainers: int = 1) -> dict:
    """Where the driver's core saturates as N grows with groups_per_step = k N: the steps/s it
    can drive at N actors is 1 / cost(N); samples/s = that x k N G."""
    a, b = fit["a_ms"], fit.get("b_ms_per_rollout", 0.0)
    a += fit.get("c_ms_per_trainer", 0.0) * trainers
    out = {}
    for n in (64, 256, 1024, 4096):
        ms = a + b * n
        out[str(n)] = {"driver_ms_per_step": ms, "max_steps_per_s": 1e3 / ms,
                       "max_samples_per_s": 1e3 / ms * groups_per_actor * n * c.group_size}
    out["asymptote_samples_per_s"] = (1e3 * groups_per_actor * c.group_size / b) if b > 0 else math.inf
    return out


def table(points: list[dict]) -> str:
    head = (f"{'mode':<13}{'N':>4}{'M':>3}{'batch':>7}{'bound':>8}{'samp/s':>8}{'eff':>6}{'drv ms/step':>12}"
            f"{'drv us/samp':>12}{'drv core':>9}{'sat samp/s':>11}{'ray cores':>10}{'machine':>8}{'start s':>8}{'busy':>6}")
    lines = [head, "-" * len(head)]
    for p in points:
        if "error" in p:
            lines.append(f"{p['mode']:<13}{p['rollouts']:>4}{p['trainers']:>3}  error: {p['error'][:80]}")
            continue
        others = sum(p["cluster_cores"].values())
        lines.append(
            f"{p['mode']:<13}{p['rollouts']:>4}{p['trainers']:>3}{p['batch']:>7}{p['bound']:>8.0f}{p['samples_per_s']:>8.1f}"
            f"{p['efficiency']:>6.2f}{p['driver_cpu_ms_per_step']:>12.1f}{p['driver_cpu_us_per_sample']:>12.0f}"
            f"{p['driver_core_frac']:>9.2f}{p['driver_saturates_at_samples_per_s']:>11.0f}{others:>10.2f}{p['machine_busy_frac']:>8.2f}"
            f"{p['startup_s']:>8.1f}{p['limiting_busy_frac']:>6.2f}")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"hostname": platform.node(), "cpu_model": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "ray": ray.__version__, "load_average_at_start": list(os.getloadavg())}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--name", default="grid", help="results file benchmarks/results/scale_sim/<name>.json")
    ap.add_argument("--modes", default="fully_async,one_step_off", help="comma-separated: fully_async, one_step_off, sync")
    ap.add_argument("--rollouts", type=ints, default=[1, 2, 4, 8, 16, 32, 64], help="rollout actor counts")
    ap.add_argument("--trainers", type=ints, default=[1], help="trainer counts")
    ap.add_argument("--groups-per-actor", type=int, default=1, help="groups_per_step = this x rollout actors (rounded up to a multiple of the trainers)")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--gen-s", type=float, default=1.0, help="seconds per group on one rollout actor")
    ap.add_argument("--train-s", type=float, default=0.0005, help="seconds per sample on one trainer")
    ap.add_argument("--train-step-s", type=float, default=0.0, help="fixed seconds per train step on each trainer")
    ap.add_argument("--sync-s", type=float, default=0.0, help="seconds per weight push on trainer rank 0")
    ap.add_argument("--payload-kb", type=float, default=256.0, help="bytes of each group in the object store (> 100 KiB: not inlined)")
    ap.add_argument("--jitter", type=float, default=0.0, help="generation time x uniform(1-j, 1+j)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the measurement window (fully_async: > max_staleness + 1, the queue's start-up backlog)")
    ap.add_argument("--max-staleness", type=int, default=1, help="fully_async eta")
    ap.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs (the stand-ins take 0.01 each)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/scale_sim/<name>.json)")
    args = ap.parse_args(argv)

    import torch

    from async_flowgrpo.stop import Stopped

    torch.set_num_threads(1)  # the driver only orchestrates
    costs = SimCosts(gen_s=args.gen_s, group_size=args.group_size, train_s=args.train_s, train_step_s=args.train_step_s,
                     sync_s=args.sync_s, payload_kb=args.payload_kb, jitter=args.jitter)
    modes = [m for m in args.modes.split(",") if m]
    out = args.out or os.path.join(RESULTS, f"{args.name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    info = {**machine(), "code": code_state()}
    ray.init(address="local", num_cpus=args.num_cpus, num_gpus=0, include_dashboard=False, log_to_driver=False,
             object_store_memory=2 * 1024**3,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    points = []
    workdir = tempfile.mkdtemp(prefix="scale_sim_")
    started = time.perf_counter()
    try:
        for mode in modes:
            for m in args.trainers:
                for n in args.rollouts:
                    log(f"{mode}: {n} rollout actors, {m} trainers")
                    try:
                        p = simulate(mode, n, m, costs, steps=args.steps, warmup=args.warmup, groups_per_actor=args.groups_per_actor,
                                     max_staleness=args.max_staleness, workdir=workdir)
                    except Stopped as e:
                        log(f"stopped by a signal; the {len(points)} points measured before are in {out}")
                        return e.exit_code
                    except Exception as e:  # one point failing should not lose the others
                        log(f"  failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                        p = {"mode": mode, "rollouts": n, "trainers": m, "error": f"{type(e).__name__}: {e}"}
                    else:
                        log(f"  {p['samples_per_s']:.1f} samples/s of {p['bound']:.0f} (eff {p['efficiency']:.2f}), driver "
                            f"{p['driver_cpu_ms_per_step']:.1f} ms CPU/step = {p['driver_core_frac']:.2f} core, "
                            f"start-up {p['startup_s']:.1f} s, run {p['total_s']:.1f} s")
                    points.append(p)
                    write(out, args, costs, info, points, time.perf_counter() - started)
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(points))
    summary = write(out, args, costs, info, points, time.perf_counter() - started)
    for mode, fit in summary["fits"].items():
        print(f"{mode}: driver CPU per step = {fit['fit']}; saturation: {json.dumps(fit['extrapolation'])}")
    log(f"wrote {out}")
    return 0


def _finite(v):
    """inf (no limit) as null: strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def write(out: str, args, costs: SimCosts, info: dict, points: list[dict], elapsed: float) -> dict:
    good = [p for p in points if "error" not in p]
    fits = {}
    for mode in dict.fromkeys(p["mode"] for p in good):
        mine = [p for p in good if p["mode"] == mode]
        fit = fit_driver_cost(mine)
        if fit:
            fits[mode] = {"fit": fit, "extrapolation": extrapolate(fit, costs, args.groups_per_actor, min(p["trainers"] for p in mine))}
    doc = {
        "benchmark": "scale_sim",
        "command": "python benchmarks/scale_sim.py " + " ".join(sys.argv[1:]) if __name__ == "__main__" else None,
        "args": vars(args), "costs": dataclasses.asdict(costs), "machine": info, "elapsed_s": elapsed,
        "points": points, "fits": fits,
    }
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(doc), f, indent=1, default=str)
    os.replace(tmp, out)
    return doc


if __name__ == "__main__":
    sys.exit(main())
