"""What the daemon knows of one root, kept up to date by targeted polling and hints.

Synchronous and single-threaded: the daemon calls it only from its one
filesystem worker thread, so it needs no locks of its own (the settler has
one, since hints are recorded from the event loop).

Targeted polling: each poll, stat the directories that lead to runs and the
run directories themselves (re-listing only those whose mtime moved), and
walk only the checkpoints that are not yet complete. A whole-volume snapshot
(watchdog's PollingObserver) would stat every file of every complete
checkpoint, every cycle.

What a look costs is bounded by what can have changed:
- A complete checkpoint is walked again at reconcile only when one of its
  directories changed (a stat each: O(directories), not O(files)), or the run
  directory's other entries did (markers, trackers), or after a reload. A file
  rewritten in place changes no directory: the reaper walks every entry again
  before it acts, and a refusal sends the tracker to look (`refused`).
- An incomplete or stalled checkpoint (a crashed rank's save, left for good)
  is walked at every poll only at first: each look that finds it unchanged
  doubles the polls until the next one, up to BACKOFF_RECONCILES reconcile
  intervals. Between looks, polls and reconciles alike stat its directories,
  the files that failed their check and the run's context (a Megatron
  tracker); any change there, or an inotify event, looks at once. (Every
  reconcile walking 20 stalled 64-rank checkpoints would cost more than the
  0.02 % of a core they may add on the M volume: BENCHMARKS.md, stalled checkpoints.)

Here: what is on the disk (runs, checkpoints, the directories on the way), what to
watch, and how hints and polls turn into looks. When each checkpoint is due for its
next look (quiet periods, a future mtime, hints' debounce, the back-off above) is
schedule.py's `LookSchedule`, which the tracker holds and asks.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.config import Root
from ckptd.daemon.schedule import HINT_DEBOUNCE as HINT_DEBOUNCE  # where tests and bench import it from
from ckptd.daemon.schedule import Backoff, LookSchedule
from ckptd.decide.planner import Scanner, run_context
from ckptd.discover.layouts import HIDDEN_TRASH, LEASE_DIR, TRASH_DIR
from ckptd.discover.runs import RunDir, depth_of, find_runs
from ckptd.judge.census import against_sibling_kinds, against_siblings
from ckptd.judge.evidence import resume_pointers
from ckptd.judge.settle import Settler
from ckptd.model import QUIET, Candidate, Check, Checkpoint, Run, State, Verdict

log = logging.getLogger("ckptd.daemon.tracker")

UNSEEN_BUDGET = 0.2  # seconds a step spends on checkpoints not looked at since start-up


@dataclass
class RunState:
    dir: RunDir
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by name
    context: object = None  # what of the run directory its checkpoints' evidence read (`_context`)


@dataclass
class Changes:
    """What one step found, for the daemon to act on; and, kept by the tracker across steps, each
    checkpoint whose state changed since the last `RootTracker.take_changes` (what the log says)."""

    completed: list[Checkpoint] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)  # checkpoint paths relative to the root
    transitions: int = 0
    # By checkpoint rel: its state before its first change here (None: new), and the checkpoint as
    # last looked at (None: gone). One entry per checkpoint however often it changed meanwhile.
    states: dict[str, tuple[State | None, Checkpoint | None]] = field(default_factory=dict)

    def changed(self, rel: str, before: State | None, after: Checkpoint | None) -> None:
        """`rel` went from `before` to `after` (its state before any earlier change here is kept)."""
        first = self.states.get(rel)
        self.states[rel] = (before if first is None else first[0], after)


class RootTracker:
    def __init__(
        self,
        root: Root,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        *,
        state_dir: Path | None = None,
    ):
        self.root = root
        self.clock = clock  # monotonic
        self.state_dir = state_dir  # where what was read from files is kept across restarts
        self.schedule = LookSchedule(root, clock, wall)  # when each checkpoint is looked at again
        self.scanner = Scanner(root, quiet=self.schedule.quiet, state_dir=state_dir)
        self.runs: dict[str, RunState] = {}
        self.dirs: dict[str, int] = {}  # every directory listed on the way to runs -> its mtime_ns
        self.dirty_dirs: set[str] = set()
        # Every checkpoint not complete, by rel: kept as they change, so that the questions each
        # tick asks (what is in flight, the next deadline, what to watch) do not go through every
        # checkpoint of the volume (6,400 on the L volume; the loop asks between every two ticks).
        self.flying: dict[str, Checkpoint] = {}
        self.version = 0  # bumped when what the state file shows changes (a checkpoint's state or size)
        # Every change of a checkpoint's state since `take_changes`, from any look (a poll, a step,
        # a reconcile, a reload's scan, a look after a slim or a refusal): the narrator's news.
        self.pending = Changes()
        self.unseen: collections.deque[str] = collections.deque()  # found at start-up, not looked at yet
        self.deep_next = False  # the next reconcile walks complete checkpoints too (after a reload)
        self.rescans = 0  # targeted rescans after missed events
        self.last_reconcile: float | None = None

    def reconfigure(self, root: Root) -> None:
        """A reloaded config for this root: new scanner (patterns, depth, world sizes), same settler.

        What was read from files stays (it does not depend on the config); the next reconcile
        walks every checkpoint again, complete ones included (pins, patterns, world sizes).
        """
        self.root = root
        verdicts = self.scanner.verdicts
        self.scanner = Scanner(root, quiet=self.schedule.quiet, state_dir=self.state_dir, verdicts=verdicts)
        self.schedule.reconfigure(root)
        self.deep_next = True

    # The schedule's own, read here by the daemon (status, narration: the settler) and tests.
    @property
    def settler(self) -> Settler:
        return self.schedule.settler

    @property
    def hints(self) -> dict[str, float]:
        return self.schedule.hints

    @property
    def backoff(self) -> dict[str, Backoff]:
        return self.schedule.backoff

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

    def take_changes(self) -> Changes:
        """The checkpoints whose state changed since the last call (`Changes.states`), and forget them."""
        taken, self.pending = self.pending, Changes()
        return taken

    def in_flight(self) -> list[Checkpoint]:
        return list(self.flying.values())

    def next_deadline(self) -> float | None:
        """The earliest time something here needs looking at again (now, while start-up's looks wait)."""
        return self.schedule.next_deadline(self.in_flight(), now=self.clock() if self.unseen else None)

    # --- hints (from watchdog, via the loop) --------------------------------

    def hint(self, path: str, now: float) -> None:
        """Something changed at `path`. Record it; the disk is looked at in `step`.

        The root is watched recursively (watch.py), so paths arrive from everywhere below it;
        only these matter: anything inside a checkpoint, an entry of a run directory, an entry
        of a directory that discovery lists. Not ckptd's own (the trash, the lease), and not
        what is deeper elsewhere (a dataset, a logger's files): its directory's entry was.
        """
        try:
            rel = os.path.relpath(path, self.root.path)
        except ValueError:
            return
        parts = rel.split(os.sep) if rel != "." else []
        if rel.startswith(".."):
            return
        if parts and (parts[0] in (TRASH_DIR, LEASE_DIR) or parts[0].startswith(HIDDEN_TRASH)):
            return
        for i in range(len(parts), -1, -1):  # the deepest known run holding the path
            run_rel = "/".join(parts[:i]) or "."
            rs = self.runs.get(run_rel)
            if rs is None:
                continue
            rest = parts[i:]
            if rest and rest[0] in rs.checkpoints:
                key = rest[0] if run_rel == "." else f"{run_rel}/{rest[0]}"
                self.schedule.touched(key, now)
            elif len(rest) <= 1:
                self.dirty_dirs.add(run_rel)  # the run's own entries: a new or removed checkpoint
            return
        parent = "/".join(parts[:-1]) or "."  # else an entry of a directory we list
        if parts and parent in self.dirs:
            self.dirty_dirs.add(parent)

    # --- looking at the disk -------------------------------------------------

    def full_scan(self, changes: Changes | None = None, *, deep: bool = False) -> Changes:
        """Discover every run and look at every checkpoint (reconcile).

        A complete checkpoint is walked again only if `deep` (or after a reload), if one of its
        directories changed, or if its run directory's other entries did; else a stat of each
        of its directories is all it costs. Then what was read is saved to `state_dir`.
        """
        changes = changes or Changes()
        deep = deep or self.deep_next
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
            self._update_run(d, changes, complete_too=True, deep=deep)
        self.dirty_dirs.clear()
        self.deep_next = False
        self.last_reconcile = self.clock()
        self.scanner.verdicts.retain(str(c.path) for c in self.checkpoints())
        self.scanner.save_verdicts()
        return changes

    def poll(self, changes: Changes | None = None) -> Changes:
        """One targeted polling cycle: re-list moved directories, walk in-flight checkpoints
        (incomplete and stalled ones only when their back-off says, or when a stat shows a change)."""
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
        # entries) alive until the loop ends: 170 MiB more at the peak on a large volume.
        wall = time.time()
        for c in self.in_flight():
            if not c.fingerprint:
                continue  # not looked at yet since start-up: `step` does, a few at a time
            if (
                c.state is State.SETTLING
                and wall - c.newest_mtime > self.root.quiet_period
                and self._dirs_unchanged(c, whole=False)
            ):
                continue  # written long ago, its directories unchanged: its quiet period's end looks
            if self._due(c.run, c.name):
                self._look(c.run, c.name, changes)
        return changes

    def step(self, now: float) -> Changes:
        """Act on hints and deadlines that are due; look at some of the checkpoints not yet seen."""
        changes = Changes()
        self._relist_dirty(changes)
        budget = time.monotonic() + UNSEEN_BUDGET
        starting = bool(self.unseen)
        while self.unseen and time.monotonic() < budget:  # a few at a time: events are not kept waiting
            run_rel, _, name = self.unseen[0].rpartition("/")
            self._look(run_rel or ".", name, changes)  # (an OSError leaves it in the queue)
            self.unseen.popleft()
        if starting and not self.unseen:
            self.scanner.save_verdicts()  # the start-up's looks, for the next start
        for key in self.schedule.due(now, self.in_flight()):
            self.schedule.spent(key)
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
                below_root=rel != ".",
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

    def _update_run(
        self, run_dir: RunDir, changes: Changes, *, complete_too: bool, deep: bool = False
    ) -> None:
        rs = self.runs.get(run_dir.rel)
        if rs is None:
            rs = self.runs[run_dir.rel] = RunState(run_dir)
            self.version += 1
            log.debug("%s: new run", run_dir.rel)
        rs.dir = run_dir
        names = {c.name for c in run_dir.candidates}
        for name in [n for n in rs.checkpoints if n not in names]:
            self._vanish(rs, name, changes)
        context = self._context(run_dir)
        if context != rs.context:  # a marker, a tracker, a pin file beside them: look at them all
            deep = complete_too = rs.context is not None
            rs.context = context
        starting = self.last_reconcile is None
        for cand in run_dir.candidates:
            old = rs.checkpoints.get(cand.name)
            if old is None and starting:
                self._first_sight(rs, run_dir, cand, changes)
                continue
            if old is None:
                look = True
            elif old.state is State.COMPLETE:
                look = complete_too and (deep or not self._dirs_unchanged(old))
            else:
                look = deep or self._due(run_dir.rel, cand.name)
            if look:
                self._record(rs, self.scanner.inspect(run_dir, cand, now=0.0), old, changes, cand.name)
            if old is None:
                # Look again once its watch exists: writes between this first look and the watch
                # send no event, and would otherwise wait for the next poll (BENCHMARKS.md, latency).
                self.schedule.soon(cand.name if run_dir.rel == "." else f"{run_dir.rel}/{cand.name}")

    def _first_sight(self, rs: RunState, run_dir: RunDir, cand: Candidate, changes: Changes) -> None:
        """At start-up, not a look at every file of the volume before READY: a checkpoint as it was
        saved in state_dir, if its directories are unchanged (settling; walked in full when its
        quiet period ends, as any checkpoint is before it counts as complete), else a placeholder
        looked at after READY, a few at a time (`unseen`). Nothing is complete before its look."""
        key = cand.name if run_dir.rel == "." else f"{run_dir.rel}/{cand.name}"
        restored = self.scanner.restore(run_dir, cand, now=0.0)
        if restored is not None:
            self._record(rs, restored, None, changes, cand.name)
            if time.time() - restored.newest_mtime <= self.root.quiet_period:
                self.schedule.soon(key)  # being written: look once watched
            return
        unseen = Check(QUIET, Verdict.UNKNOWN, "settling: not looked at yet (ckptd just started)")
        placeholder = Checkpoint(self.root.path, run_dir.rel, cand.name, cand.step, cand.layout, (unseen,),
                                 unit=cand.unit)  # ordered as it will be (planner.experiments)
        self._record(rs, placeholder, None, changes, cand.name)
        self.unseen.append(key)

    def _look(self, run_rel: str, name: str, changes: Changes) -> None:
        rs = self.runs.get(run_rel)
        if rs is None or name not in rs.checkpoints:
            return
        cand = next((c for c in rs.dir.candidates if c.name == name), None)
        fresh = self.scanner.inspect(rs.dir, cand, now=0.0) if cand else None
        self._record(rs, fresh, rs.checkpoints[name], changes, name)

    def _context(self, run_dir: RunDir) -> object:
        return run_context(run_dir)

    def _dirs_unchanged(self, c: Checkpoint, *, whole: bool = True) -> bool:
        return self.scanner.verdicts.dirs_unchanged(str(c.path), c.fingerprint, whole=whole)

    def _due(self, run_rel: str, name: str) -> bool:
        """Whether to look at an in-flight checkpoint now: always, unless it is incomplete or stalled
        and backed off, its back-off not yet run out, and nothing it depends on shows a change:
        its directories, the files that failed their check, the run directory's context."""
        rs = self.runs.get(run_rel)
        c = rs.checkpoints.get(name) if rs is not None else None
        if c is None or not self.schedule.backed_off(c.rel):
            return True
        path = str(c.path)
        verdicts = self.scanner.verdicts
        if not verdicts.dirs_unchanged(path, c.fingerprint, verdicts.problems(path), whole=False):
            return True
        if self._context(rs.dir) != rs.context:  # type: ignore[union-attr]
            return True
        self.schedule.skipped(c.rel)
        return False

    def _record(
        self, rs: RunState, fresh: Checkpoint | None, old: Checkpoint | None, changes: Changes, name: str
    ) -> None:
        if fresh is None:
            if old is not None:
                self._vanish(rs, name, changes)
            return
        fresh = against_siblings(fresh, rs.checkpoints.values())
        fresh = against_sibling_kinds(fresh, rs.checkpoints.values())
        fresh = self.schedule.looked(fresh, old)  # the stall check; the back-off
        rs.checkpoints[name] = fresh
        if old is None or (old.state, old.size_bytes) != (fresh.state, fresh.size_bytes):
            self.version += 1
        if fresh.state is State.COMPLETE:
            self.flying.pop(fresh.rel, None)
        else:
            self.flying[fresh.rel] = fresh
        before = old.state if old is not None else None
        if fresh.state is not before or fresh.rel in self.pending.states:  # (news of it as it is now)
            self.pending.changed(fresh.rel, before, fresh)
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

    def _vanish(self, rs: RunState, name: str, changes: Changes, *, trashed: bool = False) -> None:
        c = rs.checkpoints.pop(name)
        self.flying.pop(c.rel, None)
        self.version += 1
        self.schedule.forget(c.rel)
        self.scanner.verdicts.forget(str(c.path))
        changes.vanished.append(c.rel)
        if trashed:  # ckptd's own doing, said as a deletion (retention.py): no news of it
            self.pending.states.pop(c.rel, None)
        else:
            self.pending.changed(c.rel, c.state, None)
        log.debug("%s: gone", c.rel)

    def _drop_run(self, rel: str, changes: Changes) -> None:
        rs = self.runs.pop(rel)
        self.version += 1
        for name in list(rs.checkpoints):
            self._vanish(rs, name, changes)

    def look_again(self, rel: str) -> None:
        """A checkpoint we changed ourselves (slimmed): take its new form in."""
        run_rel, _, name = rel.rpartition("/")
        self._look(run_rel or ".", name, Changes())

    def refused(self, rel: str) -> None:
        """The reaper's re-check refused to act on `rel`: what it found differs from what we hold
        (a file rewritten in place changes no directory, so reconciles do not see it). Look at it,
        and at its run's newest complete checkpoint (the anchor the re-check also compared)."""
        run_rel, _, name = rel.rpartition("/")
        rs = self.runs.get(run_rel or ".")
        if rs is None:
            return
        complete = [c for c in rs.checkpoints.values() if c.state is State.COMPLETE]
        anchor = max(complete, key=Checkpoint.sort_key).name if complete else None
        for n in {name, anchor} - {None}:
            self._look(run_rel or ".", n, Changes())  # type: ignore[arg-type]

    def forget(self, rel: str) -> None:
        """A checkpoint the reaper moved to the trash."""
        run_rel, _, name = rel.rpartition("/")
        rs = self.runs.get(run_rel or ".")
        if rs is not None and name in rs.checkpoints:
            self._vanish(rs, name, Changes(), trashed=True)


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
