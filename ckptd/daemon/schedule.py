"""When the tracker looks at each checkpoint of one root again: the time side of tracking.

The tracker (tracker.py) knows what is on the disk; this knows when to look at it: the settler's
quiet periods (settle.py), a future mtime that puts a look off until the clock has passed it,
the hints that inotify events and first sights leave, and the back-off of a checkpoint left
incomplete or stalled (each unchanged look doubles the polls until the next one).

Synchronous and without locks of its own, like the tracker that holds it and alone calls it
(the settler has its lock). No I/O; the clocks are handed in. Keyed by checkpoint path relative
to the root (`Checkpoint.rel`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from ckptd.config import Root
from ckptd.judge.settle import Settler
from ckptd.model import QUIET, Check, Checkpoint, State, Verdict

HINT_DEBOUNCE = 0.05  # after an event, look again this much later (coalesces bursts)
BACKOFF_RECONCILES = 6  # an unchanged incomplete checkpoint is walked at least every 6 reconcile intervals


@dataclass
class Backoff:
    """An incomplete or stalled checkpoint's re-looks: every `span` polls, doubling while unchanged."""

    span: int = 1
    skipped: int = 0


class LookSchedule:
    """When each checkpoint of one root is due for its next look, and whether a look may wait."""

    def __init__(self, root: Root, clock: Callable[[], float], wall: Callable[[], float] = time.time):
        self.root = root  # its poll and reconcile intervals bound the back-off
        self.clock = clock  # monotonic
        self.wall = wall  # only ever holds a checkpoint back (a future mtime), never completes it
        self.settler = Settler(root.quiet_period, root.stall_after)
        self.not_before: dict[str, float] = {}  # checkpoint rel -> monotonic time its mtimes are past
        self.hints: dict[str, float] = {}  # checkpoint rel -> when to look again
        self.backoff: dict[str, Backoff] = {}  # incomplete and stalled checkpoints, by rel

    def reconfigure(self, root: Root) -> None:
        """A reloaded config: the same settler, with the new quiet period and stall time."""
        self.root = root
        self.settler.quiet_period = root.quiet_period
        self.settler.stall_after = root.stall_after

    def quiet(self, rel: str, fingerprint: str, newest_ns: int) -> Check:
        """The settler's verdict (monotonic time), unless an mtime lies in the future.

        A future mtime is not quiet, as for `plan` (README: how a checkpoint is proven
        complete): typically a writer on another host whose clock runs ahead. The wall clock
        can only hold a checkpoint back here, never complete it early; its look is put off
        until the clock has passed that mtime, rather than repeated every step meanwhile.
        """
        now = self.clock()
        check = self.settler.observe(rel, fingerprint, now)
        ahead = newest_ns / 1e9 - self.wall()
        if ahead <= 0:
            self.not_before.pop(rel, None)
            return check
        self.not_before[rel] = now + ahead
        return Check(QUIET, Verdict.FAILED, f"newest mtime is {ahead:.1f}s in the future (clock skew?)")

    def deadline(self, rel: str) -> float | None:
        """When to look at an in-flight checkpoint again: its quiet period's end, or later."""
        d = self.settler.deadline(rel)
        later = self.not_before.get(rel)
        return d if later is None or d is None else max(d, later)

    def next_deadline(self, in_flight: Iterable[Checkpoint], *, now: float | None) -> float | None:
        """The earliest time something needs looking at again: a hint's, a writing or settling
        checkpoint's deadline, or `now` when there is a look waiting already."""
        times = list(self.hints.values())
        if now is not None:
            times.append(now)
        for c in in_flight:
            if c.state in (State.WRITING, State.SETTLING):
                d = self.deadline(c.rel)
                if d is not None:
                    times.append(d)
        return min(times) if times else None

    def due(self, now: float, in_flight: Iterable[Checkpoint]) -> set[str]:
        """The checkpoints to look at now: their hint's time, or their deadline, has come."""
        due = {k for k, t in self.hints.items() if t <= now}
        for c in in_flight:
            d = self.deadline(c.rel)
            if c.state in (State.WRITING, State.SETTLING) and d is not None and d <= now:
                due.add(c.rel)
        return due

    # --- hints ---------------------------------------------------------------

    def touched(self, rel: str, now: float) -> None:
        """An event inside the checkpoint: its quiet period starts over, and it is looked at soon."""
        self.settler.touch(rel, now)
        self.hints[rel] = now + HINT_DEBOUNCE

    def soon(self, rel: str) -> None:
        """Look again shortly, once its watch exists (the tracker's first sight of it)."""
        self.hints[rel] = self.clock() + HINT_DEBOUNCE

    def spent(self, rel: str) -> None:
        """Its look is under way: the hint is used up."""
        self.hints.pop(rel, None)

    # --- back-off ------------------------------------------------------------

    def backed_off(self, rel: str) -> bool:
        """Whether `rel` is backed off and its back-off has not run out at this poll."""
        b = self.backoff.get(rel)
        return b is not None and b.skipped + 1 < b.span

    def skipped(self, rel: str) -> None:
        """A poll passed a backed-off checkpoint by: it counts toward its span."""
        self.backoff[rel].skipped += 1

    def looked(self, fresh: Checkpoint, old: Checkpoint | None) -> Checkpoint:
        """What a look found, as time sees it: an incomplete checkpoint gets the settler's stall check
        once stall_after has passed; an incomplete or stalled one's back-off starts over when it is
        new or changed, else doubles (up to `max_span`); any other state has none."""
        if fresh.state is State.INCOMPLETE:
            stall = self.settler.stall_check(fresh.rel, self.clock())
            if stall is not None:
                fresh = replace(fresh, checks=(*fresh.checks, stall))
        if fresh.state in (State.INCOMPLETE, State.STALLED):
            b = self.backoff.get(fresh.rel)
            if b is None or old is None or old.fingerprint != fresh.fingerprint:
                self.backoff[fresh.rel] = Backoff()  # new, or changed: look again at the next poll
            else:
                b.span, b.skipped = min(2 * b.span, self.max_span()), 0
        else:
            self.backoff.pop(fresh.rel, None)
        return fresh

    def max_span(self) -> int:
        """The most polls between two looks at an unchanged incomplete checkpoint: BACKOFF_RECONCILES
        reconcile intervals (30 min at the defaults)."""
        return max(1, int(BACKOFF_RECONCILES * self.root.reconcile_interval // self.root.poll_interval))

    def forget(self, rel: str) -> None:
        """A checkpoint gone from the disk (or moved to the trash)."""
        self.settler.forget(rel)
        self.not_before.pop(rel, None)
        self.hints.pop(rel, None)
        self.backoff.pop(rel, None)
