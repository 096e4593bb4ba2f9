"""Ray worker processes forked from a process that has already imported torch, diffusers,
transformers and peft, for the tests' in-process Ray clusters (conftest.py, `ray_cluster`).

Each actor of a test's run is a new Ray worker process, and a new Python process spends about 5 s
of CPU importing those libraries before it loads a tiny model in 0.4 s: on 2 cores the imports
were most of the suite's time. Here the raylet's worker command (`sys.executable default_worker.py
ARGS`, taken when Ray starts) is this file run as a script (`python -S warm_workers.py
default_worker.py ARGS`); it hands its argv, environment, working directory and standard streams
to a server (`serve`) over a Unix socket, the server forks a child that runs Ray's
default_worker.py with them, and the client waits for the child and exits as it did. Ray sees
the child's pid (its core worker registers itself), so killing an actor's process, Ray's restarts
and Ray's own kills behave as with a fresh process. Any other command (Ray's agents, a worker
without a server) execs the real interpreter unchanged.

The libraries imported ahead took their settings from the environment the server started with,
the tests' own (HF_HUB_OFFLINE, OMP_NUM_THREADS=1); ray itself is imported by each child after its
environment is set, since Ray reads settings from the environment at import. Product code never
goes through here, and the launcher tests start their own Ray from a fresh `python`, as users do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ENV_SOCKET = "ASYNC_FLOWGRPO_TEST_WORKER_SOCKET"  # where a client finds the server
ENV_PYTHON = "ASYNC_FLOWGRPO_TEST_REAL_PYTHON"  # the interpreter for what is not forked
PRELOAD = (
    "torch", "numpy", "safetensors.torch", "peft", "transformers",
    "diffusers", "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
    "diffusers.pipelines.flux.pipeline_flux", "diffusers.pipelines.flux.pipeline_flux_kontext",
    "diffusers.pipelines.qwenimage.pipeline_qwenimage", "diffusers.pipelines.wan.pipeline_wan",
    "async_flowgrpo.config", "async_flowgrpo.builders", "async_flowgrpo.algorithms", "async_flowgrpo.rewards",
    "async_flowgrpo.evaluation",
)


# -- client: the raylet's "python" -------------------------------------------------------------------
def client(argv: list[str]) -> None:
    real = os.environ.get(ENV_PYTHON, "")
    path = os.environ.get(ENV_SOCKET, "")
    if not (argv and argv[0].endswith("default_worker.py") and path):
        os.execv(real, [real, *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:  # no server (it ended with its pytest process): a plain worker
        os.execv(real, [real, *argv])
    header = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [header], [0, 1, 2])
    pid = int(conn.recv(64))

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    status = b""
    while not status:
        try:
            status = conn.recv(64)
        except InterruptedError:
            continue
        if not status:  # the server went away: nothing more to wait for
            os._exit(1)
    code = int(status)
    if code < 0:  # died by a signal: die by it too
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# -- server ------------------------------------------------------------------------------------------
def _run_child(listener: socket.socket, conn: socket.socket, others, wake: tuple[int, int], header: dict,
               fds: list[int]) -> None:
    import runpy
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        for s in (listener, conn, *others):
            s.close()
        for fd in wake:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        script = header["argv"][0]
        sys.argv = list(header["argv"])
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path: str) -> None:
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:  # not outliving the pytest process that started it
        ready, _, _ = select.select([listener, wake_r, *children.values()], [], [], 1.0)
        if listener in ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(listener, conn, list(children.values()), (wake_r, wake_w), json.loads(msg), fds)
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            children[pid] = conn
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.send(str(code).encode())
                except OSError:
                    pass
                conn.close()
        for pid, conn in list(children.items()):
            if conn in ready:  # the client ended (killed): its child goes too
                try:
                    if conn.recv(64) == b"":
                        os.kill(pid, signal.SIGKILL)
                        children.pop(pid)
                        conn.close()
                except OSError:
                    pass


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
