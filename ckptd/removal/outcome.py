"""What carrying out one decision came to: an outcome and its detail, for the daemon, `prune` and the
journal; and `_Stop`, which a step raises to stop before removing anything."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ckptd.decide.policy import Decision
from ckptd.model import Checkpoint

Anchors = Sequence[tuple[Checkpoint, str]]  # a run's anchors with why each is one (rules.anchors)

DRY_RUN_NOTE = "(dry run; not actually removing anything)"


class Outcome(StrEnum):
    TRASHED = "trashed"  # renamed into the trash; gone from its run
    REFUSED = "refused"  # a re-check failed; left where it is
    FAILED = "failed"  # the rename failed; left where it is
    DRY_RUN = "dry-run"  # would have been trashed (or slimmed)
    SLIMMED = "slimmed"  # its optimizer files renamed into the trash; its weights verified in place
    DEFERRED = "deferred"  # a slim whose fp32 weights must be consolidated first, by the caller's worker
    CONSOLIDATED = "consolidated"  # fp32 weights verified and moved into it; slimmed in a later pass


@dataclass(frozen=True)
class Result:
    decision: Decision
    outcome: Outcome
    detail: str
    trash_path: Path | None = None
    moved_bytes: int = 0  # what went into the trash
    anchors: Anchors = ()  # DEFERRED: the run's anchors to re-check against when it begins

    def line(self) -> str:
        return f"{self.outcome} {self.decision.checkpoint.rel}: {self.detail}"


class _Stop(Exception):
    """Slimming stops before removing anything: refused (a re-check) or failed."""

    def __init__(self, outcome: Outcome, why: str):
        super().__init__(why)
        self.outcome = outcome
        self.why = why
