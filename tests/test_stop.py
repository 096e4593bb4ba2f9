"""GracefulStop without Ray or real signals (request() is what the handler does)."""

import os
import signal

import pytest

from async_flowgrpo.stop import GracefulStop, Stopped, StopRequested


def test_first_signal_only_asks_outside_abandonable_stretches():
    stop = GracefulStop()
    stop.request(signal.SIGTERM)  # e.g. during a trainer update: nothing raised there
    assert stop.requested
    with pytest.raises(StopRequested) as err:
        stop.check()  # the next safe point leaves
    assert err.value.signum == signal.SIGTERM and not err.value.force


def test_a_signal_while_waiting_for_rollouts_leaves_at_once():
    stop = GracefulStop()
    with pytest.raises(StopRequested):
        with stop.abandonable():
            stop.request(signal.SIGINT)
            pytest.fail("not reached")


def test_a_stop_that_ray_wrapped_while_waiting_comes_out_as_the_stop():
    """A handler's exception raised inside ray.get reaches the caller as SystemError from it."""
    stop = GracefulStop()
    with pytest.raises(StopRequested):
        with stop.abandonable():
            try:
                stop.request(signal.SIGTERM)
            except StopRequested as e:
                raise SystemError("interrupted") from e
    with pytest.raises(StopRequested):  # raised while Ray deserializes a result: wrapped twice
        with stop.abandonable():
            try:
                try:
                    stop.check()
                except StopRequested as e:
                    raise SystemError("<class StopRequested> returned a result with an exception set") from e
            except SystemError as e:
                raise SystemError("<built-in method __new__> returned a result with an exception set") from e
    fresh = GracefulStop()
    with pytest.raises(StopRequested) as err:  # ray.get gives way to it, raising a KeyboardInterrupt of its own
        with fresh.abandonable():
            try:
                fresh.request(signal.SIGTERM)
            except KeyboardInterrupt:
                raise KeyboardInterrupt() from None
    assert err.value is fresh.raised and err.value.signum == signal.SIGTERM
    with pytest.raises(SystemError):  # any other SystemError is left alone
        with GracefulStop().abandonable():
            raise SystemError("something else")


def test_a_second_signal_forces():
    stop = GracefulStop()
    stop.request(signal.SIGINT)
    with pytest.raises(StopRequested) as err:
        stop.request(signal.SIGINT)
    assert err.value.force


def test_once_closing_a_signal_is_noted_and_never_raised():
    """Shutting down (actors, Ray) must finish: a signal then would leave processes behind."""
    stop = GracefulStop()
    stop.request(signal.SIGTERM)
    stop.close()
    stop.request(signal.SIGINT)  # would force (raise) before close()
    assert stop.signum == signal.SIGTERM
    fresh = GracefulStop()
    fresh.close()
    fresh.request(signal.SIGINT)
    assert fresh.signum == signal.SIGINT


def test_exit_codes_follow_the_shell_convention():
    assert Stopped(signal.SIGTERM, 3, True, "step_000003").exit_code == 143
    assert Stopped(signal.SIGINT, 3, True, "step_000003").exit_code == 130
    assert Stopped(signal.SIGHUP, 3, True, "step_000003").exit_code == 129


def test_a_hangup_stops_gracefully_unless_the_run_was_started_under_nohup():
    """SIGHUP (the terminal or SSH session closed) saves and stops as SIGTERM does; started under
    `nohup` (SIGHUP ignored), the run keeps ignoring it."""
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        stop = GracefulStop().install()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.requested and stop.signum == signal.SIGHUP
        finally:
            stop.uninstall()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        stop = GracefulStop().install()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            assert not stop.requested and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        finally:
            stop.uninstall()
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_stop_line_says_how_to_go_on():
    """Resume when there is a checkpoint; start again (overwrite) when a second signal left none."""
    from async_flowgrpo.cli import stop_line

    argv = ["trainer.output_dir=/tmp/x", "trainer.resume=latest"]
    last = "/tmp/x/checkpoints/step_000002"
    assert stop_line(Stopped(signal.SIGTERM, 4, saved=True, last=last), argv).startswith("stopped at step 4; resume with: ")
    previous = stop_line(Stopped(signal.SIGTERM, 4, saved=False, last=last), argv)
    assert "previous checkpoint is the latest" in previous and previous.endswith("trainer.output_dir=/tmp/x trainer.resume=latest")
    none = stop_line(Stopped(signal.SIGINT, 0, saved=False, last=None), argv)
    assert "none to resume" in none and "start again with: " in none
    assert none.endswith("trainer.output_dir=/tmp/x trainer.overwrite=true") and "resume=" not in none
    # the signal reached the trainers too (sent to every process of the run): the line names what resume takes
    lost = stop_line(Stopped(signal.SIGTERM, 5, saved=False, last=last, ray_lost=True), argv)
    assert f"stopped Ray's processes too); the last checkpoint is {last}; resume with: " in lost
    lost_none = stop_line(Stopped(signal.SIGTERM, 1, saved=False, last=None, ray_lost=True), argv)
    assert "none to resume" in lost_none and lost_none.endswith("trainer.overwrite=true")


def test_ray_lost_after_a_signal_interrupts_the_main_thread_to_leave_at_once():
    """A watcher thread reports Ray gone; after a signal the main thread leaves wherever it waits
    (a call to a dead Ray would hang); before one, nothing happens (the run's errors report it)."""
    import threading
    import time

    stop = GracefulStop().install()
    try:
        stop.request(signal.SIGTERM)  # noted, as during a trainer update
        with pytest.raises(StopRequested) as err:
            threading.Thread(target=stop.lose_ray).start()
            time.sleep(10)  # stands for a ray.get on a dead actor
        assert err.value.force and stop.ray_lost
    finally:
        stop.uninstall()
    quiet = GracefulStop()
    quiet.lose_ray()
    assert quiet.ray_lost and not quiet.requested
    with pytest.raises(StopRequested) as err:  # a signal now leaves at once: nothing is left to save
        quiet.request(signal.SIGTERM)
    assert err.value.force


def test_install_handles_a_real_signal_and_uninstall_restores():
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread's handler
        assert stop.requested and stop.signum == signal.SIGTERM
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_nonfinite_steps_are_counted_warned_and_stop_the_run_after_k_in_a_row():
    from async_flowgrpo.stop import Diverged, NonFiniteGuard

    guard = NonFiniteGuard(limit=3)
    assert guard.update(1, 0, 2) is None
    assert "1 of 2 updates skipped" in guard.update(2, 1, 2)  # partly skipped: warned, not "in a row"
    assert guard.in_a_row == 0 and guard.steps == 1
    assert "1 step(s) in a row" in guard.update(3, 2, 2)
    assert "2 step(s) in a row" in guard.update(4, 2, 2)
    guard.update(5, 0, 2)  # a good step resets the run of bad ones
    guard.update(6, 2, 2)
    guard.update(7, 2, 2)
    with pytest.raises(Diverged, match=r"last 3 steps \(to step 8\).*max_nonfinite_steps=3"):
        guard.update(8, 2, 2)
    assert guard.steps == 6


def test_the_grace_period_gives_up_a_save_that_runs_late_and_a_closed_stop_never(monkeypatch):
    """trainer.stop_grace_s: SHUTDOWN_RESERVE_S before its end, the main thread leaves wherever it
    waits (a save, an update in flight), as on a second signal; once the driver is closing, never."""
    import time

    from async_flowgrpo import stop as stop_module

    monkeypatch.setattr(stop_module, "SHUTDOWN_RESERVE_S", 9.7)  # grace 10 s: gives up 0.3 s after the signal
    stop = GracefulStop(grace_s=10.0).install()
    try:
        stop.request(signal.SIGTERM)  # noted: the driver goes on to save
        t0 = time.monotonic()
        with pytest.raises(StopRequested) as err:
            time.sleep(10)  # stands for a save (or an update) that would not end in time
        assert err.value.force and stop.overdue and 0.2 < time.monotonic() - t0 < 5
    finally:
        stop.uninstall()
    done = GracefulStop(grace_s=10.0).install()
    try:
        done.request(signal.SIGTERM)
        done.close()  # saved in time: shutting down
        time.sleep(0.6)
        assert not done.overdue
    finally:
        done.uninstall()
    assert not GracefulStop().overdue  # no grace period: no deadline


def test_the_stop_line_after_the_grace_period_ran_out_names_the_last_checkpoint():
    from async_flowgrpo.cli import stop_line

    argv = ["trainer.output_dir=/tmp/x"]
    last = "/tmp/x/checkpoints/step_000002"
    line = stop_line(Stopped(signal.SIGTERM, 4, saved=False, last=last, overdue_s=20.0), argv)
    assert line.startswith("stopped at step 4 without a checkpoint of it (trainer.stop_grace_s=20 ran out before it "
                           f"was written); the last checkpoint is {last}; resume with: ")
    assert line.endswith("trainer.resume=latest")
    none = stop_line(Stopped(signal.SIGTERM, 0, saved=False, last=None, overdue_s=20.0), argv)
    assert "none to resume" in none and none.endswith("trainer.overwrite=true")
    # the stop's own checkpoint was written just before the end: the plain line
    assert stop_line(Stopped(signal.SIGTERM, 4, saved=True, last=last, overdue_s=20.0), argv).startswith("stopped at step 4; resume")


# -- a slow cluster is not a lost one (Run.__exit__ after a signal, without Ray) -----------------------
def stopping_run(tmp_path, save, grace_s: float | None = 20.0):
    """A Run at step 5 after a SIGTERM (its last checkpoint: step 4), as `Run.__exit__` sees it, with
    `save` standing for save_checkpoint: what the stop does with the errors of the calls it makes."""
    from types import SimpleNamespace

    from async_flowgrpo.driver.run import Run

    run = Run.__new__(Run)
    run.cfg = SimpleNamespace(trainer=SimpleNamespace(stop_grace_s=grace_s),
                              ray=SimpleNamespace(call_timeout_s=60.0, work_timeout_s=3600.0))
    saved = ["step_000004"]
    run.checkpointer = SimpleNamespace(root=str(tmp_path), latest_name=lambda: saved[-1])
    run.step, run.saved_step, run.cluster, run.log, run.started_early = 5, 4, None, None, None
    run.stop = GracefulStop(grace_s)  # not installed: the deadline's timer cannot interrupt this thread
    run.exited = []
    run._on_exit = [lambda: run.exited.append(True)]

    def save_checkpoint(at_stop: bool = False) -> str:
        save()
        run.saved_step = run.step
        saved.append("step_000005")
        return str(tmp_path / "step_000005")

    run.save_checkpoint = save_checkpoint
    run.stop.request(signal.SIGTERM)  # noted: the driver goes on to its next safe point
    return run


def exit_with(run, exc: BaseException) -> Stopped:
    with pytest.raises(Stopped) as stopped:
        run.__exit__(type(exc), exc, None)
    assert run.stop.closing
    return stopped.value


def test_a_save_that_times_out_after_a_signal_is_tried_again_not_taken_for_a_lost_ray(tmp_path):
    """A ray.get past its timeout while the stop's checkpoint is written (a loaded machine) is a slow
    cluster, not one the signal stopped: the save is tried again within trainer.stop_grace_s."""
    import ray

    calls = []

    def slow_once():
        calls.append(1)
        if len(calls) == 1:
            raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    run = stopping_run(tmp_path, slow_once)
    stopped = exit_with(run, StopRequested(signal.SIGTERM))
    assert len(calls) == 2 and stopped.saved and not stopped.ray_lost and stopped.step == 5
    assert run.exited  # the actors answer: the mode's end runs as after any stop

    from async_flowgrpo.cli import stop_line

    assert stop_line(stopped, ["trainer.output_dir=/tmp/x"]).startswith("stopped at step 5; resume with: ")


def test_a_save_that_keeps_timing_out_says_so_and_never_that_ray_died(tmp_path, monkeypatch):
    """Without time left to try again (no grace period here; with one, until it runs out), the line
    names the timeouts and the last checkpoint, not "the signal stopped Ray's processes too"."""
    import time

    import ray

    from async_flowgrpo import stop as stop_module
    from async_flowgrpo.cli import stop_line

    def never():
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    stopped = exit_with(stopping_run(tmp_path, never, grace_s=None), StopRequested(signal.SIGTERM))
    assert not stopped.saved and not stopped.ray_lost and stopped.why_unsaved
    line = stop_line(stopped, ["trainer.output_dir=/tmp/x"])
    assert "Ray's processes" not in line and "did not answer in time" in line and "ray.call_timeout_s=60" in line
    assert f"the last checkpoint is {tmp_path}/step_000004; resume with: " in line and line.endswith("trainer.resume=latest")

    monkeypatch.setattr(stop_module, "SHUTDOWN_RESERVE_S", 19.0)  # grace 20 s: given up 1 s after the signal
    calls = []
    # the deadline's interrupt of this thread does nothing under the default handler (a module before
    # this one in the same process may have left Ray's installed)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        t0 = time.monotonic()
        stopped = exit_with(stopping_run(tmp_path, lambda: calls.append(1) or never()), StopRequested(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(calls) >= 2 and time.monotonic() - t0 < 5  # tried again until the grace period's end, no longer
    assert not stopped.saved and not stopped.ray_lost
    assert "Ray's processes" not in stop_line(stopped, ["trainer.output_dir=/tmp/x"])


def test_a_call_of_the_loop_that_timed_out_after_a_signal_is_not_a_lost_ray(tmp_path):
    """The step's own call (an update, a queue call) ran past its timeout after the signal: nothing is
    saved (an update may still be running in the trainers: a checkpoint would mislabel it), and the
    line says the actors did not answer, not that Ray died; the mode's end, which would wait on them, is skipped."""
    import ray

    from async_flowgrpo.cli import stop_line

    saves = []
    run = stopping_run(tmp_path, lambda: saves.append(1))
    stopped = exit_with(run, ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready."))
    assert not saves and not stopped.saved and not stopped.ray_lost and not run.exited
    assert stopped.exit_code == 143
    line = stop_line(stopped, ["trainer.output_dir=/tmp/x"])
    assert line.startswith("stopped at step 5 without a checkpoint of it (the actors did not answer in time")
    assert "Ray's processes" not in line and line.endswith("trainer.resume=latest")


def test_actors_that_died_after_a_signal_are_still_a_lost_ray(tmp_path, caplog):
    """A dead actor (the signal sent to every process of the run reached it), in the loop or during
    the save, is what `ray_lost` means: the line names the last checkpoint, the mode's end is skipped,
    and a warning says which error decided it."""
    import ray

    saves = []
    run = stopping_run(tmp_path, lambda: saves.append(1))
    with caplog.at_level("WARNING", logger="async_flowgrpo.driver.run"):
        stopped = exit_with(run, ray.exceptions.ActorDiedError())
    assert stopped.ray_lost and not stopped.saved and not saves and not run.exited
    assert "step 5: after the signal, ActorDiedError" in caplog.text and "taken for gone (ActorDiedError)" in caplog.text

    def dies():
        raise ray.exceptions.RayActorError()

    run = stopping_run(tmp_path, dies)
    stopped = exit_with(run, StopRequested(signal.SIGTERM))
    assert stopped.ray_lost and not stopped.saved and not run.exited


def test_an_actors_own_error_after_a_signal_is_named_not_taken_for_a_lost_ray(tmp_path):
    """An actor that raised (alive: its task failed) is not a Ray the signal stopped: the line names the error."""
    import ray

    from async_flowgrpo.cli import stop_line

    error = ray.exceptions.RayTaskError("get_batch", "Traceback ...", ValueError("bad group"))
    stopped = exit_with(stopping_run(tmp_path, lambda: None), error)
    assert not stopped.ray_lost and not stopped.saved
    line = stop_line(stopped, ["trainer.output_dir=/tmp/x"])
    assert "(an actor failed after the signal: ValueError: bad group); the last checkpoint is " in line
