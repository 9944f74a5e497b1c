"""A progress line on a terminal: `plan: 1,200/4,500 checkpoints looked at (26%)`, redrawn in place.

On stderr, and only when stderr is a terminal (a pipe, a log file or `--quiet` gets nothing), only
for work big enough to wait for (BIG checkpoints, or a second gone by), at most ten redraws a
second; cleared when done, so that what follows starts on a clean line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

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
