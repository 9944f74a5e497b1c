"""`Reaper`: the removal package's one entry point, which carries out a root's plan.

Each of its jobs has a module of its own: the re-check before acting (recheck.py), trashing
(trash.py), slimming (slimming.py), the consolidation hand-off (consolidation.py), purging
(purge.py), the journal's records (record.py), the filesystem primitives they all go through
(fs.py). Each job is an object holding only what it needs, built and wired here; every call
between them is explicit (`self.rechecks.recheck(...)`, `self.recorder.record(...)`). What two
of them share is an object of its own: the fence (`Fence`), the journal (`Recorder`), the trash
directory (`TrashDir`) and what this process put there (`Ledger`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptd.archive.upload import archiver_for
from ckptd.decide import rules
from ckptd.decide.planner import Scanner, experiments
from ckptd.decide.policy import Decision
from ckptd.journal import Journal
from ckptd.model import Action, Checkpoint, Run
from ckptd.removal.consolidation import Consolidating, Work
from ckptd.removal.outcome import Anchors, Result
from ckptd.removal.purge import Purging
from ckptd.removal.recheck import Fence, Rechecks
from ckptd.removal.record import Recorder
from ckptd.removal.slimming import Slimming
from ckptd.removal.trash import Ledger, TrashDir, Trashing
from ckptd.removal.zero_to_fp32 import Consolidated

# Test seam: with this set to a listening Unix socket, the reaper says which checkpoint it is
# about to act on and waits (60 s at most) for a line back, so that a test can hold a pass
# between two deletions (to send SIGHUP, remove a lock) without sleeping.
HOLD_SOCKET_ENV = "CKPTD_TEST_HOLD_SOCKET"


class Reaper:
    """Carries out one root's plan (`execute`), each deletion and slim re-checked first; purges its
    trash (`purge`); hands a slim's consolidation to the caller's worker (`begin_consolidation`,
    `finish_consolidation`). Each job is a part of its own (the module's doc), and this wires them."""

    def __init__(
        self,
        scanner: Scanner,
        journal: Journal | None,
        *,
        dry_run: bool,
        clock: Callable[[], float] = time.time,
        consolidate_timeout: float | None = None,
        fence: Callable[[], str | None] | None = None,
        trash_grace: float = 0.0,
    ):
        if not dry_run and journal is None:
            raise ValueError("a reaper that deletes needs a journal")
        self._scanner = scanner
        self.root = scanner.root.path
        self.journal = journal
        self._dry_run = dry_run
        self.clock = clock
        # Asked before each deletion and slim of a pass: why the pass stops there (a reload or a
        # stop was asked for), or None. What is left is decided again by the next pass.
        self.interrupted: Callable[[], str | None] | None = None
        self.stopped: tuple[str, str, int] | None = None  # the last execute's (why, before what, left)
        # [roots.archive]: what is to be deleted or slimmed is archived first (`execute`), and the
        # re-check refuses what is not archived and verified (`Rechecks._archive_problem`).
        self.archiver = archiver_for(scanner.root, journal, clock)
        # The parts, each given only what it reads
        self.fencing = Fence(fence)  # asked just before each rename: why not, or None
        self.recorder = Recorder(self.root, journal, clock, dry_run=dry_run)
        self.rechecks = Rechecks(scanner, clock, self.archiver, dry_run=dry_run)
        self.ledger = Ledger(grace=trash_grace)
        trash = TrashDir(self.root)
        self.trashing = Trashing(self.rechecks, self.fencing, self.recorder, trash, self.ledger, clock,
                                 dry_run=dry_run)
        self.consolidating = Consolidating(self.rechecks, self.fencing, self.recorder, trash, clock,
                                           dry_run=dry_run, consolidate_timeout=consolidate_timeout)
        self.slimming = Slimming(self.rechecks, self.fencing, self.recorder, self.trashing,
                                 self.consolidating, clock, dry_run=dry_run)
        self.purging = Purging(scanner, self.recorder, self.trashing, self.archiver, clock, dry_run=dry_run)

    # What callers set after building it: each passed on to the part that reads it

    @property
    def fence(self) -> Callable[[], str | None] | None:
        """Asked just before each rename (`Fence`): why this process may not act, or None."""
        return self.fencing.ask

    @fence.setter
    def fence(self, ask: Callable[[], str | None] | None) -> None:
        self.fencing.ask = ask

    @property
    def trash_grace(self) -> float:
        """How long a checkpoint this process trashed waits before its purge judges it again."""
        return self.ledger.grace

    @trash_grace.setter
    def trash_grace(self, seconds: float) -> None:
        self.ledger.grace = seconds

    @property
    def foreign_wait(self) -> float:
        """How long what this process did not trash (or confirm) waits before its purge."""
        return self.purging.foreign_wait

    @foreign_wait.setter
    def foreign_wait(self, seconds: float) -> None:
        self.purging.foreign_wait = seconds

    @property
    def dry_run(self) -> bool:
        return self._dry_run

    @dry_run.setter
    def dry_run(self, on: bool) -> None:
        # Every part that reads it (a reload in the daemon builds a new reaper instead)
        self._dry_run = on
        parts = (self.recorder, self.rechecks, self.trashing, self.consolidating, self.slimming, self.purging)
        for part in parts:
            part.dry_run = on

    @property
    def scanner(self) -> Scanner:
        return self._scanner

    @scanner.setter
    def scanner(self, scanner: Scanner) -> None:
        # Every part that reads the root's checkpoints afresh
        self._scanner = self.rechecks.scanner = self.purging.scanner = scanner

    # What the purge says of its last run

    @property
    def purged(self) -> dict[Path, int]:
        """What purging each trash entry freed, by its path."""
        return self.purging.purged

    @property
    def waiting(self) -> int:
        """Entries the last purge left to wait."""
        return self.purging.waiting

    @property
    def trash(self) -> Path:
        return self.trashing.trash

    # The parts' public faces, for the daemon, `prune` and `ckptd trash`

    def recheck(self, decision: Decision, anchors: Anchors) -> str | None:
        return self.rechecks.recheck(decision, anchors)

    def trash_one(self, decision: Decision, anchors: Anchors) -> Result:
        return self.trashing.trash_one(decision, anchors)

    def slim_one(self, decision: Decision, anchors: Anchors, *, consolidate: bool = True) -> Result:
        return self.slimming.slim_one(decision, anchors, consolidate=consolidate)

    def restore(self, entry: str, *, pin: bool = True) -> str:
        return self.trashing.restore(entry, pin=pin)

    def begin_consolidation(self, decision: Decision, anchors: Anchors) -> Work | Result:
        return self.consolidating.begin_consolidation(decision, anchors)

    def finish_consolidation(self, work: Work, outcome: Consolidated | BaseException) -> Result:
        return self.consolidating.finish_consolidation(work, outcome)

    def clear_work(self) -> int:
        return self.consolidating.clear_work()

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        return self.purging.purge(stop)

    def trash_pending(self) -> bool:
        return self.purging.trash_pending()

    def execute(self, decisions: Sequence[Decision], *, consolidate: bool = True) -> list[Result]:
        """Carry out one root's plan: trash each deletion, then slim each slim, each re-checked first.

        Each is checked against its run's anchors as the plan saw them (`rules.anchors`).
        With `consolidate=False`, a slim that needs its fp32 weights consolidated first
        comes back DEFERRED, for the caller to run (`begin_consolidation`).
        """
        anchored = self._anchored(decisions)
        ours = [d for d in decisions if d.checkpoint.root == self.root]
        if self.archiver is not None and not self.dry_run:
            self.archiver.archive_all(ours)
        acts = [d for d in ours if d.action is Action.DELETE] + [d for d in ours if d.action is Action.SLIM]
        results: list[Result] = []
        self.stopped = None
        for i, d in enumerate(acts):
            _hold_for_tests(d.checkpoint.rel)
            why = self.interrupted() if self.interrupted is not None else None
            if why is not None:  # decided under what no longer holds: leave the rest to the next pass
                self.stopped = (why, d.checkpoint.rel, len(acts) - i)
                break
            if d.action is Action.DELETE:
                results.append(self.trashing.trash_one(d, anchored[d.checkpoint.rel]))
            else:
                results.append(self.slimming.slim_one(d, anchored[d.checkpoint.rel], consolidate=consolidate))
        return results

    def _anchored(self, decisions: Sequence[Decision]) -> dict[str, Anchors]:
        """Each checkpoint's run's anchors (`rules.anchors`), by its path: its directory's, or, where
        the plan took several directories as one run (`planner.experiments`: a Lightning
        experiment's version_N), that run's, merged again from the plan's checkpoints as it did."""
        by_run: dict[str, list[Checkpoint]] = {}
        for d in decisions:
            if d.checkpoint.root == self.root:
                by_run.setdefault(d.checkpoint.run, []).append(d.checkpoint)
        runs = [Run(self.root, rel, tuple(ckpts)) for rel, ckpts in by_run.items()]
        out: dict[str, Anchors] = {}
        for run in experiments(self.scanner.root, runs):
            found = rules.anchors(run.checkpoints)
            out.update((c.rel, found) for c in run.checkpoints)
        return out


def _hold_for_tests(rel: str) -> None:
    """The test seam (`HOLD_SOCKET_ENV`): unset in production, and a test that does not answer
    holds the pass 60 s at most."""
    path = os.environ.get(HOLD_SOCKET_ENV)
    if not path:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        try:
            sock.connect(path)
            sock.sendall(f"{rel}\n".encode())
            sock.recv(64)
        except OSError:
            pass
