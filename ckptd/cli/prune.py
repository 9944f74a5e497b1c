"""`ckptd prune`: one retention pass, carried out (or shown, with --dry-run), under the root's
lock and lease."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.cli.common import load, preflight, with_effective_quiet
from ckptd.cli.output import report_result
from ckptd.cli.parser import EX_TEMPFAIL
from ckptd.cli.progress import Progress, Ticker
from ckptd.config import Config, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.errors import EX_OK
from ckptd.fleet.lease import Leadership, LocalLeadership, VolumeLease, choose_leadership
from ckptd.fleet.locks import RootLock
from ckptd.formatting import format_duration, format_size
from ckptd.journal import Journal
from ckptd.model import Action
from ckptd.removal.outcome import DRY_RUN_NOTE, Outcome
from ckptd.removal.purge import waiting_in_trash
from ckptd.removal.reaper import Reaper
from ckptd.volume.mounts import read_mounts


def _lead_for_prune(config: Config, root: Root, mounts: list) -> tuple[Leadership | None, str | None]:
    """The root's leadership taken for one prune, or (None, why not).

    A volume lease that a live holder renews is not waited for (prune exits 75); one whose
    holder is gone is watched for its duration plus margin first, as any standby must.
    """
    d = config.daemon
    kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent,
                                           etcd=bool(d.etcd.endpoints))
    if kind == "local":
        local = LocalLeadership(RootLock(d.state_dir, root.path), why, d.lease_margin)
        local.step()
        return (local, None) if local.held() else (None, local.blocked)
    if kind == "kubernetes":  # a Lease not renewed is watched first, as the volume lease is
        from ckptd.fleet.kubelease import kube_leadership, take_for_prune

        kube = kube_leadership(root.path, d, why)
        if take_for_prune(kube, lambda line: print(line, file=sys.stderr)):
            kube.start()  # renewed while the prune runs
            return kube, None
        return None, kube.blocked or kube.error
    if kind == "etcd":  # a held key is not waited for: etcd deletes it when its holder's lease ends
        from ckptd.fleet.etcdlease import etcd_leadership

        engine = etcd_leadership(root.path, d, why)
        engine.step()
        if engine.held():
            engine.start()  # renewed while the prune runs
            return engine, None
        return None, engine.blocked or engine.error
    if problem is not None:
        return None, problem
    lease = VolumeLease(root.path, duration=d.lease_duration, margin=d.lease_margin, why=why)
    deadline = time.monotonic() + d.lease_duration + d.lease_margin + 2 * lease.interval
    between_looks = threading.Event()  # never set: a timer between looks, nothing to synchronise with
    said = False
    while True:
        lease.step()
        if lease.held():
            lease.start()  # renewed while the prune runs
            return lease, None
        rec = lease.seen.record if lease.seen else None
        holder = f"{rec.holder.describe()} holds the volume lease (epoch {rec.epoch})" if rec else ""
        live = rec is not None and not rec.released and time.time() <= rec.expires + lease.margin
        if live:
            assert rec is not None
            return None, f"{holder}, renewed {max(0.0, time.time() - rec.renewed):.0f}s ago"
        if time.monotonic() >= deadline or lease.error or "lock" in (lease.blocked or ""):
            return None, "; ".join(filter(None, [holder, lease.blocked]))
        if not said:
            wait = d.lease_duration + d.lease_margin
            print(f"{root.path}: the volume lease is not renewed; waiting up to {wait:g}s to be sure its "
                  f"holder is gone ({lease.blocked})", file=sys.stderr)
            said = True
        between_looks.wait(lease.interval)


def _waiting(count: int, grace: float) -> str:
    """What prune says of the checkpoints it deleted that wait in the trash (`trash_grace`)."""
    if not count:
        return ""
    return (f"; {count} in the trash for {format_duration(grace)}, restorable until their purge: "
            "`ckptd trash list`")


@dataclass
class _Tally:
    """What one prune did, summed over its roots."""

    dry_run: bool
    note: str
    status: int = EX_OK
    totals: dict[Outcome, int] = field(default_factory=lambda: {o: 0 for o in Outcome})
    would: dict[str, list[int]] = field(default_factory=lambda: {"delete": [0, 0], "slim": [0, 0]})
    freed: int = 0
    slim_freed: int = 0
    waiting: int = 0
    grace: float = 0.0

    def summary(self) -> str:
        if self.dry_run:
            done = (
                f"{self.would['delete'][0]} would be deleted ({format_size(self.would['delete'][1])}), "
                f"{self.would['slim'][0]} would be slimmed "
                f"({format_size(self.would['slim'][1])} of optimizer state)"
            )
        else:
            done = (
                f"{self.totals[Outcome.TRASHED]} deleted ({format_size(self.freed)} freed"
                f"{_waiting(self.waiting, self.grace)}), "
                f"{self.totals[Outcome.SLIMMED]} slimmed "
                f"({format_size(self.slim_freed)} of optimizer state freed)"
            )
        return (f"prune: {done}, {self.totals[Outcome.REFUSED]} refused on re-check, "
                f"{self.totals[Outcome.FAILED]} failed{self.note}")


def cmd_prune(args: argparse.Namespace) -> int:
    config = load(args)
    preflight(config)
    config = with_effective_quiet(config)
    mounts = read_mounts()
    dry_run = args.dry_run or config.daemon.dry_run
    journal = None if dry_run else Journal(config.daemon.state_dir)
    tally = _Tally(dry_run, f" {DRY_RUN_NOTE}" if dry_run else "")
    tally.grace = config.trash_grace(config.roots[0]) if config.roots else 0.0
    for root in config.roots:
        lead = None
        if not dry_run:
            lead, why_not = _lead_for_prune(config, root, mounts)
            if lead is None:
                print(f"skipping {root.path}: {why_not}", file=sys.stderr)
                tally.status = max(tally.status, EX_TEMPFAIL)
                continue
        try:
            _prune_root(args, config, root, journal, lead, tally)
        finally:
            if lead is not None:
                lead.stop()
    if journal is not None:
        journal.close()
    print(tally.summary())
    return tally.status


def _prune_root(args: argparse.Namespace, config: Config, root: Root, journal: Journal | None,
                lead: Leadership | None, tally: _Tally) -> None:
    """One root's prune: an earlier run's leftovers purged, the plan made and carried out, the
    trash purged of what has waited its grace."""
    dry_run, note = tally.dry_run, tally.note
    scanner = Scanner(root, state_dir=config.daemon.state_dir)
    reaper = Reaper(
        scanner,
        journal,
        dry_run=dry_run,
        consolidate_timeout=config.daemon.consolidate_timeout,
        fence=lead.fencer() if lead is not None else None,
        trash_grace=config.trash_grace(root),
    )
    if lead is not None:
        reaper.foreign_wait = lead.takeover_wait()  # what another process trashed waits
    reaper.clear_work()  # what an interrupted consolidation left, into the trash
    leftover, leftover_bytes = reaper.purge()  # an earlier run's interrupted purge
    if leftover:
        print(f"purged {leftover} leftover trash entries ({format_size(leftover_bytes)}) in {root.path}")
    bar = Progress(f"prune {root.path}", quiet=args.quiet)
    try:
        runs = scanner.runs(now=time.time(), progress=bar.update)
    finally:
        bar.done()
    plan = decide([(root, runs)], trash=waiting_in_trash)  # what still waits there counts as free
    for w in plan.warnings:
        print(f"warning: {w}{note}")
    acting = sum(1 for d in plan.decisions if d.action is not Action.KEEP)
    trashed: list[Path] = []
    # A slim may consolidate first (zero_to_fp32, silent for as long as it takes): a
    # terminal is told what is being waited for.
    ticker = Ticker(f"prune {root.path}", quiet=args.quiet or dry_run)
    if reaper.archiver is not None:  # [roots.archive]: what is sent first, before any deletion
        reaper.archiver.on_progress = lambda rel, done, total, t=ticker: t.saying(
            f"archiving {rel}: {format_size(done)} of {format_size(total)} sent")
    with ticker:
        ticker.working(f"0 of {acting} deletions and slims done (a slim may consolidate first)")
        for n, result in enumerate(reaper.execute(plan.decisions), start=1):
            ticker.clear()
            tally.status = max(tally.status, report_result(result, tally.totals, tally.would, note))
            if result.outcome is Outcome.SLIMMED:
                tally.slim_freed += result.moved_bytes
            if result.outcome is Outcome.TRASHED and result.trash_path is not None:
                trashed.append(result.trash_path)
            ticker.working(f"{n} of {acting} deletions and slims done")
    reaper.purge(stop=lambda lead=lead: lead is not None and not lead.held())
    # What purging the deleted checkpoints freed, as the disk counts it (space.py)
    tally.freed += sum(reaper.purged.get(p, 0) for p in trashed)
    mine = [p for p in trashed if p not in reaper.purged and os.path.lexists(p)]
    tally.waiting, tally.grace = tally.waiting + len(mine), config.trash_grace(root)
    if reaper.waiting > len(mine):
        # a checkpoint waits its trash_grace too, whoever trashed it (`Purging._not_yet`)
        print(f"{root.path}: {reaper.waiting - len(mine)} trash entries another ckptd left are purged once "
              f"they have been there {format_duration(round(max(reaper.foreign_wait, tally.grace)))}, "
              "re-checked first (by the next prune or the daemon)")
