"""The cluster: Ray start or join, one placement group, the actors, and their restarts.

Everything else in the driver talks to actors through this object; it knows nothing of steps,
weights versions or checkpoints.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from async_flowgrpo.actors.rollout import RolloutActor
from async_flowgrpo.actors.trainer import TrainerActor
from async_flowgrpo.config import Config
from async_flowgrpo.rewards.pool import make_reward_pool
from async_flowgrpo.stop import GracefulStop, StopRequested
from async_flowgrpo.sync import free_port, make_transport, node_ip

logger = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A start-up or run failure with a message meant for the user (the launcher prints one line)."""


def init_ray(cfg: Config) -> None:
    # RAY_ADDRESS is how `ray job submit` and Ray users point a driver at their cluster.
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    source = "ray.address" if cfg.ray.address else "RAY_ADDRESS"
    if address and address != "auto":
        # ray.init retries an unreachable address for a long time: probe the port first.
        host, _, port = address.replace("ray://", "").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=cfg.ray.connect_timeout_s).close()
        except (OSError, ValueError) as e:
            raise RunError(f"{source}: cannot reach a Ray cluster at {address} ({e})") from None
    if ray.is_initialized():
        return
    env_vars = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    to_console = cfg.logging.actor_output == "console"
    with _driver_signals_kept(), _ray_in_its_own_group(start=not address):
        if address:
            try:
                ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=to_console)
            except (ConnectionError, RuntimeError) as e:
                raise RunError(f"{source}: cannot join the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
        else:
            # A Ray started here inherits this process's environment. Without a runtime_env the actors
            # can take the worker processes Ray starts ahead (a runtime_env makes it start new ones).
            os.environ.update(env_vars)
            # ray.shutdown waits this long to send task events (observability only) to a GCS that a
            # signal may have stopped (default 5 s)
            os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms", "1000")
            try:
                ray.init(
                    # "local": never a cluster that `ray start` left on this machine (Ray's default would
                    # join it, and refuse num_cpus there)
                    address="local",
                    num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                    num_gpus=cfg.ray.num_gpus if cfg.ray.num_gpus is not None else torch.cuda.device_count(),
                    include_dashboard=False,
                    log_to_driver=to_console,
                )
            except Exception as e:  # Ray's own start failed: "The current node timed out during startup"
                # on an overloaded machine (a signal is a KeyboardInterrupt, not caught here)
                raise RunError(f"could not start a local Ray: {str(e).splitlines()[0]} (nothing was trained; "
                               "run the command again)") from None


# The keeper of the process group that holds the Ray this process started (see _ray_in_its_own_group),
# and that Ray's node.
_keeper: subprocess.Popen | None = None
_keeper_node = None


@contextmanager
def _ray_in_its_own_group(start: bool) -> Iterator[None]:
    """The processes of a Ray that ray.init starts here (GCS, raylet and, under the raylet, its two
    agents) go into a process group of their own, held by a keeper process:

    - A SIGTERM to the launcher's process group (what `timeout`, SLURM's scancel and systemd's stop
      send) reaches the driver alone, which stops gracefully with a checkpoint of the current step.
      In the driver's group, Ray's processes would die with it (Ray blocks SIGINT there, not
      SIGTERM), leaving nothing to save from and a driver that Ray's GCS client hangs for 60 s,
      then exits 1.
    - When the driver dies, however it dies (its end of the keeper's pipe closes), the keeper kills
      the group. The GCS and raylet share the driver's fate anyway (PR_SET_PDEATHSIG), but the
      agents outlive a driver killed by SIGKILL by a minute or more, ignoring SIGTERM. The keeper
      ignores SIGTERM, SIGINT and SIGHUP, so that a signal sent to every process of the run (as
      SLURM and systemd do) still leaves it to end what is left once the driver has gone.

    (Ray's worker processes put themselves in groups of their own and die with the raylet.)"""
    global _keeper
    if not start:
        yield
        return
    _end_keeper()  # a Ray this process started before and shut down: nothing of it stays
    _keeper = subprocess.Popen(["sh", "-c", "trap '' TERM INT HUP; read _; kill -KILL 0"], stdin=subprocess.PIPE,
                               preexec_fn=os.setpgrp)
    group = _keeper.pid
    from ray._private import services

    class InKeepersGroup(services.ConsolePopen):
        def __init__(self, *args, preexec_fn=None, **kwargs):
            def join_then_ray_preexec():
                os.setpgid(0, group)
                if preexec_fn is not None:
                    preexec_fn()

            super().__init__(*args, preexec_fn=join_then_ray_preexec, **kwargs)

    global _keeper_node
    with mock.patch.object(services, "ConsolePopen", InKeepersGroup):
        yield
    _keeper_node = ray._private.worker._global_node


def _end_keeper() -> None:
    """Kill what is left of the Ray this process started (after ray.shutdown: the agents)."""
    global _keeper
    if _keeper is not None:
        _keeper.stdin.close()
        _keeper.wait(timeout=30)
        _keeper = None


def ray_started_here() -> bool:
    """Whether the Ray this process is in is the one init_ray started (not one started by other code
    of this process after that Ray was shut down some other way, which the keeper does not hold)."""
    return _keeper is not None and ray.is_initialized() and ray._private.worker._global_node is _keeper_node


def local_ray_lost() -> bool:
    """Whether the GCS or the raylet of a Ray this process started has exited (a joined cluster:
    False, it is not ours to watch). Every call to Ray would then wait 60 s for the GCS and exit 1."""
    node = ray._private.worker._global_node
    if not ray_started_here() or node is None:
        return False
    from ray._private import ray_constants

    return any(info.process.poll() is not None
               for kind in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)
               for info in node.all_processes.get(kind, []))


def _running(pid: int) -> bool:
    """(A zombie counts as running: its parent, the raylet or init, reaps it within moments.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shutdown_ray() -> None:
    """Leave Ray; a Ray this process started is gone afterwards, to the last process."""
    if ray.is_initialized():
        ray.shutdown()
    _end_keeper()


@contextmanager
def _driver_signals_kept() -> Iterator[None]:
    """ray.init takes SIGTERM twice over: a Python handler (sys.exit(15), without a word) and, in the
    driver's core worker, Ray's C++ crash handler (a stack dump and exit -6 when the signal lands in
    its last moments). The driver's own handlers (the run's graceful stop, installed before Ray
    starts) must see every signal, so ray.init here installs neither. Actor processes keep both."""
    from ray._private import ray_constants, utils

    with mock.patch.object(utils, "set_sigterm_handler", lambda handler: None), \
            mock.patch.object(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True):
        yield


def check_resources(cfg: Config) -> None:
    """Fail in seconds, not hang, when the cluster cannot hold the requested actors."""
    total = ray.cluster_resources()
    r, t, w = cfg.rollout, cfg.trainer, cfg.reward
    need_gpu = r.num_workers * r.gpus_per_worker + t.num_workers * t.gpus_per_worker + w.num_workers * w.gpus_per_worker
    need_cpu = r.num_workers * r.cpus_per_worker + t.num_workers * t.cpus_per_worker
    need_cpu += w.num_workers * w.cpus_per_worker
    if need_gpu > total.get("GPU", 0):
        raise RunError(
            f"rollout/trainer/reward .gpus_per_worker: {need_gpu:g} GPUs requested "
            f"({r.num_workers} rollout + {t.num_workers} trainer + {w.num_workers} reward actors), "
            f"the cluster has {total.get('GPU', 0):g}"
        )
    if need_cpu > total.get("CPU", 0):
        raise RunError(
            f"rollout/trainer/reward .cpus_per_worker: {need_cpu:g} CPUs requested, the cluster has {total.get('CPU', 0):g}"
        )
    for key in dict.fromkeys([*r.resources, *t.resources, *w.resources]):
        need = sum(x.num_workers * x.resources.get(key, 0) for x in (r, t, w))
        if need > total.get(key, 0):
            who = "/".join(name for x, name in ((r, "rollout"), (t, "trainer"), (w, "reward")) if key in x.resources)
            raise RunError(f"{who}.resources: {need:g} of '{key}' requested, the cluster has {total.get(key, 0):g} "
                           f"(a node offers it with `ray start --resources='{{\"{key}\": N}}'`)")


def rollout_actor_name(output_dir: str, index: int) -> str:
    """Named so operators (and the fault-tolerance test) can find a run's rollout actors."""
    return f"async_flowgrpo:{os.path.abspath(output_dir)}:rollout-{index}"


def sync_host(cfg: Config) -> str | None:
    """Where the weight-sync rendezvous listens: sync.host, else loopback when the Ray cluster is
    one node (no other machine can reach it), else the trainer's node IP (None)."""
    if cfg.sync.host:
        return cfg.sync.host
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(alive) == 1 else None


def sync_device(cfg: Config) -> str | None:
    """The weight-sync group's buffers: None (each member's GPU, so NCCL on GPUs) unless an actor
    takes a fraction of a GPU. Then two members may share one GPU, which NCCL refuses ("duplicate
    GPU"), and the group runs gloo over CPU buffers (one copy each way over PCIe)."""
    fractional = any(0 < role.gpus_per_worker < 1 for role in (cfg.rollout, cfg.trainer))
    return "cpu" if fractional and cfg.sync.transport == "collective" else None


def reward_concurrency(cfg: Config) -> int:
    """The calls one reward actor takes at once: all that the rollout workers can send together
    (each takes the actors in turn, all from the first), so that none waits inside the actor on
    another's and spends its reward.timeout_s there. reward.overlap=false: one group per worker."""
    w = cfg.reward
    return (w.max_pending if w.overlap else 1) * cfg.rollout.num_workers


def _bundle(role) -> dict:
    """One actor's bundle: its CPUs, GPUs and custom resources (which pick the node it lands on)."""
    gpus = {"GPU": role.gpus_per_worker} if role.gpus_per_worker else {}
    return {"CPU": role.cpus_per_worker, **gpus, **role.resources}


class Cluster:
    """Rollout actors, trainer actors and reward actors, placed in one placement group (one bundle
    per actor; with fractional gpus_per_worker two bundles can share a GPU). Call `shutdown` when done; a
    failed start-up shuts down what it started.

    `rollout_actor` / `trainer_actor`: the actor classes (benchmarks/scale_sim.py passes stand-ins
    with set costs, to measure the driver alone). `stop`: the run's signal handling (after a signal,
    a dead actor is not waited for)."""

    def __init__(self, cfg: Config, rollout_actor=RolloutActor, trainer_actor=TrainerActor, stop: GracefulStop | None = None):
        self.cfg, self.stop = cfg, stop
        self.rollout_actor, self.trainer_actor = rollout_actor, trainer_actor
        init_ray(cfg)
        check_resources(cfg)
        r, t = cfg.rollout, cfg.trainer
        self.transport = make_transport(cfg.sync.transport, bucket_mb=cfg.sync.bucket_mb, timeout_s=cfg.sync.timeout_s,
                                        device=sync_device(cfg), verify=cfg.sync.verify)
        if self.transport.device == "cpu":  # only set when actors hold fractions of GPUs
            logger.info("weight sync over gloo on CPU buffers: actors take fractions of a GPU, and NCCL "
                        "cannot put two of them on one GPU")
        self.bundles = [_bundle(r)] * r.num_workers + [_bundle(t)] * t.num_workers
        self.trainers, self.rollouts, self.reward_actors = [], [], []
        self.rollout_pids: list[int] = []
        self.trainer_pids: list[int] = []
        self.restarts = 0  # rollout actors Ray restarted
        self.nodes = 0  # see _count_nodes
        self._last_stats: dict[int, dict] = {}  # rollout actor -> its last counters (see rollout_stats)
        self.placement = placement_group(self.bundles, strategy="PACK")

    def start(self) -> None:
        cfg, r, t = self.cfg, self.cfg.rollout, self.cfg.trainer
        try:
            ray.get(self.placement.ready(), timeout=cfg.ray.connect_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"the cluster cannot place {len(self.bundles)} actors with bundles {self.bundles} "
                           "(ray.address / *.gpus_per_worker)") from None
        dp_address = (sync_host(cfg) or node_ip(), free_port())  # the trainers' own rendezvous, like the weight sync's
        self.trainers = [
            self.trainer_actor.options(**self._placed(r.num_workers + i, t)).remote(cfg, i, t.num_workers, dp_address, self.transport)
            for i in range(t.num_workers)
        ]
        w = cfg.reward
        self.reward_actors = (make_reward_pool(w.num_workers, w.weights, w.options, w.cpus_per_worker, w.gpus_per_worker,
                                               w.resources, reward_concurrency(cfg), w.batch_size, w.batch_wait_s)
                              if w.num_workers else [])
        self.rollouts = [
            self.rollout_actor.options(name=rollout_actor_name(t.output_dir, i), **self._placed(i, r)).remote(
                cfg, i, self.transport, self.reward_actors
            )
            for i in range(r.num_workers)
        ]
        try:
            ray.get([a.ready.remote() for a in self.trainers + self.rollouts], timeout=cfg.ray.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"the actors did not load their models within ray.start_timeout_s={cfg.ray.start_timeout_s:g} s "
                           "(raise it for a large model, a slow disk or a busy machine)") from None
        self.rollout_pids = ray.get([a.pid.remote() for a in self.rollouts], timeout=cfg.ray.call_timeout_s)
        self.trainer_pids = ray.get([a.pid.remote() for a in self.trainers], timeout=cfg.ray.call_timeout_s)
        self._count_nodes()

    def _count_nodes(self) -> None:
        """How many Ray nodes the run's actors are placed on (rollout and trainer bundles); looked up
        at start and after a restart, the only times a bundle can move."""
        self.nodes = len(set(placement_group_table(self.placement).get("bundles_to_node_id", {}).values()))

    def trainers_gone(self) -> bool:
        """Whether a trainer's process has exited (a Ray started here, whose actors run on this
        machine; a joined cluster: False). Seen at once, where Ray takes seconds to report it."""
        return ray_started_here() and any(not _running(pid) for pid in self.trainer_pids)

    def _placed(self, bundle_index: int, role) -> dict:
        return {
            "num_cpus": role.cpus_per_worker,
            "num_gpus": role.gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=bundle_index),
        }

    # -- restarts ------------------------------------------------------------------------------
    def wait_restarted(self, index: int) -> None:
        """Wait until rollout actor `index` answers; count a restart if its process is new (whichever
        of the generation loop or a weight sync noticed the death first)."""
        if self.stop is not None and self.stop.requested:
            # After a signal the stop goes ahead: the actor was most likely sent it too (SLURM and
            # systemd signal every process of the run), and the checkpoint needs only the trainers.
            raise StopRequested(self.stop.signum)
        pid = self._wait_alive(self.rollouts[index])
        if pid != self.rollout_pids[index]:
            self.restarts += 1
            self.rollout_pids[index] = pid
            self._count_nodes()

    def _wait_alive(self, actor) -> int:
        """Calls fail with ActorUnavailableError while Ray restarts an actor; wait until it answers
        and return its pid. (pid runs on the control thread, so a busy generation loop does not
        delay the answer.)"""
        timeout_s = self.cfg.ray.restart_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(actor.pid.remote(), timeout=timeout_s)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    # -- calls -----------------------------------------------------------------------------------
    @property
    def whole_weight_ranks(self) -> list:
        """Trainers that must join a call needing whole weights: rank 0 alone, or every rank when the
        weights are sharded (FSDP: gathering them is collective) or the sequence split (evaluation's
        forward passes are collective over a sequence group)."""
        t = self.cfg.trainer
        return self.trainers if t.fsdp or t.sequence_parallel > 1 else self.trainers[:1]

    def on_trainers(self, method: str, *args, timeout: float | None = None):
        """Call a rank-0 trainer method (on `whole_weight_ranks`); returns rank 0's answer."""
        refs = [getattr(t, method).remote(*args) for t in self.whole_weight_ranks]
        return ray.get(refs, timeout=timeout or self.cfg.ray.work_timeout_s)[0]

    def stop_evaluating(self) -> None:
        """The run is stopping: the trainers abandon the evaluation in progress (answered on their
        control thread, while the evaluation runs)."""
        ray.get([t.stop_evaluating.remote() for t in self.whole_weight_ranks], timeout=self.cfg.ray.call_timeout_s)

    def rollout_stats(self) -> list[dict]:
        """Each rollout actor's counters; an actor that is dead or restarting (noticed, and
        recovered, where the mode next waits on it) reports its last counters."""
        refs = [r.stats.remote() for r in self.rollouts]
        for i, ref in enumerate(refs):
            try:
                self._last_stats[i] = ray.get(ref, timeout=self.cfg.ray.call_timeout_s)
            except ray.exceptions.RayActorError:
                self._last_stats.setdefault(i, {"perf/rollout_idle_frac": 0.0})
        return [self._last_stats[i] for i in range(len(self.rollouts))]

    def trainer_idle(self) -> float:
        idle = ray.get([t.idle_fraction.remote() for t in self.trainers], timeout=self.cfg.ray.call_timeout_s)
        return sum(idle) / len(idle)

    def shutdown(self, ray_lost: bool = False, more_actors: tuple = ()) -> None:
        """End the run's actors (and `more_actors`). ray_lost: the signal that stops the run
        reached Ray's processes too. A Ray started here is then left to ray.shutdown, which ends it
        all: its GCS may be on its way out, and a call to it would wait 60 s for it, then exit 1."""
        if ray_lost and ray_started_here():
            _end_keeper()  # what the signal left of it goes at once (its GCS would take 20 s)
            return
        for actor in self.rollouts + self.trainers + self.reward_actors + list(more_actors):
            ray.kill(actor)
        remove_placement_group(self.placement)
