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
