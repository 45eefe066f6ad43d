"""The live line of the level that is running: bar, step, loss, time per step, ETA."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TextIO

BAR_WIDTH = 20
TTY_EVERY_S = 0.2     # on a terminal the line is redrawn this often
SPEED_WINDOW = 20     # steps whose arrival times give the time per step


def clock(seconds: float) -> str:
    """``m:ss``."""
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """The live line of the running level, written to ``stream``.

    On a terminal the line is redrawn in place (a few times a second); elsewhere (a log, a
    pipe) one line is written every ``log_every_s`` seconds. ``total`` is the expected number
    of steps (None: unknown; ``expected``: a guess, shown as ``~N``); ``deadline`` a
    time.time() by which the run stops (its budget). The runner feeds it ``update`` as steps
    arrive, ``render`` while it waits and ``close`` when the run ends.
    """

    def __init__(self, label: str, total: int | None = None, deadline: float | None = None, *,
                 stream: TextIO, log_every_s: float = 10.0, expected: bool = False) -> None:
        self.label, self.total, self.deadline, self.expected = label, total, deadline, expected
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = TTY_EVERY_S if self.tty else log_every_s
        self.start = time.perf_counter()
        self.last_shown = self.start
        self.step, self.loss = 0, math.nan
        self.seen: deque[tuple[float, int]] = deque(maxlen=SPEED_WINDOW)   # (time, step) as steps arrive
        self.first_seen: float | None = None
        self.drawn = False
        self.closed_at: float | None = None

    def update(self, step: int, loss: float) -> None:
        """A step the run reported, with its loss."""
        if step != self.step:
            self.seen.append((time.perf_counter(), step))
            if self.first_seen is None:
                self.first_seen = self.seen[-1][0]
        self.step, self.loss = step, loss

    def start_s(self) -> float | None:
        """Seconds from the launch to the first step seen (None: no step seen)."""
        return self.first_seen - self.start if self.first_seen is not None else None

    def exit_s(self) -> float | None:
        """Seconds from the last step seen to the end of the run (None: no step seen)."""
        return self.closed_at - self.seen[-1][0] if self.seen and self.closed_at else None

    def seconds_per_step(self) -> float | None:
        if len(self.seen) < 2:
            return None
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def eta(self) -> float | None:
        rate = self.seconds_per_step()
        left = None
        if rate is not None and self.total is not None:
            left = max(0, self.total - self.step) * rate
        if self.deadline is not None:
            until = max(0.0, self.deadline - time.time())
            left = until if left is None else min(left, until)
        return left

    def line(self) -> str:
        parts = [f"  {self.label}"]
        eta = self.eta()
        if self.total:
            done = min(1.0, self.step / self.total)
            if eta is not None and self.step:  # a deadline may end it before the last step
                spent = time.perf_counter() - self.start
                done = max(done, spent / (spent + eta) if spent + eta > 0 else 1.0)
            filled = int(done * BAR_WIDTH)
            bar = "=" * filled + (">" if filled < BAR_WIDTH else "") + " " * (BAR_WIDTH - 1 - filled)
            parts.append(f"[{bar}] {self.step}/{'~' if self.expected else ''}{self.total}")
        else:
            parts.append(f"step {self.step}")
        if self.step:
            parts.append(f"loss {self.loss:.4f}")
        rate = self.seconds_per_step()
        if rate is not None:
            parts.append(f"{rate:.2f} s/step")
        parts.append(f"ETA {clock(eta)}" if eta is not None and self.step
                     else f"{clock(time.perf_counter() - self.start)} elapsed")
        return "  ".join(parts)

    def render(self, force: bool = False) -> None:
        """Show the line if it is time to (always with ``force``)."""
        now = time.perf_counter()
        if not force and now - self.last_shown < self.every:
            return
        self.last_shown = now
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.drawn = True
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Remove the live line (terminal), so the level's result line replaces it."""
        self.closed_at = time.perf_counter()
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
