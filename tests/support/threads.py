"""Threads a test leaves running (after watchdog's own test fixture, which fails on them too)."""

from __future__ import annotations

import threading


def leaked(before: set[threading.Thread], grace: float = 5.0) -> list[threading.Thread]:
    """The threads started since `before` that are still alive after `grace` seconds to end
    (each joined for at most that long: a thread told to stop may need a moment)."""
    me = threading.current_thread()
    new = [t for t in threading.enumerate() if t not in before and t is not me and t.is_alive()]
    for t in new:
        t.join(timeout=grace)
    return [t for t in new if t.is_alive()]
