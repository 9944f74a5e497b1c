"""Completeness evidence: is this checkpoint finished, and how do we know?

Reads only. Each check returns a `Check`; `ckptd verify` prints them all, and
a checkpoint is complete only when every one passed (`model.classify`).

Why each check exists:
- quiet: no writer touched it for `quiet_period`. Necessary, not sufficient: a
  slow rank may not have started its shard yet.
- DeepSpeed shard census: every rank's `zero_pp_rank_*` shard is present. The
  `latest` file is *not* evidence: rank 0 writes it before the other ranks
  finish (observed on a real 2-rank run), which is how in-process rotation came
  to delete checkpoints still being written.
- trainer_state.json: the Trainer's rank 0 writes it last, after DeepSpeed's
  final barrier. rng_state_<rank>.pth files have no barrier, so count them.
- file integrity: torch.save files are zip archives, whose directory sits at
  the end, so a truncated one has no end record at its very end; a safetensors
  header's offsets must fit the file (wholefile.py asks, frameworks/formats.py reads them).
- native markers: DCP's `.metadata` (the coordinator writes it after every
  rank), Orbax's tmp directory and commit file, NeMo's `-unfinished` marker,
  Megatron's tracker, megatron-core's `metadata.json` (written last), torchtitan's
  `.metadata` or HF index.
- slimmed: a `.ckptd-slim.json` marker lists the optimizer shards ckptd removed
  on purpose, so the census stops demanding them, and names the weights that
  must still be there.
- one save: a job resumed into the same output directory re-saves checkpoints in
  place, file by file; until it ends, the old save's files pass every census. A
  file written last (trainer_state.json, DCP's .metadata) or after another (a
  rank's shard after its model states) that is older than it gives that away.
"""

from __future__ import annotations

import errno
import hashlib
import json
import operator
import os
import stat
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from ckptd import frameworks
from ckptd.config import DEFAULT_SLIM_FILES, Pattern, pin_matches
from ckptd.discover import layouts
from ckptd.formatting import format_age, format_duration, format_size
from ckptd.frameworks import (
    EVIDENCE,
    NESTED_METADATA_SUFFIX,
    NESTED_PART_SUFFIX,
    QUIET_ALONE,
    nested_metadata_file,
)
from ckptd.frameworks.base import (
    MAX_TRAINER_STATE_BYTES,
    MTIME_SLACK,
    SAVE_SPAN,
    MemoryKind,
    RunContext,
    Save,
)
from ckptd.frameworks.formats import SAFETENSORS_SUFFIX, ZIP_SUFFIXES
from ckptd.judge import attestation, slim, wholefile
from ckptd.judge import verdicts as verdicts_
from ckptd.judge.weights import WeightsReader
from ckptd.model import (  # Entry: re-exported, it is evidence's word
    QUIET,
    Candidate,
    Check,
    Checkpoint,
    ConsolidatedWeights,
    Entry,
    Slimming,
    Verdict,
)
from ckptd.volume import mounts, space, volread

PASSED, FAILED, UNKNOWN = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN


MAX_WALK_DEPTH = 256
MOUNT = "m"


class TooDeep(Exception):
    """A tree deeper than we walk: it cannot be proven complete, so it is never deleted."""

    def __init__(self, entries: list[Entry], why: str):
        super().__init__(why)
        self.entries = entries


def walk(path: Path) -> list[Entry]:
    """Every entry under `path` (itself included), without following symlinks, and without
    entering another filesystem: a directory on another device, or where a mount is attached
    (a bind mount keeps its device number), is listed with kind "m" and not descended into.

    Entries that vanish while we look are skipped: the quiet check will see
    the directory's mtime move. A tree deeper than MAX_WALK_DEPTH (or with
    paths too long to name) raises TooDeep with what was seen.
    """
    st = os.lstat(path)
    out = [Entry("", _kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                 st.st_blocks, st.st_nlink)]
    if not stat.S_ISDIR(st.st_mode):
        return out
    stack: list[tuple[str, str | Path, int]] = [("", path, 0)]
    append, new = out.append, tuple.__new__  # Entry's fields in order, without its __new__'s call
    kind_of, ifmt, dev = _KINDS.get, stat.S_IFMT, st.st_dev  # locals: looked up once, not per entry
    while stack:
        rel, d, depth = stack.pop()
        if depth >= MAX_WALK_DEPTH:
            raise TooDeep(out, f"deeper than {MAX_WALK_DEPTH} levels at {rel[:80]}...")
        try:
            it = os.scandir(d)  # not ENAMETOOLONG: `d` was stat'ed by this very path
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                try:
                    est = e.stat(follow_symlinks=False)
                    kind = kind_of(ifmt(est.st_mode), "o")
                    if kind == "d" and (est.st_dev != dev or mounts.is_mount_root(e.path)):
                        kind = MOUNT  # another filesystem: seen, never entered, never deleted
                except FileNotFoundError:
                    continue
                except OSError as exc:  # its path is longer than PATH_MAX: too long to name
                    if exc.errno == errno.ENAMETOOLONG:
                        raise TooDeep(out, f"paths too long to walk at {rel[:80]}...") from None
                    raise
                erel = f"{rel}/{e.name}" if rel else e.name
                append(new(Entry, (erel, kind, est.st_size, est.st_mtime_ns, est.st_ctime_ns, est.st_ino,
                                   est.st_dev, est.st_blocks, est.st_nlink)))
                if kind == "d":
                    stack.append((erel, e.path, depth + 1))
    return out


_KINDS = {stat.S_IFDIR: "d", stat.S_IFREG: "f", stat.S_IFLNK: "l"}  # `_kind`'s, by file type


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


# Files read whole for what they say (beyond a zip's directory or a header): every JSON file
# (trainer_state.json, the slim marker, megatron-core's metadata.json, indexes, configs), and what each
# framework names in its `read_whole` (Orbax's metadata and metrics).
_READ_WHOLE = frozenset().union(*(fw.read_whole for fw in frameworks.REGISTRY))


def fingerprint(entries: list[Entry]) -> str:
    # One update of the joined lines: the digest of a stream does not depend on how it is cut.
    text = "".join([f"{e.rel}\0{e.kind}\0{e.size}\0{e.mtime_ns}\n" for e in sorted(entries, key=_rel)])
    return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


_rel = operator.itemgetter(0)  # an Entry's rel


# (path relative to the root, fingerprint, newest mtime in ns) -> the quiet check
QuietJudge = Callable[[str, str, int], Check]


class Inspector:
    """Gathers the evidence for checkpoints.

    What it reads from files (integrity, DeepSpeed world sizes, trainer_state.json)
    is remembered in `verdicts` while each file's identity stays the same
    (verdicts.py), so re-inspecting an unchanged checkpoint opens no file.
    """

    def __init__(
        self, *, quiet_period: float, mp_world_size: int = 1, verdicts: verdicts_.Verdicts | None = None
    ):
        self.quiet_period = quiet_period
        self.mp_world_size = mp_world_size
        self.verdicts = verdicts if verdicts is not None else verdicts_.Verdicts()
        self._look: verdicts_.Look | None = None  # the inspection in progress
        self.ckpt_scores = frameworks.MetricFileCache()  # metrics read from inside files (torch)
        self._weights = WeightsReader()  # the dtypes of the weights a slim would keep

    def inspect(
        self,
        root: Path,
        run_rel: str,
        run: RunContext,
        cand: Candidate,
        *,
        now: float,
        world_size: int | None = None,
        pins: frozenset[str] = frozenset(),
        quiet: QuietJudge | None = None,
        slim_files: tuple[str, ...] = DEFAULT_SLIM_FILES,
        pattern: Pattern | None = None,
        metric: str | None = None,
        slim_weights: str | None = None,
    ) -> Checkpoint:
        """The evidence for one checkpoint, and the metrics it carries itself.

        Quiescence is judged by `quiet` when given (the daemon's settler, on
        monotonic time), else by comparing the newest mtime with `now`, the
        wall clock (one-shot commands have nothing better).
        `world_size` stands in for DeepSpeed's dp_world_size when the
        checkpoint's own metadata cannot be read. `metric` (retention's) is looked for
        inside a Lightning `.ckpt` when its name does not carry it (`frameworks.MetricFileCache`).
        `slim_weights` (None: the run is not slimmed) has the weights' dtypes read for
        `slim.survey`.
        """
        path = run.path / cand.name
        too_deep = None
        ranks: int | None = None
        try:
            entries = walk(path)
        except TooDeep as exc:
            entries, too_deep = exc.entries, Check("walk", UNKNOWN, f"not fully inspected: {exc}")
        files = {e.rel: e for e in entries}
        fw = frameworks.get(cand.layout)
        marker = read_slim_marker(path, files) if cand.is_dir else None
        removed = frozenset(p for p, _ in marker.removed) if isinstance(marker, slim.Marker) else frozenset()
        surveyed = bool(fw.slim_weights) and (marker is None or isinstance(marker, slim.Marker))
        seen = _Pass(entries, path.name, fw, slim.removable_file(fw.checkpoint_is_tag, cand.name, slim_files)
                     if surveyed else None)
        newest_ns = seen.newest_ns
        trainer_state = None
        rel = cand.name if run_rel == "." else f"{run_rel}/{cand.name}"
        digest = fingerprint(entries)
        self._look = self.verdicts.begin(str(path), entries)

        checks = [quiet(rel, digest, newest_ns) if quiet is not None else self._quiet(newest_ns, now)]
        save = Save(
            path, files, run, cand, world_size, self.mp_world_size, removed, pattern,
            remembered=self._remembered, share_history=self.verdicts.share_history,
            remembered_file=lambda rel, read: (
                self._remembered(MemoryKind.FRAMEWORK, files[rel], read) if rel in files else read()
            ),
        )
        found = fw.evidence(save)
        checks.extend(found.checks)
        ranks, trainer_state = found.ranks, found.trainer_state
        if pattern is not None and pattern.evidence and fw.takes_user_evidence:
            user = frameworks.USER_PATTERN.evidence(save)  # the user's pattern over a known save
            checks.extend(user.checks)
            ranks = ranks if ranks is not None else user.ranks
        checks.extend(frameworks.nested_checks(
            path, files, sorted(seen.distcp_dirs), fw.owns_top_dcp, save.remembered_file))
        checks.extend(one_save(seen.theirs, seen.distcp, seen.before_last, fw.last_written, fw.tags(files)))
        integrity = _integrity(path, seen.integrity, self._file_problem)
        checks.append(integrity)
        # The training job's commit records, whatever the framework (attestation.py); none: [].
        checks.extend(attestation.checks(path, files, removed) if cand.is_dir else ())
        metrics, metric_problem = fw.metrics(save, metric, integrity.verdict is PASSED, self.ckpt_scores.read)
        if too_deep is not None:
            checks.append(too_deep)
        slimming = self._slimming(path, cand, files, marker, seen.removable if surveyed else None,
                                  slim_files, slim_weights)
        if marker is not None:
            checks.append(_slimmed(files, marker))

        pinned = layouts.PIN_FILE in files if cand.is_dir else f"{cand.name}{layouts.PIN_FILE}" in run.names
        saved_at, written_at, touched_at = _times(seen, marker, slimming.consolidated)
        inside = tuple(seen.mounts)
        holds = layouts.held(cand.layout, files, seen.dirs) if cand.is_dir else []
        if mounts.is_mount_root(path):
            inside = ("", *inside)
        self.verdicts.end(self._look, entries, digest, seen.read_whole)
        size, shared = space.footprint(entries)
        return Checkpoint(
            root=root,
            run=run_rel,
            name=cand.name,
            step=cand.step,
            layout=cand.layout,
            checks=tuple(checks),
            size_bytes=size,
            shared=shared,
            newest_mtime=newest_ns / 1e9,
            fingerprint=digest,
            saved_at=saved_at,
            written_at=written_at,
            touched_at=touched_at,
            mounts=inside,
            holds=tuple(holds),
            ranks=ranks,
            kinds=found.kinds,
            pinned=pinned or _matches_pin(rel, pins),
            trainer_state=trainer_state,
            slim=slimming,
            unit=cand.unit,
            metrics=metrics,
            metric_problem=metric_problem,
        )

    def _slimming(
        self,
        path: Path,
        cand: Candidate,
        files: dict[str, Entry],
        marker: slim.Marker | str | None,
        removable: tuple[tuple[str, int], ...] | None,
        slim_files: tuple[str, ...],
        slim_weights: str | None,
    ) -> Slimming:
        """What a slim would do to the checkpoint (`slim.survey`); `removable`: the files a slim would
        remove (`_Pass`), None where its saves are not surveyed (a framework never slimmed, or a
        marker that cannot be read)."""
        if removable is None:
            if marker is None or isinstance(marker, slim.Marker):
                return Slimming()  # a framework whose saves are never slimmed
            return Slimming(slimmed=True)  # unreadable marker: not full, and nothing to do
        slimming = slim.survey(
            cand.layout, cand.name, files, slim_files, marker, removable=removable  # type: ignore[arg-type]
        )
        if slimming.removable and marker is None and slim_weights:  # the dtypes of what a slim keeps
            weights = self._weights.read(path, files)
            slimming = slim.survey(
                cand.layout, cand.name, files, slim_files, None, weights, slim_weights, removable
            )
        return slimming

    # --- checks ----------------------------------------------------------

    def _remembered(self, kind: str, entry: Entry, read: Callable[[], object]) -> object:
        """`read()`'s verdict on `entry`, or the one remembered for a file of the same identity."""
        if self._look is None:
            return read()
        return self._look.verdict(kind, entry, read)

    def _file_problem(self, checkpoint: str, e: Entry) -> str | None:
        """`file_problem` of the entry `e` of the checkpoint at `checkpoint`, remembered while the file
        is the same: an unchanged file is read once (and its path not even built).

        A read that failed (an I/O error) is a problem this time and not remembered.
        """

        def read() -> str | None:
            return wholefile.file_problem(f"{checkpoint}/{e.rel}" if e.rel else checkpoint, e)

        look = self._look
        try:
            return read() if look is None else look.verdict(MemoryKind.FILE, e, read)
        except OSError as exc:
            return f" could not be read: {exc.strerror or exc}"

    def _quiet(self, newest_ns: int, now: float) -> Check:
        age = now - newest_ns / 1e9
        period = format_duration(self.quiet_period)
        if age < 0:
            return Check(QUIET, Verdict.FAILED, f"newest mtime is {-age:.1f}s in the future (clock skew?)")
        if age < self.quiet_period:
            return Check(QUIET, FAILED, f"last change {age:.1f}s ago, quiet_period={period}")
        return Check(QUIET, PASSED, f"unchanged for {format_age(age)} (quiet_period={period})")



# --- one pass over a checkpoint's entries -----------------------------------------------------

# Every name ckptd puts inside a checkpoint (the pin, the slim marker, its work directory, the job's
# commit records) holds this: an entry without it is no one's but the trainer's, asked nothing more.
_OWN_MARK = "ckptd"
if not all(_OWN_MARK in n for n in (layouts.PIN_FILE, slim.MARKER, slim.LEGACY_WORK_DIR,
                                    attestation.RECORD_DIR)):
    raise ImportError(f"a name ckptd writes into checkpoints lacks {_OWN_MARK!r}: `_Pass` would miss it")
_OWN_TOP = frozenset({slim.MARKER, f"{slim.MARKER}.tmp", layouts.PIN_FILE})  # `_save_times`'s, at the top
# The files the integrity check reads the end of: torch.save's zips and safetensors at any depth, and
# a checkpoint that is itself one file in the archive format its framework writes (`whole_file_formats`).
_CHECKED_SUFFIXES = (*ZIP_SUFFIXES, SAFETENSORS_SUFFIX)
_WHOLE_FILE_SUFFIXES = tuple(wholefile.WHOLE_FILE_FORMATS)


class _Pass:
    """What the checks need of a checkpoint's entries, from one loop over them: each file is
    classified once (the trainer's or ckptd's own, a file a save wrote, one whose end the integrity
    check reads, one a slim would remove, one read whole) and the checks are fed the results;
    the directories, mount points and DCP parts are picked out by comprehensions beside it."""

    __slots__ = ("before_last", "dirs", "distcp", "distcp_dirs", "fw", "integrity", "known", "mounts",
                 "newest_ns", "read_whole", "removable", "theirs", "timed")

    def __init__(self, entries: list[Entry], name: str, fw: frameworks.Framework,
                 removable: Callable[[str], bool] | None):
        self.fw = fw
        last_before = fw.last_written[2] if fw.last_written is not None else None
        theirs: dict[str, Entry] = {}  # not ckptd's own (`_ckptd_own`): `one_save`'s
        timed: list[Entry] = []  # the files that say when it was saved (`_save_times`)
        integrity: list[Entry] = []
        before_last: list[Entry] = []  # the trainer's files its framework writes before its last-written one
        known: dict[str, bool] = {}  # that answer, by path, for `_not_rewritten`
        read_whole: list[Entry] = []
        slimmed: list[tuple[str, int]] | None = [] if removable is not None else None
        for e in entries:
            rel = e.rel
            maybe_own = _OWN_MARK in rel
            own = maybe_own and _ckptd_own(rel)
            if not own:
                theirs[rel] = e
            if e.kind != "f":
                continue
            if last_before is not None and not own:
                known[rel] = hit = last_before(rel)
                if hit:
                    before_last.append(e)
            if not maybe_own or not _untimed(rel):
                timed.append(e)
            if not rel:
                if name.endswith(_CHECKED_SUFFIXES) or name.endswith(_WHOLE_FILE_SUFFIXES):
                    integrity.append(e)  # the checkpoint is this one file
                continue
            if rel.endswith(_CHECKED_SUFFIXES):
                integrity.append(e)
            if rel.endswith(".json") or rel in _READ_WHOLE:
                read_whole.append(e)
            if slimmed is not None and removable(rel):  # type: ignore[misc]
                slimmed.append((rel, e.size))
        self.newest_ns = max([e.mtime_ns for e in entries])
        self.theirs, self.timed, self.integrity, self.before_last, self.known = (
            theirs, timed, integrity, before_last, known)
        self.dirs, self.mounts = _of_kind(entries, "d"), _of_kind(entries, MOUNT)
        self.distcp_dirs, self.distcp = _distcp_parts(entries, theirs)
        self.read_whole = read_whole
        self.removable = tuple(sorted(slimmed)) if slimmed is not None else None


def _untimed(rel: str) -> bool:
    """Whether ckptd's file `rel` is one that says nothing of when the trainer saved (`_save_times`):
    the pin or slim marker at the top, its work directory, the job's commit records."""
    return rel in _OWN_TOP or slim.in_work_dir(rel) or attestation.is_metadata(rel)


def _of_kind(entries: list[Entry], kind: str) -> list[str]:
    return [e.rel for e in entries if e.kind == kind]


def _distcp_parts(
    entries: list[Entry], theirs: dict[str, Entry]
) -> tuple[set[str], dict[str, tuple[int, str]]]:
    """Every directory holding a `*.distcp` entry (DCP's .metadata demanded there) or DCP's metadata
    (a `.metadata` or `__<rank>.metadata` file: a DCP save with every `*.distcp` gone is still one,
    and what its metadata names is demanded), and each one's newest *.distcp file that is the
    trainer's (in `theirs`, not ckptd's own): `one_save`'s."""
    dirs: set[str] = set()
    newest: dict[str, tuple[int, str]] = {}
    for e in entries:
        rel = e.rel
        if rel.endswith(NESTED_PART_SUFFIX):
            d = rel.rpartition("/")[0]
            dirs.add(d)
            if e.kind == "f" and rel in theirs:
                newest[d] = max(newest.get(d, (0, "")), (e.mtime_ns, rel))
        elif rel.endswith(NESTED_METADATA_SUFFIX):
            d, _, name = rel.rpartition("/")
            if nested_metadata_file(name, e.kind):
                dirs.add(d)
    return dirs, newest


def _times(
    seen: _Pass, marker: slim.Marker | str | None, consolidated: ConsolidatedWeights | None
) -> tuple[float, float, float]:
    """`_save_times` of the files the pass found, less the weights ckptd consolidated."""
    return _save_times(seen.timed, marker, seen.newest_ns, seen.fw, consolidated, seen.known)


def _save_times(
    timed: list[Entry],
    marker: slim.Marker | str | None,
    newest_ns: int,
    fw: frameworks.Framework,
    consolidated: ConsolidatedWeights | None = None,
    known: dict[str, bool] | None = None,
) -> tuple[float, float, float]:
    """(saved_at, written_at, touched_at): the oldest mtime of the checkpoint's files, the newest of
    the files its framework writes in a save (`save_file`), and the newest of any of its files.

    Directories are left out (adding a pin or touching one moves their mtime), and so are
    ckptd's own files (the pin, the slim marker, weights it consolidated, its work directory):
    none of them says when the trainer saved. `written_at` leaves out, besides, what was added
    to the checkpoint after its save (an evaluation's results.json, a zero_to_fp32 conversion):
    an old checkpoint given a new file is not the run's newest save. Where
    the layout's own files cannot be told (`save_file` is False for all), every file counts.
    A checkpoint with no such file (an empty directory) falls back to its newest mtime. Nor does
    a file the framework writes last in its save, rewritten later (`_not_rewritten`: sed -i over
    trainer_state.json after a move), move `written_at`; `touched_at` counts it.

    `timed`: the pass's files (`_Pass`) less the pin, the slim marker (and its temp name), the
    work directory and the job's commit records; here less the weights ckptd consolidated.
    """
    own = slim.ckptd_files(marker if isinstance(marker, slim.Marker) else None) - _OWN_TOP
    if consolidated is not None:  # fp32/ consolidated before the slim that will record it
        own |= {consolidated.index, *(path for path, _, _ in consolidated.files)}
    theirs = [e for e in timed if e.rel not in own] if own else timed
    if not theirs:
        return newest_ns / 1e9, newest_ns / 1e9, newest_ns / 1e9
    save_file = fw.save_file
    saved = _not_rewritten([e for e in theirs if save_file(e.rel)], fw, known)
    saved = [e.mtime_ns for e in saved] or [e.mtime_ns for e in theirs]
    return min(e.mtime_ns for e in theirs) / 1e9, max(saved) / 1e9, max(e.mtime_ns for e in theirs) / 1e9


# A save's last-written files rewritten after it: a script fixing paths in every
# trainer_state.json after a move (sed -i writes a new file) gives each the time of the fix, in
# shell order, and the old checkpoint fixed last would be the run's newest save. The framework
# writes such a file right after the others of its save (`written_before`), in the same process:
# seconds after them, minutes at most on a slow filesystem. One much newer than all of them was
# rewritten later, and its mtime does not say when the save ended. The bound is `SAVE_SPAN`, the
# most one save's files are apart in `one_save`: a real save is never excluded, and a rewrite
# within it moves `written_at` by no more than a save can take.
def _not_rewritten(
    saved: list[Entry], fw: frameworks.Framework, known: dict[str, bool] | None = None
) -> list[Entry]:
    """`saved` less each last-written file more than `SAVE_SPAN` newer than every file its framework
    writes before it (`written_before`). Kept where none of those is there: nothing to tell by.
    `known`: what the framework's last-written file's `written_before` answered, by path (the pass)."""
    kept = []
    last_before = fw.last_written[2] if fw.last_written is not None else None
    for e in saved:
        before = fw.written_before(e.rel)
        if before is None:
            ahead = []
        elif before is last_before and known is not None:
            ahead = [o.mtime_ns for o in saved if o is not e and (
                known[o.rel] if o.rel in known else before(o.rel))]
        else:
            ahead = [o.mtime_ns for o in saved if o is not e and before(o.rel)]
        if not ahead or e.mtime_ns - max(ahead) <= SAVE_SPAN * 1e9:
            kept.append(e)
    return kept


def save_files(layout: str, rel: str) -> bool:
    """Whether the file at `rel` (in a checkpoint of `layout`) is one its framework writes in a save,
    as opposed to one added later. Only the files that end a save need be named: their newest mtime
    is when the save ended. False for every file of a layout with no such list (then all count)."""
    return frameworks.get(layout).save_file(rel)


# --- one save: a checkpoint re-saved in place -------------------------------
#
# A job resumed into the same output directory re-saves the checkpoints the first job left there,
# in place: the Trainer and DeepSpeed makedirs(exist_ok=True) and overwrite file by file. Until the
# save ends the directory holds the new save's files beside the old one's, and every file a census
# counts is there (a slow rank's old shard among them). What gives it away is order: a file the
# framework writes *after* another, in one save, older than it.
ONE_SAVE = "one save"


def _tags(layout: str, files: dict[str, Entry]) -> list[str]:
    """The DeepSpeed tag directories of a checkpoint ("" for the checkpoint itself)."""
    return frameworks.get(layout).tags(files)


def _ckptd_own(rel: str) -> bool:
    """Whether `rel` (in a checkpoint, at any depth) is ckptd's, not the trainer's: a pin
    (`.ckptd-keep`, `<file>.ckptd-keep`), the slim marker, its work directory, the job's commit
    records under `.ckptd/`."""
    return (
        rel.rpartition("/")[2].endswith(layouts.PIN_FILE)
        or rel in (slim.MARKER, f"{slim.MARKER}.tmp")
        or slim.in_work_dir(rel)
        or attestation.is_metadata(rel)
    )


def one_save(
    files: dict[str, Entry],
    distcp: dict[str, tuple[int, str]],
    before_last: list[Entry],
    last: tuple[str, str, Callable[[str], bool]] | None,
    tags: Iterable[str],
) -> list[Check]:
    """Whether the checkpoint's files are from one save, by the order its framework writes them:
    the Trainer's trainer_state.json after everything else it saves (`_BEFORE_TRAINER_STATE`, every
    DeepSpeed file) and accelerate's random_states_0.pkl likewise (`_LAST_WRITTEN`), each DeepSpeed
    rank its optimizer shard after its model states, and no rank its shard long before rank 0's
    model states (`SAVE_SPAN`); DCP's `.metadata` and megatron-core's `metadata.json` after the
    *.distcp beside them. [] when the checkpoint has none of these files. Failed: files from two
    saves, a re-save in place not finished; kept, and said why. ckptd's own files (`_ckptd_own`)
    are no framework's and are left out: a pin touched inside a DeepSpeed tag is not a late file.

    Only "older than" counts: a file added after the save (an evaluation's output, zero_to_fp32's
    weights) is newer, never a reason. A copy that did not keep mtimes (cp -r without -p) can
    break the order: its checkpoints are kept, and `plan` says so (planner.decide).

    Fed by the pass over the entries (`_Pass`): `files` less ckptd's own, each directory's newest
    *.distcp file, the files written before the framework's last-written one (`last`)."""
    problems: list[tuple[float, str]] = []  # (seconds out of order, why)
    checked = False
    name, who, before = last if last is not None else ("", "", None)
    ts = files.get(name) if before is not None else None
    if ts is not None and ts.kind == "f" and before is not None:
        for e in before_last:  # the trainer's files `before` names (the pass asked it of each)
            checked = True
            gap = (e.mtime_ns - ts.mtime_ns) / 1e9
            if gap > MTIME_SLACK:
                why = f"{name} is {format_age(gap)} older than {e.rel}"
                problems.append((gap, f"{why}, which {who} writes before it"))
    for found, more in frameworks.order_problems(files, distcp, tags):
        checked = checked or found
        problems += more
    if problems:
        _, worst = max(problems)
        more = f" (and {len(problems) - 1} more out of order)" if len(problems) > 1 else ""
        return [Check(ONE_SAVE, FAILED, f"{MIXED_SAVE}: {worst}{more}; a re-save in place not finished?")]
    if not checked:
        return []
    return [Check(ONE_SAVE, PASSED, "its files are in the order one save writes them")]


MIXED_SAVE = "files from two saves"


def mixed_save(c: Checkpoint) -> bool:
    """Whether `one_save` found files from two saves in `c`."""
    for k in c.checks:  # noqa: SIM110 (a loop, not any(): planning asks this of every checkpoint)
        if k.name == ONE_SAVE and k.verdict is FAILED:
            return True
    return False


def read_slim_marker(path: Path, files: dict[str, Entry]) -> slim.Marker | str | None:
    """The checkpoint's slim marker; a string says why it cannot be read; None: not slimmed."""
    entry = files.get(slim.MARKER)
    if entry is None:
        return None
    if entry.kind != "f" or entry.size > MAX_TRAINER_STATE_BYTES:
        return "not a regular file of sensible size"
    try:
        with volread.open_file(path / slim.MARKER) as f:
            return slim.parse_marker(json.loads(volread.read_upto(f, MAX_TRAINER_STATE_BYTES + 1)))
    except (OSError, ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _slimmed(files: dict[str, Entry], marker: slim.Marker | str) -> Check:
    """A slimmed checkpoint must still hold the weights its marker names."""
    if isinstance(marker, str):
        return Check("slimmed", FAILED, f"{slim.MARKER} unreadable: {marker}")
    weights = files.get(marker.weights)
    if weights is None or weights.kind != "f":
        return Check("slimmed", FAILED, f"{marker.weights} missing: the marker says the weights are there")
    if marker.weights_bytes is not None and weights.size != marker.weights_bytes:
        return Check(
            "slimmed",
            FAILED,
            f"{marker.weights} is {weights.size} bytes, the marker says {marker.weights_bytes}",
        )
    for path, size in marker.files:  # the shards of sharded weights
        if path not in files or files[path].kind != "f" or files[path].size != size:
            why = f"{path} missing or not {size} bytes: the marker says it is there"
            return Check("slimmed", FAILED, why)
    left = [p for p, _ in marker.removed if p in files]
    detail = marker.summary(format_size)
    if left:  # a crash between the marker and the renames
        detail += (
            f"; interrupted: {len(left)} of {len(marker.removed)} files still present, prune finishes it"
        )
    return Check("slimmed", PASSED, detail)


def step_mismatch(ckpt: Checkpoint, names: Iterable[str]) -> list[str]:
    """Why a checkpoint's name and contents disagree on its step, if they do (the Trainer's:
    `frameworks/hf.py`). Not a completeness check (every file may be there), so not a reason to
    keep or delete; `verify` shows it as a warning. `names`: the entries directly inside.
    """
    fw = frameworks.get(ckpt.layout)
    return fw.step_mismatch(ckpt.name, ckpt.step, list(names), ckpt.trainer_state)


def on_quiet_alone(c: Checkpoint) -> bool:
    """Whether nothing but quiet proves this checkpoint finished (a user pattern without evidence)."""
    for k in c.checks:  # noqa: SIM110 (a loop, not any(): planning asks this of every checkpoint)
        if k.name == EVIDENCE and k.detail.endswith(QUIET_ALONE):
            return True
    return False


def resume_pointers(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """The checkpoints of a run directory (`names`: its entries) that a framework's own resume
    pointer or "last" copy names, each with why, asked of every framework (`Framework.resume_pointers`:
    DeepSpeed's `latest`, Megatron's tracker, Lightning's and NeMo's `*last*` links). Not
    completeness evidence (rank 0 writes `latest` before the other ranks finish), but never
    deleted: the next resume loads it. A pointer that is there but cannot be read may name any
    checkpoint of the run, so every one is named by it: kept, saying why, until it can be read.
    Guessing (or ignoring it, as if absent) could delete the very checkpoint the next resume loads.
    The first framework to name an entry says why."""
    found: dict[str, str] = {}
    for fw in frameworks.REGISTRY:
        for name, why in fw.resume_pointers(run_path, names).items():
            found.setdefault(name, why)
    return found


FileProblem = Callable[[str, "Entry"], str | None]  # (the checkpoint's path, one of its entries)


def _integrity(path: Path, checked: list[Entry], problem: FileProblem) -> Check:
    """Every file whose end says whether it is whole (`checked`, from the pass: torch.save zips and
    safetensors at any depth, a whole-file checkpoint in its archive format) read for `problem`."""
    bad: list[str] = []
    where = os.fspath(path)
    for e in checked:
        why = problem(where, e)
        if why:
            bad.append(f"{e.rel or path.name}{why}")
    count = len(checked)
    if bad:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        return Check("file integrity", FAILED, shown)
    return Check(
        "file integrity", PASSED, f"{count} torch/safetensors files intact" if count else "no torch files"
    )


def _matches_pin(rel: str, pins: frozenset[str]) -> bool:
    return any(pin_matches(rel, p) for p in pins)
