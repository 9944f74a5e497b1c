"""`ckptd run`: the asyncio daemon.

Shape (after uvicorn): `startup() -> main_loop() -> shutdown()`.

- The event loop only schedules. Every look at the disk, every decision and
  every rename happens on one filesystem worker thread (`_fs`), so the
  per-root trackers need no locks; purging the trash runs on a second thread
  at idle priority. Consolidating a checkpoint's fp32 weights before slimming
  (zero_to_fp32, minutes for a large model) runs on a third, one at a time,
  while the filesystem thread goes on tracking, settling and deleting; what it
  made goes into place on the filesystem thread (`_ConsolidationJob`).
- The inotify descriptor (`watch.py`) is read on the loop, no thread of its
  own; the loop queues the paths as hints for the worker, which folds them in
  at its next step.
- The loop sleeps on an `asyncio.Event` until the earliest deadline: a
  checkpoint's quiet period ending, a debounced hint, the next targeted poll
  (which runs in inotify mode too, since inotify drops events), the next
  reconcile, or systemd's watchdog ping.
- Signals only set flags: SIGTERM/SIGINT stop (a second SIGINT forces),
  SIGHUP reloads (the new config is validated first; a bad one is logged and
  the old one stays).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptd import __version__
from ckptd.config import Config, Root, format_age, format_duration, format_size
from ckptd.consolidate import Consolidation
from ckptd.envconfig import effective_config
from ckptd.errors import ConfigError, RootMissingError
from ckptd.journal import Journal
from ckptd.lease import (
    Leadership,
    LocalLeadership,
    VolumeLease,
    choose_leadership,
    coherence_note,
    volume_leader_seen,
)
from ckptd.locks import RootLock
from ckptd.metrics import Metrics, unmet_budgets
from ckptd.model import QUIET, SAVE_LEASE, Action, Checkpoint, State, Verdict
from ckptd.mounts import AttributeCache, Mount, quiet_for, read_mounts
from ckptd.notify import notify, watchdog_interval
from ckptd.planner import DiskSpace, decide, disk_space
from ckptd.policy import Decision
from ckptd.removal.consolidation import Work
from ckptd.removal.outcome import DRY_RUN_NOTE, Outcome, Result
from ckptd.removal.purge import lower_priority, waiting_in_trash
from ckptd.removal.reaper import Reaper
from ckptd.tracker import Changes, RootTracker
from ckptd.watch import Watcher, choose_observer

log = logging.getLogger("ckptd.daemon")

SHUTDOWN_TIMEOUT = 10.0
SAVE_TIMEOUT = 3.0  # at a stop, for the verdicts proven since the last save (verdicts.py)
STATE_MIN_INTERVAL = 1.0
# A running consolidation, and the looks at what a first scan found, say so this often (seconds).
CONSOLIDATION_PROGRESS_EVERY = 60.0
SCAN_PROGRESS_EVERY = 10.0
# Retention (a plan across every root) runs at most this often: in a save storm each tick completes
# a few checkpoints, and a pass per tick held the filesystem thread from its next looks.
RETENTION_MIN_INTERVAL = 1.0
STATE_PREFIX = "daemon."


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
        self.dev: int | None = None  # the root's filesystem, as last seen (`Daemon._space`)
        self.configured_quiet = tracker.root.quiet_period  # before `_effective_root`
        self.catching_up = False  # took over a volume lease: no retention before a full scan
        self.cache: AttributeCache | None = None  # the mount's attribute cache (mounts.py)

    @property
    def root(self):
        return self.tracker.root

    def role(self, dry_run: bool) -> str:
        """What this daemon does at this root: `leader` (deletes here), `standby` (another ckptd
        holds the root's lock: this one observes) or `dry-run` (decides, deletes nothing, no lock)."""
        return "dry-run" if dry_run else "leader" if self.leader else "standby"


@dataclass
class _ConsolidationJob:
    """The one consolidation the daemon runs at a time, and for which root.

    At most one: each needs about twice the model's largest tensor on top of torch (README,
    Slimming), and reads a checkpoint's whole optimizer state from the volume the training
    writes to; two at once would double the memory a unit must be given (`MemoryMax=`), for
    no checkpoint freed sooner: each slim waits for its own consolidation either way.
    """

    rt: RootRuntime
    work: Work
    run: Consolidation
    future: concurrent.futures.Future | None = None
    stopping: str | None = None  # why it was stopped, if it was
    started: float = 0.0  # wall-clock time, for `status`
    said: float = 0.0  # monotonic time of its last progress line


_Waiting = tuple[RootRuntime, Result]  # a slim whose fp32 weights are to be consolidated first (DEFERRED)


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        cli_roots: list[Path] | None = None,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
        install_signals: bool = True,
    ):
        self.config = config
        self.config_path = config_path
        self.cli_roots = cli_roots or []
        self.cli_dry_run = dry_run
        self.dry_run = dry_run or config.daemon.dry_run
        self.clock = clock
        self.install_signals = install_signals
        self.roots: list[RootRuntime] = []
        self.journal: Journal | None = None
        self.counters = collections.Counter[str]()
        self.started = time.time()
        self._decisions: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}  # by (root, rel)
        # What the log last said of each checkpoint (by (root, rel)): its state, its action.
        self._said_states: dict[tuple[str, str], State] = {}
        self._said_actions: dict[tuple[str, str], str] = {}
        # Checkpoints found by a first scan, until each has settled: their first state and
        # decision are debug lines, and one totals line says what became of them (`_say_totals`).
        self._found_at_start: set[tuple[str, str]] = set()
        self._totals_said = False
        self._looks_due: dict[str, int] = {}  # root -> checkpoints found at start, to be looked at
        self._looks_said = 0.0  # monotonic time of the last progress line about them
        self._start_notes: list[str] = []  # what the first scan found, said after "ready"
        self._preview_due = False  # `_as_plan_sees_it`, said once the start-up's looks are done
        self._decisions_version = 0  # bumped when `_decisions` changes (the state file's cache)
        self._runs_cache: dict[Path, tuple[tuple[int, int], str]] = {}  # see `_runs_json`
        self._hints: collections.deque[str] = collections.deque()
        self._state_path = config.daemon.state_dir / f"{STATE_PREFIX}{os.getpid()}.json"
        self._watchdog_every = watchdog_interval()
        self._reload = False
        self._sigint_count = 0
        self._purge_stop = False
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()  # set once the first scan is done and READY=1 sent
        self._state_written = -1e9
        self._state_due: float | None = None
        self._lead_gained = False  # a root's lead was taken: run retention now, not at the next event
        self._retention_ran = -1e9
        self._retention_due: float | None = None
        self.metrics: Metrics | None = None  # with [daemon] metrics_listen (metrics.py)
        self._consolidation: _ConsolidationJob | None = None  # running; the fs thread's alone
        self._consolidated = collections.deque[_ConsolidationJob]()  # finished, for the fs thread
        self._consolidation_failed: dict[tuple[str, str], str] = {}  # (root, rel) -> its fingerprint then

    # --- entry point ---------------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._fs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptd-fs")
        self._purger = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ckptd-purge", initializer=lower_priority
        )
        self._consolidator = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptd-consolidate")
        if self.install_signals:
            self._install_signals()
        self.watcher: Watcher | None = None
        pinger = (
            asyncio.create_task(self._ping_watchdog(self._watchdog_every)) if self._watchdog_every else None
        )
        try:
            await self.startup()
            await self.main_loop()
        finally:
            if pinger is not None:
                pinger.cancel()
            await self.shutdown()
        return 0

    async def _on_fs(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._loop.run_in_executor(self._fs, fn, *args)

    # --- start-up ------------------------------------------------------------

    async def startup(self) -> None:
        note = f" {DRY_RUN_NOTE}" if self.dry_run else ""
        source = self.config_path or "no config file (built-in defaults)"
        log.info("ckptd %s starting (pid %d), config %s%s", __version__, os.getpid(), source, note)
        if self.config.daemon.metrics_listen:
            self.metrics = Metrics(self.counters)
            self.metrics.start(self.config.daemon.metrics_listen)
        self.config.daemon.state_dir.mkdir(parents=True, exist_ok=True)
        self.journal = None if self.dry_run else Journal(self.config.daemon.state_dir)
        for root in self.config.roots:
            self.roots.append(self._runtime(root, self.config))
        if any(rt.observer == "inotify" for rt in self.roots):
            self.watcher = Watcher(self._loop, self._on_path, self._on_overflow)
            self.watcher.start()
        if not await self._until_stopped(self._first_scan):
            return
        self._report("READY=1")
        self.ready.set()
        for line in self._start_notes:  # "ready: ..."; what `plan` would show follows (`_tick`)
            log.info("%s", line)

    def _runtime(self, root, config: Config) -> RootRuntime:
        mounts = read_mounts()
        effective, cache = self._effective_root(root, mounts)
        tracker = RootTracker(effective, self.clock, state_dir=self.config.daemon.state_dir)
        reaper = self._reaper(tracker, config)
        observer, why = choose_observer(root.path, root.observer)
        log.info("%s: observer=%s (%s)", root.path, observer, why, extra={"root": str(root.path)})
        rt = RootRuntime(tracker, self._leadership(root, config, mounts), reaper, observer)
        rt.configured_quiet, rt.cache = root.quiet_period, cache
        return rt

    def _effective_root(self, root, mounts: list[Mount]):
        """The root with the quiet period its mount's attribute cache calls for (mounts.quiet_for)."""
        quiet, cache, warning = quiet_for(root.path, root.quiet_period, mounts, root.attribute_cache)
        if warning is not None:
            log.warning("%s: %s", root.path, warning)
        if quiet != root.quiet_period:
            root = root.model_copy(update={"quiet_period": quiet})
        return root, cache

    def _leadership(self, root, config: Config, mounts: list[Mount]) -> Leadership:
        d = config.daemon
        kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent)
        log.info("%s: leadership=%s (%s)", root.path, kind, why)
        if problem is not None:
            log.error("%s: %s", root.path, problem)
        elif kind == "volume" and (note := coherence_note(root.path, mounts, root.coherent)) is not None:
            log.warning("%s: %s", root.path, note)
        if kind == "local":
            if (mixed := volume_leader_seen(root.path)) is not None:
                log.warning("%s: %s", root.path, mixed)
            return LocalLeadership(RootLock(d.state_dir, root.path), why)
        lease = VolumeLease(
            root.path, duration=d.lease_duration, margin=d.lease_margin, why=why, problem=problem
        )
        lease.want = not self.dry_run
        lease.start(on_change=lambda: self._loop.call_soon_threadsafe(self._wake.set))
        return lease

    def _reaper(self, tracker: RootTracker, config: Config) -> Reaper:
        return Reaper(
            tracker.scanner,
            self.journal,
            dry_run=self.dry_run,
            consolidate_timeout=config.daemon.consolidate_timeout,
        )

    def _first_scan(self) -> None:
        now = self.clock()
        for rt in self.roots:
            if isinstance(rt.lead, VolumeLease) and not self.dry_run:
                rt.lead.step()  # a first look now (its thread may not have had one): no false "standby"
            self._try_lead(rt, attempt=True)
            rt.tracker.full_scan()
            rt.catching_up = False  # this was the scan a lead taken at start-up waits for
            rt.next_poll = now + rt.root.poll_interval
            rt.next_reconcile = now + rt.root.reconcile_interval
            n = len(rt.tracker.checkpoints())
            log.info(
                "%s: %d checkpoint(s) in %d run(s)", rt.root.path, n, len(rt.tracker.runs),
                extra={"root": str(rt.root.path)},
            )
        self._said_states = {
            (str(rt.root.path), c.rel): c.state for rt in self.roots for c in rt.tracker.checkpoints()
        }
        self._found_at_start = set(self._said_states)
        self._looks_due = {str(rt.root.path): len(rt.tracker.unseen) for rt in self.roots}
        self._looks_said = now
        self._start_notes = [self._what_comes_next()]
        self._preview_due = True  # what `plan` would show, once every checkpoint found was looked at
        self._sync_watches()
        self._sample_metrics()
        self._write_state(force=True)

    def _what_comes_next(self) -> str:
        """The start-up line: what the daemon waits for, and when it first decides.

        Every checkpoint found at start settles once: it is complete only after the daemon
        itself has seen it unchanged for its quiet period, on the monotonic clock (settle.py),
        so the first decisions come one quiet period after the first scan.
        """
        periods = sorted({rt.root.quiet_period for rt in self.roots}) or [0.0]
        quiet = " to ".join(dict.fromkeys(format_duration(p) for p in (periods[0], periods[-1])))
        head = f"ready: watching {len(self.roots)} root(s)"
        now = self.clock()
        waiting = []
        for rt in self.roots:
            for c in rt.tracker.in_flight():
                d = rt.tracker.settler.deadline(c.rel)
                if d is None and not c.fingerprint:
                    # Found at start-up, not looked at yet (READY comes first): it settles from its
                    # first look, a quiet period from now at the soonest.
                    d = now + rt.root.quiet_period
                if c.state in IN_FLIGHT and d is not None:
                    waiting.append(d)
        dry = "; dry run: nothing will be deleted" if self.dry_run else ""
        if not waiting:
            return (
                f"{head}, no checkpoint in flight: a new one is decided once ckptd has seen it "
                f"unchanged for quiet_period ({quiet}){dry}"
            )
        first = min(waiting) - now
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + first))
        return (
            f"{head}, {len(waiting)} checkpoint(s) settling: ckptd decides about a checkpoint once it "
            f"has itself seen it unchanged for quiet_period ({quiet}; file times are not trusted). "
            f"First decisions at {at} (in {format_age(first)}){dry}"
        )

    def _as_plan_sees_it(self) -> list[str]:
        """Meanwhile: the plan by file times, as `ckptd plan` would show it now (not acted on).

        So that the first quiet period is not silent. The daemon decides for itself once
        checkpoints have settled; this only previews what that is likely to be.
        """
        wall = time.time()
        runs = []
        for rt in self.roots:
            period = rt.root.quiet_period
            judged = [
                replace(r, checkpoints=tuple(_by_file_times(c, period, wall) for c in r.checkpoints))
                for r in rt.tracker.current_runs()
            ]
            runs.append((rt.root, judged))
        if not any(r.checkpoints for _, rs in runs for r in rs):
            return []
        plan = decide(runs, space=self._space)
        states = collections.Counter(str(d.checkpoint.state) for d in plan.decisions)
        found = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
        acts = []
        for action in (Action.DELETE, Action.SLIM):
            ds = [d for d in plan.decisions if d.action is action]
            if ds:
                more = f" and {len(ds) - 3} more" if len(ds) > 3 else ""
                names = ", ".join(d.checkpoint.rel for d in ds[:3]) + more
                freed = format_size(sum(d.bytes_freed for d in ds))
                acts.append(f"{action} {len(ds)} ({freed}: {names})")
        would = "; would " + ", ".join(acts) if acts else "; nothing to delete or slim"
        return [f"meanwhile, by file times (as `ckptd plan` shows it now): {found}{would}"]

    def _standing_by(self, rt: RootRuntime) -> bool:
        """A standby for a volume lease: it watches the lease closely (its own thread) and the
        volume loosely (a full scan at each reconcile, no polls), and catches up at takeover."""
        return isinstance(rt.lead, VolumeLease) and not rt.leader and not self.dry_run

    def _try_lead(self, rt: RootRuntime, attempt: bool = False) -> None:
        """Follow the root's leadership: lead where it is held, stand by (observe only) where not.

        A local lock is tried when `attempt`; a volume lease is taken and renewed by its own
        thread, and only looked at here (no I/O).
        """
        if self.dry_run and not rt.said_dry_run:
            log.info("%s: dry run: deciding, deleting nothing (no lock taken)", rt.root.path,
                     extra={"root": str(rt.root.path), "dry_run": True})
            rt.said_dry_run = True
        if self.dry_run:
            return
        if attempt and isinstance(rt.lead, LocalLeadership):
            rt.lead.step()
        held = rt.lead.held()
        if held and not rt.leader:
            if isinstance(rt.lead, VolumeLease):
                # It stood by looking at the volume loosely: a full scan first (the next tick),
                # and no retention here until it is done (`_retention`).
                rt.catching_up, rt.next_reconcile = True, self.clock()
            rt.leader, rt.said_standby = True, False
            status = rt.lead.status()
            local = rt.lead.kind == "local"
            how = f"holds {status['lock']}" if local else f"volume lease, epoch {status['epoch']}"
            log.info("%s: this ckptd deletes here (%s)", rt.root.path, how)
            rt.reaper.clear_work()  # what an interrupted consolidation left, into the trash
            self._purge(rt)  # what an earlier run left in the trash
            self._lead_gained = True  # what the standby decided is carried out at the next tick
        elif not held and rt.leader:
            rt.leader = False
            log.warning("%s: standby from now on: this ckptd lost the lead and deletes nothing", rt.root.path)
        elif not held and not rt.said_standby:
            why = rt.lead.blocked or rt.lead.status().get("error") or "waiting for the volume lease"
            log.warning("%s: standby, observing only: %s", rt.root.path, why)
            rt.said_standby = True

    # --- the main loop -----------------------------------------------------

    async def main_loop(self) -> None:
        while not self._stop.is_set():
            timeout = self._next_timeout()
            if timeout > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
            self._wake.clear()
            if self._stop.is_set():
                break
            if self._reload:
                self._reload = False
                await self.reload()
            if not await self._until_stopped(self._tick):
                break

    async def _until_stopped(self, fn: Callable[[], Any]) -> bool:
        """Run `fn` on the filesystem thread; return False if a stop request came first.

        A stop does not wait for a long scan (a hung NFS mount, a huge reconcile):
        `shutdown` gives the thread a bounded time and then exits regardless.
        """
        work = asyncio.ensure_future(self._on_fs(fn))
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            stop.cancel()
            work.result()  # an exception here is a bug: let it end the daemon (exit 70)
            return True
        work.add_done_callback(_log_late_failure)
        return False

    def _next_timeout(self) -> float:
        now = self.clock()
        times = [rt.next_poll for rt in self.roots] + [rt.next_reconcile for rt in self.roots]
        times += [d for rt in self.roots if (d := rt.tracker.next_deadline()) is not None]
        if self._state_due is not None:
            times.append(self._state_due)
        if self._retention_due is not None:
            times.append(self._retention_due)
        if self._hints or any(rt.overflowed for rt in self.roots):
            return 0.0
        return max(0.0, min(times, default=now + 60) - now)

    def _on_path(self, path: str) -> None:
        """From the inotify reader on the loop (`watch.py`): a hint for the worker."""
        self._hints.append(path)
        self._wake.set()

    def _on_overflow(self) -> None:
        self.counters["overflows"] += 1
        for rt in self.roots:
            if rt.observer == "inotify":
                rt.overflowed = True
        self._wake.set()

    def _tick(self) -> None:
        """One step of work, on the filesystem thread."""
        now = self.clock()
        hints = []
        while self._hints:
            hints.append(self._hints.popleft())
        retention = False
        changed = False
        while self._consolidated:  # a consolidation ended: its weights go into place, or are dropped
            self._finish_consolidation(self._consolidated.popleft())
            retention = True  # the next one waiting may start
        for rt in self.roots:
            tr = rt.tracker
            for path in hints:
                tr.hint(path, now)
            changes = Changes()
            try:
                if now >= rt.next_reconcile:
                    tr.full_scan(changes)
                    rt.next_reconcile = now + rt.root.reconcile_interval
                    rt.next_poll = now + rt.root.poll_interval
                    rt.catching_up = False
                    retention = True
                elif rt.overflowed:
                    rt.overflowed = False
                    self.counters["rescans"] += 1
                    tr.rescan_in_flight(changes)
                    rt.next_poll = now + rt.root.poll_interval
                elif now >= rt.next_poll and self._standing_by(rt):
                    rt.next_poll = rt.next_reconcile  # the volume loosely: at reconcile only
                elif now >= rt.next_poll:
                    tr.poll(changes)
                    rt.next_poll = now + rt.root.poll_interval
                    self._try_lead(rt, attempt=True)
                    if rt.leader and rt.reaper.trash_pending():  # another process's, maybe renamed late
                        self._purge(rt)
                self._try_lead(rt)  # a volume lease changes hands on its own thread
                step = tr.step(now)
            except (OSError, RootMissingError) as exc:
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
                continue
            if rt.last_error is not None:
                log.info("%s: the volume answers again", rt.root.path)
                rt.last_error, rt.failures = None, 0
            completed = changes.completed + step.completed
            self.counters["completed"] += len(completed)
            if completed or changes.vanished or step.vanished:
                retention = True
            changed = changed or retention or bool(changes.transitions or step.transitions)
        if self._preview_due and not any(rt.tracker.unseen for rt in self.roots):
            # READY came before the looks (tracker.py, `unseen`): the preview waits for them.
            self._preview_due = False
            for line in self._as_plan_sees_it():
                log.info("%s", line)
        if self._lead_gained:
            self._lead_gained, retention = False, True
        if changed:
            self._say_state_changes()
        if not self._totals_said and not self._found_at_start:
            # Everything found at start has settled, complete or not: decide (and say so) once
            # even where none completed (all incomplete: a world_size too large says why here).
            retention = True
        if retention or (self._retention_due is not None and now >= self._retention_due):
            retention = now - self._retention_ran >= RETENTION_MIN_INTERVAL
            self._retention_due = None if retention else self._retention_ran + RETENTION_MIN_INTERVAL
        if retention:
            self._retention_ran = now
            try:
                self._retention()
            except OSError as exc:  # statvfs, a re-check's walk: skip this pass, the next one retries
                log.error("retention skipped this time: %s", exc)
        self._sync_watches()
        self._say_consolidating(now)
        self._say_first_looks(now)
        self._sample_metrics()
        self._write_state()

    def _say_first_looks(self, now: float) -> None:
        """Every SCAN_PROGRESS_EVERY seconds while the checkpoints found at start are looked at
        (a few at a time, after READY: minutes on a big volume), how far it has got."""
        if not self._looks_due or now - self._looks_said < SCAN_PROGRESS_EVERY:
            return
        self._looks_said = now
        for rt in self.roots:
            total = self._looks_due.get(str(rt.root.path), 0)
            left = len(rt.tracker.unseen)
            if total and left:
                log.info("%s: looked at %d of the %d checkpoints found at start (%d%%)", rt.root.path,
                         total - left, total, 100 * (total - left) // total,
                         extra={"root": str(rt.root.path), "done": total - left, "total": total})
        if not any(rt.tracker.unseen for rt in self.roots):
            self._looks_due = {}

    def _say_consolidating(self, now: float) -> None:
        """A line a minute while a consolidation runs (one can take an hour on a big model):
        start and end alone looked like a daemon that had stopped."""
        job = self._consolidation
        if job is None or job.stopping is not None or now - job.said < CONSOLIDATION_PROGRESS_EVERY:
            return
        job.said = now
        c = job.work.decision.checkpoint
        log.info("still consolidating %s (fp32 weights from %s): %s so far", c.rel, job.work.tag,
                 format_age(time.time() - job.started),
                 extra={"run": c.run, "checkpoint": c.name, "action": "consolidate"})

    def _say_state_changes(self) -> None:
        """Log what a person watching wants to know, once per change, in path order: a new
        checkpoint, one complete, incomplete (and why), stalled, in flight again, gone.

        Not every look: a checkpoint being written goes writing -> settling -> writing many
        times; those transitions are debug lines (tracker.py).
        """
        said = self._said_states
        now: dict[tuple[str, str], State] = {}
        for rt in self.roots:
            root = str(rt.root.path)
            for run in rt.tracker.current_runs():
                for c in run.checkpoints:
                    key = (root, c.rel)
                    now[key] = c.state
                    before = said.get(key)
                    if before is not None and (c.state is before or {c.state, before} <= IN_FLIGHT):
                        continue
                    extra = {"root": root, "run": c.run, "checkpoint": c.name, "state": str(c.state)}
                    level = logging.INFO
                    if c.state is State.COMPLETE:
                        what = f"complete ({c.layout}, {format_size(c.size_bytes)})"
                        if key in self._found_at_start:  # one of thousands at start: the totals say it
                            level = logging.DEBUG
                    elif c.state in IN_FLIGHT:
                        what = f"new, {c.state}" if before is None else f"{c.state} again (was {before})"
                    else:
                        what = f"{c.state}: {_first_failed(c)}"
                    if c.state not in IN_FLIGHT:
                        self._found_at_start.discard(key)
                    log.log(level, "%s: %s", c.rel, what, extra=extra)
                    said[key] = c.state
        for key in [k for k in said if k not in now]:
            del said[key]
            self._found_at_start.discard(key)
            root, rel = key
            log.info("%s: gone (not by ckptd)", rel, extra={"root": root})

    # --- retention ---------------------------------------------------------

    def _retention(self) -> None:
        """Decide across every root (min_free is per filesystem), then let each leader's reaper act."""
        runs = [(rt.root, rt.tracker.current_runs(resume=True)) for rt in self.roots]
        plan = decide(runs, space=self._space)
        for w in plan.warnings:
            log.warning("%s", w)
        if self.metrics is not None:
            self.metrics.budgets = {str(rt.root.path): configured_budgets(rt.root) for rt in self.roots}
            self.metrics.budgets_unmet = unmet_budgets(
                plan.warnings, plan.decisions, (str(rt.root.path) for rt in self.roots)
            )
        news = self._log_decisions(plan.decisions)
        done = {"deleted": 0, "slimmed": 0, "freed": 0, "would delete": 0, "would slim": 0}
        waiting: list[_Waiting] = []  # slims whose fp32 weights are to be consolidated first
        for rt in self.roots:
            self._try_lead(rt)
            if (not rt.leader or rt.catching_up) and not self.dry_run:
                continue
            mine = [d for d in plan.decisions if d.checkpoint.root == rt.root.path]
            if not any(d.action in (Action.DELETE, Action.SLIM) for d in mine):
                continue
            trashed = False
            # Fencing: each rename asks whether this ckptd still leads, under the epoch held now.
            rt.reaper.fence = None if self.dry_run else rt.lead.fencer()
            for result in rt.reaper.execute(mine, consolidate=False):
                c = result.decision.checkpoint
                if result.outcome is Outcome.DEFERRED:
                    waiting.append((rt, result))
                    continue
                action = str(result.decision.action)
                verb = "deleted" if action == "delete" else "slimmed"
                extra = {
                    "root": str(rt.root.path),
                    "run": c.run,
                    "checkpoint": c.name,
                    "action": action,
                    "reasons": list(result.decision.reasons),
                    "outcome": str(result.outcome),
                    "dry_run": self.dry_run,
                }
                if result.outcome in (Outcome.TRASHED, Outcome.SLIMMED):
                    trashed = True
                    self.counters[verb] += 1
                    moved = c.size_bytes if result.outcome is Outcome.TRASHED else result.moved_bytes
                    done[verb] += 1
                    done["freed"] += moved
                    if result.outcome is Outcome.TRASHED:
                        rt.tracker.forget(c.rel)
                        self._said_states.pop((str(rt.root.path), c.rel), None)
                    else:
                        rt.tracker.look_again(c.rel)  # slimmed: not the checkpoint the plan saw
                    reasons = "; ".join(result.decision.reasons)
                    log.info("%s %s (%s): %s", verb, c.rel, format_size(moved), reasons, extra=extra)
                elif result.outcome is Outcome.DRY_RUN:
                    done[f"would {action}"] += 1
                    log.debug("would %s %s: %s %s", action, c.rel, result.detail, DRY_RUN_NOTE, extra=extra)
                else:
                    self.counters[str(result.outcome)] += 1
                    if result.outcome is Outcome.REFUSED:
                        # Changed since the tracker settled it (a re-save in place, say): complete
                        # checkpoints are walked again only at reconcile, so look now (and at its anchor).
                        rt.tracker.refused(c.rel)  # the disk differs from what the plan was made of
                    if rt.outcomes.get(c.rel) != result.detail:  # once per reason, not every pass
                        rt.outcomes[c.rel] = result.detail
                        level = logging.ERROR if result.outcome is Outcome.FAILED else logging.WARNING
                        what = "deleting" if action == "delete" else "slimming"
                        log.log(level, "not %s %s: %s", what, c.rel, result.detail, extra=extra)
            if trashed:
                self._purge(rt)
        self._say_totals(plan.decisions, done, news)
        self._schedule_consolidation(plan.decisions, waiting)
        # Forget what was said about checkpoints that are gone (a path re-created later is news again).
        current = {(str(d.checkpoint.root), d.checkpoint.rel) for d in plan.decisions}
        kept = {k: v for k, v in self._decisions.items() if k in current}
        if len(kept) != len(self._decisions):
            self._decisions, self._decisions_version = kept, self._decisions_version + 1
        self._said_actions = {k: v for k, v in self._said_actions.items() if k in current}
        for rt in self.roots:
            rels = {c.rel for c in rt.tracker.checkpoints()}
            rt.outcomes = {k: v for k, v in rt.outcomes.items() if k in rels}

    # --- consolidation, on a worker of its own --------------------------------------

    def _schedule_consolidation(self, decisions: tuple[Decision, ...], waiting: list[_Waiting]) -> None:
        """Stop the running consolidation if the plan no longer wants it, else start the first one
        waiting (one at a time: `_ConsolidationJob`). On the filesystem thread."""
        job = self._consolidation
        if job is not None:
            why = None if job.stopping else self._unwanted(job, decisions, waiting)
            if why is not None:
                job.stopping = why
                log.info("stopping the consolidation of %s: %s", job.work.decision.checkpoint.rel, why)
                job.run.cancel(f"stopped: {why}")
            return
        for rt, result in waiting:
            c = result.decision.checkpoint
            if self._consolidation_failed.get((str(rt.root.path), c.rel)) == c.fingerprint:
                continue  # failed on this very checkpoint: not again until it changes or a reload
            work = rt.reaper.begin_consolidation(result.decision, result.anchors)
            if isinstance(work, Result):
                self._consolidation_failed[(str(rt.root.path), c.rel)] = c.fingerprint
                self._say_not(rt, work, "consolidating")
                continue
            self._start_consolidation(rt, work)
            return

    def _unwanted(
        self, job: _ConsolidationJob, decisions: tuple[Decision, ...], waiting: list[_Waiting]
    ) -> str | None:
        """Why the running consolidation is no longer wanted, or None."""
        planned = job.work.decision.checkpoint

        def same(c: Checkpoint) -> bool:
            return c.root == planned.root and c.rel == planned.rel

        unchanged = [r for rt, r in waiting if rt is job.rt and same(r.decision.checkpoint)]
        if unchanged and unchanged[0].decision.checkpoint.fingerprint == planned.fingerprint:
            return None  # still a slim whose weights are to be consolidated: re-checked this very pass
        if job.rt not in self.roots:
            return "its root is no longer configured"
        if self.dry_run:
            return "dry run"
        if not job.rt.leader:
            return "this ckptd no longer deletes there"
        d = next((d for d in decisions if same(d.checkpoint)), None)
        if d is None:
            return "it is gone"
        if d.action is not Action.SLIM:
            return f"the plan no longer slims it ({d.action}: {'; '.join(d.reasons)})"
        if d.checkpoint.fingerprint != planned.fingerprint:
            return "it changed since the consolidation began"
        return "its re-check failed"

    def _start_consolidation(self, rt: RootRuntime, work: Work) -> None:
        c = work.decision.checkpoint
        job = _ConsolidationJob(rt, work, work.consolidation(self.config.daemon.consolidate_timeout))
        loop = self._loop

        def done(_: concurrent.futures.Future) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(self._on_consolidated, job)
            except RuntimeError:  # the loop is closed: the daemon is gone, the next start clears up
                pass

        job.started, job.said = time.time(), self.clock()
        self._consolidation = job  # before it runs: whoever sees it running sees it here too
        if self.metrics is not None:
            self.metrics.consolidations_running = 1
        job.future = self._consolidator.submit(job.run.run)
        job.future.add_done_callback(done)
        self.counters["consolidations"] += 1
        log.info(
            "consolidating %s: fp32 weights from %s, beside the tracking and deleting; the slim follows "
            "once they are verified in place",
            c.rel,
            work.tag,
            extra={"run": c.run, "checkpoint": c.name, "action": "consolidate"},
        )

    def _on_consolidated(self, job: _ConsolidationJob) -> None:
        """From the worker (via call_soon_threadsafe): hand the finished job to the filesystem thread."""
        self._consolidated.append(job)
        self._wake.set()

    def _finish_consolidation(self, job: _ConsolidationJob) -> None:
        """On the filesystem thread: move the verified weights into place, or drop what was made."""
        if self._consolidation is job:
            self._consolidation = None
            if self.metrics is not None:
                self.metrics.consolidations_running = 0
        assert job.future is not None
        try:
            outcome = job.future.result()
        except Exception as exc:  # ConsolidationFailed, or a bug: nothing goes into place then
            outcome = exc
        rt, c = job.rt, job.work.decision.checkpoint
        result = rt.reaper.finish_consolidation(job.work, outcome)
        extra = {"run": c.run, "checkpoint": c.name, "action": "consolidate", "outcome": str(result.outcome)}
        if result.outcome is Outcome.CONSOLIDATED:
            self.counters["consolidated"] += 1
            log.info("consolidated %s: %s", c.rel, result.detail, extra=extra)
            rt.tracker.look_again(c.rel)  # fp32/ is new: it settles, and the slim follows
            return
        self._purge(rt)  # what it made went to the trash
        if job.stopping is not None:
            log.info("stopped consolidating %s: %s", c.rel, job.stopping, extra=extra)
            return
        self._consolidation_failed[(str(rt.root.path), c.rel)] = c.fingerprint
        self._say_not(rt, result, "consolidating")

    def _say_not(self, rt: RootRuntime, result: Result, what: str) -> None:
        """A refusal or failure, logged once per reason and checkpoint, not every pass."""
        c = result.decision.checkpoint
        self.counters[str(result.outcome)] += 1
        if rt.outcomes.get(c.rel) != result.detail:
            rt.outcomes[c.rel] = result.detail
            level = logging.ERROR if result.outcome is Outcome.FAILED else logging.WARNING
            extra = {"run": c.run, "checkpoint": c.name, "outcome": str(result.outcome)}
            log.log(level, "not %s %s: %s", what, c.rel, result.detail, extra=extra)

    def _say_totals(self, decisions: tuple[Decision, ...], done: dict[str, int], news: int) -> None:
        """One line for a retention pass: after the first that decided about every checkpoint
        found at start (4,500 checkpoints said one line each before, twice), and after each
        that deletes or slims (a dry run: each whose deletions or slims are news, `news`).
        `kept` counts complete checkpoints kept; `incomplete` the rest."""
        acted = done["deleted"] + done["slimmed"] if not self.dry_run else news
        first = not self._totals_said and not self._found_at_start
        if not (first or acted):
            return
        self._totals_said = True
        kept = sum(1 for d in decisions if d.action is Action.KEEP and d.checkpoint.state is State.COMPLETE)
        incomplete = sum(1 for d in decisions if d.checkpoint.state is not State.COMPLETE)
        runs = len({(str(d.checkpoint.root), d.checkpoint.run) for d in decisions})
        if self.dry_run:
            acts = f"would delete {done['would delete']}, would slim {done['would slim']}"
        else:
            acts = (f"{done['deleted']} deleted, {done['slimmed']} slimmed, "
                    f"{format_size(done['freed'])} freed")
        log.info(
            "retention: %d kept, %s, %d incomplete or in flight (%d runs)%s",
            kept, acts, incomplete, runs, f" {DRY_RUN_NOTE}" if self.dry_run else "",
            extra={"kept": kept, "deleted": done["deleted"], "slimmed": done["slimmed"],
                   "incomplete": incomplete, "bytes_freed": done["freed"], "dry_run": self.dry_run},
        )

    def _log_decisions(self, decisions: tuple[Decision, ...]) -> int:
        """Log a checkpoint's decision when its action changes, in plan order (root, run, step).

        At INFO: a complete checkpoint's first decision, and any change of action (keep ->
        delete, keep -> slim); a keep waits until nothing in its run is settling, so that the
        checkpoints found at start (which complete milliseconds apart) are not said to be kept
        as "newest complete" one moment and deleted the next. A kept checkpoint's reasons
        shift with every save (`keep_last=2 (#2 newest)`), and one in flight is kept because
        it is in flight (its state line said so): those are debug lines. Returns how many
        deletions and slims were news.
        """
        news_acting = 0
        note = f" {DRY_RUN_NOTE}" if self.dry_run else ""
        busy = {(c.root, c.run) for d in decisions if (c := d.checkpoint).state in IN_FLIGHT}
        for d in decisions:
            c = d.checkpoint
            key = (str(c.root), c.rel)
            value = (str(d.action), d.reasons)
            changed = self._decisions.get(key) != value
            if changed:
                self._decisions[key] = value
                self._decisions_version += 1
            acting = d.action is not Action.KEEP
            news = (
                c.state is State.COMPLETE
                and self._said_actions.get(key) != value[0]
                and (acting or (c.root, c.run) not in busy)
            )
            if not (news or changed):
                continue
            if news:
                self._said_actions[key] = value[0]
                news_acting += acting
            log.log(
                logging.INFO if news and acting else logging.DEBUG,  # a keep is said by `_say_totals`
                "decide %s%s",
                d.line(),
                note if acting else "",
                extra={
                    "root": str(c.root),
                    "run": c.run,
                    "checkpoint": c.name,
                    "action": str(d.action),
                    "reasons": list(d.reasons),
                    "dry_run": self.dry_run,
                },
            )
        return news_acting

    def _space(self, path: Path) -> DiskSpace:
        """Free space on `path`'s filesystem, counting what its roots hold in the trash as freed:
        what this daemon moved there, and what waits there longer (another process's, one a killed
        prune left: removal.purge.waiting_in_trash).

        While a purge runs, an entry it is removing may be counted with what statvfs sees freed
        already: free space is overestimated for a moment, so min_free deletes less, never more.
        """
        space = disk_space(path)
        dev = os.stat(path).st_dev
        pending = 0
        for rt in self.roots:
            # Another root gone or unreachable (unmounted, ESTALE) must not stop this one's
            # retention: its filesystem is the one it was last seen on.
            try:
                rt.dev = os.stat(rt.root.path).st_dev
            except OSError:
                pass
            if rt.dev == dev:
                pending += waiting_in_trash(rt.root.path)
        return DiskSpace(free=space.free + pending, total=space.total)

    def _purge(self, rt: RootRuntime) -> None:
        if self.dry_run:
            return

        rt.reaper.foreign_wait = rt.lead.takeover_wait()  # what another process trashed waits this long

        def purge() -> None:
            # A leader that lost the lead leaves the rest of the trash to the one that has it.
            count, freed = rt.reaper.purge(stop=lambda: self._purge_stop or not rt.lead.held())
            self.counters["bytes_reclaimed"] += freed
            if count:
                log.info("%s: purged %d trash entries (%s)", rt.root.path, count, format_size(freed))

        self._purger.submit(purge)

    # --- watches, state, systemd ---------------------------------------------

    def _sync_watches(self) -> None:
        if self.watcher is None:
            return
        wanted: set[tuple[str, bool]] = set()
        for rt in self.roots:
            if rt.observer == "inotify":
                wanted |= rt.tracker.wanted_watches()
        self.watcher.reconcile(wanted)

    def _sample_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.sample(self.roots, self.clock())

    async def _ping_watchdog(self, every: float) -> None:
        """WATCHDOG=1 while the event loop runs, also during a long scan or consolidation on the
        filesystem thread (that thread's liveness shows in the state file's heartbeat: `ckptd health`)."""
        while not self._stop.is_set():
            notify("WATCHDOG=1")
            try:
                await asyncio.wait_for(self._stop.wait(), every)
            except TimeoutError:
                pass

    def _status_line(self) -> str:
        states = collections.Counter(str(c.state) for rt in self.roots for c in rt.tracker.checkpoints())
        runs = sum(len(rt.tracker.runs) for rt in self.roots)
        parts = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none"
        return (
            f"{runs} runs; checkpoints: {parts}; {self.counters['deleted']} deleted, "
            f"{format_size(self.counters['bytes_reclaimed'])} reclaimed"
        )

    def _report(self, *fields: str) -> None:
        notify(*fields, f"STATUS={self._status_line()}")

    def state(self) -> dict[str, Any]:
        """The state file's document (what `ckptd status` reads)."""
        return json.loads(self._state_text())

    def _state_text(self) -> str:
        """The state file's JSON. Written at every poll for the heartbeat: each root's runs are
        encoded again only when its tracker or the decisions changed (on the L volume, 6,400
        checkpoints, encoding them was most of an idle tick)."""
        now_mono = self.clock()
        roots = []
        for rt in self.roots:
            oldest = None
            for c in rt.tracker.in_flight():
                since = rt.tracker.settler.changed_at(c.rel)
                if since is not None:
                    oldest = max(oldest or 0.0, now_mono - since)
            head = {
                "path": str(rt.root.path),
                "observer": rt.observer,
                "role": rt.role(self.dry_run),  # leader, standby or dry-run
                "leader": rt.leader,
                "leadership": rt.lead.status(),
                "quiet_period": rt.configured_quiet,
                "effective_quiet_period": rt.root.quiet_period,  # with the attribute cache's
                "attribute_cache": rt.cache.detail if rt.cache is not None else None,
                "poll_interval": rt.root.poll_interval,  # `ckptd health` allows 3 of these
                "oldest_incomplete_age": oldest,
            }
            roots.append(_json(head)[:-1] + ',"runs":' + self._runs_json(rt) + "}")
        job = self._consolidation
        head = {
            "pid": os.getpid(),
            "version": __version__,
            "heartbeat": time.time(),
            "started": self.started,
            "dry_run": self.dry_run,
            "counters": dict(self.counters),
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

    def _runs_json(self, rt: RootRuntime) -> str:
        key = (rt.tracker.version, self._decisions_version)
        hit = self._runs_cache.get(rt.root.path)
        if hit is not None and hit[0] == key:
            return hit[1]
        root_key = str(rt.root.path)
        # The settler's monotonic times as wall-clock times, so that `ckptd status` says how long
        # a checkpoint has been unchanged when it is asked, not when this was written.
        to_wall = time.time() - self.clock()
        runs = []
        for run in rt.tracker.current_runs():
            ckpts = []
            for c in run.checkpoints:
                decided = self._decisions.get((root_key, c.rel))  # not c.path: building Paths was slow
                if c.state is not State.COMPLETE:
                    # Never deleted, whatever retention said when it last ran (it runs when
                    # checkpoints complete or vanish: its reason may be an earlier state's).
                    action, reasons = "keep", [f"{c.state}, never deleted: {_first_failed(c)}"]
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
        self._runs_cache[rt.root.path] = (key, text)
        return text

    def _write_state(self, force: bool = False) -> None:
        """Rewrite the state file atomically (readers see the old or the new), at most once a second."""
        now = self.clock()
        if not force and now - self._state_written < STATE_MIN_INTERVAL:
            self._state_due = self._state_written + STATE_MIN_INTERVAL
            return
        self._state_written, self._state_due = now, None
        tmp = self._state_path.with_suffix(".tmp")
        try:
            tmp.write_text(self._state_text())
            os.replace(tmp, self._state_path)
            log.debug("state written to %s", self._state_path)
        except OSError as exc:
            log.warning("cannot write the state file %s: %s", self._state_path, exc)

    # --- signals, reload, shutdown -----------------------------------------------

    def _install_signals(self) -> None:
        loop = self._loop
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def request_stop(self, why: str) -> None:
        if self._stop.is_set():
            log.info("%s: already stopping", why)
            return
        log.info("%s: stopping", why)
        self._stop.set()
        self._wake.set()

    def _on_sigint(self) -> None:
        self._sigint_count += 1
        if self._sigint_count > 1:
            log.warning("second SIGINT: exiting now")
            _flush_logs()
            os._exit(130)
        self.request_stop("SIGINT (again to force)")

    def request_reload(self) -> None:
        self._reload = True
        self._wake.set()

    async def reload(self) -> None:
        self._report("RELOADING=1")
        try:
            if self.config_path is None:
                raise ConfigError(["no config file to reload (started without one)"])
            new = await self._loop.run_in_executor(
                None, effective_config, self.config_path, dict(os.environ), self.cli_roots
            )
        except ConfigError as exc:
            for line in exc.problems:
                log.error("reload failed, keeping the old config: %s", line)
            self._report("READY=1")
            return
        await self._on_fs(self._apply_config, new)
        log.info("reloaded %s", self.config_path)
        self._report("READY=1")

    def _apply_config(self, new: Config) -> None:
        """Swap in a new config on the fs thread: keep what is known of roots that stay."""
        dry_run = self.cli_dry_run or new.daemon.dry_run
        if dry_run != self.dry_run:
            log.info("dry run %s", "on: deleting nothing from now on" if dry_run else "off: deleting again")
            self.dry_run = dry_run
            if not dry_run and self.journal is None:
                self.journal = Journal(self.config.daemon.state_dir)
            for rt in self.roots:
                if isinstance(rt.lead, VolumeLease):
                    rt.lead.want = not dry_run  # its thread hands the lease back, or takes it again
                elif dry_run:
                    rt.lead.release()
                if dry_run:
                    rt.leader, rt.said_standby = False, False
        old = self.config.daemon
        if (new.daemon.leadership, new.daemon.lease_duration, new.daemon.lease_margin) != (
            old.leadership, old.lease_duration, old.lease_margin
        ):
            log.warning("daemon.leadership/lease_*: changes take effect at the next start, not at a reload")
        mounts = read_mounts()
        by_path = {rt.root.path: rt for rt in self.roots}
        keep: list[RootRuntime] = []
        for root in new.roots:
            rt = by_path.pop(root.path, None)
            if rt is None:
                rt = self._runtime(root, new)
                self._try_lead(rt)
                rt.tracker.full_scan()
                found = rt.tracker.checkpoints()
                log.info("%s: %d checkpoint(s) in %d run(s)", root.path, len(found), len(rt.tracker.runs),
                         extra={"root": str(root.path)})
                self._said_states.update({(str(root.path), c.rel): c.state for c in found})
                self._found_at_start.update((str(root.path), c.rel) for c in found)
            else:
                if root.observer != rt.root.observer:
                    log.warning("%s: observer changed: it takes effect at the next start", root.path)
                # Patterns, depth, world sizes may have changed: look again with the new eyes,
                # keeping what the settler knows (a reload does not restart quiet periods).
                effective, rt.cache = self._effective_root(root, mounts)
                rt.configured_quiet = root.quiet_period
                rt.tracker.reconfigure(effective)
                rt.reaper = self._reaper(rt.tracker, new)
                rt.tracker.full_scan()
            rt.next_poll = min(rt.next_poll, self.clock() + root.poll_interval)
            keep.append(rt)
        if new.daemon.metrics_listen != self.config.daemon.metrics_listen:
            log.warning("daemon.metrics_listen changed: it takes effect at the next start, not at a reload")
        if new.daemon.state_dir != self.config.daemon.state_dir:
            log.warning("daemon.state_dir changed: it takes effect at the next start, not at a reload")
        for rt in by_path.values():
            log.info("%s: no longer configured", rt.root.path)
            rt.lead.stop()
        self.roots = keep
        self.config = new
        self._decisions.clear()
        self._consolidation_failed.clear()  # a new timeout or setting may let them through
        self._decisions_version += 1
        self._retention()
        self._sync_watches()

    def _save_verdicts(self) -> None:
        for rt in self.roots:
            rt.tracker.scanner.save_verdicts()

    async def shutdown(self) -> None:
        notify("STOPPING=1")
        self._purge_stop = True
        loop = self._loop
        if self.install_signals:
            loop.remove_signal_handler(signal.SIGHUP)  # SIGTERM/SIGINT stay ours until the loop closes
        if self.watcher is not None:
            await loop.run_in_executor(None, self.watcher.stop)
        if self.metrics is not None:
            await loop.run_in_executor(None, self.metrics.stop)
        job = self._consolidation
        if job is not None:  # its child is killed; its work directory goes to the trash at the next start
            job.stopping = "the daemon is stopping"
            job.run.cancel("stopped: the daemon is stopping")
        try:  # what was proven since the last reconcile, for the next start (not if the thread hangs)
            await asyncio.wait_for(self._on_fs(self._save_verdicts), SAVE_TIMEOUT)
        except TimeoutError:
            pass
        self._fs.shutdown(wait=False, cancel_futures=True)
        self._purger.shutdown(wait=False, cancel_futures=True)
        self._consolidator.shutdown(wait=False, cancel_futures=True)
        executors = [self._fs, self._purger, self._consolidator]
        done = await loop.run_in_executor(None, _join_executors, executors, SHUTDOWN_TIMEOUT)
        try:
            self._state_path.unlink()
        except OSError:
            pass
        if not done:
            # Threads cannot be cancelled. Exit with them still running: the kernel drops the
            # locks, the journal has what was fsynced, the next start finishes the trash.
            log.warning(
                "shutdown timed out after %.0fs with work in flight; the trash is finished at the next start",
                SHUTDOWN_TIMEOUT,
            )
            _flush_logs()
            os._exit(0)
        # A volume lease is marked released (a standby takes over at once), off the loop and
        # bounded: a volume that no longer answers must not hold up the exit.
        stopped = loop.run_in_executor(None, lambda: all([rt.lead.stop() for rt in self.roots]))
        try:
            await asyncio.wait_for(asyncio.shield(stopped), SHUTDOWN_TIMEOUT)
        except TimeoutError:
            log.warning("the volume lease could not be handed back in time: it expires by itself")
            _flush_logs()
            os._exit(0)
        if self.journal is not None:
            self.journal.close()
        log.info("stopped")


IN_FLIGHT = frozenset({State.WRITING, State.SETTLING})


def _first_failed(c: Checkpoint) -> str:
    """The first check that did not pass, for a state line; a live save lease before any: it holds
    the checkpoint in flight whatever the others say (`model.classify`), and the quiet check before
    it may be one the lease outlived (`settling: unchanged for 1s of 2s` long after)."""
    unpassed = [check for check in c.checks if check.verdict is not Verdict.PASSED]
    for check in sorted(unpassed, key=lambda k: k.name != SAVE_LEASE):
        return f"{check.name} {check.verdict}: {check.detail}"
    return "every check passed"


def _by_file_times(c: Checkpoint, quiet_period: float, wall: float) -> Checkpoint:
    """`c` with its quiet check as `ckptd plan` makes it: its newest mtime against the wall clock.

    For the start-up preview only. The daemon itself settles a checkpoint on what it has
    watched, on the monotonic clock (settle.py); a settling checkpoint is judged here.
    """
    if c.state is not State.SETTLING or not c.fingerprint:
        return c  # (no fingerprint: found at start-up, not looked at yet; its mtimes are not known)
    age = wall - c.newest_mtime
    verdict = Verdict.PASSED if age >= quiet_period else Verdict.FAILED  # a future mtime: not quiet
    detail = f"by file times: last change {format_age(age)} ago"
    checks = tuple(replace(k, verdict=verdict, detail=detail) if k.name == QUIET else k for k in c.checks)
    return replace(c, checks=checks)


def _json(doc: object) -> str:
    # Compact: with indent, json falls back to its pure-Python encoder (9 ms a tick on 960
    # checkpoints; BENCHMARKS.md, idle cost).
    return json.dumps(doc, separators=(",", ":"))


def _log_late_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("work in flight at shutdown failed: %s", future.exception())


def _join_executors(executors: list[concurrent.futures.ThreadPoolExecutor], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    for ex in executors:
        for t in list(getattr(ex, "_threads", ())):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False
    return True


def _flush_logs() -> None:
    for h in logging.getLogger("ckptd").handlers:
        h.flush()


def configured_budgets(root: Root) -> tuple[str, ...]:
    """The budget keys a root sets, in [roots.retention] or any run rule (ckptd_budget_unmet's labels)."""
    rules = (root.retention, *root.runs)
    keys = ("max_size", "min_free", "keep_total")
    return tuple(k for k in keys if any(getattr(r, k) is not None for r in rules))


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
