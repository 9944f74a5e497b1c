"""`Reaper`: the removal package's one entry point, which carries out a root's plan.

Each of its jobs has a module of its own: the re-check before acting (recheck.py), trashing
(trash.py), slimming (slimming.py), the consolidation hand-off (consolidation.py), purging
(purge.py), the journal's records (record.py), the filesystem primitives they all go through
(fs.py). `Reaper` holds what they share (the root, its scanner, the journal, the fence, what this
process trashed) and wires them; each part is one of its bases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptd import rules
from ckptd.journal import Journal
from ckptd.model import Action, Checkpoint, Run
from ckptd.planner import Scanner, experiments
from ckptd.policy import Decision
from ckptd.removal.consolidation import Consolidating
from ckptd.removal.outcome import Anchors, Result
from ckptd.removal.purge import Purging
from ckptd.removal.recheck import Rechecks
from ckptd.removal.record import Recording
from ckptd.removal.slimming import Slimming
from ckptd.removal.trash import Trashing


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

    def execute(self, decisions: Sequence[Decision], *, consolidate: bool = True) -> list[Result]:
        """Carry out one root's plan: trash each deletion, then slim each slim, each re-checked first.

        Each is checked against its run's anchors as the plan saw them (`rules.anchors`).
        With `consolidate=False`, a slim that needs its fp32 weights consolidated first
        comes back DEFERRED, for the caller to run (`begin_consolidation`).
        """
        anchored = self._anchored(decisions)
        ours = [d for d in decisions if d.checkpoint.root == self.root]
        results = [self.trash_one(d, anchored[d.checkpoint.rel]) for d in ours if d.action is Action.DELETE]
        results += [
            self.slim_one(d, anchored[d.checkpoint.rel], consolidate=consolidate)
            for d in ours
            if d.action is Action.SLIM
        ]
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
