"""A progress line on a terminal: `plan: 1,200/4,500 checkpoints looked at (26%)`, redrawn in place.

On stderr, and only when stderr is a terminal (a pipe, a log file or `--quiet` gets nothing), only
for work big enough to wait for (BIG checkpoints, or a second gone by), at most ten redraws a
second; cleared when done, so that what follows starts on a clean line.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from ckptd.formatting import format_age

BIG = 200  # checkpoints: fewer are looked at before a person could read the line
AFTER = 1.0  # seconds: shown for fewer too, once they take this long
EVERY = 0.1  # seconds between redraws


class Progress:
    def __init__(self, label: str, *, quiet: bool = False, stream: TextIO | None = None,
                 clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.on = not quiet and _isatty(self.stream)
        self.label = label
        self.clock = clock
        self.started = clock()
        self.drawn = 0.0
        self.width = 0

    def update(self, done: int, total: int, unit: str = "checkpoints") -> None:
        if not self.on:
            return
        now = self.clock()
        if total < BIG and now - self.started < AFTER:
            return
        if now - self.drawn < EVERY and done < total:
            return
        self.drawn = now
        pct = 100 * done // total if total else 100
        text = f"{self.label}: {done:,}/{total:,} {unit} looked at ({pct}%)"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def done(self) -> None:
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Ticker:
    """For a step that says nothing while it runs (a zero_to_fp32 consolidation before a slim can
    take an hour): `LABEL: WHAT, 1m12s` redrawn every second on a terminal, once the step has taken
    SLOW seconds; `clear` before printing anything else. A thread of its own, stopped by `stop`."""

    SLOW = 2.0

    def __init__(self, label: str, *, quiet: bool = False, stream: TextIO | None = None,
                 clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.on = not quiet and _isatty(self.stream)
        self.label, self.clock = label, clock
        self.what, self.since, self.width = "", clock(), 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        if self.on:
            self._thread = threading.Thread(target=self._run, name="ckptd-ticker", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.clear()

    def working(self, what: str) -> None:
        """A new step begins: `what` it is."""
        with self._lock:
            self.what, self.since = what, self.clock()

    def saying(self, what: str) -> None:
        """The same step, further on (`archiving run/ckpt: 1.2 GiB of 4 GiB sent`): its time runs on."""
        with self._lock:
            self.what = what

    def clear(self) -> None:
        with self._lock:
            if self.on and self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
                self.width = 0

    def draw(self) -> None:
        """Redraw the line if the current step has been slow (the thread calls this every second)."""
        with self._lock:
            took = self.clock() - self.since
            if not self.on or not self.what or took < self.SLOW:
                return
            text = f"{self.label}: {self.what}, {format_age(took)}"
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = len(text)

    def _run(self) -> None:
        while not self._stop.wait(1.0):  # a timer between redraws, nothing to synchronise with
            self.draw()
