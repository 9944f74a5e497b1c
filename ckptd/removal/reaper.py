"""`Reaper`: the removal package's one entry point, which carries out a root's plan.

Each of its jobs has a module of its own: the re-check before acting (recheck.py), trashing
(trash.py), slimming (slimming.py), the consolidation hand-off (consolidation.py), purging
(purge.py), the journal's records (record.py), the filesystem primitives they all go through
(fs.py). `Reaper` holds what they share (the root, its scanner, the journal, the fence, what this
process trashed) and wires them; each part is one of its bases.
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
from ckptd.removal.consolidation import Consolidating
from ckptd.removal.outcome import Anchors, Result
from ckptd.removal.purge import Purging
from ckptd.removal.recheck import Rechecks
from ckptd.removal.record import Recording
from ckptd.removal.slimming import Slimming
from ckptd.removal.trash import Trashing

# Test seam: with this set to a listening Unix socket, the reaper says which checkpoint it is
# about to act on and waits (60 s at most) for a line back, so that a test can hold a pass
# between two deletions (to send SIGHUP, remove a lock) without sleeping.
HOLD_SOCKET_ENV = "CKPTD_TEST_HOLD_SOCKET"


class Reaper(Rechecks, Trashing, Slimming, Consolidating, Purging, Recording):
    """Carries out one root's plan (`execute`), each deletion and slim re-checked first; purges its
    trash (`purge`); hands a slim's consolidation to the caller's worker (`begin_consolidation`,
    `finish_consolidation`). Each base is one job of it, in a module of its own; the state they
    share is set here."""

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
        self.scanner = scanner
        self.root = scanner.root.path
        self.journal = journal
        self.dry_run = dry_run
        self.clock = clock
        self.consolidate_timeout = consolidate_timeout
        self.fence = fence  # asked just before each rename: why not, or None (`Rechecks._fenced`)
        self.purged: dict[Path, int] = {}  # what purging each trash entry freed, by its path
        # Trash entries this process moved there and confirmed under its fence just after: the
        # only ones purged at once. Others wait `foreign_wait` seconds (by their ctime) and are
        # re-checked first (`purge`). The daemon sets it from its leadership (lease duration +
        # margin for a volume lease; 0 where no other process could have renamed late).
        self._finished: set[str] = set()
        # How long a checkpoint this process trashed waits there before its purge judges it again
        # (config's trash_grace; 0: at the first purge), and when each becomes due.
        self.trash_grace = trash_grace
        self._due: dict[str, float] = {}
        self.foreign_wait = 0.0
        self.waiting = 0  # entries the last purge left to wait
        self._purging = False
        # Asked before each deletion and slim of a pass: why the pass stops there (a reload or a
        # stop was asked for), or None. What is left is decided again by the next pass.
        self.interrupted: Callable[[], str | None] | None = None
        self.stopped: tuple[str, str, int] | None = None  # the last execute's (why, before what, left)
        # [roots.archive]: what is to be deleted or slimmed is archived first (`execute`), and the
        # re-check refuses what is not archived and verified (`Rechecks._archive_problem`).
        self.archiver = archiver_for(scanner.root, journal, clock)

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
                results.append(self.trash_one(d, anchored[d.checkpoint.rel]))
            else:
                results.append(self.slim_one(d, anchored[d.checkpoint.rel], consolidate=consolidate))
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
