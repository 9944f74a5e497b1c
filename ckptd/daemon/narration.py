"""What the daemon's log says of the checkpoints it watches (`Narrator`), once per change: the
trackers report which checkpoints changed state since it last asked (`RootTracker.take_changes`),
so it keeps no copy of every checkpoint's state.

A new checkpoint, one complete, incomplete (and why), stalled, in flight again, gone; the
start-up line and what `ckptd plan` would show meanwhile; how far the looks at what a first scan
found have got; one totals line for a retention pass. The decisions themselves are said by
`Retention.log_decisions`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.config import format_age, format_duration, format_size
from ckptd.decide.planner import DiskSpace, decide
from ckptd.decide.policy import Decision
from ckptd.model import QUIET, Action, Checkpoint, State, Verdict, deciding_check
from ckptd.removal.outcome import DRY_RUN_NOTE

if TYPE_CHECKING:
    from ckptd.daemon.state import DaemonState
    from ckptd.daemon.tracker import RootTracker

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")

# The looks at what a first scan found say how far they have got this often (seconds).
SCAN_PROGRESS_EVERY = 10.0
IN_FLIGHT = frozenset({State.WRITING, State.SETTLING})


class Narrator:
    """What the log says of each checkpoint as its state changes. On the filesystem thread.

    Handed the shared state and `space` (free space counting the trash, for the preview's plan)."""

    def __init__(self, state: DaemonState, *, space: Callable[[Path], DiskSpace]):
        self.state = state
        self.space = space
        # Checkpoints found by a first scan, until each has settled: their first state and
        # decision are debug lines, and one totals line says what became of them (`totals`).
        self.found_at_start: set[tuple[str, str]] = set()
        self.totals_said = False
        self.looks_due: dict[str, int] = {}  # root -> checkpoints found at start, to be looked at
        self.looks_said = 0.0  # monotonic time of the last progress line about them
        self.start_notes: list[str] = []  # what the first scan found, said after "ready"
        self.preview_due = False  # `as_plan_sees_it`, said once the start-up's looks are done

    def first_scan_done(self, now: float) -> None:
        """What the first scan found: each checkpoint's state as said (no line each), the start-up line."""
        roots = self.state.roots
        for rt in roots:
            rt.tracker.take_changes()
        self.found_at_start = {(str(rt.root.path), c.rel) for rt in roots for c in rt.tracker.checkpoints()}
        self.looks_due = {str(rt.root.path): len(rt.tracker.unseen) for rt in roots}
        self.looks_said = now
        self.start_notes = [self.what_comes_next()]
        self.preview_due = True  # what `plan` would show, once every checkpoint found was looked at

    def found(self, root: str, tracker: RootTracker) -> None:
        """What the first scan of a root added at a reload found, as said (its totals come with the rest)."""
        tracker.take_changes()
        self.found_at_start.update((root, c.rel) for c in tracker.checkpoints())

    def let_go(self, root: str) -> None:
        """A root no longer configured (a reload): what it found at start is not waited for."""
        self.found_at_start = {key for key in self.found_at_start if key[0] != root}

    def totals_due(self) -> bool:
        """Everything found at start has settled, and no totals line said so yet."""
        return not self.totals_said and not self.found_at_start

    def what_comes_next(self) -> str:
        """The start-up line: what the daemon waits for, and when it first decides.

        Every checkpoint found at start settles once: it is complete only after the daemon
        itself has seen it unchanged for its quiet period, on the monotonic clock (settle.py),
        so the first decisions come one quiet period after the first scan.
        """
        roots = self.state.roots
        periods = sorted({rt.root.quiet_period for rt in roots}) or [0.0]
        quiet = " to ".join(dict.fromkeys(format_duration(p) for p in (periods[0], periods[-1])))
        head = f"ready: watching {len(roots)} root(s)"
        now = self.state.clock()
        waiting = []
        for rt in roots:
            for c in rt.tracker.in_flight():
                d = rt.tracker.settler.deadline(c.rel)
                if d is None and not c.fingerprint:
                    # Found at start-up, not looked at yet (READY comes first): it settles from its
                    # first look, a quiet period from now at the soonest.
                    d = now + rt.root.quiet_period
                if c.state in IN_FLIGHT and d is not None:
                    waiting.append(d)
        dry = "; dry run: nothing will be deleted" if self.state.dry_run else ""
        if not waiting:
            return (
                f"{head}, no checkpoint in flight: a new one is decided once ckptd has seen it "
                f"unchanged for quiet_period ({quiet}){dry}"
            )
        first = min(waiting) - now
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + first))
        return (
            f"{head}, {len(waiting)} checkpoint(s) settling: ckptd decides about a checkpoint once it "
            f"has itself seen it unchanged for quiet_period ({quiet}; file times are not trusted). "
            f"First decisions at {at} (in {format_age(first)}){dry}"
        )

    def preview(self) -> None:
        """Once every checkpoint found at start was looked at: what `ckptd plan` would show."""
        if self.preview_due and not any(rt.tracker.unseen for rt in self.state.roots):
            # READY came before the looks (tracker.py, `unseen`): the preview waits for them.
            self.preview_due = False
            for line in self.as_plan_sees_it():
                log.info("%s", line)

    def as_plan_sees_it(self) -> list[str]:
        """Meanwhile: the plan by file times, as `ckptd plan` would show it now (not acted on).

        So that the first quiet period is not silent. The daemon decides for itself once
        checkpoints have settled; this only previews what that is likely to be.
        """
        wall = time.time()
        runs = []
        for rt in self.state.roots:
            period = rt.root.quiet_period
            judged = [
                replace(r, checkpoints=tuple(_by_file_times(c, period, wall) for c in r.checkpoints))
                for r in rt.tracker.current_runs()
            ]
            runs.append((rt.root, judged))
        if not any(r.checkpoints for _, rs in runs for r in rs):
            return []
        plan = decide(runs, space=self.space)
        states = collections.Counter(str(d.checkpoint.state) for d in plan.decisions)
        found = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
        acts = []
        for action in (Action.DELETE, Action.SLIM):
            ds = [d for d in plan.decisions if d.action is action]
            if ds:
                more = f" and {len(ds) - 3} more" if len(ds) > 3 else ""
                names = ", ".join(d.checkpoint.rel for d in ds[:3]) + more
                freed = format_size(sum(d.bytes_freed for d in ds))
                acts.append(f"{action} {len(ds)} ({freed}: {names})")
        would = "; would " + ", ".join(acts) if acts else "; nothing to delete or slim"
        return [f"meanwhile, by file times (as `ckptd plan` shows it now): {found}{would}"]

    def first_looks(self, now: float) -> None:
        """Every SCAN_PROGRESS_EVERY seconds while the checkpoints found at start are looked at
        (a few at a time, after READY: minutes on a big volume), how far it has got."""
        if not self.looks_due or now - self.looks_said < SCAN_PROGRESS_EVERY:
            return
        self.looks_said = now
        for rt in self.state.roots:
            total = self.looks_due.get(str(rt.root.path), 0)
            left = len(rt.tracker.unseen)
            if total and left:
                log.info("%s: looked at %d of the %d checkpoints found at start (%d%%)", rt.root.path,
                         total - left, total, 100 * (total - left) // total,
                         extra={"root": str(rt.root.path), "done": total - left, "total": total})
        if not any(rt.tracker.unseen for rt in self.state.roots):
            self.looks_due = {}

    def state_changes(self) -> None:
        """Log what a person watching wants to know, once per change, in path order: a new
        checkpoint, one complete, incomplete (and why), stalled, in flight again, gone.

        Not every look: a checkpoint being written goes writing -> settling -> writing many
        times; those transitions are debug lines (tracker.py). What changed is each tracker's
        report since the last call; `before` is the state then, which is the state the log said
        last (or, while in flight, one it need not say again).
        """
        gone: list[tuple[str, str]] = []
        for rt in self.state.roots:
            root = str(rt.root.path)
            changes = rt.tracker.take_changes().states
            now = [c for _, c in changes.values() if c is not None]
            for c in sorted(now, key=lambda c: (c.run, c.sort_key())):  # path order, as `current_runs`
                before = changes[c.rel][0]
                if before is not None and (c.state is before or {c.state, before} <= IN_FLIGHT):
                    continue
                self._say(root, c, before)
            gone += [(root, rel) for rel, (was, c) in changes.items() if c is None and was is not None]
        for key in gone:
            self.found_at_start.discard(key)
            root, rel = key
            log.info("%s: gone (not by ckptd)", rel, extra={"root": root})

    def _say(self, root: str, c: Checkpoint, before: State | None) -> None:
        """One checkpoint's new state (`state_changes`)."""
        key = (root, c.rel)
        extra = {"root": root, "run": c.run, "checkpoint": c.name, "state": str(c.state)}
        level = logging.INFO
        if c.state is State.COMPLETE:
            what = f"complete ({c.layout}, {format_size(c.size_bytes)})"
            if key in self.found_at_start:  # one of thousands at start: the totals say it
                level = logging.DEBUG
        elif c.state in IN_FLIGHT:
            what = f"new, {c.state}" if before is None else f"{c.state} again (was {before})"
        else:
            what = f"{c.state}: {first_failed(c)}"
        if c.state not in IN_FLIGHT:
            self.found_at_start.discard(key)
        log.log(level, "%s: %s", c.rel, what, extra=extra)

    def totals(self, decisions: tuple[Decision, ...], done: dict[str, int], news: int) -> None:
        """One line for a retention pass: after the first that decided about every checkpoint
        found at start (4,500 checkpoints said one line each before, twice), and after each
        that deletes or slims (a dry run: each whose deletions or slims are news, `news`).
        `kept` counts complete checkpoints kept; `incomplete` the rest."""
        dry_run = self.state.dry_run
        acted = done["deleted"] + done["slimmed"] if not dry_run else news
        first = not self.totals_said and not self.found_at_start
        if not (first or acted):
            return
        self.totals_said = True
        kept = sum(1 for d in decisions if d.action is Action.KEEP and d.checkpoint.state is State.COMPLETE)
        incomplete = sum(1 for d in decisions if d.checkpoint.state is not State.COMPLETE)
        runs = len({(str(d.checkpoint.root), d.checkpoint.run) for d in decisions})
        if dry_run:
            acts = f"would delete {done['would delete']}, would slim {done['would slim']}"
        else:
            acts = (f"{done['deleted']} deleted, {done['slimmed']} slimmed, "
                    f"{format_size(done['freed'])} freed")
        log.info(
            "retention: %d kept, %s, %d incomplete or in flight (%d runs)%s",
            kept, acts, incomplete, runs, f" {DRY_RUN_NOTE}" if dry_run else "",
            extra={"kept": kept, "deleted": done["deleted"], "slimmed": done["slimmed"],
                   "incomplete": incomplete, "bytes_freed": done["freed"], "dry_run": dry_run},
        )


def first_failed(c: Checkpoint) -> str:
    """The check that keeps a checkpoint from complete (`model.deciding_check`), for a state line: a
    live save lease before any, since it holds the checkpoint in flight whatever the others say
    (`model.classify`), and the quiet check before it may be one the lease outlived (`settling:
    unchanged for 1s of 2s` long after)."""
    check = deciding_check(c.checks)
    if check is not None:
        return f"{check.name} {check.verdict}: {check.detail}"
    return "every check passed"


def _by_file_times(c: Checkpoint, quiet_period: float, wall: float) -> Checkpoint:
    """`c` with its quiet check as `ckptd plan` makes it: its newest mtime against the wall clock.

    For the start-up preview only. The daemon itself settles a checkpoint on what it has
    watched, on the monotonic clock (settle.py); a settling checkpoint is judged here.
    """
    if c.state is not State.SETTLING or not c.fingerprint:
        return c  # (no fingerprint: found at start-up, not looked at yet; its mtimes are not known)
    age = wall - c.newest_mtime
    verdict = Verdict.PASSED if age >= quiet_period else Verdict.FAILED  # a future mtime: not quiet
    detail = f"by file times: last change {format_age(age)} ago"
    checks = tuple(replace(k, verdict=verdict, detail=detail) if k.name == QUIET else k for k in c.checks)
    return replace(c, checks=checks)
