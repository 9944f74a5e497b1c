"""A root tracker on a real directory with a clock the test drives (test_tracker.py, test_one_save.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ckptd.config import Root
from ckptd.daemon.tracker import RootTracker
from ckptd.judge.verdicts import RACY_NS


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


@pytest.fixture
def clock():
    return Clock()


def tracker(root: Path, clock: Clock, **kw) -> RootTracker:
    t = RootTracker(Root(path=root, quiet_period=60, world_size=2, **kw), clock)
    # The wall clock the verdicts' racy-clean rule reads: the test's files count as written well
    # before each look (as they are, one quiet period before, outside a test).
    t.scanner.verdicts.clock_ns = lambda: time.time_ns() + 10 * RACY_NS
    return t


def start(t: RootTracker) -> None:
    """What the daemon does at start-up: the first scan, then (after READY) the first looks."""
    t.full_scan()
    while t.unseen:
        t.step(t.clock())
