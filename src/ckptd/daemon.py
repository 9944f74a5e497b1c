"""`ckptd run`: the asyncio daemon.

Shape (after uvicorn): `startup() -> main_loop() -> shutdown()`.

- The event loop only schedules. Every look at the disk, every decision and
  every rename happens on one filesystem worker thread (`_fs`), so the
  per-root trackers need no locks; purging the trash runs on a second thread
  at idle priority.
- watchdog's threads hand paths to the loop (`watch.py`); the loop queues them
  as hints for the worker, which folds them in at its next step.
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd import __version__
from ckptd.config import Config, format_size
from ckptd.envconfig import effective_config
from ckptd.errors import ConfigError, RootMissingError
from ckptd.journal import Journal
from ckptd.metrics import Metrics
from ckptd.model import Action
from ckptd.notify import notify, watchdog_interval
from ckptd.planner import DiskSpace, decide, disk_space
from ckptd.policy import Decision
from ckptd.reaper import DRY_RUN_NOTE, LockHeld, Outcome, Reaper, RootLock, lower_priority
from ckptd.tracker import Changes, RootTracker
from ckptd.watch import Watcher, choose_observer

log = logging.getLogger("ckptd.daemon")

SHUTDOWN_TIMEOUT = 10.0
SAVE_TIMEOUT = 3.0  # at a stop, for the verdicts proven since the last save (verdicts.py)
STATE_MIN_INTERVAL = 1.0
# Retention (a plan across every root) runs at most this often: in a save storm each tick completes
# a few checkpoints, and a pass per tick held the filesystem thread from its next looks.
RETENTION_MIN_INTERVAL = 1.0
STATE_PREFIX = "daemon."


class RootRuntime:
    """One root as the daemon runs it: its tracker, its lock, its reaper."""

    def __init__(self, tracker: RootTracker, lock: RootLock, reaper: Reaper, observer: str):
        self.tracker = tracker
        self.lock = lock
        self.reaper = reaper
        self.observer = observer
        self.leader = False
        self.next_poll = 0.0
        self.next_reconcile = 0.0
        self.overflowed = False
        self.pending_purge_bytes = 0  # in the trash, not yet purged: counted as free (under `pending_lock`)
        self.pending_lock = threading.Lock()
        self.said_standby = False
        self.last_error: str | None = None
        self.failures = 0
        self.outcomes: dict[str, str] = {}  # checkpoint -> the last refusal or failure said about it
        self.dev: int | None = None  # the root's filesystem, as last seen (`Daemon._space`)

    @property
    def root(self):
        return self.tracker.root


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
        self._retention_ran = -1e9
        self._retention_due: float | None = None
        self.metrics: Metrics | None = None  # with [daemon] metrics_listen (metrics.py)

    # --- entry point ---------------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._fs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptd-fs")
        self._purger = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ckptd-purge", initializer=lower_priority
        )
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
        log.info("ckptd %s starting (pid %d)%s", __version__, os.getpid(), note)
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
        log.info("ready: watching %d root(s)", len(self.roots))

    def _runtime(self, root, config: Config) -> RootRuntime:
        tracker = RootTracker(root, self.clock, state_dir=self.config.daemon.state_dir)
        reaper = self._reaper(tracker, config)
        observer, why = choose_observer(root.path, root.observer)
        log.info("%s: observer=%s (%s)", root.path, observer, why)
        return RootRuntime(tracker, RootLock(self.config.daemon.state_dir, root.path), reaper, observer)

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
            self._try_lead(rt)
            rt.tracker.full_scan()
            rt.next_poll = now + rt.root.poll_interval
            rt.next_reconcile = now + rt.root.reconcile_interval
        self._sync_watches()
        self._sample_metrics()
        self._write_state(force=True)

    def _try_lead(self, rt: RootRuntime) -> None:
        """Take the root's deleter lock if free; otherwise stay an observe-only standby."""
        if rt.leader or self.dry_run:
            return
        try:
            rt.lock.acquire()
        except LockHeld as exc:
            if not rt.said_standby:
                log.warning("%s: standby, observing only: %s", rt.root.path, exc)
                rt.said_standby = True
            return
        rt.leader = True
        log.info("%s: this ckptd deletes here (holds %s)", rt.root.path, rt.lock.path)
        self._purge(rt)  # what an earlier run left in the trash

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
        """From watchdog (via call_soon_threadsafe): a hint for the worker."""
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
                    retention = True
                elif rt.overflowed:
                    rt.overflowed = False
                    self.counters["rescans"] += 1
                    tr.rescan_in_flight(changes)
                    rt.next_poll = now + rt.root.poll_interval
                elif now >= rt.next_poll:
                    tr.poll(changes)
                    rt.next_poll = now + rt.root.poll_interval
                    self._try_lead(rt)
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
            for c in completed:
                self.counters["completed"] += 1
                log.info(
                    "%s: complete (%s, %s)",
                    c.rel,
                    c.layout,
                    format_size(c.size_bytes),
                    extra={"run": c.run, "checkpoint": c.name, "state": "complete"},
                )
            if completed or changes.vanished or step.vanished:
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
        self._sample_metrics()
        self._write_state()

    # --- retention ---------------------------------------------------------

    def _retention(self) -> None:
        """Decide across every root (min_free is per filesystem), then let each leader's reaper act."""
        plan = decide([(rt.root, rt.tracker.current_runs()) for rt in self.roots], space=self._space)
        for w in plan.warnings:
            log.warning("%s", w)
        self._log_decisions(plan.decisions)
        for rt in self.roots:
            if not rt.leader and not self.dry_run:
                continue
            mine = [d for d in plan.decisions if d.checkpoint.root == rt.root.path]
            if not any(d.action in (Action.DELETE, Action.SLIM) for d in mine):
                continue
            trashed = False
            for result in rt.reaper.execute(mine):
                c = result.decision.checkpoint
                action = str(result.decision.action)
                verb = "deleted" if action == "delete" else "slimmed"
                extra = {
                    "run": c.run,
                    "checkpoint": c.name,
                    "action": action,
                    "reasons": list(result.decision.reasons),
                    "outcome": str(result.outcome),
                }
                if result.outcome in (Outcome.TRASHED, Outcome.SLIMMED):
                    trashed = True
                    self.counters[verb] += 1
                    moved = c.size_bytes if result.outcome is Outcome.TRASHED else result.moved_bytes
                    with rt.pending_lock:
                        rt.pending_purge_bytes += moved
                    if result.outcome is Outcome.TRASHED:
                        rt.tracker.forget(c.rel)
                    else:
                        rt.tracker.look_again(c.rel)  # slimmed: not the checkpoint the plan saw
                    reasons = "; ".join(result.decision.reasons)
                    log.info("%s %s (%s): %s", verb, c.rel, format_size(moved), reasons, extra=extra)
                elif result.outcome is Outcome.DRY_RUN:
                    log.debug("would %s %s: %s %s", action, c.rel, result.detail, DRY_RUN_NOTE, extra=extra)
                else:
                    self.counters[str(result.outcome)] += 1
                    if result.outcome is Outcome.REFUSED:
                        rt.tracker.refused(c.rel)  # the disk differs from what the plan was made of
                    if rt.outcomes.get(c.rel) != result.detail:  # once per reason, not every pass
                        rt.outcomes[c.rel] = result.detail
                        level = logging.ERROR if result.outcome is Outcome.FAILED else logging.WARNING
                        what = "deleting" if action == "delete" else "slimming"
                        log.log(level, "not %s %s: %s", what, c.rel, result.detail, extra=extra)
            if trashed:
                self._purge(rt)
        # Forget what was said about checkpoints that are gone (a path re-created later is news again).
        current = {(str(d.checkpoint.root), d.checkpoint.rel) for d in plan.decisions}
        kept = {k: v for k, v in self._decisions.items() if k in current}
        if len(kept) != len(self._decisions):
            self._decisions, self._decisions_version = kept, self._decisions_version + 1
        for rt in self.roots:
            rels = {c.rel for c in rt.tracker.checkpoints()}
            rt.outcomes = {k: v for k, v in rt.outcomes.items() if k in rels}

    def _log_decisions(self, decisions: tuple[Decision, ...]) -> None:
        """Log each checkpoint's decision when it changes (not at every reconcile)."""
        note = f" {DRY_RUN_NOTE}" if self.dry_run else ""
        for d in decisions:
            key = (str(d.checkpoint.root), d.checkpoint.rel)
            value = (str(d.action), d.reasons)
            if self._decisions.get(key) != value:
                self._decisions[key] = value
                self._decisions_version += 1
                level = logging.INFO if d.action is Action.DELETE else logging.DEBUG
                log.log(
                    level,
                    "decide %s%s",
                    d.line(),
                    note if d.action is Action.DELETE else "",
                    extra={
                        "run": d.checkpoint.run,
                        "checkpoint": d.checkpoint.name,
                        "action": str(d.action),
                        "reasons": list(d.reasons),
                    },
                )

    def _space(self, path: Path) -> DiskSpace:
        """Free space on `path`'s filesystem, counting what its roots hold in the trash as freed.

        While a purge runs, bytes it already freed are counted twice: free space is
        overestimated for a moment, so min_free deletes less, never more.
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
                with rt.pending_lock:
                    pending += rt.pending_purge_bytes
        return DiskSpace(free=space.free + pending, total=space.total)

    def _purge(self, rt: RootRuntime) -> None:
        if self.dry_run:
            return

        def purge() -> None:
            count, freed = rt.reaper.purge(stop=lambda: self._purge_stop)
            with rt.pending_lock:
                rt.pending_purge_bytes = max(0, rt.pending_purge_bytes - freed)
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
                "leader": rt.leader,
                "poll_interval": rt.root.poll_interval,  # `ckptd health` allows 3 of these
                "oldest_incomplete_age": oldest,
            }
            roots.append(_json(head)[:-1] + ',"runs":' + self._runs_json(rt) + "}")
        head = {
            "pid": os.getpid(),
            "version": __version__,
            "heartbeat": time.time(),
            "started": self.started,
            "dry_run": self.dry_run,
            "counters": dict(self.counters),
        }
        return _json(head)[:-1] + ',"roots":[' + ",".join(roots) + "]}"

    def _runs_json(self, rt: RootRuntime) -> str:
        key = (rt.tracker.version, self._decisions_version)
        hit = self._runs_cache.get(rt.root.path)
        if hit is not None and hit[0] == key:
            return hit[1]
        root_key = str(rt.root.path)
        runs = []
        for run in rt.tracker.current_runs():
            ckpts = []
            for c in run.checkpoints:
                decided = self._decisions.get((root_key, c.rel))  # not c.path: building Paths was slow
                ckpts.append(
                    {
                        "name": c.name,
                        "step": c.step,
                        "state": str(c.state),
                        "size_bytes": c.size_bytes,
                        "action": decided[0] if decided else None,
                        "reasons": list(decided[1]) if decided else [],
                    }
                )
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
        by_path = {rt.root.path: rt for rt in self.roots}
        keep: list[RootRuntime] = []
        for root in new.roots:
            rt = by_path.pop(root.path, None)
            if rt is None:
                rt = self._runtime(root, new)
                self._try_lead(rt)
                rt.tracker.full_scan()
            else:
                if root.observer != rt.root.observer:
                    log.warning("%s: observer changed: it takes effect at the next start", root.path)
                # Patterns, depth, world sizes may have changed: look again with the new eyes,
                # keeping what the settler knows (a reload does not restart quiet periods).
                rt.tracker.reconfigure(root)
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
            rt.lock.release()
        self.roots = keep
        self.config = new
        self._decisions.clear()
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
        try:  # what was proven since the last reconcile, for the next start (not if the thread hangs)
            await asyncio.wait_for(self._on_fs(self._save_verdicts), SAVE_TIMEOUT)
        except TimeoutError:
            pass
        self._fs.shutdown(wait=False, cancel_futures=True)
        self._purger.shutdown(wait=False, cancel_futures=True)
        done = await loop.run_in_executor(None, _join_executors, [self._fs, self._purger], SHUTDOWN_TIMEOUT)
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
        for rt in self.roots:
            rt.lock.release()
        if self.journal is not None:
            self.journal.close()
        log.info("stopped")


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
