"""Each root as the daemon runs it (`RootRuntime`), and its keeper (`RootKeeper`): the root's
tracker and reaper built from the config, its leadership followed (lead where it is held, stand
by where not), its trash emptied on the purger's thread at idle priority, and what waits in the
trash counted as free space (`RootKeeper.space`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.config import Config, format_size
from ckptd.daemon.tracker import RootTracker
from ckptd.daemon.watch import choose_observer
from ckptd.decide.planner import DiskSpace, disk_space
from ckptd.fleet.etcdlease import EtcdLeadership, etcd_leadership, prefix_mismatch
from ckptd.fleet.kubelease import KubeLeadership, kube_leadership
from ckptd.fleet.lease import (
    Leadership,
    LocalLeadership,
    VolumeLease,
    choose_leadership,
    coherence_note,
    volume_leader_seen,
)
from ckptd.fleet.leaserecord import engine_leader_seen
from ckptd.fleet.locks import LockHeld, RootLock
from ckptd.removal.purge import waiting_in_trash
from ckptd.removal.reaper import Reaper
from ckptd.volume.mounts import AttributeCache, Mount, quiet_for, read_mounts

if TYPE_CHECKING:
    from ckptd.daemon.state import DaemonState

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")


class RootRuntime:
    """One root as the daemon runs it: its tracker, its leadership (lease.py), its reaper."""

    def __init__(self, tracker: RootTracker, lead: Leadership, reaper: Reaper, observer: str):
        self.tracker = tracker
        self.lead = lead
        self.reaper = reaper
        self.observer = observer
        self.leader = False
        self.next_poll = 0.0
        self.next_reconcile = 0.0
        self.overflowed = False
        self.said_standby = False
        self.said_dry_run = False
        self.last_error: str | None = None
        self.failures = 0
        self.outcomes: dict[str, str] = {}  # checkpoint -> the last refusal or failure said about it
        self.dev: int | None = None  # the root's filesystem, as last seen (`RootKeeper.space`)
        self.configured_quiet = tracker.root.quiet_period  # before `effective_root`
        self.catching_up = False  # took over a volume lease: no retention before a full scan
        self.cache: AttributeCache | None = None  # the mount's attribute cache (mounts.py)
        # Why this ckptd stopped deleting here though it holds the lead: the lock it took or the
        # state_dir and journal it opened are no longer the files at their paths (`RootKeeper.footing`).
        self.lost_footing: str | None = None
        self.retake_blocked: str | None = None  # why taking them again failed, as last said

    @property
    def root(self):
        return self.tracker.root

    def role(self, dry_run: bool) -> str:
        """What this daemon does at this root: `leader` (deletes here), `standby` (another ckptd
        holds the root's lock: this one observes), `stopped` (it holds the lead but lost its footing:
        `lost_footing`) or `dry-run` (decides, deletes nothing, no lock)."""
        if dry_run:
            return "dry-run"
        return "stopped" if self.lost_footing is not None else "leader" if self.leader else "standby"

    def standing_by(self, dry_run: bool) -> bool:
        """A standby for a volume lease: it watches the lease closely (its own thread) and the
        volume loosely (a full scan at each reconcile, no polls), and catches up at takeover."""
        return not isinstance(self.lead, LocalLeadership) and not self.leader and not dry_run


def effective_root(root, mounts: list[Mount]):
    """The root with the quiet period its mount's attribute cache calls for (mounts.quiet_for)."""
    quiet, cache, warning = quiet_for(root.path, root.quiet_period, mounts, root.attribute_cache)
    if warning is not None:
        log.warning("%s: %s", root.path, warning)
    if quiet != root.quiet_period:
        root = root.model_copy(update={"quiet_period": quiet})
    return root, cache


class RootKeeper:
    """Builds each root's runtime, follows its leadership and empties its trash, for the daemon.

    On the filesystem thread, but for the purge itself (the purger's thread, `purge_aside`). A
    lease's thread calls `wake` (from any thread) when the lease changes hands."""

    def __init__(
        self,
        state: DaemonState,
        *,
        wake: Callable[[], None],
        purge_aside: Callable[[Callable[[], None]], None],
    ):
        self.state = state
        self.wake = wake
        self.purge_aside = purge_aside
        self.lead_gained = False  # a root's lead was taken: run retention now, not at the next event
        self.purge_stop = False  # the daemon is stopping: a purge leaves the rest of the trash

    def runtime(self, root, config: Config) -> RootRuntime:
        mounts = read_mounts()
        effective, cache = effective_root(root, mounts)
        tracker = RootTracker(effective, self.state.clock, state_dir=self.state.config.daemon.state_dir)
        reaper = self.reaper(tracker, config)
        observer, why = choose_observer(root.path, root.observer)
        log.info("%s: observer=%s (%s)", root.path, observer, why, extra={"root": str(root.path)})
        rt = RootRuntime(tracker, self.leadership(root, config, mounts), reaper, observer)
        rt.configured_quiet, rt.cache = root.quiet_period, cache
        return rt

    def leadership(self, root, config: Config, mounts: list[Mount]) -> Leadership:
        d = config.daemon
        kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent,
                                               etcd=bool(d.etcd.endpoints))
        log.info("%s: leadership=%s (%s)", root.path, kind, why)
        if problem is not None:
            log.error("%s: %s", root.path, problem)
        elif kind == "volume" and (note := coherence_note(root.path, mounts, root.coherent)) is not None:
            log.warning("%s: %s", root.path, note)
        if kind == "local":
            mixed = volume_leader_seen(root.path) or engine_leader_seen(root.path, d.lease_margin)
            if mixed is not None:
                log.warning("%s: %s", root.path, mixed)
            return LocalLeadership(RootLock(d.state_dir, root.path), why, d.lease_margin)
        lease: VolumeLease | EtcdLeadership | KubeLeadership
        if kind == "etcd":
            if (other := prefix_mismatch(root.path, d.etcd.prefix)) is not None:
                log.warning("%s: %s", root.path, other)
            lease = etcd_leadership(root.path, d, why)
        elif kind == "kubernetes":
            lease = kube_leadership(root.path, d, why)
        else:
            lease = VolumeLease(
                root.path, duration=d.lease_duration, margin=d.lease_margin, why=why, problem=problem
            )
        lease.want = not self.state.dry_run
        lease.start(on_change=self.wake)
        return lease

    def reaper(self, tracker: RootTracker, config: Config) -> Reaper:
        return Reaper(
            tracker.scanner,
            self.state.journal,
            dry_run=self.state.dry_run,
            consolidate_timeout=config.daemon.consolidate_timeout,
            trash_grace=config.trash_grace(tracker.scanner.root),
        )

    def try_lead(self, rt: RootRuntime, attempt: bool = False) -> None:
        """Follow the root's leadership: lead where it is held, stand by (observe only) where not.

        A local lock is tried when `attempt`; a volume lease is taken and renewed by its own
        thread, and only looked at here (no I/O).
        """
        dry_run = self.state.dry_run
        if dry_run and not rt.said_dry_run:
            log.info("%s: dry run: deciding, deleting nothing (no lock taken)", rt.root.path,
                     extra={"root": str(rt.root.path), "dry_run": True})
            rt.said_dry_run = True
        if dry_run:
            return
        if attempt and isinstance(rt.lead, LocalLeadership):
            rt.lead.step()
        self.keep_footing(rt)
        held = rt.lead.held() and rt.lost_footing is None
        if held and not rt.leader:
            if not isinstance(rt.lead, LocalLeadership):
                # It stood by looking at the volume loosely: a full scan first (the next tick),
                # and no retention here until it is done (`Retention.run`).
                rt.catching_up, rt.next_reconcile = True, self.state.clock()
            rt.leader, rt.said_standby = True, False
            status = rt.lead.status()
            local = rt.lead.kind == "local"
            how = (f"holds {status['lock']}" if local else f"volume lease, epoch {status['epoch']}"
                   if rt.lead.kind == "volume" else f"{rt.lead.kind}, token {status['epoch']}")
            log.info("%s: this ckptd deletes here (%s)", rt.root.path, how)
            rt.reaper.clear_work()  # what an interrupted consolidation left, into the trash
            self.purge(rt)  # what an earlier run left in the trash
            self.lead_gained = True  # what the standby decided is carried out at the next tick
        elif not held and rt.leader:
            rt.leader = False
            log.warning("%s: standby from now on: this ckptd lost the lead and deletes nothing", rt.root.path)
        elif not held and not rt.said_standby:
            lease = "the etcd lease" if rt.lead.kind == "etcd" else "the volume lease"
            why = rt.lead.blocked or rt.lead.status().get("error") or f"waiting for {lease}"
            log.warning("%s: standby, observing only: %s", rt.root.path, why)
            rt.said_standby = True

    def footing(self, rt: RootRuntime) -> str | None:
        """Why this ckptd must not delete in `rt`'s root now though it leads: the root's lock or its
        state_dir lock is no longer the file it locked (removed, replaced: another ckptd would lock
        a new one there), or the state_dir or journal no longer the ones it opened (what it records
        would go nowhere). Asked at each tick and, through the reaper's fence, before each rename."""
        lock = rt.lead.lock if isinstance(rt.lead, LocalLeadership) else None
        try:
            why = lock.footing() if lock is not None and lock.held else None
            if why is None and self.state.journal is not None:
                why = self.state.journal.footing()
        except OSError as exc:  # cannot tell: as good as lost
            why = f"cannot look at its lock or journal: {exc}"
        return why

    def keep_footing(self, rt: RootRuntime) -> None:
        """Stop deleting in the root when its footing is lost (said once, as an error), and take the
        lock and journal again where that is safe: the files made afresh and locked, with nobody
        else holding them (locks.RootLock.retake: the root directory's own lock, held throughout,
        kept any other ckptd out meanwhile). Until then the root's role is `stopped`."""
        if self.state.dry_run or not (rt.leader or rt.lost_footing is not None):
            return
        why = self.footing(rt)
        if why is None:
            self._regained(rt)
            return
        if rt.lost_footing is None:
            log.error("%s: stopped deleting here: %s", rt.root.path, why, extra={"root": str(rt.root.path)})
            rt.lost_footing, rt.leader = why, False
        try:
            if isinstance(rt.lead, LocalLeadership):
                rt.lead.lock.retake()
            journal = self.state.journal
            if journal is not None and (lost := journal.footing()) is not None:
                journal.reopen(lost)
        except (LockHeld, OSError) as exc:
            if rt.retake_blocked != str(exc):
                log.warning("%s: still deleting nothing: cannot take its lock and journal again: %s",
                            rt.root.path, exc, extra={"root": str(rt.root.path)})
                rt.retake_blocked = str(exc)
            return
        if self.footing(rt) is None:
            self._regained(rt)

    def _regained(self, rt: RootRuntime) -> None:
        if rt.lost_footing is not None:
            log.warning("%s: took its lock and journal again (they were lost: %s); deleting again",
                        rt.root.path, rt.lost_footing, extra={"root": str(rt.root.path)})
        rt.lost_footing = rt.retake_blocked = None

    def purge(self, rt: RootRuntime) -> None:
        if self.state.dry_run:
            return

        rt.reaper.foreign_wait = rt.lead.takeover_wait()  # what another process trashed waits this long
        counters = self.state.counters

        def purge() -> None:
            # A leader that lost the lead leaves the rest of the trash to the one that has it.
            count, freed = rt.reaper.purge(
                stop=lambda: self.purge_stop or not rt.lead.held() or rt.lost_footing is not None
            )
            counters["bytes_reclaimed"] += freed
            if count:
                log.info("%s: purged %d trash entries (%s)", rt.root.path, count, format_size(freed))

        self.purge_aside(purge)

    def space(self, path: Path) -> DiskSpace:
        """Free space on `path`'s filesystem, counting what its roots hold in the trash as freed:
        what this daemon moved there, and what waits there longer (another process's, one a killed
        prune left: removal.purge.waiting_in_trash).

        While a purge runs, an entry it is removing may be counted with what statvfs sees freed
        already: free space is overestimated for a moment, so min_free deletes less, never more.
        """
        space = disk_space(path)
        dev = os.stat(path).st_dev
        pending = 0
        for rt in self.state.roots:
            # Another root gone or unreachable (unmounted, ESTALE) must not stop this one's
            # retention: its filesystem is the one it was last seen on.
            try:
                rt.dev = os.stat(rt.root.path).st_dev
            except OSError:
                pass
            if rt.dev == dev:
                pending += waiting_in_trash(rt.root.path)
        return DiskSpace(free=space.free + pending, total=space.total)
