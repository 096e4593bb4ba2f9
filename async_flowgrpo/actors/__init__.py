"""Ray actors: thin shells around the plain components (a rollout worker, a learner), adding only
what needs Ray (remote calls, threads for weight receive, the object store, restarts)."""

import os
import sys


def quiet_actor_output(output_dir: str, name: str, to_file: bool) -> None:
    """Keep an actor's library chatter (model-loading progress bars, per-process warnings) off the
    user's console: progress bars off, and with `to_file` this process's stdout and stderr go to
    <output_dir>/logs/<name>.log (a crash's traceback still reaches the driver as an exception)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    if not to_file:
        return
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    log = open(os.path.join(output_dir, "logs", f"{name}.log"), "a", buffering=1, encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
