"""Child processes that go with the command: each in a session of its own, told of the
command's SIGINT/SIGTERM/SIGHUP, and never left behind.

A run starts in a new session (so a new process group, the run and whatever it starts), so
that a signal reaches all of it and the terminal's Ctrl-C reaches only the command, which
decides what the run gets. On Linux a run is also SIGKILLed when the thread that started it
ends (``PR_SET_PDEATHSIG``): a command killed outright (``kill -9``, the OOM killer) leaves no
run behind (what a run started must guard itself, as DataLoader workers do: Linux does not
pass the guard on to a fork's child; after any other end of the command, the run's group is
killed). Two ways to wait for a run:

- `attached` (``ampatch run``): the command passes each SIGINT/SIGTERM/SIGHUP on to the run
  and keeps waiting, so the script can save a checkpoint; its exit status is the command's;
- `stopping` (``compare``, ``diagnose``, ``tune``): SIGTERM and SIGHUP raise `Stopped` in the
  command as Ctrl-C raises KeyboardInterrupt; the runner then stops the running child with
  that signal first (`runner.stop`) and the command reports what finished.

A signal the command was started ignoring (``nohup``'s SIGHUP, SIGINT in a background job) is
left ignored. Handlers are only installed from the main thread (Python's rule); elsewhere the
signals keep their handlers, and the parent-death guard still holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what `attached` passes on to the run
STOPPING = (signal.SIGTERM, signal.SIGHUP)                 # what `stopping` turns into `Stopped`
JOB_CONTROL = (signal.SIGTSTP, signal.SIGCONT)              # Ctrl-Z and fg/bg: what `following` passes on
PR_SET_PDEATHSIG = 1                                        # <linux/prctl.h>

__all__ = ["Child", "Stopped", "start", "attached", "stopping", "following", "signal_of", "exit_status",
           "die_with_parent", "kill_group", "FORWARDED", "STOPPING", "JOB_CONTROL"]


class Stopped(KeyboardInterrupt):
    """A signal (SIGTERM, SIGHUP) asked the command to stop: handled where Ctrl-C's
    KeyboardInterrupt is (the running child is stopped, the finished levels reported)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(exc: BaseException) -> int:
    """The signal behind an interruption: a `Stopped`'s, else SIGINT (Ctrl-C)."""
    return exc.signum if isinstance(exc, Stopped) else signal.SIGINT


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: 128+N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


@functools.cache
def prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (None: not Linux, or not found). Looked up before a fork, so that the
    child only calls it."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl to call: the process group is the remaining guard
        return None


def die_with_parent(parent: int | None = None, call: Callable[..., int] | None = None) -> None:
    """In a child: be SIGKILLed when the thread that started it ends (Linux; elsewhere nothing).
    ``parent``: the pid that started it; if it is gone already, end now. ``call``: `prctl()`,
    looked up before the fork (default: looked up here)."""
    call = call if call is not None else prctl()
    if call is None:
        return
    call(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
         ctypes.c_ulong(0))
    if parent is not None and os.getppid() != parent:  # the parent died before the guard was set
        os.kill(os.getpid(), signal.SIGKILL)


def kill_group(pid: int) -> None:
    """SIGKILL what is left of the process group ``pid`` leads (after its leader ended: what
    the run started and left running)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left (or no longer ours)
        pass


class Child(subprocess.Popen):
    """A `subprocess.Popen` started by `start`: a signal goes to its process group, the run and
    what it started (to the run alone if it left the group)."""

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is not None:  # reaped: its pid is no longer its own
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:  # the run made a session of its own: signal it directly
            super().send_signal(sig)


def start(cmd: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any) -> Child:
    """Start ``cmd`` in a new session, to die with this thread (see `die_with_parent`);
    ``popen``: `subprocess.Popen`'s other arguments (streams)."""
    parent = os.getpid()
    prctl()  # looked up here, not in the forked child
    return Child(list(cmd), env=None if env is None else dict(env), start_new_session=True,
                 preexec_fn=lambda: die_with_parent(parent), **popen)


Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def handling(signums: Sequence[int], handler: Handler) -> Iterator[list[int]]:
    """While inside: ``handler`` for each of ``signums`` this process neither ignores nor left
    to C code; yields those it handles. The previous handlers come back on the way out.
    Nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    previous = {s: signal.getsignal(s) for s in signums}
    handled = [s for s, h in previous.items() if h not in (signal.SIG_IGN, None)]
    try:
        for s in handled:
            signal.signal(s, handler)
        yield handled
    finally:
        for s in handled:
            signal.signal(s, previous[s])


def stop_with(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def stopping() -> contextlib.AbstractContextManager[list[int]]:
    """While inside: SIGTERM and SIGHUP raise `Stopped` (see the module's docstring)."""
    return handling(STOPPING, stop_with)


def following(proc: Any) -> contextlib.AbstractContextManager[list[int]]:
    """While inside: Ctrl-Z (SIGTSTP) stops ``proc``'s process group, then this process, as
    it did when they shared the terminal's group; ``fg``/``bg`` (SIGCONT) resumes both."""

    def pass_on(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTSTP:  # the kernel drops a SIGTSTP to a group of another session: SIGSTOP
            proc.send_signal(signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            proc.send_signal(signum)

    return handling(JOB_CONTROL, pass_on)


def attached(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` with this process's standard streams to its end, passing on each SIGINT,
    SIGTERM and SIGHUP the command gets; then end what it left running. Returns its exit
    status (128+N when signal N killed it)."""
    holder: list[Child] = []
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if holder:
            holder[0].send_signal(signum)
        else:  # arrived while the run was being started
            pending.append(signum)

    with handling(FORWARDED, forward):
        try:
            holder.append(start(cmd, env))
            for signum in pending:
                holder[0].send_signal(signum)
            with following(holder[0]):
                returncode = holder[0].wait()
        finally:
            if holder:
                child = holder[0]
                if child.poll() is None:   # something above failed while it ran
                    child.kill()
                    child.wait()
                kill_group(child.pid)      # what it started and left behind
    return exit_status(returncode)
