"""What the daemon tells others of itself: the state file `ckptd status` and `ckptd health` read
(`StateFile`, `read_states`), and systemd's STATUS= line."""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd import __version__
from ckptd.config import format_size
from ckptd.daemon.narration import first_failed
from ckptd.daemon.notify import notify
from ckptd.model import State

if TYPE_CHECKING:
    from ckptd.archive.upload import Archiver
    from ckptd.daemon.consolidation import Consolidations
    from ckptd.daemon.retention import Retention
    from ckptd.daemon.roots import RootRuntime
    from ckptd.daemon.state import DaemonState

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")

STATE_MIN_INTERVAL = 1.0
STATE_PREFIX = "daemon."


class StateFile:
    """The daemon's state file (`<state_dir>/daemon.<pid>.json`), rewritten atomically at most once
    a second, and the status line systemd shows. On the filesystem thread.

    Handed the shared state, and the rooms whose state it shows: the retention's decisions, the
    running consolidation."""

    def __init__(
        self, state: DaemonState, path: Path, *, retention: Retention, consolidations: Consolidations
    ):
        self.state = state
        self.retention = retention
        self.consolidations = consolidations
        self.path = path
        self.written = -1e9
        self.due: float | None = None  # a write put off by STATE_MIN_INTERVAL comes then
        self.runs_cache: dict[Path, tuple[tuple[int, int], str]] = {}  # see `runs_json`

    def status_line(self) -> str:
        roots = self.state.roots
        states = collections.Counter(str(c.state) for rt in roots for c in rt.tracker.checkpoints())
        runs = sum(len(rt.tracker.runs) for rt in roots)
        parts = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none"
        counters = self.state.counters
        return (
            f"{runs} runs; checkpoints: {parts}; {counters['deleted']} deleted, "
            f"{format_size(counters['bytes_reclaimed'])} reclaimed"
        )

    def report(self, *fields: str) -> None:
        notify(*fields, f"STATUS={self.status_line()}")

    def text(self) -> str:
        """The state file's JSON. Written at every poll for the heartbeat: each root's runs are
        encoded again only when its tracker or the decisions changed (on the L volume, 6,400
        checkpoints, encoding them was most of an idle tick)."""
        d = self.state
        now_mono = d.clock()
        roots = []
        for rt in d.roots:
            oldest = None
            for c in rt.tracker.in_flight():
                since = rt.tracker.settler.changed_at(c.rel)
                if since is not None:
                    oldest = max(oldest or 0.0, now_mono - since)
            head = {
                "path": str(rt.root.path),
                "observer": rt.observer,
                "role": rt.role(d.dry_run),  # leader, standby or dry-run
                "leader": rt.leader,
                "leadership": rt.lead.status(),
                "lost_footing": rt.lost_footing,  # why it stopped deleting here (role "stopped")
                "quiet_period": rt.configured_quiet,
                "effective_quiet_period": rt.root.quiet_period,  # with the attribute cache's
                "attribute_cache": rt.cache.detail if rt.cache is not None else None,
                "poll_interval": rt.root.poll_interval,  # `ckptd health` allows 3 of these
                "oldest_incomplete_age": oldest,
                "archive": archive_state(rt.reaper.archiver),
            }
            roots.append(_json(head)[:-1] + ',"runs":' + self.runs_json(rt) + "}")
        job = self.consolidations.running
        head = {
            "pid": os.getpid(),
            "version": __version__,
            "heartbeat": time.time(),
            "started": d.started,
            "dry_run": d.dry_run,
            "counters": dict(d.counters),
            # the running zero_to_fp32 consolidation, if any (`ckptd status` says how long so far)
            "consolidation": None if job is None else {
                "root": str(job.rt.root.path),
                "checkpoint": job.work.decision.checkpoint.rel,
                "from": job.work.tag,
                "started": job.started,
                "stopping": job.stopping,
            },
        }
        return _json(head)[:-1] + ',"roots":[' + ",".join(roots) + "]}"

    def runs_json(self, rt: RootRuntime) -> str:
        decisions = self.retention.decisions
        key = (rt.tracker.version, self.retention.version)
        hit = self.runs_cache.get(rt.root.path)
        if hit is not None and hit[0] == key:
            return hit[1]
        root_key = str(rt.root.path)
        # The settler's monotonic times as wall-clock times, so that `ckptd status` says how long
        # a checkpoint has been unchanged when it is asked, not when this was written.
        to_wall = time.time() - self.state.clock()
        runs = []
        for run in rt.tracker.current_runs():
            ckpts = []
            for c in run.checkpoints:
                decided = decisions.get((root_key, c.rel))  # not c.path: building Paths was slow
                if c.state is not State.COMPLETE:
                    # Never deleted, whatever retention said when it last ran (it runs when
                    # checkpoints complete or vanish: its reason may be an earlier state's).
                    action, reasons = "keep", [f"{c.state}, never deleted: {first_failed(c)}"]
                else:
                    action, reasons = (decided[0], list(decided[1])) if decided else (None, [])
                ckpts.append(
                    {
                        "name": c.name,
                        "step": c.step,
                        "state": str(c.state),
                        "size_bytes": c.size_bytes,
                        "action": action,
                        "reasons": reasons,
                    }
                )
                if c.state is State.SETTLING and (since := rt.tracker.settler.changed_at(c.rel)) is not None:
                    ckpts[-1]["unchanged_since"] = since + to_wall
            runs.append({"run": run.rel, "checkpoints": ckpts})
        text = _json(runs)
        self.runs_cache[rt.root.path] = (key, text)
        return text

    def write(self, force: bool = False) -> None:
        """Rewrite the state file atomically (readers see the old or the new), at most once a second."""
        now = self.state.clock()
        if not force and now - self.written < STATE_MIN_INTERVAL:
            self.due = self.written + STATE_MIN_INTERVAL
            return
        self.written, self.due = now, None
        tmp = self.path.with_suffix(".tmp")
        try:
            # os.open, not open(): Python's open() fstats the file it opened (for its buffer size),
            # and a standby writes this at every poll for its heartbeat (bench.standby counts stats).
            data = self.text().encode()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            log.debug("state written to %s", self.path)
        except OSError as exc:
            log.warning("cannot write the state file %s: %s", self.path, exc)


def _json(doc: object) -> str:
    # Compact: with indent, json falls back to its pure-Python encoder (9 ms a tick on 960
    # checkpoints; BENCHMARKS.md, idle cost).
    return json.dumps(doc, separators=(",", ":"))


def read_states(state_dir: Path) -> list[dict[str, Any]]:
    """The state files of running daemons (those whose pid is alive)."""
    out = []
    for path in sorted(state_dir.glob(f"{STATE_PREFIX}*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid = doc.get("pid")
        if isinstance(pid, int) and _alive(pid):
            out.append(doc)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def archive_state(archiver: Archiver | None) -> dict[str, object] | None:
    """[roots.archive]: where, what this daemon uploaded, and the checkpoints whose last attempt
    failed, each with why (kept meanwhile, where the archive is required)."""
    if archiver is None:
        return None
    return {"url": archiver.store.url, "required": archiver.cfg.required, "when": archiver.cfg.when,
            "uploaded_bytes": archiver.uploaded_bytes, "failed": dict(sorted(archiver.failures.items()))}
