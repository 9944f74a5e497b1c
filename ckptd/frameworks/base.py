"""The protocol every framework module answers, and the census helpers several of them share.

The engine (evidence.Inspector) walks a checkpoint once and hands its framework a `Save`: the
entries by path, the run directory around it, and `remembered`, the engine's memory of what was
read from a file while its identity stays the same (DeepSpeed's world sizes, trainer_state.json
use it). The framework answers with its `Evidence`, and with what the engine asks of every
checkpoint: which file it writes last and what before it (`last_written`, `written_before`), which
files a save writes (`save_file`), its DeepSpeed tag directories (`tags`), the metrics its files
carry (`metrics`), the whole-file archives it writes (`whole_file_formats`); and of every run
directory: what its resume pointers and "last" copies name (`resume_pointers`). Retention and
`ckptd latest` ask which run a directory of checkpoints belongs to (`run_key`): the directory
itself, unless the framework puts each launch of one run in a directory of its own. A framework
that uses another's contract calls its module (the Trainer under DeepSpeed: `deepspeed.census`).
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase, translate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.model import Candidate, Check, Entry, Reading, TrainerState, Verdict
from ckptd.volume import volread

if TYPE_CHECKING:
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


class MemoryKind:
    """What `Save.remembered` keeps, by kind: verdicts.py keeps each its own way, under these names
    in state_dir (a new name is a new cache format)."""

    FILE = "file"  # a file's integrity verdict (evidence's)
    WORLD = "world"  # DeepSpeed's world sizes (dsmeta.WorldSizes)
    TRAINER_STATE = "ts"  # trainer_state.json's check and contents (hf.py)
    FRAMEWORK = "fw"  # a framework module's own read of one file (Save.remembered_file): a JSON value


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
    # What the engine remembers between inspections while a file's identity stays the same
    # (verdicts.py): `remembered(kind, entry, read)` (`kind`: a `MemoryKind`) is `read()`'s value, or
    # the one remembered for the same file. An OSError from `read` passes through, not remembered.
    remembered: Callable[[str, Entry, Callable[[], object]], object] = lambda kind, entry, read: read()
    # A trainer state with its log history kept once per run (`Verdicts.share_history`)
    share_history: Callable[[TrainerState, str], TrainerState] = lambda ts, run: ts

    # remembered_file(rel, read): read()'s JSON-able result on the file `rel`, or the one remembered
    # while that file is the same (MemoryKind.FRAMEWORK): a look at an unchanged checkpoint opens
    # nothing. An OSError from read() passes through and is not remembered.
    remembered_file: Callable[[str, Callable[[], object]], object] = lambda rel, read: read()


@dataclass
class Evidence:
    """A framework's verdict on one save: its checks, and what else it learnt on the way."""

    checks: list[Check] = field(default_factory=list)
    ranks: int | None = None  # per-rank files counted without a known world size (against_siblings)
    trainer_state: TrainerState | None = None
    # The kinds of file the save wrote that the checkpoint itself cannot say it must have (one
    # optimizer file per prepared optimizer, the Trainer's optimizer.pt unless save_only_model):
    # one its run's earlier complete checkpoints all have is missing (census.against_sibling_kinds).
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
    # Files (paths as `slim_files` globs see them) that loading the weights of a slimmed checkpoint
    # reads besides the weights: a `slim_files` glob that would remove one is refused at config load.
    load_needs: tuple[str, ...] = ()
    named_alone: bool = False  # its name alone says it is a checkpoint (no look inside needed)
    takes_user_evidence: bool = True  # a user pattern naming its saves adds the pattern's require/ranks
    items_like_steps: bool = False  # its items, directly inside a step, look like steps of its own

    file_suffixes: tuple[str, ...] = ()  # the checkpoint files it claims by name (`recognise_file`)
    # Files (relative to the checkpoint) whose contents a decision reads, beyond the JSON files every
    # look reads whole: the verdict cache stamps them, so a rewrite in place is read again.
    read_whole: frozenset[str] = frozenset()

    # Recognition (layouts.recognise asks each framework in registry order). `names_first`: its names
    # are its own (`checkpoint-<N>/`), asked before the user's patterns; the others' after them.
    names_first: bool = False
    # The extensions of its saves that are files a checkpoint directory may hold as a run of its own
    # (`layouts.held` looks at such files; `frameworks.name_fields` takes them off a name).
    held_suffixes: tuple[str, ...] = ()
    # Files in the run directory (beside its checkpoints) its evidence reads, rewritten in place: the
    # plan's run context stats them so that a rewrite is seen (Megatron's tracker).
    run_files: tuple[str, ...] = ()

    def outside_run_files(self, run_path: Path, names: Collection[str]) -> tuple[Path, ...]:
        """Files outside the run directory (holding `names`) its evidence reads, rewritten in place: the
        plan's run context stats them as it does `run_files` (Ray Tune's experiment state, one level up)."""
        return ()

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        """Whether `name` alone says it is its save, at which step. The default: a file ending in one
        of `file_suffixes`, as `recognise_file` says."""
        if not is_dir and self.file_suffixes and name.endswith(self.file_suffixes):
            return self.recognise_file(name)
        return None

    def recognise_contents(self, name: str, children: Collection[str]) -> Candidate | None:
        """Whether a directory `name` holding `children` (named as nothing by `recognise_name`) is its
        save, by its own files in it, at which step."""
        return None

    def recognise_file(self, name: str) -> Candidate | None:
        """Whether a file named `name` (ending in one of `file_suffixes`) is its checkpoint, at which step."""
        return None

    def recognise_among(self, names: Collection[str]) -> list[Candidate]:
        """Its saves among the files `names` of one directory that no name alone made a checkpoint
        (`recognise_name` said None for each): what only the saves of one template together show
        (Keras's `model.{epoch:02d}-{val_loss:.2f}.keras`: the number that varies is the epoch)."""
        return []

    def part_inside(self, name: str, sibling_dirs: Callable[[], Collection[str]]) -> bool:
        """Whether its save `name`, found inside another checkpoint beside `sibling_dirs`, is that
        checkpoint's part rather than a save of a run held there (`layouts.held`)."""
        return False

    def unnamed_save(self, children: Collection[str]) -> bool:
        """Whether a directory holding `children` is one of its saves whatever the directory's name
        (a save into a directory the user named): then the checkpoints found in it are that save's
        parts, and the directory is no run (`discover.find_runs`)."""
        return False

    def rank_dir(self, name: str) -> bool:
        """Whether `name` is one model-parallel rank's directory of its saves (its steps are parts of
        steps whose other parts are in the sibling rank directories)."""
        return False

    def makes_dir(self, name: str) -> bool:
        """Whether it makes directories so named on the way to its checkpoints (not counted against
        max_depth: Lightning's `lightning_logs/version_<N>/checkpoints/`)."""
        return False

    def unfinished_marker(self, name: str) -> str | None:
        """The name of the marker it puts beside a save `name` while saving it, if it writes one."""
        return None

    def resume_copy(self, name: str) -> str | None:
        """Why `name` is a copy its resume loads, rewritten at each save and never a step of its own
        (never counted, never deleted), or None."""
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

    def slim_keeps(self, name: str) -> bool:
        """Whether slimming keeps a file so named whatever `slim_files` says (its weights, its state)."""
        return False

    def consolidation_source(self, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
        """The DeepSpeed tag directory (relative to its save_dir) zero_to_fp32 would consolidate fp32
        weights from, or why there is none."""
        return None, "nothing ckptd can consolidate"

    def consolidation_paths(self, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
        """(save_dir, tag, model-states file) for zero_to_fp32, relative to the run directory."""
        raise NotImplementedError(f"{self.layout}: not consolidated")

    def consolidation_reads(self, name: str) -> bool:
        """Whether zero_to_fp32 reads a file so named in the tag it consolidates (slim.source_fingerprint)."""
        return False

    def step_mismatch(self, name: str, step: int, names: list[str], ts: TrainerState | None) -> list[str]:
        """Why its name and contents disagree on its step (a warning, not completeness evidence)."""
        return []

    def run_key(self, rel: str) -> str:
        """The run that the checkpoints directly in `rel` (a directory, relative to a root, "." for
        the root) belong to, as a path relative to the same root: `rel` itself, unless this
        framework writes each launch of one run into a directory of its own below the run's
        (Lightning's `lightning_logs/version_N/checkpoints`). From the path alone: no I/O."""
        return rel

    # Whole-file checkpoints it writes in an archive format, by suffix: "zip" (torch.save's) or
    # "tar"; the engine's file integrity check reads each one's end (wholefile.file_problem).
    whole_file_formats: tuple[tuple[str, str], ...] = ()

    def run_evidence(self, save: Save) -> Check | None:
        """What this framework's own records in the run directory say of a save another layout names
        (a user's pattern over its saves), or None where they say nothing: Ray's run snapshot."""
        return None

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        """The entries of the run directory (`names`) that its own resume pointers or "last" copies
        name, each with why: what the next resume loads, never deleted. {} for a framework with none.
        A why beginning with `model.KEPT_FOR` is kept for a reason of its own, said whole
        (`model.pointer_reason`)."""
        return {}


# One save's order (evidence.one_save). Tolerated disorder between two files that one save writes
# in order: mtime granularity (2s on some filesystems) and the clocks of nodes that set their own
# mtimes (Lustre clients) a few seconds apart. A job re-saving the same step that soon after the
# first save does not happen: it restarts first.
MTIME_SLACK = 10.0
# Between files of one save written by different ranks, with no barrier between them: a rank's
# optimizer shard may end before rank 0 has finished writing the model states, by at most the time
# that one file takes to write. Larger than that: the shard is from another save.
SAVE_SPAN = 30 * 60.0
# The slowest write a save is allowed, in bytes a second: a file of S bytes took at most
# S / SLOWEST_WRITE seconds to write (a network volume shared with every rank writing at once).
SLOWEST_WRITE = 4 * 2**20


def write_span(size: int) -> float:
    """How long writing a file of `size` bytes may take, at most: the slack for small files, never
    more than `SAVE_SPAN`."""
    return min(SAVE_SPAN, MTIME_SLACK + size / SLOWEST_WRITE)


OrderProblems = list[tuple[float, str]]  # (seconds out of order, why): files from two saves


Remembered = Callable[[str, Callable[[], object]], object]  # Save.remembered_file


def read_now(rel: str, read: Callable[[], object]) -> object:
    """Save.remembered_file without a memory (a check called outside an inspection)."""
    return read()


def files_whole(
    name: str,
    path: Path,
    files: Mapping[str, Entry],
    rels: list[str],
    problem: Callable[[Path, int], str | None],
    fails: str,
    remembered: Remembered = read_now,
) -> Check | None:
    """The first of `rels` (sorted) whose `problem(path / rel, size)` is not None, as `name`'s
    failed check ending in `fails` (what the framework's loader then does), or unknown where a file
    cannot be read; None when every one is whole. Each answer is remembered by file identity."""
    for rel in rels:
        try:
            why = remembered(rel, lambda rel=rel: problem(path / rel, files[rel].size))
        except OSError as exc:
            return Check(name, Verdict.UNKNOWN, f"{rel} unreadable: {type(exc).__name__}: {exc}")
        if why is not None:
            return Check(name, Verdict.FAILED, f"{rel} {why}: {fails}")
    return None


# Globs on paths inside a checkpoint, as a user writes them (a pattern's `require`, `slim_files`):
# segment by segment, so `*` never crosses a `/`.
def matches(path: str, glob: str) -> bool:
    """`glob` matches `path` segment by segment: `*` never crosses a `/`."""
    p, g = path.split("/"), glob.split("/")
    return len(p) == len(g) and all(fnmatchcase(a, b) for a, b in zip(p, g, strict=True))


@functools.lru_cache(maxsize=64)
def _segment_matchers(globs: tuple[str, ...]) -> dict[int, tuple[tuple[Callable[[str], Any], ...], ...]]:
    """`globs` by their number of segments, each segment compiled once (as `fnmatchcase` does)."""
    by_depth: dict[int, list[tuple[Callable[[str], Any], ...]]] = {}
    for glob in globs:
        parts = glob.split("/")
        by_depth.setdefault(len(parts), []).append(tuple(re.compile(translate(b)).match for b in parts))
    return {n: tuple(gs) for n, gs in by_depth.items()}


def matches_any(path: str, globs: tuple[str, ...]) -> bool:
    """`matches(path, g)` for some g in `globs`, without splitting and translating each glob per path:
    a survey asks this for every file of every checkpoint."""
    p = path.split("/")
    for segments in _segment_matchers(globs).get(len(p), ()):
        for a, m in zip(p, segments, strict=True):
            if not m(a):
                break
        else:
            return True
    return False



# The single file an older ckptd consolidated a DeepSpeed checkpoint's fp32 weights into (slim.py,
# which now writes fp32/): what a slim of a bare DeepSpeed save keeps as its weights.
CONSOLIDATED = "model.safetensors"


MAX_TRAINER_STATE_BYTES = 64 * 1024 * 1024  # JSON a framework writes (trainer_state.json, an index)
MAX_POINTER_BYTES = 4096


def known_world(world_size: int | None, mp_world_size: int) -> int | None:
    """Every rank's count from the config (data- times model-parallel), if it says."""
    return world_size * mp_world_size if world_size is not None else None


def rank_files(
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


def run_pointer(
    found: dict[str, str], run_path: Path, pointer: str, names: Collection[str], label: str
) -> str | None:
    """The text of the resume pointer `pointer` in the run directory (`read_pointer`), or None:
    gone since the listing (as if never there), or unreadable, when it may name any entry of the
    run: then every one of `names` is named by it in `found` (`unreadable_names_all`), `label` saying
    whose pointer, kept until it can be read."""
    try:
        return read_pointer(run_path / pointer)
    except FileNotFoundError:
        return None  # gone since the listing: as if never there
    except OSError as exc:
        why = f"{label} (unreadable: {exc.strerror or exc}; it may name any checkpoint here)"
        unreadable_names_all(found, names, why)
        return None


def pointer_target(run_path: Path, text: str) -> set[str]:
    """The entries of `run_path` a resume pointer holding the relative or absolute path `text` makes
    a framework load when it joins it to the run directory (`os.path.join(load_dir, tag)`). What the
    join lands on, or below, names the run's entry it lies in (a tag `checkpoint-10/global_step10`
    keeps checkpoint-10). Both the lexical normpath and the resolved path count: a symlink on the
    way (or a symlinked root spelled another way) may make them differ, and keeping both is never
    less safe. Outside the run: nothing here."""
    if not text:
        return set()
    joined = os.path.join(run_path, text)
    out = set()
    for target, top in ((os.path.normpath(joined), os.path.normpath(run_path)),
                        (os.path.realpath(joined), os.path.realpath(run_path))):
        if target.startswith(top.rstrip("/") + "/"):
            out.add(target[len(top.rstrip("/")) + 1 :].split("/", 1)[0])
    return out


def unreadable_names_all(found: dict[str, str], names: Collection[str], why: str) -> None:
    """A pointer that is there but cannot be read may name any entry of the run: every one is named by it."""
    for name in names:
        found.setdefault(name, why)
