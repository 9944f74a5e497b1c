"""The journal's account of each removal: what every record about a decision carries, a write
that, failing, is logged and never stops what it records (`Recorder.record`), and the intent
records that must come first, which stop the step when they cannot be written (`Recorder.intent`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckptd.decide.policy import Decision
from ckptd.journal import Journal

log = logging.getLogger(__name__)


class Recorder:
    """A reaper's journal records (removal/reaper.py). Nothing is written in a dry run, nor
    without a journal (a reaper that deletes always has one)."""

    def __init__(self, root: Path, journal: Journal | None, clock: Callable[[], float], *, dry_run: bool):
        self.root = root
        self.journal = journal
        self.clock = clock
        self.dry_run = dry_run

    def fields(self, decision: Decision, nbytes: int, **extra: object) -> dict[str, object]:
        """What every journal record about a decision carries."""
        c = decision.checkpoint
        return dict(
            **extra,
            root=str(self.root),
            run=c.run,
            path=str(c.path),
            step=c.step,
            bytes=nbytes,
            reasons=list(decision.reasons),
        )

    def record(self, event: str, **fields: object) -> None:
        if self.journal is None or self.dry_run:
            return
        fields.setdefault("time", self.clock())
        try:
            self.journal.record(event, **fields)
        except OSError as exc:
            log.error("cannot write the journal %s: %s", self.journal.path, exc.strerror)

    def intent(self, event: str, **fields: object) -> None:
        """The record a step writes before it acts (a crash after must find it): raises OSError
        (ENOSPC with state_dir on the full volume), and the step does not act."""
        assert self.journal is not None
        self.journal.record(event, time=self.clock(), **fields)
