"""A reload's new config swapped in on the filesystem thread (`apply_config`): what is known of
the roots that stay is kept (a reload does not restart quiet periods), new roots are scanned,
roots no longer configured let go, and what cannot change without a restart says so."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ckptd.config import Config
from ckptd.daemon.roots import RootRuntime, effective_root
from ckptd.fleet.lease import LocalLeadership
from ckptd.journal import Journal
from ckptd.volume.mounts import Mount, read_mounts

if TYPE_CHECKING:
    from ckptd.daemon.core import Daemon

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")


def apply_config(d: Daemon, new: Config) -> None:
    """Swap in a new config on the fs thread: keep what is known of roots that stay."""
    dry_run = d.cli_dry_run or new.daemon.dry_run
    if dry_run != d.dry_run:
        _switch_dry_run(d, dry_run)
    old = d.config.daemon
    leading = ("leadership", "lease_duration", "lease_margin", "etcd", "kubernetes")
    if [getattr(new.daemon, k) for k in leading] != [getattr(old, k) for k in leading]:
        log.warning("daemon.leadership/lease_*/etcd/kubernetes: changes take effect at the next start, "
                    "not at a reload")
    mounts = read_mounts()
    by_path = {rt.root.path: rt for rt in d.roots}
    keep: list[RootRuntime] = []
    for root in new.roots:
        rt = by_path.pop(root.path, None)
        if rt is None:
            rt = _new_root(d, root, new)
        else:
            _look_again(d, rt, root, new, mounts)
        rt.next_poll = min(rt.next_poll, d.clock() + root.poll_interval)
        keep.append(rt)
    if new.daemon.metrics_listen != d.config.daemon.metrics_listen:
        log.warning("daemon.metrics_listen changed: it takes effect at the next start, not at a reload")
    if new.daemon.state_dir != d.config.daemon.state_dir:
        log.warning("daemon.state_dir changed: it takes effect at the next start, not at a reload")
    for rt in by_path.values():
        log.info("%s: no longer configured", rt.root.path)
        rt.lead.stop()
    d.roots = keep
    d.config = new
    d.retention.decisions.clear()
    d.consolidations.failed.clear()  # a new timeout or setting may let them through
    d.retention.version += 1
    d.retention.run()
    d._sync_watches()


def _switch_dry_run(d: Daemon, dry_run: bool) -> None:
    log.info("dry run %s", "on: deleting nothing from now on" if dry_run else "off: deleting again")
    d.dry_run = dry_run
    if not dry_run and d.journal is None:
        d.journal = Journal(d.config.daemon.state_dir)
    for rt in d.roots:
        if not isinstance(rt.lead, LocalLeadership):
            rt.lead.want = not dry_run  # its thread hands the lease back, or takes it again
        elif dry_run:
            rt.lead.release()
        if dry_run:
            rt.leader, rt.said_standby = False, False


def _new_root(d: Daemon, root, new: Config) -> RootRuntime:
    """A root the new config adds: scanned now, its checkpoints as found at start."""
    rt = d.keeper.runtime(root, new)
    d.keeper.try_lead(rt)
    rt.tracker.full_scan()
    found = rt.tracker.checkpoints()
    log.info("%s: %d checkpoint(s) in %d run(s)", root.path, len(found), len(rt.tracker.runs),
             extra={"root": str(root.path)})
    d.narrator.found(str(root.path), found)
    return rt


def _look_again(d: Daemon, rt: RootRuntime, root, new: Config, mounts: list[Mount]) -> None:
    """A root that stays: patterns, depth, world sizes may have changed."""
    if root.observer != rt.root.observer:
        log.warning("%s: observer changed: it takes effect at the next start", root.path)
    # Patterns, depth, world sizes may have changed: look again with the new eyes,
    # keeping what the settler knows (a reload does not restart quiet periods).
    effective, rt.cache = effective_root(root, mounts)
    rt.configured_quiet = root.quiet_period
    rt.tracker.reconfigure(effective)
    rt.reaper = d.keeper.reaper(rt.tracker, new)
    rt.tracker.full_scan()
