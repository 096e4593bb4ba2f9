"""Command-line entry shared by the launchers.

Exit codes: 0 done; 2 a mistake found before Ray starts (config, input files, run directory,
checkpoint to resume), one line on stderr; 1 a failure during the run, one line; 128 + signal
(143 SIGTERM, 130 SIGINT, 129 SIGHUP) a graceful stop, with the command that resumes: after a checkpoint of the
current step, or, when the signal stopped the trainers too, trainer.stop_grace_s ran out first or
the actors did not answer in time, naming the last checkpoint.
"""

from __future__ import annotations

import contextlib
import shlex
import sys

from async_flowgrpo.checkpoint import Checkpointer, CheckpointError, RunDirError, RunDirLock, config_changes, decode, prepare_run_dir
from async_flowgrpo.config import Config, ConfigError, config_or_exit
from async_flowgrpo.stop import GracefulStop, Stopped, StopRequested


def preflight(cfg: Config) -> RunDirLock:
    """Before Ray starts: lock the run directory (one run per directory), refuse a used one unless
    resuming or overwriting, and check the checkpoint to resume against the config. Resolves
    trainer.resume=latest to the checkpoint it will use (so a fallback is decided, and warned
    about, once). Raises ConfigError / RunDirError."""
    import os

    lock = prepare_run_dir(cfg.trainer.output_dir, cfg.trainer.resume, cfg.trainer.overwrite)
    try:
        if cfg.trainer.resume:
            ckpt = Checkpointer(os.path.join(cfg.trainer.output_dir, "checkpoints"), keep=cfg.trainer.keep_checkpoints)
            try:
                path, tree = ckpt.find(cfg.trainer.resume)
            except CheckpointError as e:
                raise ConfigError(str(e)) from None
            if isinstance(tree.get("config"), dict):
                fixed, _ = config_changes(decode(tree["config"], {}), cfg)
                if fixed:
                    old = decode(tree["config"], {})
                    diffs = ", ".join(f"{k} {_lookup(old, k)!r} -> {_lookup_cfg(cfg, k)!r}" for k in fixed)
                    raise ConfigError(f"trainer.resume: {path} cannot continue with a changed {diffs} "
                                      "(revert them, or start a new run in another trainer.output_dir)")
            cfg.trainer.resume = path
    except BaseException:
        lock.release()
        raise
    return lock


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _lookup_cfg(cfg: Config, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part, None)
    return value


def again_command(argv: list[str], how: str) -> str:
    """This run's command line with `how` (trainer.resume=latest or trainer.overwrite=true) instead
    of the user's own resume/overwrite setting."""
    kept = [a for a in argv if not a.startswith(("trainer.resume=", "trainer.overwrite="))]
    return shlex.join(["python", sys.argv[0] if sys.argv and sys.argv[0] else "launch/<mode>.py", *kept, how])


def stop_line(stopped: Stopped, argv: list[str]) -> str:
    if stopped.saved:
        return f"stopped at step {stopped.step}; resume with: {again_command(argv, 'trainer.resume=latest')}"
    if stopped.overdue_s is not None:
        why = f"trainer.stop_grace_s={stopped.overdue_s:g} ran out before it was written"
        if stopped.resumable:
            return (f"stopped at step {stopped.step} without a checkpoint of it ({why}); the last checkpoint is "
                    f"{stopped.last}; resume with: {again_command(argv, 'trainer.resume=latest')}")
        return (f"stopped at step {stopped.step} without a checkpoint ({why}; there is none to resume); "
                f"start again with: {again_command(argv, 'trainer.overwrite=true')}")
    if stopped.ray_lost and stopped.resumable:
        return (f"stopped at step {stopped.step} without a checkpoint of it (the signal stopped Ray's processes too); "
                f"the last checkpoint is {stopped.last}; resume with: {again_command(argv, 'trainer.resume=latest')}")
    if stopped.ray_lost:
        return (f"stopped at step {stopped.step} without a checkpoint (the signal stopped Ray's processes too; there is "
                f"none to resume); start again with: {again_command(argv, 'trainer.overwrite=true')}")
    if stopped.why_unsaved is not None and stopped.resumable:
        return (f"stopped at step {stopped.step} without a checkpoint of it ({stopped.why_unsaved}); the last checkpoint "
                f"is {stopped.last}; resume with: {again_command(argv, 'trainer.resume=latest')}")
    if stopped.why_unsaved is not None:
        return (f"stopped at step {stopped.step} without a checkpoint ({stopped.why_unsaved}; there is none to resume); "
                f"start again with: {again_command(argv, 'trainer.overwrite=true')}")
    if stopped.resumable:
        return (f"stopped at step {stopped.step} without a checkpoint of it (second signal; the previous checkpoint "
                f"is the latest); resume with: {again_command(argv, 'trainer.resume=latest')}")
    return (f"stopped at step {stopped.step} without a checkpoint (second signal; there is none to resume); "
            f"start again with: {again_command(argv, 'trainer.overwrite=true')}")


def main(mode: str, argv: list[str]) -> None:
    """Entry point of launch/<mode>.py: load the config, run the mode's driver (which prints its summary line)."""
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Until the pipeline takes over the signals (and after it gives them back) a signal just ends
    # the process, with one line instead of a KeyboardInterrupt traceback.
    stop = GracefulStop().install()
    lock = None
    try:
        with stop.abandonable():
            cfg = config_or_exit(mode, argv)
            try:
                lock = preflight(cfg)
            except (ConfigError, RunDirError) as e:
                print(f"config error: {e}", file=sys.stderr)
                raise SystemExit(2) from None

            from async_flowgrpo.modes import run
            from async_flowgrpo.driver.cluster import RunError
            from async_flowgrpo.driver.run import disk_full

            print(f"async_flowgrpo {mode}: model={cfg.model.path} output_dir={cfg.trainer.output_dir}", file=sys.stderr)
            try:
                run(cfg)  # its logger prints the summary line
            except RunError as e:
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(1) from None
            except OSError as e:  # the disk filled while writing metrics, images or logs (checkpoints: RunError)
                if disk_full(e) is None:
                    raise
                print(f"error: disk full writing {e.filename or cfg.trainer.output_dir} ({e.strerror}); free space, "
                      f"then resume from the last checkpoint with trainer.resume=latest", file=sys.stderr)
                raise SystemExit(1) from None
    except Stopped as e:
        with contextlib.suppress(OSError):  # after a hangup the terminal may be gone: the exit code stays
            print(stop_line(e, argv), file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except StopRequested as e:
        print("stopped during start-up (nothing trained by this run); run the same command again", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    finally:
        stop.close()  # a signal during ray.shutdown would leave Ray's processes behind
        _shutdown_ray()
        stop.uninstall()
        if lock is not None:
            lock.release()


def _shutdown_ray() -> None:
    """A local cluster's processes must not outlive the driver, however it ends."""
    cluster = sys.modules.get("async_flowgrpo.driver.cluster")
    if cluster is not None:
        cluster.shutdown_ray()
