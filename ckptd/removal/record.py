"""The journal's account of each removal: what every record about a decision carries, and a write
that, failing, is logged and never stops what it records (the intent records that must come first
are written by each step itself, and stop it when they cannot be)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckptd.decide.policy import Decision
from ckptd.journal import Journal

log = logging.getLogger(__name__)


class Recording:
    """Part of `Reaper` (removal/reaper.py): its journal records."""

    root: Path
    journal: Journal | None
    dry_run: bool
    clock: Callable[[], float]

    def _fields(self, decision: Decision, nbytes: int, **extra: object) -> dict[str, object]:
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

    def _record(self, event: str, **fields: object) -> None:
        if self.journal is None or self.dry_run:
            return
        fields.setdefault("time", self.clock())
        try:
            self.journal.record(event, **fields)
        except OSError as exc:
            log.error("cannot write the journal %s: %s", self.journal.path, exc.strerror)
