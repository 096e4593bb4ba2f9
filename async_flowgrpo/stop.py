"""Graceful stop on SIGTERM / SIGINT / SIGHUP (what a scheduler, `ray job stop`, Ctrl-C and a closed
terminal send; a run started under `nohup` keeps ignoring SIGHUP).

The first signal asks the driver to stop at the next safe point: between two trainer steps, or at
once while it waits for work whose result the checkpoint does not need (rollouts: a batch being
generated is regenerated after resume; an evaluation: abandoned, see `Run.evaluate`). It never
interrupts a trainer update or a checkpoint: an update interrupted half-way would go on in the
trainer actor and a checkpoint labelled step N would hold N+1 updates. An update in flight
finishes (one step's work), then the driver saves a checkpoint, prints one line and exits
128 + signal (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP).

The grace period (`trainer.stop_grace_s`, a scheduler's wait between SIGTERM and SIGKILL): when the
update and the save have not finished `SHUTDOWN_RESERVE_S` before it ends, the driver gives them up
and leaves as a second signal does, naming the last complete checkpoint; the reserve is what
shutting the actors and Ray down takes. So that this loses at most the update in flight, a signal
during an update saves the step before it at once, from the trainer's state staged in host memory
(`Run.save_staged_checkpoint`), without waiting for the update.

A second signal abandons at once, without a checkpoint: the previous one stays the latest. Once
the driver is closing (actors and Ray being shut down) signals are noted and nothing more: leaving
then would leave Ray's processes behind.

A signal sent to every process of the run (SLURM, systemd) stops the trainers and Ray's own
processes with the driver: nothing of the current step can be saved then, so the driver leaves at
once (`ray_lost`), naming the last checkpoint, rather than wait on a Ray that is gone. Only a death
says so (a dead trainer, GCS or raylet, a dead actor's error): a call that merely ran past its
timeout (a loaded machine) is a slow cluster; the stop's save is tried again within the grace
period, and where it cannot be written the line says the actors did not answer in time
(`Stopped.why_unsaved`), never that Ray died.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal or SSH session closed
SHUTDOWN_RESERVE_S = 8.0  # of the grace period, kept for shutting the actors and Ray down (took about 4 s on 2 busy cores)


class StopRequested(KeyboardInterrupt):
    """Raised on the driver's main thread to leave the loop. A KeyboardInterrupt, so that no `except
    Exception` on the way swallows it and so that a ray.get gives way to it at once (Ray's wait
    checks for signals and stops on a KeyboardInterrupt, raising one of its own in its place:
    `GracefulStop.as_stop` maps that back; any other exception it would keep until the result came)."""

    def __init__(self, signum: int, force: bool = False):
        super().__init__(f"stop requested by {signal.Signals(signum).name}")
        self.signum, self.force = signum, force


def as_stop(error: BaseException) -> StopRequested | None:
    """The StopRequested that `error` is, or carries: Ray hands an exception raised by a signal
    handler during ray.get back as a SystemError caused by it (twice over when the handler ran in
    the Python code that Ray calls to deserialize a result)."""
    while isinstance(error, SystemError) and error.__cause__ is not None:
        error = error.__cause__
    return error if isinstance(error, StopRequested) else None


class Stopped(Exception):
    """The run stopped on a signal at ``step``; ``saved``: a checkpoint of that step exists;
    ``last``: the newest checkpoint's name (None: there is none: a second signal, or Ray lost,
    before the first); ``ray_lost``: the signal reached the trainers too, so nothing could be saved;
    ``overdue_s``: the grace period (s) that ran out before the checkpoint was written, or None;
    ``why_unsaved``: why it was not written, Ray being up (actors that did not answer in time, an
    actor's error), or None."""

    def __init__(self, signum: int, step: int, saved: bool, last: str | None, ray_lost: bool = False,
                 overdue_s: float | None = None, why_unsaved: str | None = None):
        super().__init__(f"stopped at step {step}")
        self.signum, self.step, self.saved, self.last, self.ray_lost = signum, step, saved, last, ray_lost
        self.overdue_s, self.why_unsaved = overdue_s, why_unsaved
        self.exit_code = 128 + signum

    @property
    def resumable(self) -> bool:
        return self.last is not None


class GracefulStop:
    """Signal handling for the driver. Plain class: `request()` does what a signal does.
    grace_s: the grace period after the first signal (see the module docstring); None: no deadline."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.signum: int | None = None
        self.grace_s = grace_s
        self.overdue = False  # the grace period ran out before the driver was done saving
        self.ray_lost = False  # Ray's processes died under the driver (see lose_ray)
        self.raised: StopRequested | None = None  # the last stop raised by the handler (see as_stop)
        self._give_up_at: float | None = None  # (monotonic) when the grace period's end gives up (see time_left)
        self._abandonable = 0
        self._closing = False
        self._previous: dict[int, object] = {}

    def install(self) -> "GracefulStop":
        """Take over SIGNALS (main thread only; elsewhere, e.g. under a test runner's
        worker thread, signals are left alone). Install before Ray starts: `init_ray` keeps ray.init
        from replacing these handlers."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started under nohup: a hangup is meant to be ignored
                self._previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        if self._closing:
            self.signum = self.signum or signum
            return
        if self.signum is not None or self.ray_lost:
            self.raised = StopRequested(self.signum or signum, force=True)  # asked twice, or nothing left to save
            raise self.raised
        self.signum = signum
        if self.grace_s is not None:
            self._give_up_at = time.monotonic() + max(0.0, self.grace_s - SHUTDOWN_RESERVE_S)
            timer = threading.Timer(max(0.0, self.grace_s - SHUTDOWN_RESERVE_S), self._give_up)
            timer.daemon = True
            timer.start()
        if self._abandonable:
            self.raised = StopRequested(signum)
            raise self.raised

    def as_stop(self, error: BaseException) -> StopRequested | None:
        """`as_stop(error)`, or the stop this raised when `error` is the bare KeyboardInterrupt that
        ray.get raises in its place."""
        if type(error) is KeyboardInterrupt and self.raised is not None:
            return self.raised
        return as_stop(error)

    def _give_up(self) -> None:
        """(Timer thread) The grace period is nearly over and the driver is still saving or waiting for
        an update: it leaves as on a second signal, while there is time to shut Ray down."""
        if self._closing:
            return
        self.overdue = True
        if self._previous:  # the handlers are ours: a real signal wakes the main thread from any wait
            signal.pthread_kill(threading.main_thread().ident, self.signum)
        else:
            _thread.interrupt_main(self.signum)

    def time_left(self) -> float | None:
        """Seconds until the grace period's end gives up what is in progress (>= 0), after a signal;
        None without a deadline (no grace period, or no signal yet)."""
        if self._give_up_at is None:
            return None
        return max(0.0, self._give_up_at - time.monotonic())

    def lose_ray(self) -> None:
        """Ray's processes are gone (called by a watcher thread). After a signal, the driver leaves at
        once, without a checkpoint: a call to a dead Ray would wait 60 s for it, then exit 1. (Without a
        signal, the run's own error handling reports the dead actors.)"""
        self.ray_lost = True
        if self.signum is not None and not self._closing:
            _thread.interrupt_main(self.signum)  # runs the handler on the main thread, as a signal does

    def close(self) -> None:
        """The driver is shutting down: from now on a signal (or the deadline) is noted, never raised."""
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """At a safe point: leave the loop if a stop was asked for."""
        if self.signum is not None:
            raise StopRequested(self.signum)

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """A stretch the driver may leave at once on a signal (it only waits for work that the
        checkpoint does not need: rollouts, an evaluation)."""
        self.check()
        self._abandonable += 1
        try:
            yield
        except (SystemError, KeyboardInterrupt) as e:
            stop = self.as_stop(e)
            if stop is not None and stop is not e:
                raise stop from None
            raise
        finally:
            self._abandonable -= 1


class Diverged(RuntimeError):
    """Every update of too many steps in a row was non-finite."""


class NonFiniteGuard:
    """Counts steps with non-finite (skipped) updates. The trainer skips a NaN/inf update, which
    would poison the weights for good; a run where *every* update is skipped step after step (e.g.
    trainer.lr far too high) only burns GPU time, so after `limit` such steps in a row it stops."""

    def __init__(self, limit: int, steps: int = 0):
        self.limit = limit
        self.steps = steps  # steps with at least one skipped update (checkpointed)
        self.in_a_row = 0  # consecutive steps in which every update was skipped

    def update(self, step: int, skipped: int, updates: int) -> str | None:
        """After a step with `skipped` of `updates` updates skipped: a warning line (or None);
        raises Diverged at the limit."""
        self.in_a_row = self.in_a_row + 1 if skipped >= updates else 0
        if not skipped:
            return None
        self.steps += 1
        if self.in_a_row >= self.limit:
            raise Diverged(f"training diverged: every update of the last {self.in_a_row} steps (to step {step}) was "
                           f"non-finite (trainer.max_nonfinite_steps={self.limit})")
        return (f"step {step}: {skipped} of {updates} updates skipped (non-finite loss or gradient); "
                f"{self.in_a_row} step(s) in a row with nothing trained (limit {self.limit})")
