"""The protocol every framework module answers, and the census helpers several of them share.

The engine (evidence.Inspector) walks a checkpoint once and hands its framework a `Save`: the
entries by path, the run directory around it, and the few readers whose results the engine
remembers between inspections (DeepSpeed's world sizes, trainer_state.json). The framework
answers with its `Evidence`, and with what the engine asks of every checkpoint: which file it
writes last and what before it (`last_written`, `written_before`), which files a save writes
(`save_file`), its DeepSpeed tag directories (`tags`), the metrics its files carry (`metrics`).
A framework that uses another's contract calls it (the Trainer under DeepSpeed: `save.deepspeed`).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd import volread
from ckptd.layouts import Candidate
from ckptd.model import Check, Entry, Reading, TrainerState, Verdict

if TYPE_CHECKING:
    from ckptd import dsmeta
    from ckptd.config import Pattern

PASSED, FAILED, UNKNOWN = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN

# (the file written last, who writes it, which files it writes before it in the same save)
LastWritten = tuple[str, str, Callable[[str], bool]]
Metrics = tuple[tuple[tuple[str, Reading], ...], str | None]


@dataclass(frozen=True)
class RunContext:
    """What a checkpoint's checks need to know of the run directory around it."""

    path: Path
    names: frozenset[str]


@dataclass(frozen=True)
class Save:
    """One checkpoint, as the engine walked it, for its framework to judge."""

    path: Path
    files: Mapping[str, Entry]
    run: RunContext
    cand: Candidate
    world_size: int | None  # from the config: stands in where the checkpoint's own metadata says nothing
    mp_world_size: int
    removed: frozenset[str]  # optimizer shards a slim marker lists as removed on purpose
    pattern: Pattern | None
    # DeepSpeed's shard census of one tag directory ("" for the checkpoint itself), remembered by the engine
    deepspeed: Callable[[str], tuple[Check, dsmeta.WorldSizes | None]]
    # trainer_state.json's check and contents, parsed again only when the file changed
    trainer_state: Callable[[], tuple[Check, TrainerState | None]]
    # remembered(rel, read): read()'s JSON-able result on the file `rel`, or the one remembered while
    # that file is the same (verdicts.FRAMEWORK): a look at an unchanged checkpoint opens nothing.
    # An OSError from read() passes through and is not remembered.
    remembered: Callable[[str, Callable[[], object]], object] = lambda rel, read: read()


@dataclass
class Evidence:
    """A framework's verdict on one save: its checks, and what else it learnt on the way."""

    checks: list[Check] = field(default_factory=list)
    ranks: int | None = None  # per-rank files counted without a known world size (against_siblings)
    trainer_state: TrainerState | None = None
    # The kinds of file the save wrote that the checkpoint itself cannot say it must have (one
    # optimizer file per prepared optimizer, the Trainer's optimizer.pt unless save_only_model):
    # one its run's earlier complete checkpoints all have is missing (evidence.against_sibling_kinds).
    kinds: frozenset[str] | None = None


class Framework:
    """A framework's save contract. The defaults are a framework that says nothing."""

    layout: str = ""
    last_written: LastWritten | None = None  # the file its process 0 writes last in a save
    owns_top_dcp: bool = False  # its checkpoint itself is a DCP directory (else one at its top is a part)
    # What slimming may do: the weights files a slim keeps, best first (none: never slimmed, ckptd
    # cannot tell its weights from its state), and whether the checkpoint is itself a DeepSpeed tag
    # directory (its save_dir the run directory) rather than holding one.
    slim_weights: tuple[str, ...] = ()
    checkpoint_is_tag: bool = False
    named_alone: bool = False  # its name alone says it is a checkpoint (no look inside needed)
    takes_user_evidence: bool = True  # a user pattern naming its saves adds the pattern's require/ranks
    items_like_steps: bool = False  # its items, directly inside a step, look like steps of its own

    file_suffixes: tuple[str, ...] = ()  # the checkpoint files it claims by name (`recognise_file`)
    # Files (relative to the checkpoint) whose contents a decision reads, beyond the JSON files every
    # look reads whole: the verdict cache stamps them, so a rewrite in place is read again.
    read_whole: frozenset[str] = frozenset()

    def recognise_file(self, name: str) -> Candidate | None:
        """Whether a file named `name` (ending in one of `file_suffixes`) is its checkpoint, at which step."""
        return None

    def recognised_inside(self, name: str, children: Collection[str]) -> bool:
        """Whether a directory recognised as its checkpoint by name holds what one of its saves does."""
        return True

    def evidence(self, save: Save) -> Evidence:
        """The checks that the save is finished, by this framework's contract."""
        return Evidence()

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        """Its DeepSpeed tag directories ("" for the checkpoint itself), for `one_save`'s shard order."""
        return []

    def save_file(self, rel: str) -> bool:
        """Whether it writes `rel` in a save (as opposed to a file added later). False for every
        file of a framework that cannot tell: then every file counts."""
        return False

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        """The files it writes before `rel` in one save, if it writes `rel` last; else None."""
        return None

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        """The metrics the checkpoint carries itself, and why one could not be read."""
        return (), None

    def step_mismatch(self, name: str, step: int, names: list[str], ts: TrainerState | None) -> list[str]:
        """Why its name and contents disagree on its step (a warning, not completeness evidence)."""
        return []


Remembered = Callable[[str, Callable[[], object]], object]  # Save.remembered


def read_now(rel: str, read: Callable[[], object]) -> object:
    """Save.remembered without a memory (a check called outside an inspection)."""
    return read()


MAX_TRAINER_STATE_BYTES = 64 * 1024 * 1024  # JSON a framework writes (trainer_state.json, an index)
MAX_POINTER_BYTES = 4096


def _known_world(world_size: int | None, mp_world_size: int) -> int | None:
    """Every rank's count from the config (data- times model-parallel), if it says."""
    return world_size * mp_world_size if world_size is not None else None


def _rank_files(
    files: dict[str, Entry], regex: re.Pattern[str], world: int | None, *, name: str = "random states"
) -> tuple[Check, int | None]:
    """Each rank's file, `regex` capturing the rank, in the checkpoint's top directory (or where
    the pattern puts it): ranks 0..world-1, or 0..n-1 with no gap when the world size is not
    known (then n is returned, for `against_siblings`)."""
    ranks = sorted(int(m[1]) for rel in files if (m := regex.fullmatch(rel)) and files[rel].kind == "f")
    example = regex.pattern.replace(r"(\d+)", "0").replace("\\", "")
    if not ranks:
        return Check(name, FAILED, f"{example} missing (each rank writes its own, last)"), None
    # Ranks 0..n-1 are all there exactly when n of them are and the highest is n-1: no
    # walk up to a rank number taken from a (possibly hostile) file name.
    present = set(ranks)
    n = world if world is not None else max(ranks) + 1
    if len([r for r in present if r < n]) < n:
        first = next(r for r in range(n) if r not in present)  # at most len(present)+1 steps
        counted = f" ({len(present)}/{world} ranks)" if world is not None else ""
        missing = regex.pattern.replace(r"(\d+)", str(first)).replace("\\", "")
        return Check(name, FAILED, f"{missing} missing{counted}"), None
    if world is not None:
        return Check(name, PASSED, f"{world}/{world} ranks"), None
    return Check(name, PASSED, f"ranks 0..{n - 1} contiguous (world size not known)"), n


def read_pointer(path: Path) -> str:
    """A resume pointer's text, stripped as DeepSpeed and Megatron strip it. Raises OSError: a
    FIFO, socket or device is never opened for reading (volread), a symlink is followed (the
    frameworks follow it), and a pointer longer than any name can be is unreadable."""
    raw = volread.read_bytes(path, MAX_POINTER_BYTES + 1, follow_symlinks=True)
    if len(raw) > MAX_POINTER_BYTES:
        raise OSError(errno.EFBIG, f"longer than {MAX_POINTER_BYTES} bytes", str(path))
    return raw.decode("utf-8", "surrogateescape").strip()
