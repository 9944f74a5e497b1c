"""Settling: has a checkpoint stopped changing for long enough? Pure bookkeeping.

The daemon judges quiescence on *monotonic* time, from what `stat` shows:
a checkpoint is quiet when its fingerprint (every entry's path, type, size,
mtime) has been the same for `quiet_period`, measured on the monotonic clock
from the first observation that showed it in that form. Wall-clock steps
(NTP) therefore cannot complete anything early, and mtimes are only ever
compared with each other (inside the fingerprint).

Filesystem events are hints: `touch` (a path watchdog reported, folded in on
the filesystem thread) says "something changed here just now", which can only
push the end of the quiet period later, never earlier.

No I/O, no clock: every method takes `now` (seconds on a monotonic clock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ckptd.formatting import format_duration
from ckptd.model import QUIET, STALL, Check, Verdict


@dataclass
class Track:
    fingerprint: str
    changed_at: float  # when we last saw it change (or first saw it)
    confirmed: bool = False  # a later observation saw the same fingerprint


class Settler:
    """Quiescence bookkeeping for the checkpoints of one root, keyed by path relative to the root.

    Locked: the event loop reads deadlines (how long it may sleep) while the filesystem thread
    observes and folds hints in.
    """

    def __init__(self, quiet_period: float, stall_after: float = 6 * 3600.0):
        self.quiet_period = quiet_period
        self.stall_after = stall_after
        self._tracks: dict[str, Track] = {}
        self._lock = threading.Lock()

    def observe(self, key: str, fingerprint: str, now: float) -> Check:
        """Record what stat shows now; return the quiet check for it."""
        with self._lock:
            track = self._tracks.get(key)
            changed = track is not None and track.fingerprint != fingerprint
            if track is None or changed:
                track = self._tracks[key] = Track(fingerprint, now)
            else:
                track.confirmed = True
            quiet_for = now - track.changed_at
        if quiet_for >= self.quiet_period:
            period = format_duration(self.quiet_period)
            return Check(QUIET, Verdict.PASSED, f"unchanged for {quiet_for:.1f}s (quiet_period={period})")
        if changed:
            return Check(QUIET, Verdict.FAILED, "writing: changed since the last look")
        return Check(QUIET, Verdict.UNKNOWN, self._settling(quiet_for))

    def _settling(self, quiet_for: float) -> str:
        return f"settling: unchanged for {quiet_for:.1f}s of {format_duration(self.quiet_period)}"

    def touch(self, key: str, now: float) -> None:
        """An event says `key` changed at `now`: its quiet period starts again."""
        with self._lock:
            track = self._tracks.get(key)
            if track is not None and now > track.changed_at:
                track.changed_at = now
                track.confirmed = False

    def stall_check(self, key: str, now: float) -> Check | None:
        """For a checkpoint that is quiet but not complete: a failed check once it has stalled."""
        with self._lock:
            track = self._tracks.get(key)
            idle = None if track is None else now - track.changed_at
        if idle is not None and idle >= self.stall_after:
            return Check(
                STALL,
                Verdict.FAILED,
                f"untouched for {format_duration(round(idle))} "
                f"(stall_after={format_duration(self.stall_after)})",
            )
        return None

    def deadline(self, key: str) -> float | None:
        """When `key`'s quiet period ends, if nothing changes before then."""
        with self._lock:
            track = self._tracks.get(key)
            return None if track is None else track.changed_at + self.quiet_period

    def changed_at(self, key: str) -> float | None:
        with self._lock:
            track = self._tracks.get(key)
            return None if track is None else track.changed_at

    def forget(self, key: str) -> None:
        with self._lock:
            self._tracks.pop(key, None)
