"""The filesystem thread's work (`Tick`): the first scan before READY, then one step at each
wake of the loop: look at each root as its deadlines say, settle, and let what changed through
to the log, retention and the state file."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd.daemon.tracker import Changes
from ckptd.errors import RootMissingError
from ckptd.fleet.lease import LocalLeadership

if TYPE_CHECKING:
    from ckptd.daemon.consolidation import Consolidations
    from ckptd.daemon.narration import Narrator
    from ckptd.daemon.retention import Retention
    from ckptd.daemon.roots import RootKeeper, RootRuntime
    from ckptd.daemon.state import DaemonState
    from ckptd.daemon.status import StateFile

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")


class Tick:
    """The daemon's steps on the filesystem thread (the per-root trackers need no locks).

    Handed the shared state and the rooms a step goes through, in the order it calls them, and
    `sync_watches` (the watcher follows the roots configured now)."""

    def __init__(
        self,
        state: DaemonState,
        *,
        keeper: RootKeeper,
        narrator: Narrator,
        retention: Retention,
        consolidations: Consolidations,
        state_file: StateFile,
        sync_watches: Callable[[], None],
    ):
        self.state = state
        self.keeper = keeper
        self.narrator = narrator
        self.retention = retention
        self.consolidations = consolidations
        self.state_file = state_file
        self.sync_watches = sync_watches

    def first_scan(self) -> None:
        d = self.state
        now = d.clock()
        for rt in d.roots:
            if not isinstance(rt.lead, LocalLeadership) and not d.dry_run:
                rt.lead.step()  # a first look now (its thread may not have had one): no false "standby"
            self.keeper.try_lead(rt, attempt=True)
            rt.tracker.full_scan()
            rt.catching_up = False  # this was the scan a lead taken at start-up waits for
            rt.next_poll = now + rt.root.poll_interval
            rt.next_reconcile = now + rt.root.reconcile_interval
            n = len(rt.tracker.checkpoints())
            log.info(
                "%s: %d checkpoint(s) in %d run(s)", rt.root.path, n, len(rt.tracker.runs),
                extra={"root": str(rt.root.path)},
            )
        self.narrator.first_scan_done(now)
        self.sync_watches()
        self._sample_metrics()
        self.state_file.write(force=True)

    def run(self) -> None:
        """One step of work, on the filesystem thread."""
        d = self.state
        now = d.clock()
        hints = []
        while d.hints:
            hints.append(d.hints.popleft())
        # A consolidation ended: its weights go into place, or are dropped; the next one waiting may start.
        retention = self.consolidations.finish_ended()
        changed = False
        for rt in d.roots:
            tr = rt.tracker
            for path in hints:
                tr.hint(path, now)
            changes = Changes()
            reconciled, step = self._look(rt, now, changes)
            retention = retention or reconciled
            if step is None:
                continue
            if rt.last_error is not None:
                log.info("%s: the volume answers again", rt.root.path)
                rt.last_error, rt.failures = None, 0
            completed = changes.completed + step.completed
            d.counters["completed"] += len(completed)
            if completed or changes.vanished or step.vanished:
                retention = True
            changed = changed or retention or bool(changes.transitions or step.transitions)
        narrator, keeper = self.narrator, self.keeper
        narrator.preview()
        if keeper.lead_gained:
            keeper.lead_gained, retention = False, True
        if changed:
            narrator.state_changes()
        if narrator.totals_due():
            # Everything found at start has settled, complete or not: decide (and say so) once
            # even where none completed (all incomplete: a world_size too large says why here).
            retention = True
        self.retention.when_due(now, retention)
        self.sync_watches()
        self.consolidations.say_progress(now)
        narrator.first_looks(now)
        self._sample_metrics()
        self.state_file.write()

    def _sample_metrics(self) -> None:
        if self.state.metrics is not None:
            self.state.metrics.sample(self.state.roots, self.state.clock())

    def _look(self, rt: RootRuntime, now: float, changes: Changes) -> tuple[bool, Changes | None]:
        """Look at one root as its deadlines say (a reconcile, a rescan after an inotify overflow,
        a poll), follow its lead, and step its settling. Returns whether it reconciled, and the
        step's changes (None: the volume did not answer, `_failed`)."""
        d, keeper, tr = self.state, self.keeper, rt.tracker
        reconciled = False
        try:
            if now >= rt.next_reconcile:
                tr.full_scan(changes)
                rt.next_reconcile = now + rt.root.reconcile_interval
                rt.next_poll = now + rt.root.poll_interval
                rt.catching_up = False
                reconciled = True
            elif rt.overflowed:
                rt.overflowed = False
                d.counters["rescans"] += 1
                tr.rescan_in_flight(changes)
                rt.next_poll = now + rt.root.poll_interval
            elif now >= rt.next_poll and rt.standing_by(d.dry_run):
                # The volume loosely (a full scan at reconcile only), but a step every poll all the
                # same: the state file's heartbeat is written at its end (`run`), and `ckptd health`,
                # a Kubernetes liveness probe, judges a standby by it as it judges a leader.
                rt.next_poll = now + rt.root.poll_interval
                keeper.try_lead(rt)
                return reconciled, Changes()
            elif now >= rt.next_poll:
                tr.poll(changes)
                rt.next_poll = now + rt.root.poll_interval
                keeper.try_lead(rt, attempt=True)
                if rt.leader and rt.reaper.trash_pending():  # another process's, maybe renamed late
                    keeper.purge(rt)
            keeper.try_lead(rt)  # a volume lease changes hands on its own thread
            return reconciled, tr.step(now)
        except (OSError, RootMissingError) as exc:
            self._failed(rt, now, exc)
            return reconciled, None

    def _failed(self, rt: RootRuntime, now: float, exc: Exception) -> None:
        # A flaky or unmounted volume (ESTALE, EIO, EACCES, gone): say so once, back off,
        # keep running. Nothing is decided from a scan that failed.
        rt.failures += 1
        delay = min(rt.root.reconcile_interval, rt.root.poll_interval * 2 ** min(rt.failures, 10))
        # The same fault on another path is not news.
        kind = getattr(exc, "strerror", None) or str(exc)
        if kind != rt.last_error:
            rt.last_error = kind
            log.error(
                "%s: cannot look at the volume: %s; retrying in %.1fs", rt.root.path, exc, delay
            )
        rt.next_poll = now + delay
        rt.next_reconcile = max(rt.next_reconcile, rt.next_poll)
