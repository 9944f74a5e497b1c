"""`ckptd run`: the asyncio daemon, the one thing that wires its rooms together.

Shape (after uvicorn): `startup() -> main_loop() -> shutdown()`.

- The event loop only schedules. Every look at the disk, every decision and
  every rename happens on one filesystem worker thread (`_fs`), so the
  per-root trackers need no locks; purging the trash runs on a second thread
  at idle priority. Consolidating a checkpoint's fp32 weights before slimming
  (zero_to_fp32, minutes for a large model) runs on a third, one at a time,
  while the filesystem thread goes on tracking, settling and deleting; what it
  made goes into place on the filesystem thread (`consolidation.py`).
- watchdog's observer (`watch.py`) watches each inotify root recursively; its
  handler hands each path to the loop, which queues it as a hint for the
  worker, folded in at its next step.
- The loop sleeps on an `asyncio.Event` until the earliest deadline: a
  checkpoint's quiet period ending, a debounced hint, the next targeted poll
  (which runs in inotify mode too, since inotify drops events), the next
  reconcile, or systemd's watchdog ping.
- Signals only set flags: SIGTERM/SIGINT stop (a second SIGINT forces),
  SIGHUP reloads (the new config is validated first; a bad one is logged and
  the old one stays).

The rooms, each with one job: `roots.py` (each root's tracker, leadership and trash),
`tick.py` (the filesystem thread's steps), `narration.py` (what the log says of the
checkpoints), `retention.py` (the plan and the reapers acting on it), `consolidation.py`
(fp32 weights before a slim), `status.py` (the state file), `reload.py` (a new config).
They share `state.py`'s `DaemonState` and are handed the collaborators they call, by name;
none is handed the `Daemon`.
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
from pathlib import Path
from typing import Any

from ckptd import __version__
from ckptd.config import Config
from ckptd.config.effective import effective_config
from ckptd.daemon.consolidation import Consolidations
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.narration import Narrator
from ckptd.daemon.notify import notify, watchdog_interval
from ckptd.daemon.reload import apply_config
from ckptd.daemon.retention import Retention
from ckptd.daemon.roots import RootKeeper, RootRuntime
from ckptd.daemon.state import DaemonState
from ckptd.daemon.status import STATE_PREFIX, StateFile
from ckptd.daemon.tick import Tick
from ckptd.daemon.watch import Watcher
from ckptd.decide.planner import CONFIG_CHECKS, refuse_a_checkpoint_as_root
from ckptd.errors import ConfigError, UsageError
from ckptd.journal import Journal
from ckptd.removal.outcome import DRY_RUN_NOTE
from ckptd.removal.purge import lower_priority

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")

SHUTDOWN_TIMEOUT = 10.0
SAVE_TIMEOUT = 3.0  # at a stop, for the verdicts proven since the last save (verdicts.py)


class Daemon:
    """The daemon: its loop, its threads and signals, and the rooms that do its work (each one
    job: the module docstring names them). What the rooms share is `shared` (`DaemonState`): the
    config, the roots, dry_run, the counters, the clock."""

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
        self.shared = DaemonState(config, dry_run=dry_run or config.daemon.dry_run, clock=clock)
        self.config_path = config_path
        self.cli_roots = cli_roots or []
        self.cli_dry_run = dry_run
        self.install_signals = install_signals
        self._watchdog_every = watchdog_interval()
        self._reload = False
        self._sigint_count = 0
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()  # set once the first scan is done and READY=1 sent
        # The rooms, each with one job (their modules say which), each handed the shared state and
        # what it calls: the other rooms, and these callables of the daemon's loop and threads.
        shared = self.shared
        self.keeper = RootKeeper(shared, wake=self.wake_threadsafe, purge_aside=self.purge_aside)
        self.narrator = Narrator(shared, space=self.keeper.space)
        self.consolidations = Consolidations(
            shared, purge=self.keeper.purge, to_loop=self.call_soon_threadsafe, wake=self.wake,
            run_aside=self.consolidate_aside,
        )
        self.retention = Retention(
            shared, keeper=self.keeper, narrator=self.narrator, consolidations=self.consolidations,
            interrupted=self.interrupted,
        )
        self.state_file = StateFile(
            shared, config.daemon.state_dir / f"{STATE_PREFIX}{os.getpid()}.json",
            retention=self.retention, consolidations=self.consolidations,
        )
        self.tick = Tick(
            shared, keeper=self.keeper, narrator=self.narrator, retention=self.retention,
            consolidations=self.consolidations, state_file=self.state_file, sync_watches=self.sync_watches,
        )

    # What the shared state holds, read here by the command line, tests and bench.
    @property
    def config(self) -> Config:
        return self.shared.config

    @property
    def dry_run(self) -> bool:
        return self.shared.dry_run

    @property
    def roots(self) -> list[RootRuntime]:
        return self.shared.roots

    @property
    def clock(self) -> Callable[[], float]:
        return self.shared.clock

    @property
    def counters(self) -> collections.Counter[str]:
        return self.shared.counters

    @property
    def journal(self) -> Journal | None:
        return self.shared.journal

    @property
    def metrics(self) -> Metrics | None:
        return self.shared.metrics

    @property
    def started(self) -> float:
        return self.shared.started

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

    # --- what the rooms are handed of the loop and the threads ----------------

    def wake(self) -> None:
        """On the loop: look again now (the main loop's next step comes at once)."""
        self._wake.set()

    def wake_threadsafe(self) -> None:
        """From any thread (a lease's renewal thread): `wake`, on the loop."""
        self._loop.call_soon_threadsafe(self._wake.set)

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: `fn(*args)` on the loop (RuntimeError once the loop is closed)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def purge_aside(self, fn: Callable[[], None]) -> None:
        """`fn` on the purger's thread (idle priority)."""
        self._purger.submit(fn)

    def consolidate_aside(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """`fn` on the consolidator's thread (one at a time)."""
        return self._consolidator.submit(fn)

    def state(self) -> dict[str, Any]:
        """The state file's document (what `ckptd status` reads)."""
        return json.loads(self.state_file.text())

    # --- start-up ------------------------------------------------------------

    async def startup(self) -> None:
        note = f" {DRY_RUN_NOTE}" if self.dry_run else ""
        source = self.config_path or "no config file (built-in defaults)"
        log.info("ckptd %s starting (pid %d), config %s%s", __version__, os.getpid(), source, note)
        shared = self.shared
        if self.config.daemon.metrics_listen:
            shared.metrics = Metrics(self.counters, self.config.daemon.state_dir)
            shared.metrics.start(self.config.daemon.metrics_listen)
        self.config.daemon.state_dir.mkdir(parents=True, exist_ok=True)
        shared.journal = None if self.dry_run else Journal(self.config.daemon.state_dir)
        for root in self.config.roots:
            self.roots.append(self.keeper.runtime(root, self.config))
        if any(rt.observer == "inotify" for rt in self.roots):
            self.watcher = Watcher(self._loop, self._on_path, self._on_overflow)
            self.watcher.start()
        if not await self._until_stopped(self.tick.first_scan):
            return
        self.state_file.report("READY=1")
        self.ready.set()
        for line in self.narrator.start_notes:  # "ready: ..."; what `plan` would show follows (`Tick.run`)
            log.info("%s", line)

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
            if not await self._until_stopped(self.tick.run):
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
        if self.state_file.due is not None:
            times.append(self.state_file.due)
        if self.retention.due is not None:
            times.append(self.retention.due)
        if self.shared.hints or any(rt.overflowed for rt in self.roots):
            return 0.0
        return max(0.0, min(times, default=now + 60) - now)

    def _on_path(self, path: str) -> None:
        """From watchdog's handler, on the loop (`watch.py`): a hint for the worker."""
        self.shared.hints.append(path)
        self._wake.set()

    def _on_overflow(self) -> None:
        self.counters["overflows"] += 1
        for rt in self.roots:
            if rt.observer == "inotify":
                rt.overflowed = True
        self._wake.set()

    # --- watches, metrics, systemd -------------------------------------------

    def sync_watches(self) -> None:
        """Watch the inotify roots configured now (after a step, a reload), and only those."""
        if self.watcher is None:
            return
        self.watcher.reconcile({(str(rt.root.path), True) for rt in self.roots if rt.observer == "inotify"})

    async def _ping_watchdog(self, every: float) -> None:
        """WATCHDOG=1 while the event loop runs, also during a long scan or consolidation on the
        filesystem thread (that thread's liveness shows in the state file's heartbeat: `ckptd health`)."""
        while not self._stop.is_set():
            notify("WATCHDOG=1")
            try:
                await asyncio.wait_for(self._stop.wait(), every)
            except TimeoutError:
                pass

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
        log.info("SIGHUP: reloading %s once the work in hand stops (a retention pass stops before its "
                 "next deletion)", self.config_path or "the config")

    def interrupted(self) -> str | None:
        """Why a retention pass must stop before its next deletion, or None. Asked on the
        filesystem thread; set on the loop (a bool and an Event's flag: read without a lock)."""
        if self._stop.is_set():
            return "stopping"
        if self._reload:
            return "a reload was asked for (SIGHUP): the pass was decided under the config being replaced"
        return None

    async def reload(self) -> None:
        self.state_file.report("RELOADING=1")
        try:
            if self.config_path is None:
                raise ConfigError(["no config file to reload (started without one)"])
            # On the filesystem thread, idle between ticks: asyncio's default executor would start a
            # thread at the first SIGHUP that stays for the daemon's life.
            new = await self._on_fs(_reloaded_config, self.config_path, dict(os.environ), self.cli_roots)
        except ConfigError as exc:
            for line in exc.problems:
                log.error("reload failed, keeping the old config: %s", line)
            self.state_file.report("READY=1")
            return
        await self._on_fs(self._apply_config, new)
        log.info("reloaded %s", self.config_path)
        self.state_file.report("READY=1")

    def _apply_config(self, new: Config) -> None:
        apply_config(
            self.shared, new, cli_dry_run=self.cli_dry_run, keeper=self.keeper, narrator=self.narrator,
            retention=self.retention, consolidations=self.consolidations, sync_watches=self.sync_watches,
        )

    def _save_verdicts(self) -> None:
        for rt in self.roots:
            rt.tracker.scanner.save_verdicts()

    async def shutdown(self) -> None:
        notify("STOPPING=1")
        self.keeper.purge_stop = True
        loop = self._loop
        if self.install_signals:
            loop.remove_signal_handler(signal.SIGHUP)  # SIGTERM/SIGINT stay ours until the loop closes
        if self.watcher is not None:
            await loop.run_in_executor(None, self.watcher.stop)
        if self.metrics is not None:
            await loop.run_in_executor(None, self.metrics.stop)
        job = self.consolidations.running
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
            self.state_file.path.unlink()
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
        # A volume lease is marked released, an etcd lease revoked (a standby takes over at once),
        # off the loop and bounded: a volume or etcd that no longer answers must not hold up the exit.
        stopped = loop.run_in_executor(None, lambda: all([rt.lead.stop() for rt in self.roots]))
        try:
            await asyncio.wait_for(asyncio.shield(stopped), SHUTDOWN_TIMEOUT)
        except TimeoutError:
            kinds = sorted({rt.lead.kind for rt in self.roots if rt.lead.kind != "local"})
            leases = " and ".join(f"the {kind} lease" for kind in kinds)
            log.warning("%s could not be handed back in time: it expires by itself", leases or "the lease")
            _flush_logs()
            os._exit(0)
        if self.journal is not None:
            self.journal.close()
        log.info("stopped")


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


def _reloaded_config(path: Path, environ: dict[str, str], cli_roots: list[Path]) -> Config:
    """The config a reload swaps in, refused (ConfigError) where `ckptd run` would refuse it at
    start: a root that is a checkpoint, or lies in one (cli preflight)."""
    new = effective_config(path, environ, cli_roots, checks=CONFIG_CHECKS)
    for root in new.roots:
        try:
            refuse_a_checkpoint_as_root(root)
        except UsageError as exc:
            raise ConfigError([str(exc)]) from None
    return new
