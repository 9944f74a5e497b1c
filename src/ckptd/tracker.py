"""What the daemon knows of one root, kept up to date by targeted polling and hints.

Synchronous and single-threaded: the daemon calls it only from its one
filesystem worker thread, so it needs no locks of its own (the settler has
one, since hints are recorded from the event loop).

Targeted polling: each poll, stat the directories that lead to runs and the
run directories themselves (re-listing only those whose mtime moved), and
walk only the checkpoints that are not yet complete. Complete checkpoints
are looked at again only at reconcile. A whole-volume snapshot (watchdog's
PollingObserver) would stat every file of every complete checkpoint, every
cycle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.config import Root
from ckptd.discover import RunDir, depth_of, find_runs
from ckptd.evidence import against_siblings, resume_pointers
from ckptd.layouts import TRASH_DIR
from ckptd.model import QUIET, Check, Checkpoint, Run, State, Verdict
from ckptd.planner import Scanner
from ckptd.settle import Settler

log = logging.getLogger("ckptd.tracker")

HINT_DEBOUNCE = 0.05  # after an event, look again this much later (coalesces bursts)


@dataclass
class RunState:
    dir: RunDir
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by name


@dataclass
class Changes:
    """What one step found, for the daemon to act on."""

    completed: list[Checkpoint] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)  # checkpoint paths relative to the root
    transitions: int = 0


class RootTracker:
    def __init__(self, root: Root, clock: Callable[[], float], wall: Callable[[], float] = time.time):
        self.root = root
        self.clock = clock  # monotonic
        self.wall = wall  # only ever holds a checkpoint back (a future mtime), never completes it
        self.not_before: dict[str, float] = {}  # checkpoint rel -> monotonic time its mtimes are past
        self.settler = Settler(root.quiet_period, root.stall_after)
        self.scanner = Scanner(root, quiet=self._quiet)
        self.runs: dict[str, RunState] = {}
        self.dirs: dict[str, int] = {}  # every directory listed on the way to runs -> its mtime_ns
        self.hints: dict[str, float] = {}  # checkpoint rel -> when to look again
        self.dirty_dirs: set[str] = set()
        self.rescans = 0  # targeted rescans after missed events
        self.last_reconcile: float | None = None

    def reconfigure(self, root: Root) -> None:
        """A reloaded config for this root: new scanner (patterns, depth, world sizes), same settler."""
        self.root = root
        self.scanner = Scanner(root, quiet=self._quiet)
        self.settler.quiet_period = root.quiet_period
        self.settler.stall_after = root.stall_after

    def _quiet(self, rel: str, fingerprint: str, newest_ns: int) -> Check:
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

    def _deadline(self, rel: str) -> float | None:
        """When to look at an in-flight checkpoint again: its quiet period's end, or later."""
        d = self.settler.deadline(rel)
        later = self.not_before.get(rel)
        return d if later is None or d is None else max(d, later)

    # --- queries ---------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        return [c for rs in self.runs.values() for c in rs.checkpoints.values()]

    def current_runs(self, *, resume: bool = False) -> list[Run]:
        """The runs as last seen. With `resume`, each run's resume pointers (DeepSpeed's `latest`)
        are read afresh: retention needs them, the state file's heartbeat does not."""
        return [
            Run(
                self.root.path,
                rel,
                tuple(sorted(rs.checkpoints.values(), key=Checkpoint.sort_key)),
                resume_pointers(rs.dir.path, rs.dir.names) if resume else {},
            )
            for rel, rs in sorted(self.runs.items())
        ]

    def in_flight(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints() if c.state is not State.COMPLETE]

    def next_deadline(self) -> float | None:
        """The earliest time something here needs looking at again."""
        times = list(self.hints.values())
        for c in self.in_flight():
            if c.state in (State.WRITING, State.SETTLING):
                d = self._deadline(c.rel)
                if d is not None:
                    times.append(d)
        return min(times) if times else None

    def wanted_watches(self) -> set[tuple[str, bool]]:
        """(path, recursive): the directories on the way to runs, and in-flight checkpoints deeply.

        Not a checkpoint the daemon has never seen change whose files are all older than the
        quiet period by the wall clock: at start-up that is nearly every checkpoint on the
        volume (each settles once), most finished long ago, and a deep watch costs a thread
        and a watch per directory. The wall clock only chooses what to watch, it never
        completes anything; polls and the look at the quiet period's end cover these.
        """
        watches = {(str(self._abs(rel)), False) for rel in self.dirs}
        wall = time.time()
        for c in self.in_flight():
            if c.state is State.STALLED or not c.path.is_dir():
                continue
            if c.state is State.SETTLING and wall - c.newest_mtime > self.root.quiet_period:
                continue
            watches.add((str(c.path), True))
        return watches

    # --- hints (from inotify, via the loop) --------------------------------

    def hint(self, path: str, now: float) -> None:
        """Something changed at `path`. Record it; the disk is looked at in `step`."""
        try:
            rel = os.path.relpath(path, self.root.path)
        except ValueError:
            return
        if rel.startswith(("..", TRASH_DIR)):
            return
        parts = rel.split(os.sep) if rel != "." else []
        for i in range(len(parts), -1, -1):  # the deepest known run holding the path
            run_rel = "/".join(parts[:i]) or "."
            rs = self.runs.get(run_rel)
            if rs is None:
                continue
            rest = parts[i:]
            if rest and rest[0] in rs.checkpoints:
                key = rest[0] if run_rel == "." else f"{run_rel}/{rest[0]}"
                self.settler.touch(key, now)
                self.hints[key] = now + HINT_DEBOUNCE
            else:
                self.dirty_dirs.add(run_rel)  # the run's own entries: a new or removed checkpoint
            return
        for i in range(len(parts) - 1, -1, -1):  # else the deepest directory we list
            d = "/".join(parts[:i]) or "."
            if d in self.dirs:
                self.dirty_dirs.add(d)
                return

    # --- looking at the disk -------------------------------------------------

    def full_scan(self, changes: Changes | None = None, *, complete_too: bool = True) -> Changes:
        """Discover every run and look at every checkpoint (reconcile)."""
        changes = changes or Changes()
        self.scanner.check_root()
        visited: dict[str, int] = {}
        found = find_runs(
            self.root.path, max_depth=self.root.max_depth, patterns=self.scanner.patterns, visited=visited
        )
        self.dirs = visited
        found = self.scanner.in_scope(found)
        seen = {d.rel for d in found}
        for rel in [r for r in self.runs if r not in seen]:
            self._drop_run(rel, changes)
        for d in found:
            self._update_run(d, changes, complete_too=complete_too)
        self.dirty_dirs.clear()
        self.last_reconcile = self.clock()
        return changes

    def poll(self, changes: Changes | None = None) -> Changes:
        """One targeted polling cycle: re-list moved directories, walk in-flight checkpoints."""
        changes = changes or Changes()
        for rel, mtime in list(self.dirs.items()):
            try:
                now_mtime = os.stat(self._abs(rel), follow_symlinks=False).st_mtime_ns
            except OSError:
                now_mtime = -1
            if now_mtime != mtime:
                self.dirty_dirs.add(rel)
        self._relist_dirty(changes)
        # By name: a list of the Checkpoints themselves would keep every replaced one (and its
        # entries) alive until the loop ends; on a large volume that was 170 MiB at the peak.
        for run, name in [(c.run, c.name) for c in self.in_flight()]:
            self._look(run, name, changes)
        return changes

    def step(self, now: float) -> Changes:
        """Act on hints and deadlines that are due."""
        changes = Changes()
        self._relist_dirty(changes)
        due = {k for k, t in self.hints.items() if t <= now}
        for c in self.in_flight():
            d = self._deadline(c.rel)
            if c.state in (State.WRITING, State.SETTLING) and d is not None and d <= now:
                due.add(c.rel)
        for key in due:
            self.hints.pop(key, None)
            run_rel, _, name = key.rpartition("/")
            self._look(run_rel or ".", name, changes)
        return changes

    def rescan_in_flight(self, changes: Changes | None = None) -> Changes:
        """After missed events (queue overflow, no watch): a poll, not a re-walk of the volume."""
        self.rescans += 1
        log.warning("%s: events may have been missed; rescanning in-flight checkpoints", self.root.path)
        return self.poll(changes)

    # --- internals ----------------------------------------------------------

    def _abs(self, rel: str) -> Path:
        return self.root.path if rel == "." else self.root.path / rel

    def _relist_dirty(self, changes: Changes) -> None:
        """Re-discover below each directory whose entries changed, and only there."""
        dirty, self.dirty_dirs = self.dirty_dirs, set()
        for rel in sorted(dirty, key=lambda r: (r != ".", r.count("/"), r)):
            if any(d != rel and _under(rel, d) for d in dirty):
                continue  # an ancestor is re-listed anyway
            depth = depth_of(rel)  # framework-made directories on the way are not counted (discover.py)
            visited: dict[str, int] = {}
            found = find_runs(
                self._abs(rel),
                max_depth=self.root.max_depth - depth,
                patterns=self.scanner.patterns,
                visited=visited,
            )
            for d in [d for d in self.dirs if _under(d, rel)]:
                del self.dirs[d]
            self.dirs.update({_join(rel, v): m for v, m in visited.items()})
            found_runs = {_join(rel, r.rel): r for r in found if self.root.in_scope(_join(rel, r.rel))}
            for run_rel in [r for r in self.runs if _under(r, rel) and r not in found_runs]:
                self._drop_run(run_rel, changes)
            for run_rel, r in found_runs.items():
                self._update_run(
                    RunDir(self.root.path, run_rel, r.names, r.candidates), changes, complete_too=False
                )

    def _update_run(self, run_dir: RunDir, changes: Changes, *, complete_too: bool) -> None:
        rs = self.runs.get(run_dir.rel)
        if rs is None:
            rs = self.runs[run_dir.rel] = RunState(run_dir)
            log.debug("%s: new run", run_dir.rel)
        rs.dir = run_dir
        names = {c.name for c in run_dir.candidates}
        for name in [n for n in rs.checkpoints if n not in names]:
            self._vanish(rs, name, changes)
        for cand in run_dir.candidates:
            old = rs.checkpoints.get(cand.name)
            if old is None or complete_too or old.state is not State.COMPLETE:
                self._record(rs, self.scanner.inspect(run_dir, cand, now=0.0), old, changes, cand.name)
            if old is None:
                # Look again once its watch exists: writes between this first look and the watch
                # send no event, and would otherwise wait for the next poll (BENCHMARKS.md, latency).
                key = cand.name if run_dir.rel == "." else f"{run_dir.rel}/{cand.name}"
                self.hints[key] = self.clock() + HINT_DEBOUNCE

    def _look(self, run_rel: str, name: str, changes: Changes) -> None:
        rs = self.runs.get(run_rel)
        if rs is None or name not in rs.checkpoints:
            return
        cand = next((c for c in rs.dir.candidates if c.name == name), None)
        fresh = self.scanner.inspect(rs.dir, cand, now=0.0) if cand else None
        self._record(rs, fresh, rs.checkpoints[name], changes, name)

    def _record(
        self, rs: RunState, fresh: Checkpoint | None, old: Checkpoint | None, changes: Changes, name: str
    ) -> None:
        if fresh is None:
            if old is not None:
                self._vanish(rs, name, changes)
            return
        fresh = against_siblings(fresh, rs.checkpoints.values())
        if fresh.state is State.INCOMPLETE:
            stall = self.settler.stall_check(fresh.rel, self.clock())
            if stall is not None:
                fresh = replace(fresh, checks=(*fresh.checks, stall))
        rs.checkpoints[name] = fresh
        before = old.state if old is not None else None
        if fresh.state is not before:
            changes.transitions += 1
            log.debug(
                "%s: %s -> %s (%s)",
                fresh.rel,
                before or "new",
                fresh.state,
                _why(fresh),
                extra={"run": fresh.run, "checkpoint": fresh.name, "state": str(fresh.state)},
            )
            if fresh.state is State.COMPLETE:
                changes.completed.append(fresh)

    def _vanish(self, rs: RunState, name: str, changes: Changes) -> None:
        c = rs.checkpoints.pop(name)
        self.settler.forget(c.rel)
        self.not_before.pop(c.rel, None)
        self.hints.pop(c.rel, None)
        changes.vanished.append(c.rel)
        log.debug("%s: gone", c.rel)

    def _drop_run(self, rel: str, changes: Changes) -> None:
        rs = self.runs.pop(rel)
        for name in list(rs.checkpoints):
            self._vanish(rs, name, changes)

    def look_again(self, rel: str) -> None:
        """A checkpoint we changed ourselves (slimmed): take its new form in."""
        run_rel, _, name = rel.rpartition("/")
        self._look(run_rel or ".", name, Changes())

    def forget(self, rel: str) -> None:
        """A checkpoint the reaper moved to the trash."""
        run_rel, _, name = rel.rpartition("/")
        rs = self.runs.get(run_rel or ".")
        if rs is not None and name in rs.checkpoints:
            self._vanish(rs, name, Changes())


def _under(path: str, rel: str) -> bool:
    """Whether `path` is `rel` or below it (both relative to the root; "." is the root)."""
    return rel == "." or path == rel or path.startswith(f"{rel}/")


def _join(rel: str, sub: str) -> str:
    if sub == ".":
        return rel
    return sub if rel == "." else f"{rel}/{sub}"


def _why(c: Checkpoint) -> str:
    for check in c.checks:
        if check.verdict.value != "passed":
            return f"{check.name}: {check.detail}"
    return "every check passed"
