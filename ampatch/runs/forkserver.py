"""Start the built-in workloads' runs from one warm process, instead of a fresh Python each.

A fresh Python pays for importing torch, ampatch and torch._dynamo (which the first optimizer
imports) before its first step: about 6 s of CPU, a third of a 120 s comparison over six
levels on a small machine. The server (``python -m ampatch.runs.forkserver MODULE...``)
imports them once, then for each request forks: the run is a process of its own, with its
environment, stderr file and exit code, that runs ``python -m MODULE ARGS`` as if started
afresh (its ``atexit`` report included), only without the imports, and without tearing them
down at exit. The modules to run are not preloaded (``runpy`` runs them as ``__main__``).

Protocol, one JSON object per line: the server says ``{"ready": true}`` once its imports are
done; the parent sends ``{"module", "argv", "env", "stderr"}``; the server answers
``{"pid"}`` once forked and ``{"pid", "returncode"}`` when the run ends (negative: killed by
that signal, as ``subprocess`` says). The parent signals runs by pid; end of input ends the
server. Linux only, and only where nothing initialized CUDA in the server (a forked child
cannot use it): the caller decides (``builtin.launcher``). As a fresh run would be, the server
and each run are in a session of their own and die with their parent (`process`): a signal
to a run reaches its process group, and nothing outlives the command.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, TextIO

from ampatch.errors import ServerError, reason
from ampatch.runs import process
from ampatch.runs.runner import popen

READY_TIMEOUT_S = 600.0   # the server's imports; a busy machine is slow, a hung one is not waited on forever
CLOSE_WAIT_S = 5.0


def serve(preload: Sequence[str], requests: TextIO, replies: TextIO) -> None:
    """The server's loop (in the server process). Returns when the input ends; in a forked
    child it never returns: the run ends the process (`run_forked`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent and the run, not the server
    for name in preload:
        importlib.import_module(name)
    gc.freeze()  # the runs' garbage collector leaves the imported objects alone: no copy of their pages

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": True})
    server = os.getpid()
    for line in requests:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_forked(request, server)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def run_forked(request: dict[str, Any], server: int) -> None:
    """In the forked child: become the run (environment, standard streams, Ctrl-C, argv), run
    its module as ``__main__`` and exit as a fresh ``python -m`` would: its exit code, a
    traceback on stderr if it raised, its ``atexit`` handlers run. Then the process ends
    without tearing down the modules it inherited (seconds of work, for nothing)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()                              # its own process group, as `process.start` gives a fresh run
    process.die_with_parent(server)          # the server (it dies with the command); gone already: end now
    code = [0]

    def leave() -> None:  # registered first, so it runs after the run's own exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code[0])

    atexit.register(leave)
    os.environ.clear()
    os.environ.update(request["env"])
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err, 2)
    os.close(err)
    os.close(null)
    sys.argv = [request["module"], *request["argv"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
        code[0] = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        code[0] = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code[0] = 1
    sys.exit(code[0])


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """A pipe of the server's process (``None`` only if it was started without one)."""
    if stream is None:
        raise ServerError("the fork server was started without its stdin/stdout pipes")
    return stream


class ForkServer:
    """The parent's side: starts the server, launches runs through it (one at a time), closes it."""

    def __init__(self, preload: Sequence[str], env: dict[str, str]) -> None:
        self.errors = tempfile.NamedTemporaryFile(prefix="ampatch-forkserver-", suffix=".txt")
        self.proc = process.start([sys.executable, "-m", __name__, *preload], env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)
        self.requests, self.replies = _pipe(self.proc.stdin), _pipe(self.proc.stdout)
        self.buffer = b""
        self.ready = False
        self.running: Forked | None = None

    def read(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next message, or None when none came within ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        fd = self.replies.fileno()
        while b"\n" not in self.buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.errors.seek(0)
                why = self.errors.read().decode(errors="replace").strip().splitlines()
                raise ServerError(f"the fork server ended ({why[-1] if why else 'no message'})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self) -> None:
        """Wait until the server has done its imports (raises `ServerError` if it fails to)."""
        if not self.ready:
            if self.read(READY_TIMEOUT_S) is None:
                raise ServerError(f"the fork server did not start within {READY_TIMEOUT_S:g}s")
            self.ready = True

    def launch(self, cmd: Sequence[str], env: dict[str, str], stderr: Path) -> Forked:
        """Start ``cmd`` (``python -m MODULE ARGS``) as a forked run; a Popen-like handle."""
        if len(cmd) < 3 or cmd[1] != "-m":
            raise ValueError(f"the fork server runs 'python -m MODULE ...' commands, not {list(cmd)}")
        self.wait_ready()
        if self.running is not None and self.running.returncode is None:
            raise RuntimeError(f"run {self.running.pid} has not ended: the fork server runs one at a time")
        request = {"module": cmd[2], "argv": list(cmd[3:]), "env": env, "stderr": str(stderr)}
        self.requests.write((json.dumps(request) + "\n").encode())
        self.requests.flush()
        started = self.read(None)
        if started is None:  # no timeout: it answers or raises ServerError
            raise ServerError("the fork server did not answer")
        self.running = Forked(self, started["pid"])
        return self.running

    def close(self) -> None:
        """End the server (it finishes the run it waits for, if any, first)."""
        try:
            self.requests.close()
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.errors.close()


class WarmLauncher:
    """A `runner.Launch` that forks runs from a `ForkServer`, started when the launcher is
    entered (so that its imports are not counted as any run's start-up). If the server fails,
    it says so on ``log`` and starts the rest as fresh processes."""

    def __init__(self, preload: Sequence[str], env: dict[str, str], log: TextIO) -> None:
        self.preload, self.env, self.log = list(preload), env, log
        self.server: ForkServer | None = None

    def start(self) -> None:
        began = time.perf_counter()
        self.log.write("starting a warm process for the runs (it imports torch and ampatch once; each run forks "
                       "from it)\n")
        self.log.flush()
        try:
            self.server = ForkServer(self.preload, self.env)
            self.server.wait_ready()
        except ServerError as exc:
            self.fail(exc)
            return
        except BaseException:  # Ctrl-C while it imports: __exit__ will not run
            self.close()
            raise
        self.log.write(f"warm process ready in {time.perf_counter() - began:.1f}s\n")
        self.log.flush()

    def fail(self, exc: ServerError) -> None:
        self.log.write(f"note: {reason(exc)}; starting each run as a fresh process instead\n")
        self.log.flush()
        self.close()

    def __call__(self, cmd: Sequence[str], env: dict[str, str], stderr: Path) -> Any:
        if self.server is not None:
            try:
                return self.server.launch(cmd, env, stderr)
            except ServerError as exc:
                self.fail(exc)
        return popen(cmd, env, stderr)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> WarmLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forked:
    """A forked run, with the part of `subprocess.Popen` the runner uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self.server.read(timeout)
            if message is None:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            if message.get("pid") != self.pid:
                raise ServerError(f"the fork server answered for run {message.get('pid')}, not {self.pid}")
            self.returncode = message["returncode"]
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        """``sig`` to the run's process group (the run and what it started)."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:  # it ended (its return code is on the way), or left its group
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1:], sys.stdin, sys.stdout)
