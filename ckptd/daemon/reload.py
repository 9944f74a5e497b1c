"""A reload's new config swapped in on the filesystem thread (`apply_config`): what is known of
the roots that stay is kept (a reload does not restart quiet periods), new roots are scanned,
roots no longer configured let go, and what cannot change without a restart says so."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd.config import Config
from ckptd.daemon.roots import RootRuntime, effective_root
from ckptd.fleet.lease import LocalLeadership
from ckptd.journal import Journal
from ckptd.volume.mounts import Mount, read_mounts

if TYPE_CHECKING:
    from ckptd.daemon.consolidation import Consolidations
    from ckptd.daemon.narration import Narrator
    from ckptd.daemon.retention import Retention
    from ckptd.daemon.roots import RootKeeper
    from ckptd.daemon.state import DaemonState

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")


def apply_config(
    d: DaemonState,
    new: Config,
    *,
    cli_dry_run: bool,
    keeper: RootKeeper,
    narrator: Narrator,
    retention: Retention,
    consolidations: Consolidations,
    sync_watches: Callable[[], None],
) -> None:
    """Swap in a new config on the fs thread: keep what is known of roots that stay.

    `cli_dry_run`: the command line's --dry-run, which no config turns off. The rooms are those
    whose state depends on the config: the keeper builds and follows the roots, the narrator
    hears of a new root's checkpoints, the retention and consolidations forget what they decided."""
    dry_run = cli_dry_run or new.daemon.dry_run
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
            rt = _new_root(keeper, narrator, root, new)
        else:
            _look_again(keeper, rt, root, new, mounts)
        rt.next_poll = min(rt.next_poll, d.clock() + root.poll_interval)
        keep.append(rt)
    if new.daemon.metrics_listen != d.config.daemon.metrics_listen:
        log.warning("daemon.metrics_listen changed: it takes effect at the next start, not at a reload")
    if new.daemon.state_dir != d.config.daemon.state_dir:
        log.warning("daemon.state_dir changed: it takes effect at the next start, not at a reload")
    for rt in by_path.values():
        log.info("%s: no longer configured", rt.root.path)
        rt.lead.stop()
        narrator.let_go(str(rt.root.path))
    d.roots = keep
    d.config = new
    retention.decisions.clear()
    consolidations.failed.clear()  # a new timeout or setting may let them through
    retention.version += 1
    retention.run()
    sync_watches()


def _switch_dry_run(d: DaemonState, dry_run: bool) -> None:
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


def _new_root(keeper: RootKeeper, narrator: Narrator, root, new: Config) -> RootRuntime:
    """A root the new config adds: scanned now, its checkpoints as found at start."""
    rt = keeper.runtime(root, new)
    keeper.try_lead(rt)
    rt.tracker.full_scan()
    found = rt.tracker.checkpoints()
    log.info("%s: %d checkpoint(s) in %d run(s)", root.path, len(found), len(rt.tracker.runs),
             extra={"root": str(root.path)})
    narrator.found(str(root.path), rt.tracker)
    return rt


def _look_again(keeper: RootKeeper, rt: RootRuntime, root, new: Config, mounts: list[Mount]) -> None:
    """A root that stays: patterns, depth, world sizes may have changed."""
    if root.observer != rt.root.observer:
        log.warning("%s: observer changed: it takes effect at the next start", root.path)
    # Patterns, depth, world sizes may have changed: look again with the new eyes,
    # keeping what the settler knows (a reload does not restart quiet periods).
    effective, rt.cache = effective_root(root, mounts)
    rt.configured_quiet = root.quiet_period
    rt.tracker.reconfigure(effective)
    rt.reaper = keeper.reaper(rt.tracker, new)
    rt.tracker.full_scan()
