"""`ckptd status`: what a running daemon reports, read from its status file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ckptd.cli.common import load, without_c_hint
from ckptd.cli.output import columns
from ckptd.config import Config
from ckptd.errors import EX_OK
from ckptd.fleet.leaserecord import Holder, holder_gone
from ckptd.formatting import format_age, format_size
from ckptd.removal.inventory import summary, trash_entries


def role_of(root: dict[str, Any], doc: dict[str, Any]) -> str:
    """leader, standby or dry-run; from `leader` for a state file written before `role` existed."""
    role = root.get("role")
    if isinstance(role, str):
        return role
    return "dry-run" if doc.get("dry_run") else "leader" if root.get("leader") else "standby"


ROLES = {
    "leader": "leader: deletes here",
    "standby": "standby: another ckptd deletes here, this one observes",
    "dry-run": "dry run: decides, deletes nothing",
    "stopped": "stopped: leads but deletes nothing until its lock and journal are its own again",
}


def _role_text(role: str, root: dict[str, Any]) -> str:
    """ROLES' line, except for a standby whose lease names a process of this host that is gone:
    nobody deletes there until this one (or another standby) takes over."""
    lead = root.get("leadership") or {}
    holder = lead.get("holder")
    if role != "standby" or not isinstance(holder, dict) or lead.get("released"):
        return ROLES.get(role, role)
    try:
        who = Holder(str(holder["host"]), int(holder["pid"]), float(holder["start"]),
                     str(holder.get("id", "")))
    except (KeyError, TypeError, ValueError):
        return ROLES.get(role, role)
    if not holder_gone(who):
        return ROLES.get(role, role)
    return (f"standby: the lease's holder ({who.describe()}) is gone, so nothing deletes here until this "
            "one takes over")


def cmd_status(args: argparse.Namespace) -> int:
    from ckptd.daemon import read_states

    config = load(args)
    docs = read_states(config.daemon.state_dir)
    if args.json:
        print(json.dumps(docs, indent=2))
    if not docs:
        print(f"no ckptd daemon is running (state_dir {config.daemon.state_dir})", file=sys.stderr)
        hint = without_c_hint(args, config)
        if hint:
            print(f"  {hint}", file=sys.stderr)
        return 1
    if args.json:
        return EX_OK
    now = time.time()
    for doc in docs:
        dry = ", dry run" if doc.get("dry_run") else ""
        print(
            f"ckptd {doc['version']}, pid {doc['pid']}{dry}: up {format_age(now - doc.get('started', now))}, "
            f"heartbeat {format_age(now - doc['heartbeat'])} ago"
        )
        counters = doc.get("counters", {})
        print(
            f"  {counters.get('deleted', 0)} deleted, {counters.get('slimmed', 0)} slimmed, "
            f"{format_size(counters.get('bytes_reclaimed', 0))} reclaimed, "
            f"{counters.get('rescans', 0)} rescans after missed events"
        )
        job = doc.get("consolidation")
        if isinstance(job, dict):
            stopping = f", stopping: {job['stopping']}" if job.get("stopping") else ""
            print(f"  consolidating {job['checkpoint']} in {job['root']} (fp32 weights from {job['from']}): "
                  f"running {format_age(now - job['started'])}{stopping}")
        for root in doc["roots"]:
            role = role_of(root, doc)
            oldest = root.get("oldest_incomplete_age")
            if oldest is not None:  # as old as it is now, not as it was at the daemon's last write
                oldest += max(0.0, now - doc["heartbeat"])
            extra = f"; oldest incomplete: {format_age(oldest)}" if oldest is not None else ""
            print(f"  {root['path']}: {_role_text(role, root)} (observer {root['observer']}{extra})")
            if root.get("lost_footing"):
                print(f"    stopped because {root['lost_footing']}")
            for line in _lead_and_quiet_lines(root, time.time()):
                print(f"    {line}")
            trash = _trash_line(config, Path(root["path"]), now)
            if trash:
                print(f"    {trash}")
            rows = [("RUN", "CHECKPOINT", "STATE", "SIZE", "ACTION", "REASONS")]
            for run in root["runs"]:
                for c in run["checkpoints"]:
                    action = c["action"] or "-"
                    reasons = "; ".join(c["reasons"]) or f"not decided yet ({c['state']})"
                    if isinstance(c.get("unchanged_since"), int | float):
                        reasons = settling_now(c["unchanged_since"], root.get("effective_quiet_period"), now)
                    size = format_size(c["size_bytes"])
                    rows.append((run["run"], c["name"], c["state"], size, action, reasons))
            if len(rows) == 1:
                print("    no checkpoints yet")
                continue
            for line in columns(rows):
                print(f"    {line}")
    return EX_OK


def _trash_line(config: Config, path: Path, now: float) -> str | None:
    """`status`: what waits in the root's trash, read from it now, and when the next purge may
    take some of it (the grace this config gives the root); None where it is empty."""
    root = next((r for r in config.roots if r.path == path), None)
    grace = config.daemon.trash_grace if root is None else config.trash_grace(root)
    waiting = summary(trash_entries(path, grace))
    if not waiting["entries"]:
        return None
    nxt = waiting["next_purge"]
    when = ("none purged by itself" if nxt is None else "next purge: now" if nxt <= now
            else f"next purge in {format_age(nxt - now)}")
    review = f", {waiting['review']} held for review" if waiting["review"] else ""
    return (f"trash: {waiting['entries']} entries ({format_size(waiting['bytes'])}){review}, {when}: "
            "`ckptd trash list`")


def settling_now(since: float, quiet: float | None, now: float) -> str:
    """A settling checkpoint's reason, computed when `status` is asked: how long the daemon has
    seen it unchanged (wall-clock time of its last change, from the state file) of its quiet period."""
    age = max(0.0, now - since)
    if not isinstance(quiet, int | float):
        return f"settling, never deleted: unchanged for {format_age(age)}"
    if age >= quiet:
        return (f"settling, never deleted: unchanged for {format_age(age)} of {format_age(quiet)}: "
                "the daemon's next look decides")
    return f"settling, never deleted: unchanged for {format_age(age)} of {format_age(quiet)}"


def _lead_and_quiet_lines(root: dict[str, Any], now: float) -> list[str]:
    """`status`: who deletes here and under which lease; the archive; the quiet period, if the
    mount changed it."""
    lines = []
    lead = root.get("leadership")
    if lead:
        lines.append(_leadership_line(lead, now))
    archive = root.get("archive")
    if archive and archive.get("failed"):
        (rel, why), more = next(iter(archive["failed"].items())), len(archive["failed"]) - 1
        lines.append(f"archive {archive['url']}: {rel} not archived{f' (and {more} more)' if more else ''}: {why}")
    elif archive:
        lines.append(f"archive {archive['url']}: nothing failed ({archive['uploaded_bytes']} bytes uploaded)")
    quiet, effective = root.get("quiet_period"), root.get("effective_quiet_period")
    if quiet is not None and effective is not None and effective != quiet:
        lines.append(f"quiet_period {quiet:g}s, watched as {effective:g}s: {root.get('attribute_cache')}")
    return lines


def _leadership_line(lead: dict[str, Any], now: float) -> str:
    """One line: the lease this root is led under (volume, etcd, kubernetes) or the local lock."""
    if lead.get("kind") == "volume":
        text = _volume_lease_text(lead, now)
    elif lead.get("kind") in ("etcd", "kubernetes"):
        text = _engine_lease_text(lead, now)
    else:
        return f"leadership: local lock {lead['lock']} [{lead['why']}]"
    waiting = f"; {lead['waiting']}" if lead.get("waiting") else ""
    error = f"; error: {lead['error']}" if lead.get("error") else ""
    return f"leadership: {text}{waiting}{error} [{lead['why']}]"


def _volume_lease_text(lead: dict[str, Any], now: float) -> str:
    holder = lead.get("holder")
    if not holder or lead.get("released"):
        return "volume lease free" + (f" (epoch {lead['epoch']} released)" if holder else "")
    left = lead["expires"] - now
    when = f"expires in {left:.0f}s" if left >= 0 else f"expired {-left:.0f}s ago"
    who = f"{holder['host']} pid {holder['pid']}" + (" (this ckptd)" if lead["held"] else "")
    since = lead.get("since")
    if isinstance(since, int | float) and since > 0:  # when this epoch was taken
        when += f", taken {format_age(max(0.0, now - since))} ago"
    return f"volume lease epoch {lead['epoch']}, held by {who}, {when}"


def _engine_lease_text(lead: dict[str, Any], now: float) -> str:
    what = "etcd key" if lead["kind"] == "etcd" else "kubernetes Lease"
    holder = lead.get("holder")
    if not isinstance(holder, dict):
        return f"{what} {lead.get('key')} free"
    who = f"{holder.get('host')} pid {holder.get('pid')}" + (" (this ckptd)" if lead["held"] else "")
    since = lead.get("since")
    taken = f", taken {format_age(max(0.0, now - since))} ago" if isinstance(since, int | float) else ""
    return f"{what} {lead.get('key')}, token {lead.get('epoch')}, held by {who}{taken}"

