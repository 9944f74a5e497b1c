"""Consolidating a checkpoint's fp32 weights before it is slimmed (`Consolidations`): zero_to_fp32,
minutes for a large model, runs on a worker of its own, one at a time, while the filesystem
thread goes on tracking, settling and deleting; what it made goes into place on the filesystem
thread."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd.config import format_age
from ckptd.daemon.roots import RootRuntime
from ckptd.decide.policy import Decision
from ckptd.model import Action, Checkpoint
from ckptd.removal.consolidation import Work
from ckptd.removal.outcome import Outcome, Result
from ckptd.removal.zero_to_fp32 import Consolidation

if TYPE_CHECKING:
    from ckptd.daemon.state import DaemonState

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")

# A running consolidation says so this often (seconds).
CONSOLIDATION_PROGRESS_EVERY = 60.0


@dataclass
class ConsolidationJob:
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


Waiting = tuple[RootRuntime, Result]  # a slim whose fp32 weights are to be consolidated first (DEFERRED)


class Consolidations:
    """Starts, stops and finishes the daemon's consolidations. On the filesystem thread, but for
    `_on_consolidated` (on the loop) and the run itself (the consolidator's thread).

    Handed the shared state and what it calls: `purge` (a root's trash, after a consolidation
    that made nothing to keep), `run_aside` (the consolidator's thread), `to_loop` (from that
    thread, a call on the loop) and `wake` (on the loop: the filesystem thread's next step)."""

    def __init__(
        self,
        state: DaemonState,
        *,
        purge: Callable[[RootRuntime], None],
        to_loop: Callable[..., None],
        wake: Callable[[], None],
        run_aside: Callable[[Callable[[], object]], concurrent.futures.Future],
    ):
        self.state = state
        self.purge = purge
        self.to_loop = to_loop
        self.wake = wake
        self.run_aside = run_aside
        self.running: ConsolidationJob | None = None  # the fs thread's alone
        self.ended = collections.deque[ConsolidationJob]()  # finished, for the fs thread
        self.failed: dict[tuple[str, str], str] = {}  # (root, rel) -> its fingerprint then

    def schedule(self, decisions: tuple[Decision, ...], waiting: list[Waiting]) -> None:
        """Stop the running consolidation if the plan no longer wants it, else start the first one
        waiting (one at a time: `ConsolidationJob`). On the filesystem thread."""
        job = self.running
        if job is not None:
            why = None if job.stopping else self._unwanted(job, decisions, waiting)
            if why is not None:
                job.stopping = why
                log.info("stopping the consolidation of %s: %s", job.work.decision.checkpoint.rel, why)
                job.run.cancel(f"stopped: {why}")
            return
        for rt, result in waiting:
            c = result.decision.checkpoint
            if self.failed.get((str(rt.root.path), c.rel)) == c.fingerprint:
                continue  # failed on this very checkpoint: not again until it changes or a reload
            work = rt.reaper.begin_consolidation(result.decision, result.anchors)
            if isinstance(work, Result):
                self.failed[(str(rt.root.path), c.rel)] = c.fingerprint
                self._say_not(rt, work, "consolidating")
                continue
            self._start(rt, work)
            return

    def _unwanted(
        self, job: ConsolidationJob, decisions: tuple[Decision, ...], waiting: list[Waiting]
    ) -> str | None:
        """Why the running consolidation is no longer wanted, or None."""
        planned = job.work.decision.checkpoint

        def same(c: Checkpoint) -> bool:
            return c.root == planned.root and c.rel == planned.rel

        unchanged = [r for rt, r in waiting if rt is job.rt and same(r.decision.checkpoint)]
        if unchanged and unchanged[0].decision.checkpoint.fingerprint == planned.fingerprint:
            return None  # still a slim whose weights are to be consolidated: re-checked this very pass
        if job.rt not in self.state.roots:
            return "its root is no longer configured"
        if self.state.dry_run:
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

    def _start(self, rt: RootRuntime, work: Work) -> None:
        state = self.state
        c = work.decision.checkpoint
        job = ConsolidationJob(rt, work, work.consolidation(state.config.daemon.consolidate_timeout))
        to_loop = self.to_loop

        def done(_: concurrent.futures.Future) -> None:  # on the worker thread
            try:
                to_loop(self._on_consolidated, job)
            except RuntimeError:  # the loop is closed: the daemon is gone, the next start clears up
                pass

        job.started, job.said = time.time(), state.clock()
        self.running = job  # before it runs: whoever sees it running sees it here too
        if state.metrics is not None:
            state.metrics.consolidations_running = 1
        job.future = self.run_aside(job.run.run)
        job.future.add_done_callback(done)
        state.counters["consolidations"] += 1
        log.info(
            "consolidating %s: fp32 weights from %s, beside the tracking and deleting; the slim follows "
            "once they are verified in place",
            c.rel,
            work.tag,
            extra={"run": c.run, "checkpoint": c.name, "action": "consolidate"},
        )

    def _on_consolidated(self, job: ConsolidationJob) -> None:
        """From the worker (via call_soon_threadsafe): hand the finished job to the filesystem thread."""
        self.ended.append(job)
        self.wake()

    def finish_ended(self) -> bool:
        """On the filesystem thread: finish each consolidation that ended; whether any did."""
        any_ended = False
        while self.ended:  # a consolidation ended: its weights go into place, or are dropped
            self._finish(self.ended.popleft())
            any_ended = True  # the next one waiting may start
        return any_ended

    def _finish(self, job: ConsolidationJob) -> None:
        """On the filesystem thread: move the verified weights into place, or drop what was made."""
        state = self.state
        if self.running is job:
            self.running = None
            if state.metrics is not None:
                state.metrics.consolidations_running = 0
        assert job.future is not None
        try:
            outcome = job.future.result()
        except Exception as exc:  # ConsolidationFailed, or a bug: nothing goes into place then
            outcome = exc
        rt, c = job.rt, job.work.decision.checkpoint
        result = rt.reaper.finish_consolidation(job.work, outcome)
        extra = {"run": c.run, "checkpoint": c.name, "action": "consolidate", "outcome": str(result.outcome)}
        if result.outcome is Outcome.CONSOLIDATED:
            state.counters["consolidated"] += 1
            log.info("consolidated %s: %s", c.rel, result.detail, extra=extra)
            rt.tracker.look_again(c.rel)  # fp32/ is new: it settles, and the slim follows
            return
        self.purge(rt)  # what it made went to the trash
        if job.stopping is not None:
            log.info("stopped consolidating %s: %s", c.rel, job.stopping, extra=extra)
            return
        self.failed[(str(rt.root.path), c.rel)] = c.fingerprint
        self._say_not(rt, result, "consolidating")

    def say_progress(self, now: float) -> None:
        """A line a minute while a consolidation runs (one can take an hour on a big model):
        start and end alone looked like a daemon that had stopped."""
        job = self.running
        if job is None or job.stopping is not None or now - job.said < CONSOLIDATION_PROGRESS_EVERY:
            return
        job.said = now
        c = job.work.decision.checkpoint
        log.info("still consolidating %s (fp32 weights from %s): %s so far", c.rel, job.work.tag,
                 format_age(time.time() - job.started),
                 extra={"run": c.run, "checkpoint": c.name, "action": "consolidate"})

    def _say_not(self, rt: RootRuntime, result: Result, what: str) -> None:
        """A refusal or failure, logged once per reason and checkpoint, not every pass."""
        c = result.decision.checkpoint
        self.state.counters[str(result.outcome)] += 1
        if rt.outcomes.get(c.rel) != result.detail:
            rt.outcomes[c.rel] = result.detail
            level = logging.ERROR if result.outcome is Outcome.FAILED else logging.WARNING
            extra = {"run": c.run, "checkpoint": c.name, "outcome": str(result.outcome)}
            log.log(level, "not %s %s: %s", what, c.rel, result.detail, extra=extra)
