"""A run: the parts a mode's loop uses, put together, and what every mode does the same way.

    with Run(cfg) as run:             # cluster up, weights published, resumed if asked
        records = ...                 # the mode decides when groups are made (its own file)
        metrics = run.train(records)  # advantages from rewards; trainers fetch the groups by ref
        run.publish_weights()
        run.end_step(metrics, extra)  # samples, evaluation, one metrics row, checkpoint when due

Parts (each with one job): `Cluster` (Ray, placement, actors, restarts), `WeightPublisher`
(trainer -> rollout weights), `BatchRollouts` (batch modes' tickets), `make_batch` (advantages),
`Checkpointer` (atomic checkpoints), `Schedule` (when to evaluate, checkpoint, save samples),
`RunLogger` (outputs and the progress bar). This class holds the run's counters, writes and
restores them, and turns signals and actor deaths into one line for the user.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import ray

from async_flowgrpo import checkpoint
from async_flowgrpo.actors.rollout import WeightsNotReceived
from async_flowgrpo.checkpoint import Checkpointer, CheckpointError
from async_flowgrpo.config import Config
from async_flowgrpo.driver.batch import Batch, make_batch
from async_flowgrpo.driver.cluster import Cluster, RunError, local_ray_lost
from async_flowgrpo.driver.weights import WeightPublisher
from async_flowgrpo.metrics import RunLogger, reduce_metrics
from async_flowgrpo.stop import Diverged, GracefulStop, NonFiniteGuard, Stopped, StopRequested
from async_flowgrpo.types import Group, GroupRecord

logger = logging.getLogger(__name__)


# Errors that mean a process of Ray died (after a signal: the signal reached it too), as opposed to a
# call that was slow (GetTimeoutError) or an actor's own error (RayTaskError).
RAY_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.RaySystemError, ray.exceptions.ObjectLostError,
              ray.exceptions.WorkerCrashedError, ray.exceptions.LocalRayletDiedError, ray.exceptions.NodeDiedError,
              ray.exceptions.RpcError, ray.exceptions.OutOfMemoryError)


def checkpointer(cfg: Config) -> Checkpointer:
    return Checkpointer(os.path.join(cfg.trainer.output_dir, "checkpoints"), keep=cfg.trainer.keep_checkpoints)


@dataclass
class Schedule:
    """When a step is followed by an evaluation, a checkpoint or a saved sample grid."""

    total_steps: int
    eval_every: int
    eval_at_start_and_end: bool
    checkpoint_every: int
    sample_every: int

    @classmethod
    def of(cls, cfg: Config) -> "Schedule":
        t, e = cfg.trainer, cfg.eval
        return cls(t.total_steps, e.every, e.at_start_and_end, t.checkpoint_every, t.sample_every)

    def last(self, step: int) -> bool:
        return step >= self.total_steps

    def evaluate(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0) or (self.last(step) and self.eval_at_start_and_end)

    def checkpoint(self, step: int) -> bool:
        return bool(self.checkpoint_every and step % self.checkpoint_every == 0) or self.last(step)

    def samples(self, step: int) -> bool:
        return bool(self.sample_every and step % self.sample_every == 0)


def disk_full(error: BaseException) -> OSError | None:
    """The out-of-space OSError behind `error` (raised here or inside an actor), or None."""
    cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else error
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return cause
    return None


def requeued(extra: dict, groups: list[Group]) -> dict:
    """fully_async's checkpoint state (`saved_queue`) with `groups`, taken from the queue for an
    update that did not finish, back at the queue's head and no longer counted as consumed: a
    resumed run trains them first, and produced = consumed + dropped + drained + queued holds."""
    saved = extra["queue"]
    counters = {**saved["queue"], "consumed": saved["queue"]["consumed"] - len(groups),
                "consumed_samples": saved["queue"]["consumed_samples"] - sum(g.size for g in groups)}
    return {**extra, "queue": {**saved, "queue": counters,
                               "queued_groups": [g.to_state() for g in groups] + saved["queued_groups"]}}


class _UpdateEnded(Exception):
    """The update in flight ended during a stop's save from the staged state (see save_staged_checkpoint)."""


@dataclass
class TrainStep:
    """An update sent to the trainers (`calls`: one ref per trainer; none when the batch was too
    short); `records`: every group taken for it (a stop's checkpoint puts them back untrained)."""

    batch: Batch
    calls: list
    records: list[GroupRecord]


@dataclass
class Share:
    """A rollout actor's part of a batch: `tickets`, being generated into `refs` ([records,
    *groups]); or, with `actor` None, `restored` records from a checkpoint, ready to train (None:
    a group whose reward had failed)."""

    actor: int | None
    tickets: list[int]
    refs: list
    restored: list[GroupRecord | None] | None = None


class BatchRollouts:
    """sync and one_step_off: the driver hands out tickets (group indices) round-robin, one batch
    at a time, and gets back each group's record; the groups stay in the object store, owned by
    the driver, so they outlive a rollout actor that dies after making them.

    At a stop, the finished groups of the batch in flight go into the checkpoint (`in_flight_state`)
    and its unfinished tickets are noted: the resumed run's first batch is those groups plus the
    regenerated tickets (same prompts and seeds), so a stop loses no finished rollout."""

    def __init__(self, cluster: Cluster, weights: WeightPublisher, run: "Run", saved: dict | None = None):
        self.cluster, self.weights, self.run = cluster, weights, run
        self.next_ticket = run.trained_ticket_end  # resume regenerates from the first untrained ticket
        self._started: deque[tuple[int, list[Share]]] = deque()  # (end ticket, shares) of each batch not yet collected
        self._saved = saved  # the batch in flight at a stop, from the checkpoint
        self.last_skipped = 0  # groups of the last collected batch whose reward failed
        if saved:
            self.next_ticket = saved["end"]

    def start(self, num_groups: int) -> list[Share]:
        if self._saved:
            return self._restart_saved()
        tickets = list(range(self.next_ticket, self.next_ticket + num_groups))
        self.next_ticket += num_groups
        return self._start(self.next_ticket, tickets, [])

    def _start(self, end: int, tickets: list[int], shares: list[Share]) -> list[Share]:
        rollouts = self.cluster.rollouts
        for i in range(len(rollouts)):
            share = tickets[i :: len(rollouts)]  # round-robin
            if share:
                shares.append(Share(i, share, self._generate(i, share)))
        self._started.append((end, shares))
        return shares

    def _restart_saved(self) -> list[Share]:
        saved, self._saved = self._saved, None
        groups = [Group.from_state(g) for g in saved["groups"]]
        records = [GroupRecord.of(g, ray.put(g)) for g in groups] + [None] * saved["skipped"]
        return self._start(saved["end"], list(saved["tickets"]), [Share(None, [], [], restored=records)])

    def _generate(self, index: int, tickets: list[int]) -> list:
        return self.cluster.rollouts[index].generate.options(num_returns=len(tickets) + 1).remote(tickets)

    def collect(self, pending: list[Share]) -> list[GroupRecord]:
        """Wait for a batch's records; a share lost with a dead rollout actor is regenerated after
        its restart. Groups whose reward failed are counted in rewards/skipped_groups."""
        run, timeout = self.run, self.run.cfg.ray.work_timeout_s
        records = []
        with run.stop.abandonable():  # only waiting: a batch left half-made is regenerated on resume
            for share in pending:
                if share.restored is not None:
                    records.extend(share.restored)
                    continue
                i, tickets, refs = share.actor, share.tickets, share.refs
                try:
                    got = ray.get(refs[0], timeout=timeout)
                except (ray.exceptions.RayActorError, WeightsNotReceived) as e:
                    # died while generating, or restarted since the last publication (killed while idle)
                    self.weights.recover(i, e, run.version)
                    share.refs = refs = self._generate(i, tickets)
                    got = ray.get(refs[0], timeout=timeout)
                for record, ref in zip(got, refs[1:]):
                    if record is not None:
                        record.ref = ref
                    records.append(record)
        run.collected_ticket_end, _ = self._started.popleft()
        kept = [r for r in records if r is not None]
        self.last_skipped = len(records) - len(kept)
        run.skipped_groups += self.last_skipped
        run.produced_samples += sum(r.size for r in kept)
        return kept

    def in_flight_state(self) -> dict:
        """The oldest batch started and not collected, without waiting for it: its finished groups
        (whole trajectories: the one time they pass through the driver), the number whose reward
        failed, and the tickets still being generated. {} when no batch is in flight."""
        if not self._started:
            return {}
        end, shares = self._started[0]
        groups, skipped, tickets = [], 0, []
        for share in shares:
            if share.restored is not None:  # restored and not trained yet: saved again
                got, refs = share.restored, [r.ref if r is not None else None for r in share.restored]
            elif ray.wait(share.refs[:1], timeout=0)[0]:
                try:
                    got, refs = ray.get(share.refs[0], timeout=self.run.cfg.ray.call_timeout_s), share.refs[1:]
                except (ray.exceptions.RayActorError, WeightsNotReceived):
                    tickets += share.tickets
                    continue
            else:
                tickets += share.tickets
                continue
            for record, ref in zip(got, refs):
                if record is None:
                    skipped += 1
                else:
                    groups.append(ray.get(ref, timeout=self.run.cfg.ray.call_timeout_s).to_state())
        return {"end": end, "groups": groups, "skipped": skipped, "tickets": sorted(tickets)}


class Run:
    """Start with `with Run(cfg) as run:`; see the module docstring. `actor_classes`: passed to
    `Cluster` (stand-in actors for benchmarks). `start_early`: called once Ray is up, before the
    actors load their models; its result is `started_early` (fully_async's queue actor), ended with
    the run's other actors."""

    def __init__(self, cfg: Config, actor_classes: dict | None = None,
                 start_early: Callable[[], ray.actor.ActorHandle] | None = None):
        self.cfg = cfg
        self.started_early: ray.actor.ActorHandle | None = None
        self.schedule = Schedule.of(cfg)
        self.checkpointer = checkpointer(cfg)
        # Before Ray starts (init_ray keeps these handlers): a signal during start-up is ours, not
        # Ray's (which exits 15 with no message). Undone by shutdown().
        self.stop = GracefulStop(cfg.trainer.stop_grace_s).install()
        self.log: RunLogger | None = None
        self.cluster: Cluster | None = None
        try:
            self.cluster = Cluster(cfg, **(actor_classes or {}), stop=self.stop)
            threading.Thread(target=self._watch_ray, name="ray-watch", daemon=True).start()
            # once Ray is up, before the actors load their models (fully_async's queue actor starts here)
            self.started_early = start_early() if start_early else None
            with self.stop.abandonable():  # a signal during start-up: nothing to save yet
                self._start()
        except BaseException as e:
            self.shutdown()  # no half-started actors left behind
            if isinstance(e, ray.exceptions.GetTimeoutError):  # loading a checkpoint, the first weight push
                raise RunError(f"the actors did not answer in time during start-up (ray.work_timeout_s="
                               f"{cfg.ray.work_timeout_s:g} s, ray.call_timeout_s={cfg.ray.call_timeout_s:g} s, "
                               f"sync.timeout_s={cfg.sync.timeout_s:g} s); nothing was trained by this run") from None
            raise

    def _start(self) -> None:
        cfg = self.cfg
        self.cluster.start()
        self.weights = WeightPublisher(self.cluster, cfg)
        # counters, all checkpointed
        self.step = 0  # trainer steps done
        self.version = 0  # published weight version (= updates made)
        self.trained_ticket_end = 0  # batch modes: groups before this ticket are trained
        self.collected_ticket_end = 0
        self.consumed_samples = 0
        self.produced_samples = 0  # batch modes (fully_async: the queue counts)
        self.skipped_groups = 0
        self.lost_groups = 0  # groups in flight on a rollout actor when it died (fully_async: regenerated)
        self.lost_samples = 0  # queued samples whose rollout actor died before they were trained (fully_async)
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self._reward_errors_seen: dict[int, int] = {}  # fully_async: per rollout actor, to count skipped groups
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote
        self.checkpoint_extra = lambda: {}  # a mode adds its own state (fully_async: the queue's counters)
        # a stop's checkpoint written during an update: a mode first gives back what it took for the
        # next update (fully_async: a prefetched batch, back to the queue)
        self.before_staged_save: Callable[[], None] = lambda: None
        self._on_exit: list[Callable[[], None]] = []
        self.log = RunLogger(cfg.trainer.output_dir, cfg, total_steps=cfg.trainer.total_steps, progress=cfg.logging.progress)
        self.resumed_state = self._resume_if_asked()
        self.publish_weights()  # rollout actors start from exactly the trainer's weights
        self.batches = BatchRollouts(self.cluster, self.weights, self, self.resumed_state.get("batch_in_flight"))
        self.start_time = time.perf_counter()
        self._consumed_at_start = self.consumed_samples  # throughput counts this process's work only

    @property
    def rollouts(self) -> list:
        return self.cluster.rollouts

    @property
    def trainers(self) -> list:
        return self.cluster.trainers

    def publish_weights(self) -> dict:
        return self.weights.publish(self.version)

    def recover_rollout(self, index: int, error: Exception) -> None:
        self.weights.recover(index, error, self.version)

    # -- training ------------------------------------------------------------------------------
    def train(self, records: list[GroupRecord]) -> dict[str, float] | None:
        """One data-parallel update on the batch (version + 1). Returns the step's metrics, or None
        when every group of the batch was skipped (counted in rewards/skipped_groups)."""
        return self.finish_train(self.start_train(records))

    def start_train(self, records: list[GroupRecord]) -> TrainStep | None:
        """Advantages from the records' rewards; each trainer is sent the refs of its shard and
        starts at once (the groups go from the object store to the trainers, not through here)."""
        if not records:
            return None
        batch = make_batch(records, self.version, self.cfg.algorithm)
        sp = self.cfg.trainer.sequence_parallel  # the sp consecutive trainers of a sequence group share a shard
        n = len(self.trainers) // sp
        if len(batch.records) < n:  # nothing (or too little) to learn from: keep the weights, count it
            return TrainStep(batch, [], records)
        shards = [shard for shard in batch.shards(n) for _ in range(sp)]
        calls = [trainer.train_step.remote([([r.ref], adv) for r, adv in shard], self.version)
                 for trainer, shard in zip(self.trainers, shards)]
        return TrainStep(batch, calls, records)

    def finish_train(self, step: TrainStep | None) -> dict[str, float] | None:
        """Wait for a started update and count it."""
        if step is None:
            return None
        if not step.calls:
            return {**step.batch.metrics, "train/skipped_short_batch": 1.0}
        # a sequence group's ranks return the same metrics of the same shard: one of each counts
        per_rank = self._wait_update(step)[:: self.cfg.trainer.sequence_parallel]
        metrics = {**reduce_metrics(per_rank), **step.batch.metrics}  # batch-wide reward stats, not per-shard means
        lost = int(metrics.pop("samples/lost", 0))  # fully_async: queued groups die with their rollout actor
        self.lost_samples += lost
        self.consumed_samples += step.batch.samples - lost
        self.trained_ticket_end = self.collected_ticket_end  # batch modes: resume regenerates from here
        self.step += 1
        self.version += 1
        self._count_nonfinite(metrics, updates=self.cfg.trainer.mini_batches * len(per_rank))
        return metrics

    def _wait_update(self, step: TrainStep) -> list[dict]:
        """The trainers' results. A stop meanwhile saves the step before the update at once, from
        the trainers' staged state (`save_staged_checkpoint`), since the update may outlast
        trainer.stop_grace_s; the update is still waited for, and counted and saved if it ends in time."""
        deadline = time.monotonic() + self.cfg.ray.work_timeout_s
        while not self.stop.requested:
            left = deadline - time.monotonic()
            done, _ = ray.wait(step.calls, num_returns=len(step.calls), timeout=max(0.0, min(0.5, left)))
            if len(done) == len(step.calls) or left <= 0:
                break
        else:
            self.save_staged_checkpoint(step)
        return ray.get(step.calls, timeout=max(1.0, deadline - time.monotonic()))

    def _count_nonfinite(self, metrics: dict, updates: int) -> None:
        """Skipped NaN/inf updates are warned about; too many whole steps of them in a row stop the run."""
        try:
            warning = self.nonfinite.update(self.step, int(metrics.get("train/skipped_nonfinite", 0)), updates)
        except Diverged as e:
            last = self.checkpointer.latest_name()
            raise RunError(f"{e}; lower trainer.lr (now {self.cfg.trainer.lr:g}) and resume from the last "
                           f"checkpoint ({last or 'none'}) with trainer.resume=latest") from None
        if warning:
            logger.warning(warning)
        metrics["train/nonfinite_steps"] = self.nonfinite.steps

    # -- after each step -----------------------------------------------------------------------
    def needs_trainers_after(self, step: int) -> bool:
        """Whether step `step`'s end uses the trainers' weights (evaluation, checkpoint): then the
        next update must not be started before it."""
        return self.schedule.evaluate(step) or self.schedule.checkpoint(step)

    def end_step(self, train_metrics: dict, extra: dict | None = None) -> None:
        """Save samples, evaluate, write the step's metrics row, checkpoint: each when scheduled. A
        stop abandons the evaluation; the step's row is still written (without it), then the stop's
        checkpoint, of this step, takes the periodic one's place."""
        if self.schedule.samples(self.step):
            images = ray.get(self.trainers[0].sample_images.remote(), timeout=self.cfg.ray.call_timeout_s)
            if images is not None:
                self.log.log_images(self.step, "rollout", *images)
        eval_metrics, cut = {}, None
        if self.schedule.evaluate(self.step):
            try:
                eval_metrics = self.evaluate()
            except StopRequested as e:
                cut = e
        if cut is None or not self.stop.ray_lost:  # (with Ray gone, its counters cannot be read)
            self.log.log(self.step, self.step_metrics(train_metrics, {**(extra or {}), **eval_metrics}))
        if cut is not None:
            raise cut
        if self.schedule.checkpoint(self.step):
            self.save_checkpoint()

    def evaluate(self) -> dict:
        """The trainers' evaluation of the current weights. A signal abandons it at once: the
        checkpoint does not need it, and it can take minutes (many prompts, a model reward), longer
        than a scheduler waits after SIGTERM. The trainers are told to drop it, so the checkpoint,
        queued behind it on trainer rank 0, is written next."""
        e = self.cfg.eval
        logger.info("step %d: evaluating (%s, %d samples a prompt)", self.step, e.prompts, e.samples_per_prompt)
        try:
            with self.stop.abandonable():
                result = self.cluster.on_trainers("evaluate", self.step)
        except StopRequested as e:
            if not self.stop.ray_lost:
                self.cluster.stop_evaluating()
            logger.warning("step %d: evaluation abandoned for the stop (%s); not logged", self.step,
                           signal.Signals(e.signum).name)
            raise
        self.log.log_images(self.step, "eval", result["images"], result["captions"], nrow=result.get("nrow"))
        return result["metrics"]

    def evaluate_at_start(self) -> None:
        """The base model's evaluation, logged as step 0 (not repeated on resume)."""
        if self.step == 0 and self.schedule.eval_at_start_and_end:
            self.log.log(0, {"step": 0, "version": self.version, **self.evaluate()})

    def step_metrics(self, train_metrics: dict, extra: dict | None = None) -> dict:
        elapsed = time.perf_counter() - self.start_time
        rollout_stats = self.cluster.rollout_stats()
        if self.cfg.mode == "fully_async":  # batch modes count skipped groups in collect()
            for i, s in enumerate(rollout_stats):  # each reward failure skips one group
                errors, seen = int(s.get("rewards/errors", 0)), self._reward_errors_seen.get(i, 0)
                self.skipped_groups += errors - seen if errors >= seen else errors  # fewer: the actor restarted
                self._reward_errors_seen[i] = errors
        m = {
            "step": self.step,
            "version": self.version,
            "time_s": elapsed,
            **train_metrics,
            "sync/time_s": 0.0,  # this step's weight sync (the mode's extra has it when one ran)
            "sync/bytes": 0,
            **self.weights.totals(),
            "perf/samples_per_s": (self.consumed_samples - self._consumed_at_start) / max(elapsed, 1e-9),
            "perf/trainer_idle_frac": self.cluster.trainer_idle(),
            "samples/consumed": self.consumed_samples,
            "rewards/skipped_groups": self.skipped_groups,
            "train/nonfinite_steps": self.nonfinite.steps,
            "rollout/restarts": self.cluster.restarts,
            "cluster/nodes": self.cluster.nodes,
            "rollout/lost_groups": self.lost_groups,
            "samples/lost": self.lost_samples,
        }
        m.update(reduce_metrics(rollout_stats))
        m["perf/rollout_idle_frac"] = sum(s["perf/rollout_idle_frac"] for s in rollout_stats) / len(rollout_stats)
        m.setdefault("samples/produced", self.produced_samples)
        m.setdefault("samples/dropped_stale", 0)
        m.setdefault("queue/size", 0)
        m.update(extra or {})
        return m

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, at_stop: bool = False) -> str:
        """Atomically (see async_flowgrpo/checkpoint.py): state.json + tensors.safetensors + weights/.
        at_stop: with the finished groups of the batch in flight (batch modes), which a resumed run
        trains first."""
        in_flight = self.batches.in_flight_state() if at_stop else {}
        state = self._state(self.cluster.on_trainers("state_dict"), self.checkpoint_extra(), in_flight)
        return self._write(state, lambda tmp: self.cluster.on_trainers("save_weights", os.path.join(tmp, "weights")))

    def save_staged_checkpoint(self, step: TrainStep) -> str | None:
        """A stop during an update: checkpoint the step before it now, from the trainers' state staged
        in host memory after that step, without waiting for the update. Its groups go back in
        untrained: fully_async's at the queue's head, batch modes' as the batch a resumed run trains
        first (one_step_off's next batch, being generated, is regenerated). None, and nothing
        written, where no state is staged (sharded weights) or the update has just ended."""
        timeout, trainer = self.cfg.ray.call_timeout_s, self.trainers[0]
        staged = ray.get(trainer.staged_state.remote(), timeout=timeout)
        if staged is None or staged[0] != self.version:
            return None
        try:
            groups = ray.get([r.ref for r in step.records], timeout=timeout)
        except ray.exceptions.ObjectLostError:  # died with its rollout actor: the regular save accounts for it
            return None
        self.before_staged_save()
        extra, in_flight = self.checkpoint_extra(), {}
        counts = {"produced_samples": self.produced_samples, "skipped_groups": self.skipped_groups}
        if "queue" in extra:  # fully_async
            extra = requeued(extra, groups)
        else:  # counted again when the resumed run collects them
            skipped = self.batches.last_skipped
            in_flight = {"end": self.collected_ticket_end, "groups": [g.to_state() for g in groups],
                         "skipped": skipped, "tickets": []}
            counts = {"produced_samples": self.produced_samples - sum(g.size for g in groups),
                      "skipped_groups": self.skipped_groups - skipped}
        state = {**self._state(staged[1], extra, in_flight), **counts}

        def write_weights(tmp: str) -> None:
            saved = trainer.save_staged_weights.remote(os.path.join(tmp, "weights"), self.version)
            if not ray.get(saved, timeout=self.cfg.ray.work_timeout_s):
                raise _UpdateEnded

        try:
            path = self._write(state, write_weights)
        except _UpdateEnded:  # (the checkpointer removes its partial directory)
            logger.info("step %d: update %d ended during the stop's save of step %d from the staged state; "
                        "that save is left to the regular checkpoint", self.step, self.step + 1, self.step)
            return None
        logger.info("step %d: a stop during update %d: step %d saved from the trainer's staged state (%s); the update "
                    "goes on within trainer.stop_grace_s", self.step, self.step + 1, self.step, path)
        return path

    def _state(self, learner: dict, extra: dict, in_flight: dict) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "next_ticket": self.trained_ticket_end,
            "consumed_samples": self.consumed_samples,
            "produced_samples": self.produced_samples,
            "lost_samples": self.lost_samples,
            "lost_groups": self.lost_groups,
            "skipped_groups": self.skipped_groups,
            "nonfinite_steps": self.nonfinite.steps,
            "config": dataclasses.asdict(self.cfg),  # resume compares the new config with it
            "learner": learner,
            **extra,
            **({"batch_in_flight": in_flight} if in_flight else {}),
        }

    def _write(self, state: dict, write_weights: Callable[[str], None]) -> str:
        try:
            path = self.checkpointer.save(self.step, state, write_extra=write_weights)
        except (OSError, ray.exceptions.RayTaskError) as e:
            full = disk_full(e)  # in the driver, or in a trainer writing the weights
            if full is None:
                raise
            last = self.checkpointer.latest_name()
            raise RunError(
                f"disk full: checkpoint step {self.step} could not be written to {self.checkpointer.root} "
                f"({full.strerror}); the previous checkpoint ({last or 'none'}) is intact: free space, then "
                f"resume with trainer.resume=latest"
            ) from None
        self.saved_step = self.step
        return path

    def _resume_if_asked(self) -> dict:
        resume = self.cfg.trainer.resume
        if not resume:
            return {}
        try:
            path, _ = self.checkpointer.find(resume)
            if path is None:  # trainer.resume=auto with no checkpoint yet: a fresh start
                return {}
            state = checkpoint.load(path)
        except CheckpointError as e:
            raise RunError(str(e)) from None
        if "config" in state:  # (legacy state.pt checkpoints have none)
            fixed, changed = checkpoint.config_changes(state["config"], self.cfg)
            if fixed:
                raise RunError(f"trainer.resume: {path} cannot continue with a changed {', '.join(fixed)}")
            if changed:
                logger.info("resume: applying changed settings: %s", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        checkpoint.apply_optimizer_settings(state["learner"]["optimizer"], self.cfg)  # the new lr takes effect
        ray.get([t.load_state_dict.remote(state["learner"], state["version"]) for t in self.trainers],
                timeout=self.cfg.ray.work_timeout_s)
        self.step, self.version = state["step"], state["version"]
        self.trained_ticket_end = self.collected_ticket_end = state["next_ticket"]
        self.consumed_samples = state["consumed_samples"]
        self.produced_samples = state.get("produced_samples", self.consumed_samples)
        self.lost_samples, self.lost_groups = state.get("lost_samples", 0), state.get("lost_groups", 0)
        self.skipped_groups = state.get("skipped_groups", 0)
        self.nonfinite.steps = state.get("nonfinite_steps", 0)
        self.saved_step = self.step
        logger.info("resumed from %s at step %d", path, self.step)
        return state

    # -- lifetime ------------------------------------------------------------------------------
    def _watch_ray(self) -> None:
        """Tell the stop handling when a Ray this process started dies under it: a signal sent to every
        process of the run (SLURM, systemd) stops the trainers, the GCS and the raylet with the driver."""
        while not self.stop.closing:
            gcs_or_raylet = local_ray_lost()
            if gcs_or_raylet or (self.stop.requested and self.cluster.trainers_gone()):
                if self.stop.requested:  # (before a signal, the run's own error handling reports it)
                    logger.warning("step %d: after the signal, %s has exited: Ray's processes taken for gone",
                                   getattr(self, "step", 0), "the GCS or the raylet" if gcs_or_raylet else "a trainer's process")
                self.stop.lose_ray()
                return
            time.sleep(0.5)

    def on_exit(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Register `fn` to run when the run ends, however it ends: after the last checkpoint (a
        stop's too), before the actors are shut down. Usable as a decorator."""
        self._on_exit.append(fn)
        return fn

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """A signal saves a checkpoint and becomes `Stopped`; a dead actor ends the run with one clear
        line; always shut down."""
        stop = self.stop.as_stop(exc) if exc is not None else None
        why_unsaved = None  # Ray up, the stop's checkpoint not written: why (actors that did not answer in time...)
        if stop is None and self.stop.requested and isinstance(exc, ray.exceptions.RayError):
            # A call failed after a signal. Its step's update may still be running in the trainers (a
            # checkpoint now would label it wrongly): nothing is saved. Either the signal reached Ray's
            # processes too (sent to every process of the run), or the call was slow, or an actor raised.
            stop = StopRequested(self.stop.signum, force=True)
            gone = self._ray_gone(exc)
            if gone:
                self._lose_ray(exc, gone)
            else:
                why_unsaved = self._why_not_saved(exc)
        try:
            if stop is not None:
                # Raised only between steps or while waiting for rollouts or an evaluation (a second
                # signal or the grace period's end: anywhere).
                # Saved even when step N already was: the rollouts finished since then go in too.
                if not stop.force:
                    why_unsaved = self._save_at_stop()
                self.stop.close()  # saved or given up: nothing more to interrupt (the deadline included)
                if self.stop.overdue and (stop.force or self.saved_step != self.step):
                    logger.warning("step %d: trainer.stop_grace_s=%g nearly over: the update or save in progress is "
                                   "given up (the last checkpoint holds the weights before it)", self.step,
                                   self.cfg.trainer.stop_grace_s)
                last = self.checkpointer.latest_name()
                raise Stopped(stop.signum, self.step, saved=self.saved_step == self.step,
                              last=os.path.join(self.checkpointer.root, last) if last else None,
                              ray_lost=self.stop.ray_lost,
                              overdue_s=self.cfg.trainer.stop_grace_s if self.stop.overdue else None,
                              why_unsaved=why_unsaved) from None
            elif exc_type is not None and issubclass(exc_type, ray.exceptions.RayActorError):
                last = self.checkpointer.latest_name()
                raise RunError(
                    f"an actor died at step {self.step} ({str(exc).splitlines()[0][:200]}); "
                    f"last checkpoint: {last or 'none'}; resume with trainer.resume=latest"
                ) from None
            elif exc_type is not None and issubclass(exc_type, ray.exceptions.GetTimeoutError):
                # A hung actor (a deadlocked collective, a reward that never returns) or work longer
                # than its bound: whatever it holds is not saved, the last checkpoint resumes.
                r, last = self.cfg.ray, self.checkpointer.latest_name()
                raise RunError(
                    f"the actors did not answer in time at step {self.step} (a hung actor, or work longer than "
                    f"ray.work_timeout_s={r.work_timeout_s:g} s or a call longer than ray.call_timeout_s={r.call_timeout_s:g} s); "
                    f"last checkpoint: {last or 'none'}; resume with trainer.resume=latest"
                ) from None
            elif exc_type is not None and issubclass(exc_type, ray.exceptions.RayTaskError):
                # An actor raised (e.g. too many consecutive reward failures): keep the good state.
                path = self.save_checkpoint()
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise RunError(f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]} (checkpoint: {path})") from None
        finally:
            self.stop.close()
            # (skipped when they would wait on dead actors, or on actors that did not answer in time)
            for fn in self._on_exit if not (self.stop.ray_lost or why_unsaved) else ():
                try:
                    fn()
                except Exception as e:  # the actors are shut down next anyway; keep the run's own error
                    logger.warning("while ending the run: %s: %s", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            self.shutdown()

    def _save_at_stop(self) -> str | None:
        """The stop's checkpoint. Returns None when it is written, or given up for good reason (asked
        again, the grace period's end, Ray gone with the signal: the previous checkpoint stays the
        latest); else why it was not written, Ray being up. A call that ran past its timeout (a slow
        cluster, not a dead one) is tried again while trainer.stop_grace_s lasts."""
        pause = 0.0
        while True:
            try:
                time.sleep(pause)
                self.save_checkpoint(at_stop=True)
                return None
            except BaseException as e:
                if self.stop.as_stop(e) is not None:  # asked again while saving, or out of time
                    return None
                if not isinstance(e, ray.exceptions.RayError):
                    raise
                gone = self._ray_gone(e)
                if gone:  # the trainers went with the signal
                    self._lose_ray(e, gone)
                    return None
                left = self.stop.time_left()
                if not isinstance(e, ray.exceptions.GetTimeoutError) or not left:
                    return self._why_not_saved(e)
                logger.warning("step %d: the stop's checkpoint: a call to the actors ran past its timeout; trying "
                               "again (%.0f s left of trainer.stop_grace_s)", self.step, left)
                pause = min(0.5, left)

    def _ray_gone(self, error: BaseException) -> str | None:
        """Whether `error`, raised by a call after a signal, means Ray's processes died (the signal was
        sent to every process of the run): what says so (a trainer, the GCS or the raylet of a Ray
        started here has exited, or the error is a death: an actor, a worker, a node, an object's
        owner), or None. A call past its timeout is not: the cluster is slow (a loaded machine)."""
        if self.stop.ray_lost:
            return "seen by the watcher"
        if local_ray_lost():
            return "the GCS or the raylet has exited"
        if self.cluster is not None and self.cluster.trainers_gone():
            return "a trainer's process has exited"
        cause = getattr(error, "cause", None)  # an actor's task that raised: what it raised
        if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, (SystemExit, KeyboardInterrupt)):
            return f"an actor's task ended by {type(cause).__name__}"  # the signal reached the actor during the task
        if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, ray.exceptions.RayError):
            error = cause  # (an actor waiting on another that died)
        if isinstance(error, (ray.exceptions.GetTimeoutError, ray.exceptions.ObjectFetchTimedOutError)):
            return None
        return type(error).__name__ if isinstance(error, RAY_DEATHS) else None

    def _lose_ray(self, error: BaseException, gone: str) -> None:
        """After a signal, `error` showed Ray's processes gone: say what (the stop line says only that
        the signal stopped them too), then leave without waiting on them."""
        text = str(error).splitlines()[0][:200] if str(error) else ""
        logger.warning("step %d: after the signal, %s%s: Ray's processes taken for gone (%s)", self.step,
                       type(error).__name__, f" ({text})" if text else "", gone)
        self.stop.ray_lost = True

    def _why_not_saved(self, error: BaseException) -> str:
        """The stop line's words for a call that failed after a signal, Ray being up."""
        if isinstance(error, (ray.exceptions.GetTimeoutError, ray.exceptions.ObjectFetchTimedOutError)):
            r = self.cfg.ray
            return (f"the actors did not answer in time after the signal: a call longer than ray.call_timeout_s="
                    f"{r.call_timeout_s:g} s or work longer than ray.work_timeout_s={r.work_timeout_s:g} s")
        cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
        cause = cause if cause is not None else error
        text = str(cause).splitlines()[0][:200] if str(cause) else ""
        return f"an actor failed after the signal: {type(cause).__name__}{': ' + text if text else ''}"

    def shutdown(self) -> None:
        self.stop.close()  # a signal now would leave actors behind
        if self.cluster is not None:
            # the queue actor too: in a process that goes on (a notebook, a test) it would outlive the run
            self.cluster.shutdown(ray_lost=self.stop.ray_lost, more_actors=(self.started_early,) if self.started_early is not None else ())
        if self.log is not None:
            self.log.close()
        self.stop.uninstall()
