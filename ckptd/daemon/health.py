"""`ckptd health`: is a daemon alive and looking at the disk? One line, and a verdict.

The daemon rewrites its state file (`state_dir/daemon.<pid>.json`) with a
wall-clock `heartbeat` after every step of work, and it takes a step at least
every `poll_interval`, idle or not. A heartbeat older than
`max(3 x the largest poll_interval, 30s)` means its loop or its filesystem
thread is stuck (a hung NFS mount, a scan that never ends). The daemon writes
its roots' poll intervals into the state file, so the limit is the running
daemon's own, whatever config `health` was given.

With roots configured, only a daemon managing one of them counts: several
ckptd instances (one per volume) can share a state directory.

`judge` is pure; `check` reads the state directory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptd.config import Config, format_age

MIN_MAX_AGE = 30.0
POLLS = 3  # missed polls before a heartbeat is too old


def max_age_for(doc: dict[str, Any]) -> float:
    polls = [r.get("poll_interval") for r in doc.get("roots", [])]
    largest = max((p for p in polls if isinstance(p, int | float)), default=0.0)
    return max(MIN_MAX_AGE, POLLS * largest)


def judge(
    docs: Sequence[dict[str, Any]],
    *,
    now: float,
    state_dir: Path,
    roots: Sequence[Path] = (),
    max_age: float | None = None,
    dead_pids: Sequence[int] = (),
) -> tuple[bool, str]:
    """(healthy, one line saying why) from the live daemons' state documents."""
    if roots:
        wanted = {str(r) for r in roots}
        mine = [d for d in docs if wanted & {r.get("path") for r in d.get("roots", [])}]
        if docs and not mine:
            others = ", ".join(str(d.get("pid")) for d in docs)
            for_roots = ", ".join(sorted(wanted))
            return False, f"unhealthy: no ckptd is running for {for_roots} (pid {others} runs others)"
        docs = mine
    if not docs:
        if dead_pids:
            pids = ", ".join(map(str, dead_pids))
            return False, f"unhealthy: no ckptd is running (state file in {state_dir} of pid {pids}, gone)"
        return False, f"unhealthy: no ckptd state file in {state_dir}"
    doc = max(docs, key=lambda d: d.get("heartbeat", 0.0))
    age = max(0.0, now - doc.get("heartbeat", 0.0))
    limit = max_age if max_age is not None else max_age_for(doc)
    dry = ", dry run" if doc.get("dry_run") else ""
    said = f"pid {doc.get('pid')}, heartbeat {format_age(age)} ago (max {format_age(limit)}){dry}"
    said += "".join(f"; {line}" for line in standing_by(doc, roots, now))
    if age > limit:
        return False, f"unhealthy: {said}"
    # Alive but not deleting where it should: its lock or journal was taken from under it.
    lost = [r for r in doc.get("roots", []) if isinstance(r, dict) and r.get("lost_footing")]
    if lost:
        where = "; ".join(f"{r.get('path')}: {r['lost_footing']}" for r in lost)
        return False, f"unhealthy: {said}; stopped deleting in {where}"
    return True, f"healthy: {said}"


def standing_by(doc: dict[str, Any], roots: Sequence[Path], now: float) -> list[str]:
    """For each root the daemon stands by at: who leads it and what this one waits for. A live
    standby is healthy (its heartbeat is as fresh as a leader's); this says it is one."""
    wanted = {str(r) for r in roots}
    out = []
    for root in doc.get("roots", []):
        if root.get("role") != "standby" or (wanted and root.get("path") not in wanted):
            continue
        lead = root.get("leadership") or {}
        holder = lead.get("holder")
        who = ""
        if isinstance(holder, dict) and not lead.get("released"):
            who = f", led by {holder.get('host')} pid {holder.get('pid')} ({lead.get('kind')} lease"
            since = lead.get("since")
            who += f" since {format_age(max(0.0, now - since))} ago)" if isinstance(since, int | float) else ")"
        waiting = lead.get("waiting") or "waiting for the lead"
        out.append(f"standby at {root.get('path')}{who}: {waiting}")
    return out


def check(config: Config, *, now: float | None = None, max_age: float | None = None) -> tuple[bool, str]:
    from ckptd.daemon import STATE_PREFIX, read_states

    state_dir = config.daemon.state_dir
    docs = read_states(state_dir)
    live = {d.get("pid") for d in docs}
    dead = []
    for path in sorted(state_dir.glob(f"{STATE_PREFIX}*.json")):
        pid = path.stem.removeprefix(STATE_PREFIX)
        if pid.isdigit() and int(pid) not in live:
            dead.append(int(pid))
    return judge(
        docs,
        now=time.time() if now is None else now,
        state_dir=state_dir,
        roots=[r.path for r in config.roots],
        max_age=max_age,
        dead_pids=dead,
    )
