"""What the three mode drivers share: Ray start-up, actors, weight sync, batch assembly, logging.

A driver (async_flowgrpo/modes/*.py) only decides *when* to generate, train and publish; every
*how* lives here, so the schedules read in a few lines each.
"""

from __future__ import annotations

import dataclasses
from collections import deque
import logging
import os
import socket
import time

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from async_flowgrpo import algo, checkpoint
from async_flowgrpo.checkpoint import Checkpointer, CheckpointError
from async_flowgrpo.config import Config
from async_flowgrpo.metrics import RunLogger, reduce_metrics
from async_flowgrpo.rewards.pool import make_reward_pool
from async_flowgrpo.rollout.worker import RolloutActor
from async_flowgrpo.stop import Diverged, GracefulStop, NonFiniteGuard, Stopped, StopRequested
from async_flowgrpo.sync import free_port, make_transport, node_ip
from async_flowgrpo.training import TrainerActor
from async_flowgrpo.types import Group

logger = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A start-up or run failure with a message meant for the user (the launcher prints one line)."""


# -- Ray cluster ---------------------------------------------------------------------------------
def init_ray(cfg: Config) -> None:
    address = cfg.ray.address
    if address and address != "auto":
        # ray.init retries an unreachable address for a long time: probe the port first.
        host, _, port = address.replace("ray://", "").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=cfg.ray.connect_timeout_s).close()
        except (OSError, ValueError) as e:
            raise PipelineError(f"ray.address: cannot reach a Ray cluster at {address} ({e})") from None
    if ray.is_initialized():
        return
    env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}}
    if address:
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        except (ConnectionError, RuntimeError) as e:
            raise PipelineError(f"ray.address: cannot join the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
    else:
        ray.init(
            num_cpus=cfg.ray.num_cpus or os.cpu_count(),
            num_gpus=cfg.ray.num_gpus if cfg.ray.num_gpus is not None else torch.cuda.device_count(),
            include_dashboard=False,
            runtime_env=env,
        )


def check_resources(cfg: Config) -> None:
    """Fail in seconds, not hang, when the cluster cannot hold the requested actors."""
    total = ray.cluster_resources()
    r, t = cfg.rollout, cfg.trainer
    need_gpu = r.num_workers * r.gpus_per_worker + t.num_workers * t.gpus_per_worker
    need_cpu = r.num_workers * r.cpus_per_worker + t.num_workers * t.cpus_per_worker
    need_cpu += cfg.reward.num_workers * cfg.reward.cpus_per_worker
    if need_gpu > total.get("GPU", 0):
        raise PipelineError(
            f"rollout.gpus_per_worker/trainer.gpus_per_worker: {need_gpu:g} GPUs requested "
            f"({r.num_workers} rollout + {t.num_workers} trainer actors), the cluster has {total.get('GPU', 0):g}"
        )
    if need_cpu > total.get("CPU", 0):
        raise PipelineError(
            f"rollout/trainer/reward .cpus_per_worker: {need_cpu:g} CPUs requested, the cluster has {total.get('CPU', 0):g}"
        )


def rollout_actor_name(output_dir: str, index: int) -> str:
    """Named so operators (and the fault-tolerance test) can find a run's rollout actors."""
    return f"async_flowgrpo:{os.path.abspath(output_dir)}:rollout-{index}"


def checkpointer(cfg: Config) -> Checkpointer:
    return Checkpointer(os.path.join(cfg.trainer.output_dir, "checkpoints"), keep=cfg.trainer.keep_checkpoints)


def sync_host(cfg: Config) -> str | None:
    """Where the weight-sync rendezvous listens: sync.host, else loopback when the Ray cluster is
    one node (no other machine can reach it), else the trainer's node IP (None)."""
    if cfg.sync.host:
        return cfg.sync.host
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(alive) == 1 else None


class Pipeline:
    """Rollout actors + trainer actors + the weight-sync group + run logging."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.checkpointer = checkpointer(cfg)
        self.stop = GracefulStop()
        init_ray(cfg)
        check_resources(cfg)
        self.stop.install()  # after ray.init, which installs a SIGTERM handler of its own; undone by shutdown()
        r, t = cfg.rollout, cfg.trainer
        self.transport = make_transport(
            cfg.sync.transport, bucket_mb=cfg.sync.bucket_mb, timeout_s=cfg.sync.timeout_s, verify=cfg.sync.verify
        )
        # One placement group: rollout and trainer bundles are separate, so they never share a GPU.
        bundles = [self._bundle(r.cpus_per_worker, r.gpus_per_worker)] * r.num_workers
        bundles += [self._bundle(t.cpus_per_worker, t.gpus_per_worker)] * t.num_workers
        self.trainers, self.rollouts, self.reward_actors, self.log = [], [], [], None
        self.placement = placement_group(bundles, strategy="PACK")
        try:
            with self.stop.abandonable():  # a signal during start-up: nothing to save yet
                self._start(cfg, bundles)
        except BaseException:
            self.shutdown()  # no half-started actors left behind
            raise

    def _start(self, cfg: Config, bundles: list[dict]) -> None:
        r, t = cfg.rollout, cfg.trainer
        try:
            ray.get(self.placement.ready(), timeout=cfg.ray.connect_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"the cluster cannot place {len(bundles)} actors with bundles {bundles} (ray.address / *.gpus_per_worker)") from None

        dp_address = (node_ip(), free_port())
        self.trainers = [
            TrainerActor.options(**self._placed(r.num_workers + i, t)).remote(cfg, i, t.num_workers, dp_address, self.transport)
            for i in range(t.num_workers)
        ]
        w = cfg.reward
        self.reward_actors = make_reward_pool(w.num_workers, w.weights, w.options, w.cpus_per_worker) if w.num_workers else []
        self.rollouts = [
            RolloutActor.options(name=rollout_actor_name(t.output_dir, i), **self._placed(i, r)).remote(
                cfg, i, self.transport, self.reward_actors
            )
            for i in range(r.num_workers)
        ]
        ray.get([a.ready.remote() for a in self.trainers + self.rollouts], timeout=600)
        self.rollout_pids = ray.get([a.pid.remote() for a in self.rollouts], timeout=60)  # a new pid = a restart
        self.sync_host = sync_host(cfg)
        self.connect_sync_group()

        self.version = 0  # published weight version
        self.step = 0  # trainer steps done
        self.next_ticket = 0  # batch modes: index of the next group to start
        self.trained_ticket_end = 0  # batch modes: groups before this ticket are trained
        self._batch_ends: deque[int] = deque()  # end ticket of each batch started, not yet collected
        self._collected_end = 0
        self.consumed_samples = 0
        self.produced_samples = 0  # batch modes (fully_async: the queue counts)
        self.skipped_groups = 0
        self._reward_errors_seen: dict[int, int] = {}  # fully_async: per rollout actor, to count skipped groups
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote
        self.rollout_restarts = 0
        self.lost_groups = 0  # groups in flight on a rollout actor when it died (fully_async)
        self.sync_totals = {"sync/total_time_s": 0.0, "sync/total_bytes": 0.0}
        self.log = RunLogger(t.output_dir, cfg, total_steps=t.total_steps, progress=cfg.logging.progress)
        self.resume_if_asked()
        self.publish_weights()  # rollout actors start from exactly the trainer's weights
        self.start_time = time.perf_counter()
        self._consumed_at_start = self.consumed_samples  # throughput counts this process's work only

    @staticmethod
    def _bundle(cpus: float, gpus: float) -> dict:
        return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}

    def _placed(self, bundle_index: int, role) -> dict:
        return {
            "num_cpus": role.cpus_per_worker,
            "num_gpus": role.gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=bundle_index),
        }

    # -- weight sync ---------------------------------------------------------------------------
    def connect_sync_group(self) -> None:
        """(Re)build the group of trainer rank 0 + every rollout actor; rerun after replacing one."""
        world = len(self.rollouts) + 1
        address = ray.get(self.trainers[0].sync_address.remote(self.sync_host), timeout=60)
        ray.get(
            [self.trainers[0].sync_connect.remote(address, world)]
            + [rollout.sync_connect.remote(address, i + 1, world) for i, rollout in enumerate(self.rollouts)],
            timeout=120,
        )

    def recover_rollout(self, index: int, error: Exception) -> None:
        """Ray restarts a dead rollout actor; it rejoins the sync group and gets the current weights."""
        logger.warning("rollout actor %d died (%s); waiting for its restart", index, str(error).splitlines()[0][:200])
        self._wait_restarted(index)
        self.connect_sync_group()
        self.publish_weights()

    def _wait_restarted(self, index: int) -> None:
        """Wait until rollout actor `index` answers; count a restart if its process is new (whichever
        of the generation loop or a weight sync noticed the death first)."""
        pid = self._wait_alive(self.rollouts[index])
        if pid != self.rollout_pids[index]:
            self.rollout_restarts += 1
            self.rollout_pids[index] = pid

    @staticmethod
    def _wait_alive(actor, timeout_s: float = 600) -> int:
        """Calls fail with ActorUnavailableError while Ray restarts an actor; wait until it answers
        and return its pid. (pid runs on the control thread, so a busy generation loop does not
        delay the answer.)"""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(actor.pid.remote(), timeout=timeout_s)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def publish_weights(self) -> dict:
        """Broadcast the trainer's weights (version self.version) to every rollout actor and verify.

        If a rollout actor died (the collective fails), wait for Ray to restart it, rebuild the
        group and send again: the restarted actor must hold the current weights before it generates."""
        try:
            return self._publish()
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            logger.warning("weight sync failed (%s); rebuilding the sync group", str(e).splitlines()[0][:200])
            for i in range(len(self.rollouts)):
                self._wait_restarted(i)
            self.connect_sync_group()
            return self._publish()

    @property
    def _whole_weight_ranks(self) -> list:
        """Trainers that must join a call needing whole weights: rank 0 alone, or, when the weights
        are sharded (FSDP), every rank, since gathering them is collective."""
        return self.trainers if self.cfg.trainer.fsdp else self.trainers[:1]

    def on_trainers(self, method: str, *args, timeout: float = 600):
        """Call a rank-0 trainer method (on `_whole_weight_ranks`); returns rank 0's answer."""
        return ray.get([getattr(t, method).remote(*args) for t in self._whole_weight_ranks], timeout=timeout)[0]

    def _publish(self) -> dict:
        start = time.perf_counter()
        push, *gathering = [t.push.remote(self.version) for t in self._whole_weight_ranks]  # only rank 0 sends
        pulls = [rollout.pull.remote([push]) for rollout in self.rollouts]
        sent, *received = ray.get([push, *pulls], timeout=self.cfg.sync.timeout_s)
        ray.get(gathering, timeout=self.cfg.sync.timeout_s)
        if self.cfg.sync.verify:
            for i, got in enumerate(received):
                if got["digest"] != sent.stats.digest:
                    raise PipelineError(f"weight sync: rollout actor {i} digest {got['digest'][:12]} != trainer {sent.stats.digest[:12]}")
        elapsed = time.perf_counter() - start
        self.sync_totals["sync/total_time_s"] += elapsed
        self.sync_totals["sync/total_bytes"] += sent.stats.bytes * len(self.rollouts)
        return {"sync/time_s": elapsed, "sync/bytes": sent.stats.bytes}

    # -- batch modes: the driver hands out tickets ---------------------------------------------
    def generate_batch_async(self, num_groups: int | None = None) -> list:
        """Start the next batch on the rollout actors (tickets round-robin); returns Ray refs."""
        num_groups = num_groups or self.cfg.rollout.groups_per_step
        tickets = list(range(self.next_ticket, self.next_ticket + num_groups))
        self.next_ticket += num_groups
        self._batch_ends.append(self.next_ticket)
        shares = [tickets[i :: len(self.rollouts)] for i in range(len(self.rollouts))]
        return [(i, share, self.rollouts[i].generate.remote(share)) for i, share in enumerate(shares) if share]

    def collect(self, pending: list) -> list[Group]:
        """Wait for a batch; a share lost with a dead rollout actor is regenerated after its restart."""
        groups = []
        with self.stop.abandonable():  # only waiting: a batch left half-made is regenerated on resume
            for i, tickets, ref in pending:
                try:
                    groups += ray.get(ref, timeout=3600)
                except ray.exceptions.RayActorError as e:
                    self.recover_rollout(i, e)
                    groups += ray.get(self.rollouts[i].generate.remote(tickets), timeout=3600)
        self._collected_end = self._batch_ends.popleft()
        kept = [g for g in groups if g is not None]
        self.skipped_groups += len(groups) - len(kept)
        self.produced_samples += sum(g.size for g in kept)
        return kept

    # -- training ------------------------------------------------------------------------------
    def train(self, groups: list[Group]) -> dict[str, float] | None:
        """Advantages over the batch, one data-parallel update, version + 1. Returns step metrics,
        or None when every group of the batch was skipped (counted in rewards/skipped_groups)."""
        if not groups:
            return None
        a = self.cfg.algorithm
        rewards = torch.cat([g.rewards for g in groups])
        group_ids = torch.cat([torch.full((g.size,), i) for i, g in enumerate(groups)])
        advantages, zero_std = algo.group_advantages(rewards, group_ids, global_std=a.global_std, mean_only=a.mean_only)
        for i, g in enumerate(groups):
            g.advantages = advantages[group_ids == i]
        batch_metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(correction=0).item(),
            "reward/zero_std_frac": algo.zero_std_fraction(rewards, group_ids),
        }
        staleness = torch.tensor([g.staleness(self.version) for g in groups])
        for k in range(self.cfg.algorithm.max_staleness + 2):  # histogram; the last bin is "> eta"
            in_bin = staleness == k if k <= self.cfg.algorithm.max_staleness else staleness > self.cfg.algorithm.max_staleness
            batch_metrics[f"staleness/hist_{k if k <= self.cfg.algorithm.max_staleness else 'over'}"] = int(in_bin.sum())
        for name in groups[0].reward_components:
            batch_metrics[f"reward/{name}"] = torch.cat([g.reward_components[name] for g in groups]).mean().item()
        if a.drop_zero_std:
            kept = [g for i, g in enumerate(groups) if not zero_std[group_ids == i].all()]
            batch_metrics["samples/dropped_zero_std"] = sum(g.size for g in groups) - sum(g.size for g in kept)
            groups = kept
        n = len(self.trainers)
        if len(groups) < n:  # nothing (or too little) to learn from: keep the weights, count it
            return {**batch_metrics, "train/skipped_short_batch": 1.0}
        shards = [groups[i::n] for i in range(n)]
        per_rank = ray.get([tr.train_step.remote(shard, self.version) for tr, shard in zip(self.trainers, shards)], timeout=3600)
        metrics = {**reduce_metrics(per_rank), **batch_metrics}  # batch-wide reward stats, not per-shard means
        self.consumed_samples += sum(g.size for g in groups)
        self.trained_ticket_end = self._collected_end  # batch modes: resume regenerates from here
        self.step += 1
        self.version += 1
        self._count_nonfinite(metrics, updates=self.cfg.trainer.mini_batches * n)
        return metrics

    def _count_nonfinite(self, metrics: dict, updates: int) -> None:
        """Skipped NaN/inf updates are warned about; too many whole steps of them in a row stop the run."""
        try:
            warning = self.nonfinite.update(self.step, int(metrics.get("train/skipped_nonfinite", 0)), updates)
        except Diverged as e:
            last = self.checkpointer.latest_name()
            raise PipelineError(f"{e}; lower trainer.lr (now {self.cfg.trainer.lr:g}) and resume from the last "
                                f"checkpoint ({last or 'none'}) with trainer.resume=latest") from None
        if warning:
            logger.warning(warning)
        metrics["train/nonfinite_steps"] = self.nonfinite.steps

    # -- logging, evaluation, checkpoints --------------------------------------------------------
    def step_metrics(self, train_metrics: dict, extra: dict | None = None) -> dict:
        elapsed = time.perf_counter() - self.start_time
        rollout_stats = ray.get([r.stats.remote() for r in self.rollouts], timeout=60)
        if self.cfg.mode == "fully_async":  # batch modes count skipped groups in collect()
            for i, s in enumerate(rollout_stats):  # each reward failure skips one group
                errors, seen = int(s.get("rewards/errors", 0)), self._reward_errors_seen.get(i, 0)
                self.skipped_groups += errors - seen if errors >= seen else errors  # fewer: the actor restarted
                self._reward_errors_seen[i] = errors
        trainer_idle = ray.get([t.idle_fraction.remote() for t in self.trainers], timeout=60)
        m = {
            "step": self.step,
            "version": self.version,
            "time_s": elapsed,
            **train_metrics,
            "sync/time_s": 0.0,  # this step's weight sync (the driver's extra has it when one ran)
            "sync/bytes": 0,
            **self.sync_totals,
            "perf/samples_per_s": (self.consumed_samples - self._consumed_at_start) / max(elapsed, 1e-9),
            "perf/trainer_idle_frac": sum(trainer_idle) / len(trainer_idle),
            "samples/consumed": self.consumed_samples,
            "rewards/skipped_groups": self.skipped_groups,
            "train/nonfinite_steps": self.nonfinite.steps,
            "rollout/restarts": self.rollout_restarts,
            "rollout/lost_groups": self.lost_groups,
        }
        m.update(reduce_metrics(rollout_stats))
        m["perf/rollout_idle_frac"] = sum(s["perf/rollout_idle_frac"] for s in rollout_stats) / len(rollout_stats)
        m.setdefault("samples/produced", self.produced_samples)
        m.setdefault("samples/dropped_stale", 0)
        m.setdefault("queue/size", 0)
        m.update(extra or {})
        return m

    def evaluate_at_start(self) -> None:
        """The base model's evaluation, logged as step 0 (not repeated on resume)."""
        if self.step == 0 and self.cfg.eval.at_start_and_end:
            self.log.log(0, {"step": 0, "version": self.version, **self.maybe_evaluate(force=True)})

    def maybe_evaluate(self, force: bool = False) -> dict:
        e = self.cfg.eval
        due = (e.every and self.step % e.every == 0) or (force and e.at_start_and_end)
        if not due:
            return {}
        result = self.on_trainers("evaluate", self.step, timeout=3600)
        self.log.log_images(self.step, "eval", result["images"], result["captions"])
        return result["metrics"]

    def maybe_save_samples(self, groups: list[Group]) -> None:
        every = self.cfg.trainer.sample_every
        if every and self.step % every == 0:
            images = torch.cat([g.images for g in groups])[:32]
            captions = [g.prompt for g in groups for _ in range(g.size)][:32]
            self.log.log_images(self.step, "rollout", images, captions)

    def checkpoint_extra(self) -> dict:
        """State a driver adds to every checkpoint (fully_async: the queue's counters)."""
        return {}

    def save_checkpoint(self) -> str:
        """Atomically (see async_flowgrpo/checkpoint.py): state.json + tensors.safetensors + weights/."""
        state = {
            "step": self.step,
            "version": self.version,
            "next_ticket": self.trained_ticket_end,
            "consumed_samples": self.consumed_samples,
            "skipped_groups": self.skipped_groups,
            "nonfinite_steps": self.nonfinite.steps,
            "config": dataclasses.asdict(self.cfg),  # resume compares the new config with it
            "learner": self.on_trainers("state_dict"),
            **self.checkpoint_extra(),
        }
        path = self.checkpointer.save(
            self.step, state, write_extra=lambda tmp: self.on_trainers("save_weights", os.path.join(tmp, "weights"))
        )
        self.saved_step = self.step
        return path

    def resume_if_asked(self) -> dict:
        resume = self.cfg.trainer.resume
        if not resume:
            self.resumed_state = {}
            return {}
        try:
            path, _ = self.checkpointer.find(resume)
            state = checkpoint.load(path)
        except CheckpointError as e:
            raise PipelineError(str(e)) from None
        if "config" in state:  # (legacy state.pt checkpoints have none)
            fixed, changed = checkpoint.config_changes(state["config"], self.cfg)
            if fixed:
                raise PipelineError(f"trainer.resume: {path} cannot continue with a changed {', '.join(fixed)}")
            if changed:
                logger.info("resume: applying changed settings: %s", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        checkpoint.apply_optimizer_settings(state["learner"]["optimizer"], self.cfg)  # the new lr takes effect
        ray.get([t.load_state_dict.remote(state["learner"]) for t in self.trainers], timeout=600)
        self.step, self.version = state["step"], state["version"]
        self.next_ticket = self.trained_ticket_end = state["next_ticket"]
        self.consumed_samples = state["consumed_samples"]
        self.skipped_groups = state.get("skipped_groups", 0)
        self.nonfinite.steps = state.get("nonfinite_steps", 0)
        self.saved_step = self.step
        self.resumed_state = state
        logger.info("resumed from %s at step %d", path, self.step)
        return state

    def checkpoint_due(self) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return bool(every) and self.step % every == 0

    # -- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """A signal saves a checkpoint and becomes `Stopped`; a dead actor ends the run with one clear
        line; always shut down."""
        try:
            if exc_type is not None and issubclass(exc_type, StopRequested):
                # Raised only between steps or while waiting for rollouts: step N holds exactly N updates.
                if not exc.force and self.saved_step != self.step:
                    self.save_checkpoint()
                saved = not exc.force or self.saved_step == self.step
                raise Stopped(exc.signum, self.step, saved) from None
            elif exc_type is not None and issubclass(exc_type, ray.exceptions.RayActorError):
                last = self.checkpointer.latest_name()
                raise PipelineError(
                    f"an actor died at step {self.step} ({str(exc).splitlines()[0][:200]}); "
                    f"last checkpoint: {last or 'none'}; resume with trainer.resume=latest"
                ) from None
            elif exc_type is not None and issubclass(exc_type, ray.exceptions.RayTaskError):
                # An actor raised (e.g. too many consecutive reward failures): keep the good state.
                path = self.save_checkpoint()
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise PipelineError(f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]} (checkpoint: {path})") from None
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        for actor in self.rollouts + self.trainers + self.reward_actors:
            ray.kill(actor)
        remove_placement_group(self.placement)
        if self.log is not None:
            self.log.close()
        self.stop.uninstall()
