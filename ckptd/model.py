"""The checkpoint model: what a checkpoint is, what we know of it, and how sure.

Pure data. Nothing here reads the disk or the clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from ckptd.volume.space import Shared


class Entry(NamedTuple):
    """One thing inside a checkpoint, as lstat saw it (`evidence.walk`). Here, below evidence,
    slim, weights and verdicts, so that each can name it without importing evidence.

    A named tuple, not a frozen dataclass: a walk makes one per file (75k on a volume of 960
    DeepSpeed checkpoints), and a frozen dataclass's `__init__` (one `object.__setattr__` a field)
    cost about 5 us each, the tuple's a fraction of that; immutable and hashable alike."""

    rel: str  # relative to the checkpoint; "" for the checkpoint itself
    kind: str  # "d", "f", "l" (symlink, never followed), "m" (a mount point, never entered), "o"
    size: int
    mtime_ns: int
    # The rest of the file's identity, for remembering what was read from it (verdicts.py):
    # not part of the fingerprint.
    ctime_ns: int = 0
    ino: int = 0
    dev: int = 0
    # What the filesystem counts (space.py): allocated 512-byte blocks, and links everywhere.
    blocks: int = 0
    nlink: int = 1


# What a checkpoint's number counts, when it is not a training step (`Candidate.unit`,
# `Checkpoint.unit`): ckptd orders a run by it, then by time, and says so in `plan`.
STEP = "step"
EPOCH = "epoch"  # a Lightning/NeMo name without a step: `epoch=3-val_loss=0.52.ckpt`, accelerate's epoch_<n>
CONSUMED_SAMPLES = "consumed_samples"  # NeMo 2 under Megatron: `...-epoch=0-consumed_samples=8000.0`
SAVE = "save"  # accelerate's automatic naming: checkpoint_<n> counts saves, not steps
TIME = "time"  # a user pattern's `{time}`: the date and time in the name, its digits read in order


@dataclass(frozen=True)
class Candidate:
    """A name recognised as a checkpoint (discover/layouts.py asks each framework module in turn,
    and each answers with one): of which layout, at which step."""

    name: str
    step: int  # what the run is ordered by: a training step, unless `unit` says otherwise
    layout: str
    is_dir: bool
    in_progress: bool = False  # the layout's own "not finished" name (Orbax tmp)
    pattern: int | None = None  # which of the root's patterns matched (the user pattern layout)
    unit: str = STEP  # what `step` counts: STEP, EPOCH, CONSUMED_SAMPLES, SAVE or TIME


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


KEPT_FOR = "kept: "  # a `resume_pointers` why that is a whole reason of its own, not a resume pointer's


def pointer_reason(why: str) -> str:
    """How a checkpoint `resume_pointers` names is said to be kept."""
    if why.startswith(KEPT_FOR):
        return why
    return f"named by {why}: the framework resumes from it"


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
    A live save lease (`attestation`) is writing too. Commit records from every rank that the
    disk agrees with (`ATTESTED` passed) stand in for the quiet period, and only for it.
    """
    attested = False
    for c in checks:
        if c.name == SAVE_LEASE and c.verdict is not Verdict.PASSED:
            return State.WRITING
        if c.name == ATTESTED and c.verdict is Verdict.PASSED:
            attested = True
    for c in checks:
        if attested:
            break
        if c.name == QUIET and c.verdict is Verdict.FAILED:
            return State.WRITING
        if c.name == QUIET and c.verdict is Verdict.UNKNOWN:
            return State.SETTLING
    if all(c.verdict is Verdict.PASSED or (attested and c.name == QUIET) for c in checks):
        return State.COMPLETE
    if any(c.name == STALL for c in checks):
        return State.STALLED
    return State.INCOMPLETE


def deciding_check(checks: tuple[Check, ...]) -> Check | None:
    """The check that keeps a checkpoint from complete, weighed as `classify` weighs them, for the
    line that says why: a live save lease before any; then the quiet check, unless commit records
    stand in for it (`ATTESTED` passed: a quiet period not over is then no obstacle, and naming it
    would hide the check that is, such as the run's rank census); then the first other check that
    did not pass. None when every check that counts passed."""
    attested = False
    for c in checks:
        if c.name == ATTESTED and c.verdict is Verdict.PASSED:
            attested = True
    unpassed = [c for c in checks if c.verdict is not Verdict.PASSED and not (attested and c.name == QUIET)]
    for first in (SAVE_LEASE, QUIET):
        for c in unpassed:
            if c.name == first:
                return c
    return unpassed[0] if unpassed else None


QUIET = "quiet"
STALL = "stall"  # added by the daemon to an incomplete checkpoint untouched for stall_after
# Commit records (attestation.py): every rank's, agreeing with the disk (no quiet period needed);
# agreeing, but with files no record lists (quiet still needed), or failed; a save in progress.
ATTESTED = "attested"
COMMIT_RECORDS = "commit records"
SAVE_LEASE = "save lease"


@dataclass(frozen=True)
class TrainerState:
    """What retention needs from a Hugging Face `trainer_state.json`."""

    global_step: int | None
    best_model_checkpoint: str | None  # basename only: the stored path may be relative or stale
    best_metric: float | None
    # step -> {metric name -> value}, from log_history
    history: Mapping[int, Mapping[str, object]] = field(default_factory=dict)


# Where a metric's value was read (plan's `metric_source`).
TRAINER_STATE = "trainer_state"  # the Trainer's log_history in trainer_state.json
FILE_NAME = "file name"  # a Lightning/NeMo name field: epoch=3-step=40-val_loss=0.52.ckpt (rounded as named)
CKPT_STATE = ".ckpt ModelCheckpoint state"  # Lightning's callback state inside the .ckpt (best_k_models)
ORBAX_METRICS = "orbax metrics/"  # <step>/metrics/metrics: the metrics given to CheckpointManager.save


class Reading(NamedTuple):
    """A metric's value at one checkpoint, and where it was read. A named tuple: planning makes
    one per checkpoint, and 10k frozen dataclasses cost a tenth of a 10k-checkpoint plan."""

    value: float | str  # a string: logged, but not a number
    source: str  # TRAINER_STATE, FILE_NAME, CKPT_STATE or ORBAX_METRICS


@dataclass(frozen=True)
class ConsolidatedWeights:
    """fp32 weights ckptd consolidated into a checkpoint, as their index records them (`slim.survey`)."""

    index: str  # relative to the checkpoint: "fp32/model.safetensors.index.json"
    source: str  # the DeepSpeed tag they were consolidated from: "global_step30"
    source_fingerprint: str  # of that tag's model-states and optimizer files then (`slim.source_fingerprint`)
    files: tuple[tuple[str, int, str], ...]  # (path, bytes, sha256) of each shard, relative to the checkpoint
    tool: str = ""


# Dtypes, for each weights file: the safetensors names of its floating-point tensors (integer
# and bool buffers say nothing about precision), or a string saying why they are not known.
Dtypes = frozenset[str] | str


@dataclass(frozen=True)
class WeightsSeen:
    """The weights files of one checkpoint, as their headers describe them (`weights.py`)."""

    dtypes: Mapping[str, Dtypes]  # top-level weights file (Framework.slim_weights) -> dtypes or why unknown
    consolidated: ConsolidatedWeights | str | None = (
        None  # fp32/ by ckptd: its record, why unusable, or absent
    )


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
    # Slimmed (its marker says "done") and holding optimizer files again: put back by hand, to
    # resume from it. Not an interrupted slim: kept as it is, nothing removed.
    restored: bool = False

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
    size_bytes: int = 0  # allocated (st_blocks), each inode once, as `du` counts it (space.footprint)
    newest_mtime: float = 0.0  # newest mtime of anything inside, the directory itself included
    fingerprint: str = (
        ""  # digest of every entry's (path, type, size, mtime): "unchanged" means this is equal
    )
    # When it was saved, from its files' mtimes, ckptd's own files (pin, slim marker, weights it
    # consolidated) and directories left out: a pin or a `touch` of the directory moves neither.
    saved_at: float = 0.0  # the oldest: when the save began
    written_at: float = 0.0  # the newest of the files its framework saves: when the save ended
    touched_at: float = 0.0  # the newest of all, files added after the save included (evidence._save_times)
    mounts: tuple[str, ...] = ()  # mount points inside it ("" for itself): never deleted or slimmed
    # Checkpoints of a run of its own, or pins, inside it (layouts.held): never deleted or slimmed
    holds: tuple[str, ...] = ()
    ranks: int | None = None  # per-rank files counted with no world size known (census.against_siblings)
    kinds: frozenset[str] | None = None  # its framework's file kinds (census.against_sibling_kinds)
    pinned: bool = False
    trainer_state: TrainerState | None = None
    slim: Slimming = Slimming()
    unit: str = STEP  # what `step` counts: STEP, or EPOCH, CONSUMED_SAMPLES, SAVE, TIME (`Candidate.unit`)
    # Metrics the checkpoint carries itself (its name, Orbax's metrics item, Lightning's state),
    # by name; the Trainer's come from the run's log history instead (`Run.reading`).
    metrics: tuple[tuple[str, Reading], ...] = ()
    metric_problem: str | None = None  # why a metric it should carry could not be read
    # Its inodes that are also linked from outside it (space.Shared): deleting it frees them only
    # with their last link.
    shared: tuple[Shared, ...] = ()

    def own_metric(self, name: str) -> Reading | None:
        return next((r for n, r in self.metrics if n == name), None)

    @functools.cached_property
    def path(self) -> Path:
        """Built once per checkpoint (a frozen one: its root, run and name never change): a reconcile
        asks it of every checkpoint, twice, and pathlib's joins were half its CPU time."""
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
        """Oldest first: by step (or what `unit` counts), then by when it was written, then by name."""
        return (self.step, self.written_at, self.name)

    @property
    def step_label(self) -> str:
        """`1200`, or `epoch 3` / `save 2` / `consumed_samples 8000` when the name has no step."""
        return str(self.step) if self.unit == STEP else f"{self.unit} {self.step}"


@dataclass(frozen=True)
class Run:
    """A directory that directly holds checkpoints."""

    root: Path
    rel: str
    checkpoints: tuple[Checkpoint, ...]  # oldest first (by step, then mtime)
    # checkpoint name -> the framework file that names it as the one to resume from
    # (DeepSpeed's `latest`, Megatron's tracker): never deleted, whatever the rules say
    resume: Mapping[str, str] = field(default_factory=dict)

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
        """The value of metric `name` at `ckpt` (see `reading`): a float (possibly NaN or
        infinite), a string when the logged value is not a number, or None when none was found."""
        found = self.reading(ckpt, name)
        return found.value if found is not None else None

    def reading(self, ckpt: Checkpoint, name: str) -> Reading | None:
        """Metric `name` at `ckpt`, with where it was read: the run's newest Trainer log history,
        else the checkpoint's own, else what the checkpoint carries itself (its name, Orbax's
        metrics item, Lightning's ModelCheckpoint state).

        In a Trainer log history the name is mapped as the Trainer maps `metric_for_best_model`:
        'loss' means 'eval_loss', never the training loss logged under 'loss' (which ranked
        checkpoints by it and deleted the Trainer's own best_model_checkpoint). Elsewhere the
        name is the framework's own (Lightning's monitor, the key of Orbax's metrics).
        Two histories at most, never every checkpoint's: with 10k checkpoints and
        evaluations at other steps than saves, that search was quadratic.
        """
        newest = self._newest_trainer_state
        if newest is not None or ckpt.trainer_state is not None:
            key = trainer_metric(name)
            for ts in (newest, ckpt.trainer_state):
                entry = ts.history.get(ckpt.step) if ts is not None else None
                if entry and key in entry:
                    return Reading(as_metric(entry[key]), TRAINER_STATE)
        return ckpt.own_metric(name) if ckpt.metrics else None

    def readings(self, ckpts: Iterable[Checkpoint], name: str) -> list[Reading | None]:
        """`reading` for each of `ckpts` (of this run), in one pass: planning asks for every one."""
        key = trainer_metric(name)
        newest = self._newest_trainer_state
        newest_history = newest.history if newest is not None else None
        out: list[Reading | None] = []
        for c in ckpts:  # the newest history, the checkpoint's own, what it carries: as `reading`
            entry = newest_history.get(c.step) if newest_history else None
            if not (entry and key in entry):
                own = c.trainer_state.history if c.trainer_state is not None else None
                entry = own.get(c.step) if own else None
            if entry and key in entry:
                value = entry[key]
                value = value if type(value) is float else as_metric(value)  # as_metric: a float is itself
                out.append(_new_tuple(Reading, (value, TRAINER_STATE)))
            else:
                out.append(c.own_metric(name) if c.metrics else None)
        return out


_new_tuple = tuple.__new__  # Reading(value, source) without its Python-level __new__: one per checkpoint


def trainer_metric(name: str) -> str:
    """The Trainer's mapping of `metric_for_best_model` (transformers' Trainer._determine_best_metric:
    a name not starting with 'eval_' gets the prefix)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def as_metric(value: object) -> float | str:
    if type(value) is float:  # the common case, first: float(value) is value itself
        return value
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
