"""The checkpoint model: what a checkpoint is, what we know of it, and how sure.

Pure data. Nothing here reads the disk or the clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class State(StrEnum):
    COMPLETE = "complete"  # every check that applies passed
    INCOMPLETE = "incomplete"  # quiet, but some evidence is missing or unreadable
    WRITING = "writing"  # changed within the quiet period
    SETTLING = "settling"  # the daemon saw no change, but not yet for the whole quiet period
    STALLED = "stalled"  # incomplete and untouched for `stall_after` (the daemon says so)


class Verdict(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    UNKNOWN = "unknown"  # could not tell: counts as not passed


class Action(StrEnum):
    KEEP = "keep"
    DELETE = "delete"
    SLIM = "slim"  # keep the weights, remove the optimizer state


@dataclass(frozen=True)
class Check:
    """One piece of completeness evidence, e.g. the DeepSpeed shard census."""

    name: str
    verdict: Verdict
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.verdict} ({self.detail})"


def classify(checks: tuple[Check, ...]) -> State:
    """A checkpoint is complete only when every check passed.

    An unpassed quiet check wins: something may still be writing, so whatever
    else is missing may yet arrive. The daemon's quiet check says `unknown`
    while a checkpoint is settling (no change seen, quiet period not over).
    """
    for c in checks:
        if c.name == QUIET and c.verdict is Verdict.FAILED:
            return State.WRITING
        if c.name == QUIET and c.verdict is Verdict.UNKNOWN:
            return State.SETTLING
    if all(c.verdict is Verdict.PASSED for c in checks):
        return State.COMPLETE
    if any(c.name == STALL for c in checks):
        return State.STALLED
    return State.INCOMPLETE


QUIET = "quiet"
STALL = "stall"  # added by the daemon to an incomplete checkpoint untouched for stall_after


@dataclass(frozen=True)
class TrainerState:
    """What retention needs from a Hugging Face `trainer_state.json`."""

    global_step: int | None
    best_model_checkpoint: str | None  # basename only: the stored path may be relative or stale
    best_metric: float | None
    # step -> {metric name -> value}, from log_history
    history: Mapping[int, Mapping[str, object]] = field(default_factory=dict)


@dataclass(frozen=True)
class ConsolidatedWeights:
    """fp32 weights ckptd consolidated into a checkpoint, as their index records them (`slim.survey`)."""

    index: str  # relative to the checkpoint: "fp32/model.safetensors.index.json"
    source: str  # the DeepSpeed tag they were consolidated from: "global_step30"
    source_fingerprint: str  # of that tag's model-states and optimizer files then (`slim.source_fingerprint`)
    files: tuple[tuple[str, int, str], ...]  # (path, bytes, sha256) of each shard, relative to the checkpoint
    tool: str = ""


@dataclass(frozen=True)
class Slimming:
    """What slimming would remove from a checkpoint, or has removed (see `slim.survey`).

    Paths are relative to the checkpoint. A checkpoint can be slimmed only when its
    weights survive: it holds them already (`weights`), or DeepSpeed's zero_to_fp32
    can consolidate them from `source`. With `slim_weights = "fp32"` the weights it
    keeps must be fp32: 16-bit weights alone are not enough while the fp32 master
    weights are in the optimizer state that slimming removes.
    """

    slimmed: bool = False  # a .ckptd-slim.json marker is present: weights only, not resumable
    removable: tuple[tuple[str, int], ...] = ()  # (path, bytes) matching slim_files, still present
    weights: str | None = None  # the weights a slim keeps, present: "model.safetensors", "fp32/..."
    source: str | None = None  # else the DeepSpeed tag directory to consolidate fp32 from: "global_step30"
    blocker: str | None = None  # why it cannot be slimmed although it has optimizer state
    keeps: str = ""  # which weights a slim keeps, in words, for the plan's reasons
    consolidated: ConsolidatedWeights | None = None  # when `weights` are fp32 weights ckptd consolidated
    dtype: str | None = None  # of the weights a slim keeps: "fp32", "bf16", ...; None: not known

    @property
    def removable_bytes(self) -> int:
        return sum(size for _, size in self.removable)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as found on disk, with the evidence about its completeness."""

    root: Path
    run: str  # the run directory relative to the root; "." for the root itself
    name: str  # the checkpoint's own directory or file name
    step: int
    layout: str
    checks: tuple[Check, ...]
    size_bytes: int = 0
    newest_mtime: float = 0.0  # newest mtime of anything inside, the directory itself included
    fingerprint: str = (
        ""  # digest of every entry's (path, type, size, mtime): "unchanged" means this is equal
    )
    pinned: bool = False
    trainer_state: TrainerState | None = None
    slim: Slimming = Slimming()

    @property
    def path(self) -> Path:
        return self.root / self.run / self.name if self.run != "." else self.root / self.name

    @property
    def slimmed(self) -> bool:
        """Its optimizer state was removed: it holds weights only and cannot resume training."""
        return self.slim.slimmed

    @property
    def rel(self) -> str:
        """The checkpoint's path relative to its root: `team/run42/checkpoint-1200`."""
        return self.name if self.run == "." else f"{self.run}/{self.name}"

    @functools.cached_property
    def state(self) -> State:  # cached: planning reads it many times per checkpoint
        return classify(self.checks)

    def sort_key(self) -> tuple[int, float, str]:
        return (self.step, self.newest_mtime, self.name)


@dataclass(frozen=True)
class Run:
    """A directory that directly holds checkpoints."""

    root: Path
    rel: str
    checkpoints: tuple[Checkpoint, ...]  # oldest first (by step, then mtime)

    @property
    def path(self) -> Path:
        return self.root if self.rel == "." else self.root / self.rel

    @functools.cached_property
    def _newest_trainer_state(self) -> TrainerState | None:
        return next((c.trainer_state for c in reversed(self.checkpoints) if c.trainer_state), None)

    def trainer_state(self) -> TrainerState | None:
        """The newest trainer state in the run: it has seen every evaluation so far."""
        return self._newest_trainer_state

    def metric(self, ckpt: Checkpoint, name: str) -> float | str | None:
        """The value of metric `name` at `ckpt`'s step, from the run's newest log history, else its own.

        Returns a float (possibly NaN or infinite), a string when the logged
        value is not a number, or None when nothing was logged at that step.
        'loss' also matches 'eval_loss', as the Trainer's `metric_for_best_model` does.
        Two histories at most, never every checkpoint's: with 10k checkpoints and
        evaluations at other steps than saves, that search was quadratic.
        """
        names = (name,) if name.startswith("eval_") else (name, f"eval_{name}")
        for ts in (self.trainer_state(), ckpt.trainer_state):
            entry = ts.history.get(ckpt.step) if ts is not None else None
            for n in names if entry else ():
                if n in entry:
                    return as_metric(entry[n])
        return None


def as_metric(value: object) -> float | str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # a 400-digit JSON integer
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return repr(value)


def is_rankable(value: float | str | None) -> bool:
    """Only finite numbers can be compared as 'best'."""
    return isinstance(value, float) and math.isfinite(value)
