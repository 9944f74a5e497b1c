"""The filesystem thread's work (`Tick`): the first scan before READY, then one step at each
wake of the loop: look at each root as its deadlines say, settle, and let what changed through
to the log, retention and the state file."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ckptd.daemon.tracker import Changes
from ckptd.errors import RootMissingError
from ckptd.fleet.lease import LocalLeadership

if TYPE_CHECKING:
    from ckptd.daemon.core import Daemon
    from ckptd.daemon.roots import RootRuntime

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")


class Tick:
    """The daemon's steps on the filesystem thread (the per-root trackers need no locks)."""

    def __init__(self, daemon: Daemon):
        self.d = daemon

    def first_scan(self) -> None:
        d = self.d
        now = d.clock()
        for rt in d.roots:
            if not isinstance(rt.lead, LocalLeadership) and not d.dry_run:
                rt.lead.step()  # a first look now (its thread may not have had one): no false "standby"
            d.keeper.try_lead(rt, attempt=True)
            rt.tracker.full_scan()
            rt.catching_up = False  # this was the scan a lead taken at start-up waits for
            rt.next_poll = now + rt.root.poll_interval
            rt.next_reconcile = now + rt.root.reconcile_interval
            n = len(rt.tracker.checkpoints())
            log.info(
                "%s: %d checkpoint(s) in %d run(s)", rt.root.path, n, len(rt.tracker.runs),
                extra={"root": str(rt.root.path)},
            )
        d.narrator.first_scan_done(now)
        d._sync_watches()
        d._sample_metrics()
        d.state_file.write(force=True)

    def run(self) -> None:
        """One step of work, on the filesystem thread."""
        d = self.d
        now = d.clock()
        hints = []
        while d._hints:
            hints.append(d._hints.popleft())
        # A consolidation ended: its weights go into place, or are dropped; the next one waiting may start.
        retention = d.consolidations.finish_ended()
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
        d.narrator.preview()
        if d.keeper.lead_gained:
            d.keeper.lead_gained, retention = False, True
        if changed:
            d.narrator.state_changes()
        if d.narrator.totals_due():
            # Everything found at start has settled, complete or not: decide (and say so) once
            # even where none completed (all incomplete: a world_size too large says why here).
            retention = True
        d.retention.when_due(now, retention)
        d._sync_watches()
        d.consolidations.say_progress(now)
        d.narrator.first_looks(now)
        d._sample_metrics()
        d.state_file.write()

    def _look(self, rt: RootRuntime, now: float, changes: Changes) -> tuple[bool, Changes | None]:
        """Look at one root as its deadlines say (a reconcile, a rescan after an inotify overflow,
        a poll), follow its lead, and step its settling. Returns whether it reconciled, and the
        step's changes (None: the volume did not answer, `_failed`)."""
        d, tr = self.d, rt.tracker
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
                d.keeper.try_lead(rt)
                return reconciled, Changes()
            elif now >= rt.next_poll:
                tr.poll(changes)
                rt.next_poll = now + rt.root.poll_interval
                d.keeper.try_lead(rt, attempt=True)
                if rt.leader and rt.reaper.trash_pending():  # another process's, maybe renamed late
                    d.keeper.purge(rt)
            d.keeper.try_lead(rt)  # a volume lease changes hands on its own thread
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
