"""`ckptd trash list|restore|purge`: the operator's view of what waits in each root's trash, and
the undo. A deleted checkpoint waits there `trash_grace` before its purge judges it again
(removal/purge.py); until then `restore` puts it back (pinned, unless --no-pin)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from ckptd.cli.common import load, preflight
from ckptd.cli.parser import EX_TEMPFAIL
from ckptd.config import Config
from ckptd.decide.planner import Scanner
from ckptd.errors import EX_OK, UsageError
from ckptd.formatting import format_duration, format_size
from ckptd.journal import Journal
from ckptd.removal.inventory import TrashEntry, trash_entries
from ckptd.removal.reaper import Reaper
from ckptd.volume.mounts import read_mounts

EX_NOINPUT = 66  # sysexits: nothing in the trash by that name


def cmd_trash(args: argparse.Namespace) -> int:
    config = load(args)
    if not config.roots:
        raise UsageError("no roots: name one (ckptd trash list /mnt/experiments) or configure [[roots]]")
    if args.trash_command == "list":
        return _list(config, args.json)
    if args.trash_command == "restore":
        return _restore(config, args)
    return _purge(config, now=args.now)


def _entries(config: Config) -> list[TrashEntry]:
    return [e for root in config.roots for e in trash_entries(root.path, config.trash_grace(root))]


def _when(t: float | None, now: float) -> str:
    if t is None:
        return "never by itself"
    if t <= now:
        return "at the next purge"
    stamp = datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    return f"after {stamp} (in {format_duration(round(t - now))})"


def _list(config: Config, as_json: bool) -> int:
    now = time.time()
    entries = _entries(config)
    if as_json:
        print(json.dumps({"entries": [e.json() for e in entries],
                          "bytes": sum(e.bytes for e in entries)}, indent=2))
        return EX_OK
    for e in entries:
        origin = e.origin or "(origin unknown)"
        why = "; ".join(e.reasons) or {
            "review": "held for review: never purged (see the log for why; move it back or delete it by hand)",
            "purging": "its purge has begun (the next `ckptd trash purge` judges it again)",
            "unknown": "nothing says where it came from: the next purge holds it for review"}.get(e.kind, e.kind)
        print(f"{e.name}\n  from {e.root / origin} ({e.kind}, {format_size(e.bytes)})\n  why: {why}\n"
              f"  purged: {_when(e.purge_after, now)}")
    total = sum(e.bytes for e in entries)
    print(f"{len(entries)} in the trash ({format_size(total)})"
          + ("; restore one with `ckptd trash restore NAME`" if entries else ""))
    return EX_OK


def _reaper(config: Config, root, journal: Journal | None) -> Reaper:
    return Reaper(Scanner(root, state_dir=config.daemon.state_dir), journal, dry_run=False,
                  trash_grace=config.trash_grace(root))


def _restore(config: Config, args: argparse.Namespace) -> int:
    wanted = None if args.all else args.name
    if wanted is None and not args.all:
        raise UsageError("name an entry (as `ckptd trash list` shows it, or the path it came from) or give --all")
    # a `%purging` one only by its name: restore then says what to do with it
    kinds = ("checkpoint", "review", "purging") if wanted is not None else ("checkpoint", "review")
    entries = [e for e in _entries(config) if e.kind in kinds]
    if wanted is not None:
        entries = [e for e in entries if wanted in (e.name, str(e.path), e.origin, str(e.root / (e.origin or "")))]
    if not entries:
        print(f"ckptd: nothing in the trash is {wanted!r} (see `ckptd trash list`)" if wanted else
              "nothing to restore", file=sys.stderr)
        return EX_NOINPUT if wanted else EX_OK
    journal = Journal(config.daemon.state_dir)
    status = EX_OK
    try:
        for e in entries:
            root = next(r for r in config.roots if r.path == e.root)
            try:
                shown = _reaper(config, root, journal).restore(e.name, pin=not args.no_pin)
            except (OSError, ValueError) as exc:
                print(f"ckptd: cannot restore {e.name}: {exc}", file=sys.stderr)
                status = 74
                continue
            pinned = "" if args.no_pin else " and pinned (remove its .ckptd-keep to let retention have it again)"
            print(f"restored {e.root / shown}{pinned}")
    finally:
        journal.close()
    return status


def _purge(config: Config, *, now: bool) -> int:
    """Purge what may go, with the same checks as every purge; `now`: without waiting out the
    grace. Holds each root's leadership, as prune does: one deleter per root."""
    from ckptd.cli.prune import _lead_for_prune  # the same leadership as prune, taken the same way

    preflight(config)
    mounts = read_mounts()
    journal = Journal(config.daemon.state_dir)
    status = EX_OK
    try:
        for root in config.roots:
            lead, why_not = _lead_for_prune(config, root, mounts)
            if lead is None:
                print(f"skipping {root.path}: {why_not}", file=sys.stderr)
                status = max(status, EX_TEMPFAIL)
                continue
            try:
                reaper = _reaper(config, root, journal)
                reaper.fence = lead.fencer()
                reaper.foreign_wait = lead.takeover_wait()
                if now:
                    reaper.trash_grace = 0.0
                count, freed = reaper.purge(stop=lambda lead=lead: not lead.held())
                waits = f", {reaper.waiting} wait" if reaper.waiting else ""
                print(f"{root.path}: purged {count} ({format_size(freed)}){waits}")
            finally:
                lead.stop()
    finally:
        journal.close()
    return status
