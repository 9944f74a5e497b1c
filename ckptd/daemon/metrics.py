"""Prometheus metrics for `ckptd run` (`[daemon] metrics_listen`), served at `/metrics`.

prometheus_client is an optional dependency (`pip install 'ckptd[metrics]'`),
imported only when a daemon is asked to serve metrics.

Where each value comes from, and on which thread:
- counters (deletions, bytes reclaimed, slims) are the daemon's own
  `counters`, read when Prometheus scrapes: the purge thread and the
  filesystem thread keep them, and reading an int from a dict is safe;
- per-root gauges (checkpoints by state, oldest incomplete age, rescans,
  last reconcile) come from a snapshot the filesystem thread takes after every
  step (`sample`); a scrape reads the latest snapshot, never the trackers;
- free space is `statvfs` at scrape time, so it is as fresh as the scrape;
- completion latency is observed in `sample`, once per checkpoint: from the
  daemon's *first sighting* of a checkpoint to the step that found it complete. ckptd cannot know when
  the first byte was written; with inotify it sees a new checkpoint within
  milliseconds, when polling up to `poll_interval` later. Checkpoints already on
  disk when a root is first scanned are not measured (their first write is
  long past). The oldest incomplete age counts from when a checkpoint was
  first seen, or last seen going back from complete to in flight. That time is kept in
  `state_dir/incomplete-since.json` (wall clock), so that a restart does not set the age back
  to 0: the shipped one-hour alert would otherwise never fire across restarts.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckptd import __version__
from ckptd.config import parse_listen
from ckptd.decide.planner import disk_space
from ckptd.errors import ConfigError, IOFault
from ckptd.model import State
from ckptd.removal.inventory import summary as trash_summary
from ckptd.removal.inventory import trash_entries as inventory

if TYPE_CHECKING:
    from ckptd.config import Root
    from ckptd.daemon.tracker import RootTracker


class RootView(Protocol):
    """What a root's metrics are read from: the daemon's `RootRuntime`, named here by what it
    has, so that metrics never imports the daemon (which imports metrics)."""

    root: Root
    tracker: RootTracker
    leader: bool

log = logging.getLogger(__name__)

# Seconds from first sighting to complete: at least the quiet period (60 s by default).
LATENCY_BUCKETS = (1, 5, 15, 30, 60, 90, 120, 180, 300, 600, 1200, 1800, 3600, 7200, 14400)

# The daemon's counters, as Prometheus counters: (counter key, metric name, help).
COUNTERS = (
    ("deleted", "ckptd_deletions", "Checkpoints moved to the trash."),
    ("bytes_reclaimed", "ckptd_reclaimed_bytes", "Bytes freed by purging the trash."),
    ("slimmed", "ckptd_slims", "Checkpoints slimmed (optimizer state removed)."),
)


@dataclass(frozen=True)
class RootSample:
    """What one root looked like after a step (wall-clock times, seconds)."""

    path: str
    states: Mapping[str, int]
    oldest_incomplete_age: float
    rescans: int
    last_reconcile: float | None
    leader: bool
    runs: tuple[RunSample, ...] = ()
    # [roots.archive], or None: bytes uploaded by this daemon, checkpoints whose last attempt
    # failed and how long the oldest of them has been failing (seconds), checkpoints waiting for
    # their archive and how long the oldest of them has waited (seconds)
    archive: tuple[int, int, float, int, float] | None = None


@dataclass(frozen=True)
class RunSample:
    """One run's totals (per run, never per checkpoint: a volume holds thousands)."""

    run: str
    states: Mapping[str, int]
    size_bytes: int
    newest_complete: float | None  # when its newest complete checkpoint's save ended (Unix time)


class Metrics:
    """The daemon's metrics registry and its HTTP server."""

    def __init__(self, counters: Mapping[str, int], state_dir: Path | None = None):
        try:
            import prometheus_client
            import prometheus_client.core
        except ImportError:
            raise ConfigError(
                [
                    "daemon.metrics_listen is set, but prometheus_client is not installed: "
                    "pip install 'ckptd[metrics]'"
                ]
            ) from None
        self._prom = prometheus_client
        self.counters = counters
        self.registry = prometheus_client.CollectorRegistry()
        self.latency = prometheus_client.Histogram(
            "ckptd_checkpoint_completion_seconds",
            "From the daemon's first sighting of a checkpoint to its being found complete.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        prometheus_client.ProcessCollector(registry=self.registry)
        self.registry.register(_Collector(self))
        self.samples: tuple[RootSample, ...] = ()
        self._seen: dict[tuple[str, str], _Seen] = {}  # by (root, checkpoint rel)
        # when each checkpoint in flight was first seen so (wall clock), kept across restarts
        self._since_file = state_dir / INCOMPLETE_SINCE if state_dir is not None else None
        self._since = _read_since(self._since_file)
        self._roots_seen: set[str] = set()
        self._server: Any = None
        self._thread: Any = None
        self.consolidations_running = 0  # set by the daemon (0 or 1: one consolidation at a time)
        self.budgets_unmet: set[tuple[str, str]] = set()  # (root, budget key), after each retention pass
        self.budgets: dict[str, tuple[str, ...]] = {}  # root -> the budget keys it configures

    # --- serving ---------------------------------------------------------------

    def start(self, listen: str) -> None:
        host, port = parse_listen(listen)
        try:
            self._server, self._thread = self._prom.start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise IOFault(f"daemon.metrics_listen {listen}: cannot listen: {exc}") from None
        self._thread.name = "ckptd-metrics"
        log.info("metrics at http://%s/metrics", listen)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()  # shutdown() alone keeps the port
            self._thread.join()
            self._server = None

    # --- fed by the daemon, on its filesystem thread ----------------------------

    def sample(self, roots: Iterable[RootView], now: float, wall: float | None = None) -> None:
        """Take a snapshot after a step; observe completion latencies. `now`: monotonic seconds;
        `wall`: the wall clock (time.time() unless given)."""
        wall = time.time() if wall is None else wall
        since_before = dict(self._since)
        samples = []
        present: set[tuple[str, str]] = set()
        for rt in roots:
            path = str(rt.root.path)
            first_look = path not in self._roots_seen
            self._roots_seen.add(path)
            states = dict.fromkeys((str(s) for s in State), 0)
            oldest = 0.0
            runs: dict[str, tuple[dict[str, int], list[float]]] = {}  # run -> (states, [bytes, newest])
            for c in rt.tracker.checkpoints():
                states[str(c.state)] += 1
                if c.run not in runs:
                    runs[c.run] = (dict.fromkeys((str(s) for s in State), 0), [0, -1.0])
                run_states, totals = runs[c.run]
                run_states[str(c.state)] += 1
                totals[0] += c.size_bytes
                if c.state is State.COMPLETE:
                    totals[1] = max(totals[1], c.written_at)
                key = (path, c.rel)
                present.add(key)
                oldest = max(oldest, self._observe(key, c.state is State.COMPLETE, now, wall, first_look))
            last = rt.tracker.last_reconcile
            archiver = getattr(getattr(rt, "reaper", None), "archiver", None)
            archive = None if archiver is None else (
                archiver.uploaded_bytes, len(archiver.failures),
                max((wall - t for t in archiver.failing_since.values()), default=0.0),
                len(archiver.pending_since),
                max((wall - t for t in archiver.pending_since.values()), default=0.0))
            samples.append(
                RootSample(
                    path=path,
                    states=states,
                    oldest_incomplete_age=oldest,
                    rescans=rt.tracker.rescans,
                    last_reconcile=None if last is None else wall - (now - last),
                    leader=rt.leader,
                    runs=tuple(
                        RunSample(run, st, int(t[0]), t[1] if t[1] >= 0 else None)
                        for run, (st, t) in sorted(runs.items())
                    ),
                    archive=archive,
                )
            )
        for key in [k for k in self._seen if k not in present]:
            del self._seen[key]  # gone, or its root is no longer configured
        sampled = {s.path for s in samples}
        for k in list(self._since):
            root, _, rel = k.partition("\t")
            if root in sampled and (root, rel) not in present:
                del self._since[k]  # gone (deleted, or while no daemon ran)
        if self._since != since_before:
            _write_since(self._since_file, self._since)
        self.samples = tuple(samples)  # one assignment: a scrape sees this snapshot or the last

    def _observe(self, key: tuple[str, str], complete: bool, now: float, wall: float,
                 first_look: bool) -> float:
        """One checkpoint seen in a snapshot: its completion latency observed once, when it first
        is complete; how long it has been in flight (0 once complete), which outlives a restart."""
        seen = self._seen.get(key)
        if seen is None:
            # in flight since an earlier daemon saw it so: its age goes on from then
            kept = self._since.get(_since_key(key))
            since = now - max(0.0, wall - kept) if kept is not None else now
            seen = self._seen[key] = _Seen(first=now, measure=not first_look, in_flight_since=since)
        if complete:
            if not seen.completed:  # once: a later write and re-settling is not a new checkpoint
                seen.completed = True
                if seen.measure:
                    self.latency.observe(now - seen.first)
            seen.in_flight_since = None
            self._since.pop(_since_key(key), None)
            return 0.0
        if seen.in_flight_since is None:
            seen.in_flight_since = now
        self._since.setdefault(_since_key(key), wall - (now - seen.in_flight_since))
        return now - seen.in_flight_since


INCOMPLETE_SINCE = "incomplete-since.json"


def _since_key(key: tuple[str, str]) -> str:
    return f"{key[0]}\t{key[1]}"


def _read_since(path: Path | None) -> dict[str, float]:
    """`incomplete-since.json`: {"<root>\\t<checkpoint rel>": wall-clock time first seen in flight};
    {} where there is none, or it cannot be read (an age restarting at 0 is the old behaviour)."""
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("%s unreadable (%s): incomplete checkpoints' ages start again", path, exc)
        return {}
    if not isinstance(doc, dict):
        return {}
    return {str(k): float(v) for k, v in doc.items() if isinstance(v, int | float)}


def _write_since(path: Path | None, since: Mapping[str, float]) -> None:
    """Replace `incomplete-since.json` whole (a temporary file renamed over it): never half written."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(since, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s (%s): incomplete checkpoints' ages start again after a restart",
                    path, exc)


# policy._take_oldest's warning for a budget that cannot be met: "<where>: max_size=2TiB cannot be met: ..."
_UNMET = re.compile(r"^(?P<where>.+?): (?P<budget>max_size|min_free)=\S+ cannot be met: ")


def unmet_budgets(
    warnings: Iterable[str], decisions: Iterable[Any], roots: Iterable[str]
) -> set[tuple[str, str]]:
    """(root, budget key) for each budget a plan cannot meet: max_size or min_free (their
    warnings, `policy._take_oldest`; `where` is the run, or the roots of one filesystem), and
    keep_total where a checkpoint is kept over it (`over keep_total=N: always kept`)."""
    roots = sorted(roots, key=len, reverse=True)
    out: set[tuple[str, str]] = set()
    for w in warnings:
        if (m := _UNMET.match(w)) is not None:
            for where in m["where"].split(", "):
                root = next((r for r in roots if where == r or where.startswith(r.rstrip("/") + "/")), None)
                if root is not None:
                    out.add((root, m["budget"]))
    for d in decisions:
        if any(r.startswith("over keep_total=") for r in d.reasons):
            out.add((str(d.checkpoint.root), "keep_total"))
    return out


@dataclass
class _Seen:
    """One checkpoint as the metrics know it (monotonic times)."""

    first: float  # the daemon's first sighting
    measure: bool  # seen appearing (not already there when its root was first scanned)
    in_flight_since: float | None  # not complete since
    completed: bool = False


class _Collector:
    """Builds the gauges and counters at scrape time, from the latest snapshot and the counters."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self) -> Sequence[Any]:
        core = self.m._prom.core
        samples = self.m.samples
        out = []
        for key, name, doc in COUNTERS:
            out.append(core.CounterMetricFamily(name, doc, value=self.m.counters.get(key, 0)))
        build = core.GaugeMetricFamily(
            "ckptd_build_info", "The running ckptd: its version and Python's (always 1).",
            labels=["version", "python"],
        )
        build.add_metric([__version__, platform.python_version()], 1)
        out.append(build)
        out.append(core.GaugeMetricFamily(
            "ckptd_consolidations_running", "zero_to_fp32 consolidations running now (one at a time).",
            value=self.m.consolidations_running,
        ))
        run_states = core.GaugeMetricFamily(
            "ckptd_run_checkpoints", "A run's checkpoints, by state.", labels=["root", "run", "state"]
        )
        run_bytes = core.GaugeMetricFamily(
            "ckptd_run_bytes", "Bytes a run's checkpoints hold on disk.", labels=["root", "run"]
        )
        run_newest = core.GaugeMetricFamily(
            "ckptd_run_newest_complete_timestamp_seconds",
            "When the save of a run's newest complete checkpoint ended (Unix time; absent: none).",
            labels=["root", "run"],
        )
        out += [run_states, run_bytes, run_newest]
        unmet = core.GaugeMetricFamily(
            "ckptd_budget_unmet", "1 while a budget (max_size, min_free, keep_total) cannot be met.",
            labels=["root", "budget"],
        )
        for root, budgets in sorted(self.m.budgets.items()):
            for budget in budgets:
                unmet.add_metric([root, budget], 1 if (root, budget) in self.m.budgets_unmet else 0)
        out.append(unmet)

        def per_root(cls: Any, name: str, doc: str) -> Any:
            family = cls(name, doc, labels=["root"])
            out.append(family)
            return family

        states = core.GaugeMetricFamily(
            "ckptd_checkpoints", "Checkpoints the daemon knows, by state.", labels=["root", "state"]
        )
        out.append(states)
        oldest = per_root(
            core.GaugeMetricFamily,
            "ckptd_oldest_incomplete_checkpoint_age_seconds",
            "Since the daemon first saw the oldest checkpoint that is not complete (0: none).",
        )
        rescans = per_root(
            core.CounterMetricFamily,
            "ckptd_rescans",
            "Targeted rescans after missed events (queue overflow).",
        )
        reconcile = per_root(
            core.GaugeMetricFamily,
            "ckptd_last_reconcile_timestamp_seconds",
            "When the last full scan of the root finished (Unix time).",
        )
        leader = per_root(
            core.GaugeMetricFamily, "ckptd_leader", "1 if this daemon deletes in the root, 0 if it stands by."
        )
        free = per_root(
            core.GaugeMetricFamily, "ckptd_filesystem_free_bytes", "Free space on the root's filesystem."
        )
        size = per_root(
            core.GaugeMetricFamily, "ckptd_filesystem_size_bytes", "Size of the root's filesystem."
        )
        uploaded = per_root(core.CounterMetricFamily, "ckptd_archive_uploaded_bytes",
                            "Bytes this daemon uploaded to the root's archive ([roots.archive]).")
        failing = per_root(core.GaugeMetricFamily, "ckptd_archive_failing_checkpoints",
                           "Checkpoints whose last attempt to archive failed (kept meanwhile, where required).")
        failing_age = per_root(core.GaugeMetricFamily, "ckptd_archive_oldest_failure_age_seconds",
                               "How long the checkpoint failing to archive longest has been failing (0: none).")
        pending = per_root(core.GaugeMetricFamily, "ckptd_archive_pending_checkpoints",
                           "Checkpoints to be archived (before a deletion, or every complete one "
                           "on-complete) not archived yet.")
        pending_age = per_root(core.GaugeMetricFamily, "ckptd_archive_oldest_pending_age_seconds",
                               "How long the checkpoint waiting longest for its archive has waited (0: none).")
        for s in samples:
            if s.archive is not None:
                uploaded.add_metric([s.path], s.archive[0])
                failing.add_metric([s.path], s.archive[1])
                failing_age.add_metric([s.path], s.archive[2])
                pending.add_metric([s.path], s.archive[3])
                pending_age.add_metric([s.path], s.archive[4])
        trash_bytes = per_root(
            core.GaugeMetricFamily, "ckptd_trash_bytes",
            "What waits in the root's trash (deleted, restorable, not yet purged), at scrape time.",
        )
        trash_entries = per_root(
            core.GaugeMetricFamily, "ckptd_trash_entries", "Entries in the root's trash, at scrape time."
        )
        for s in samples:
            waiting = trash_summary(inventory(Path(s.path), 0.0))
            trash_bytes.add_metric([s.path], waiting["bytes"])
            trash_entries.add_metric([s.path], waiting["entries"])
            for state, n in sorted(s.states.items()):
                states.add_metric([s.path, state], n)
            oldest.add_metric([s.path], s.oldest_incomplete_age)
            rescans.add_metric([s.path], s.rescans)
            if s.last_reconcile is not None:
                reconcile.add_metric([s.path], s.last_reconcile)
            leader.add_metric([s.path], 1 if s.leader else 0)
            for r in s.runs:
                for state, n in sorted(r.states.items()):
                    run_states.add_metric([s.path, r.run, state], n)
                run_bytes.add_metric([s.path, r.run], r.size_bytes)
                if r.newest_complete is not None:
                    run_newest.add_metric([s.path, r.run], r.newest_complete)
            try:
                space = disk_space(Path(s.path))
            except OSError:
                continue
            free.add_metric([s.path], space.free)
            size.add_metric([s.path], space.total)
        return out
