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
  the end, so a truncated one fails `zipfile.is_zipfile`; a safetensors
  header's offsets must fit the file.
- native markers: DCP's `.metadata` (the coordinator writes it after every
  rank), Orbax's tmp directory, NeMo's `-unfinished` marker, Megatron's tracker.
- slimmed: a `.ckptd-slim.json` marker lists the optimizer shards ckptd removed
  on purpose, so the census stops demanding them, and names the weights that
  must still be there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptd import dsmeta, layouts, slim
from ckptd import verdicts as verdicts_
from ckptd.config import format_duration, format_size
from ckptd.layouts import Candidate
from ckptd.model import QUIET, Check, Checkpoint, Slimming, TrainerState, Verdict, as_metric

TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE_BYTES = 64 * 1024 * 1024
ZIP_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors itself refuses headers over 100 MB

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_RNG = re.compile(r"rng_state_(\d+)\.pth")

PASSED, FAILED, UNKNOWN = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN


@dataclass(frozen=True)
class Entry:
    """One thing inside a checkpoint, as lstat saw it."""

    rel: str  # relative to the checkpoint; "" for the checkpoint itself
    kind: str  # "d", "f", "l" (symlink, never followed), "o"
    size: int
    mtime_ns: int
    # The rest of the file's identity, for remembering what was read from it (verdicts.py):
    # not part of the fingerprint.
    ctime_ns: int = 0
    ino: int = 0
    dev: int = 0


MAX_WALK_DEPTH = 256


class TooDeep(Exception):
    """A tree deeper than we walk: it cannot be proven complete, so it is never deleted."""

    def __init__(self, entries: list[Entry], why: str):
        super().__init__(why)
        self.entries = entries


def walk(path: Path) -> list[Entry]:
    """Every entry under `path` (itself included), without following symlinks.

    Entries that vanish while we look are skipped: the quiet check will see
    the directory's mtime move. A tree deeper than MAX_WALK_DEPTH (or with
    paths too long to name) raises TooDeep with what was seen.
    """
    st = os.lstat(path)
    out = [Entry("", _kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)]
    if not stat.S_ISDIR(st.st_mode):
        return out
    stack: list[tuple[str, str | Path, int]] = [("", path, 0)]
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
                except FileNotFoundError:
                    continue
                except OSError as exc:  # its path is longer than PATH_MAX: too long to name
                    if exc.errno == errno.ENAMETOOLONG:
                        raise TooDeep(out, f"paths too long to walk at {rel[:80]}...") from None
                    raise
                erel = f"{rel}/{e.name}" if rel else e.name
                kind = _kind(est.st_mode)
                out.append(
                    Entry(erel, kind, est.st_size, est.st_mtime_ns, est.st_ctime_ns, est.st_ino, est.st_dev)
                )
                if kind == "d":
                    stack.append((erel, e.path, depth + 1))
    return out


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISLNK(mode):
        return "l"
    return "o"


def fingerprint(entries: list[Entry]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for e in sorted(entries, key=lambda e: e.rel):
        h.update(f"{e.rel}\0{e.kind}\0{e.size}\0{e.mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


QuietJudge = Callable[[str, str], Check]  # (path relative to the root, fingerprint) -> quiet check


@dataclass(frozen=True)
class RunContext:
    """What a checkpoint's checks need to know of the run directory around it."""

    path: Path
    names: frozenset[str]


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
        slim_files: tuple[str, ...] = slim.DEFAULT_SLIM_FILES,
    ) -> Checkpoint:
        """The evidence for one checkpoint.

        Quiescence is judged by `quiet` when given (the daemon's settler, on
        monotonic time), else by comparing the newest mtime with `now`, the
        wall clock (one-shot commands have nothing better).
        `world_size` stands in for DeepSpeed's dp_world_size when the
        checkpoint's own metadata cannot be read.
        """
        path = run.path / cand.name
        too_deep = None
        try:
            entries = walk(path)
        except TooDeep as exc:
            entries, too_deep = exc.entries, Check("walk", UNKNOWN, f"not fully inspected: {exc}")
        files = {e.rel: e for e in entries}
        newest_ns = max(e.mtime_ns for e in entries)
        trainer_state: TrainerState | None = None
        rel = cand.name if run_rel == "." else f"{run_rel}/{cand.name}"
        digest = fingerprint(entries)
        self._look = self.verdicts.begin(str(path), entries)
        marker = read_slim_marker(path, files) if cand.is_dir else None
        removed = frozenset(p for p, _ in marker.removed) if isinstance(marker, slim.Marker) else frozenset()

        checks = [quiet(rel, digest) if quiet is not None else self._quiet(newest_ns, now)]
        if cand.layout == layouts.HF:
            ts_check, trainer_state = self._trainer_state(path, files)
            checks.append(ts_check)
            census = [self._deepspeed(path, d, files, world_size, removed) for d in _global_step_dirs(files)]
            checks.extend(check for check, _ in census)
            worlds = [w.dp * w.mp for _, w in census if w is not None]
            checks.append(_rng_states(files, worlds[0] if worlds else None))
        elif cand.layout == layouts.DEEPSPEED:
            checks.append(self._deepspeed(path, "", files, world_size, removed)[0])
        elif cand.layout == layouts.MEGATRON:
            checks.append(_megatron_tracker(run, cand))
        elif cand.layout == layouts.DCP:
            checks.append(_dcp_metadata(files, ""))
        elif cand.layout == layouts.ORBAX:
            checks.append(_orbax(cand, files))
        elif cand.layout == layouts.NEMO:
            checks.append(_nemo_unfinished(run, cand))
        else:
            checks.append(Check("evidence", PASSED, "no layout-specific markers: complete on quiet alone"))
        checks.extend(_nested_dcp(files, skip_top=cand.layout == layouts.DCP))
        checks.append(_integrity(path, entries, self._file_problem))
        if too_deep is not None:
            checks.append(too_deep)
        if marker is None or isinstance(marker, slim.Marker):
            slimming = slim.survey(cand.layout, cand.name, files, slim_files, marker)
        else:
            slimming = Slimming(slimmed=True)  # unreadable marker: not full, and nothing to do
        if marker is not None:
            checks.append(_slimmed(files, marker))

        pinned = layouts.PIN_FILE in files if cand.is_dir else f"{cand.name}{layouts.PIN_FILE}" in run.names
        self.verdicts.end(self._look, entries, digest)
        return Checkpoint(
            root=root,
            run=run_rel,
            name=cand.name,
            step=cand.step,
            layout=cand.layout,
            checks=tuple(checks),
            size_bytes=sum(e.size for e in entries if e.kind == "f"),
            newest_mtime=newest_ns / 1e9,
            fingerprint=digest,
            pinned=pinned or _matches_pin(rel, pins),
            trainer_state=trainer_state,
            slim=slimming,
        )

    # --- checks ----------------------------------------------------------

    def _remembered(self, kind: str, entry: Entry, read: Callable[[], object]) -> object:
        """`read()`'s verdict on `entry`, or the one remembered for a file of the same identity."""
        if self._look is None:
            return read()
        return self._look.verdict(kind, entry, read)

    def _file_problem(self, path: Path, e: Entry) -> str | None:
        """`file_problem`, remembered while the file is the same: an unchanged file is read once.

        A read that failed (an I/O error) is a problem this time and not remembered.
        """
        try:
            return self._remembered(verdicts_.FILE, e, lambda: file_problem(path, e))  # type: ignore[return-value]
        except OSError as exc:
            return f" could not be read: {exc.strerror or exc}"

    def _trainer_state(self, path: Path, files: dict[str, Entry]) -> tuple[Check, TrainerState | None]:
        """Parsed again only when the file changed: an in-flight checkpoint is looked at every poll,
        and a long run's log history takes tens of milliseconds to parse."""
        entry = files.get(TRAINER_STATE)
        if entry is None or entry.kind != "f":
            return _trainer_state(path, files)

        def read() -> tuple[Check, TrainerState | None]:
            check, ts = _trainer_state(path, files)
            return check, (self.verdicts.share_history(ts, str(path.parent)) if ts is not None else None)

        try:
            return self._remembered(verdicts_.TRAINER_STATE, entry, read)  # type: ignore[return-value]
        except OSError as exc:  # not remembered: read again next time
            return Check(TRAINER_STATE, FAILED, f"unreadable: {type(exc).__name__}: {exc}"), None

    def _quiet(self, newest_ns: int, now: float) -> Check:
        age = now - newest_ns / 1e9
        period = format_duration(self.quiet_period)
        if age < 0:
            return Check(QUIET, Verdict.FAILED, f"newest mtime is {-age:.1f}s in the future (clock skew?)")
        if age < self.quiet_period:
            return Check(QUIET, FAILED, f"last change {age:.1f}s ago, quiet_period={period}")
        return Check(QUIET, PASSED, f"unchanged for {format_duration(round(age))} (quiet_period={period})")

    def _world_sizes(
        self, ckpt: Path, gs: str, files: dict[str, Entry], stage3: bool, world_size: int | None
    ) -> dsmeta.WorldSizes | str:
        """World sizes from the model-states file, else from config; or why not."""
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else "mp_rank_00_model_states.pt"
        rel = f"{gs}/{name}" if gs else name
        entry = files.get(rel)
        if entry is not None:

            def read() -> dsmeta.WorldSizes | str:
                try:
                    return dsmeta.read_world_sizes(ckpt / rel)
                except dsmeta.MetadataUnavailable as exc:
                    return str(exc)

            found = self._remembered(verdicts_.WORLD, entry, read)  # an OSError: the volume is failing
            if isinstance(found, dsmeta.WorldSizes):
                return found
            why = found
        else:
            why = f"{name} missing"
        if world_size is not None:
            return dsmeta.WorldSizes(world_size, self.mp_world_size, None, "config world_size")
        return why

    def _deepspeed(
        self,
        ckpt: Path,
        gs: str,
        files: dict[str, Entry],
        world_size: int | None,
        removed: frozenset[str] = frozenset(),
    ) -> tuple[Check, dsmeta.WorldSizes | None]:
        """The shard census of one `global_step*` directory (`gs`; "" for `ckpt` itself).

        Optimizer shards that a slim marker lists as `removed` are not demanded.
        """
        name = f"deepspeed shards{f' ({gs})' if gs else ''}"
        prefix = f"{gs}/" if gs else ""
        here = {
            rel[len(prefix) :] for rel in files if rel.startswith(prefix) and "/" not in rel[len(prefix) :]
        }
        slimmed = {
            n
            for rel in removed
            if rel.startswith(prefix) and _OPTIM.fullmatch(n := rel[len(prefix) :]) and n not in here
        }
        here_or_slimmed = here | slimmed
        stage3 = any(_ZERO3_MODEL.fullmatch(n) for n in here)
        sizes = self._world_sizes(ckpt, gs, files, stage3, world_size)
        if isinstance(sizes, str):
            if not here - {""}:
                return Check(name, FAILED, f"{gs or 'directory'} is empty"), None
            return Check(name, UNKNOWN, f"cannot count shards: {sizes}"), None
        bf16 = any(n.startswith("bf16_zero_pp_rank_") for n in here_or_slimmed)
        zero = stage3 or (sizes.stage or 0) > 0 or any(_OPTIM.fullmatch(n) for n in here_or_slimmed)
        expected: list[str] = []
        for m in range(sizes.mp):
            if stage3:
                expected += [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(sizes.dp)]
            else:
                expected.append(f"mp_rank_{m:02d}_model_states.pt")
            if zero:
                opt = "bf16_" if bf16 else ""
                expected += [
                    f"{opt}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt" for r in range(sizes.dp)
                ]
        missing = [n for n in expected if n not in here_or_slimmed]
        origin = f"dp_world_size={sizes.dp}, mp_world_size={sizes.mp} from {sizes.source}"
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            return Check(name, FAILED, f"{shown} missing ({origin})"), sizes
        if stage3:
            kind = "ZeRO-3"
        elif sizes.stage is not None:
            kind = f"ZeRO-{sizes.stage}"
        else:
            kind = "ZeRO" if zero else "no ZeRO"
        present = len(expected) - len(slimmed & set(expected))
        gone = (
            f", {len(expected) - present} optimizer shards removed by slimming"
            if present < len(expected)
            else ""
        )
        return Check(name, PASSED, f"{present}/{len(expected)} files present{gone}, {kind} ({origin})"), sizes


def read_slim_marker(path: Path, files: dict[str, Entry]) -> slim.Marker | str | None:
    """The checkpoint's slim marker; a string says why it cannot be read; None: not slimmed."""
    entry = files.get(slim.MARKER)
    if entry is None:
        return None
    if entry.kind != "f" or entry.size > MAX_TRAINER_STATE_BYTES:
        return "not a regular file of sensible size"
    try:
        with open(path / slim.MARKER, "rb") as f:
            return slim.parse_marker(json.loads(f.read(MAX_TRAINER_STATE_BYTES + 1)))
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
    left = [p for p, _ in marker.removed if p in files]
    detail = marker.summary(format_size)
    if left:  # a crash between the marker and the renames
        detail += (
            f"; interrupted: {len(left)} of {len(marker.removed)} files still present, prune finishes it"
        )
    return Check("slimmed", PASSED, detail)


def _global_step_dirs(files: dict[str, Entry]) -> list[str]:
    return sorted(
        rel
        for rel, e in files.items()
        if e.kind == "d" and "/" not in rel and re.fullmatch(r"global_step\d+", rel)
    )


def _trainer_state(path: Path, files: dict[str, Entry]) -> tuple[Check, TrainerState | None]:
    entry = files.get(TRAINER_STATE)
    if entry is None or entry.kind != "f":
        return Check(TRAINER_STATE, FAILED, "missing (the Trainer writes it last)"), None
    if entry.size > MAX_TRAINER_STATE_BYTES:
        return Check(TRAINER_STATE, FAILED, f"{entry.size} bytes: larger than this tool will parse"), None
    with open(path / TRAINER_STATE, "rb") as f:  # an OSError is not a verdict: the caller's to handle
        raw = f.read(MAX_TRAINER_STATE_BYTES + 1)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return Check(TRAINER_STATE, FAILED, f"unreadable: {type(exc).__name__}: {exc}"), None
    if not isinstance(data, dict):
        return Check(TRAINER_STATE, FAILED, "not a JSON object"), None
    ts = parse_trainer_state(data)
    return Check(TRAINER_STATE, PASSED, f"parsed (global_step={ts.global_step})"), ts


def parse_trainer_state(data: dict) -> TrainerState:
    """The parts of a trainer_state.json retention uses; anything malformed is ignored."""
    history: dict[int, dict[str, object]] = {}
    log = data.get("log_history")
    for item in log if isinstance(log, list) else ():
        if (
            isinstance(item, dict)
            and isinstance(item.get("step"), int)
            and not isinstance(item["step"], bool)
        ):
            history.setdefault(item["step"], {}).update(item)
    best = data.get("best_model_checkpoint")
    best_name = os.path.basename(os.path.normpath(best)) if isinstance(best, str) and best else None
    best_metric = data.get("best_metric")
    step = data.get("global_step")
    return TrainerState(
        global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        best_model_checkpoint=best_name,
        best_metric=as_metric(best_metric)  # type: ignore[arg-type]
        if isinstance(best_metric, int | float) and not isinstance(best_metric, bool)
        else None,
        history=history,
    )


def _rng_states(files: dict[str, Entry], world: int | None) -> Check:
    """One rng_state_<rank>.pth per process: each rank writes its own, with no barrier."""
    ranks = sorted(int(m[1]) for rel in files if "/" not in rel and (m := _RNG.fullmatch(rel)))
    if not ranks:
        if "rng_state.pth" in files:
            return Check("rng states", PASSED, "rng_state.pth (one process)")
        return Check("rng states", PASSED, "none saved")
    # Ranks 0..n-1 are all there exactly when n of them are and the highest is n-1: no
    # walk up to a rank number taken from a (possibly hostile) file name.
    present = set(ranks)
    n = world if world is not None else max(ranks) + 1
    if len([r for r in present if r < n]) < n:
        first = next(r for r in range(n) if r not in present)  # at most len(present)+1 steps
        counted = f" ({len(present)}/{world} ranks)" if world is not None else ""
        return Check("rng states", FAILED, f"rng_state_{first}.pth missing{counted}")
    if world is not None:
        return Check("rng states", PASSED, f"{world}/{world} ranks")
    return Check("rng states", PASSED, f"ranks 0..{n - 1} contiguous (world size not known)")


def _megatron_tracker(run: RunContext, cand: Candidate) -> Check:
    name = "megatron tracker"
    if layouts.MEGATRON_TRACKER not in run.names:
        return Check(name, FAILED, f"{layouts.MEGATRON_TRACKER} missing (written after every rank saved)")
    try:
        text = (run.path / layouts.MEGATRON_TRACKER).read_text(errors="replace").strip()
    except OSError as exc:
        return Check(name, UNKNOWN, f"cannot read {layouts.MEGATRON_TRACKER}: {exc}")
    if text == "release":
        return Check(name, PASSED, "tracker says 'release'")
    if not text.isdigit():
        return Check(name, UNKNOWN, f"{layouts.MEGATRON_TRACKER} holds {text[:40]!r}, not an iteration")
    if int(text) < cand.step:
        return Check(name, FAILED, f"tracker at iteration {int(text)} < {cand.step}: still being saved")
    return Check(name, PASSED, f"tracker at iteration {int(text)} >= {cand.step}")


def _dcp_metadata(files: dict[str, Entry], d: str) -> Check:
    rel = f"{d}/.metadata" if d else ".metadata"
    where = f"dcp .metadata ({d})" if d else "dcp .metadata"
    if rel in files:
        return Check(where, PASSED, "present (the coordinator writes it after every rank)")
    return Check(where, FAILED, "missing (the coordinator writes it last)")


def _nested_dcp(files: dict[str, Entry], skip_top: bool) -> Iterator[Check]:
    """Any directory inside a checkpoint holding *.distcp files needs its .metadata."""
    dirs = sorted({rel.rpartition("/")[0] for rel in files if rel.endswith(".distcp")})
    for d in dirs:
        if d == "" and skip_top:
            continue
        yield _dcp_metadata(files, d)


def _orbax(cand: Candidate, files: dict[str, Entry]) -> Check:
    if cand.in_progress:
        return Check("orbax commit", FAILED, "still a tmp directory (Orbax renames it when finished)")
    if "commit_success.txt" in files:
        return Check("orbax commit", PASSED, "commit_success.txt present")
    return Check("orbax commit", PASSED, "finalized by rename from its tmp directory")


def _nemo_unfinished(run: RunContext, cand: Candidate) -> Check:
    marker = layouts.nemo_unfinished_marker(cand.name)
    if marker in run.names:
        return Check("nemo marker", FAILED, f"{marker} present: save not finished")
    return Check("nemo marker", PASSED, f"no {marker}")


FileProblem = Callable[[Path, "Entry"], str | None]


def _integrity(path: Path, entries: list[Entry], problem: FileProblem) -> Check:
    bad: list[str] = []
    count = 0
    for e in entries:
        if e.kind != "f":
            continue
        name = e.rel or path.name
        if name.endswith((*ZIP_SUFFIXES, SAFETENSORS_SUFFIX)) or (not e.rel and name.endswith(".ckpt")):
            count += 1
            why = problem(path / e.rel if e.rel else path, e)
            if why:
                bad.append(f"{name}{why}")
    if bad:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        return Check("file integrity", FAILED, shown)
    return Check(
        "file integrity", PASSED, f"{count} torch/safetensors files intact" if count else "no torch files"
    )


def file_problem(path: Path, e: Entry) -> str | None:
    """Why one torch or safetensors file is not whole (as a suffix to its name), or None."""
    if path.name.endswith(SAFETENSORS_SUFFIX):  # `path` is the file itself
        problem = safetensors_problem(path, e.size)
        return f": {problem}" if problem else None
    if e.size == 0:
        return " is empty"
    if not _is_zip(path, e.size):
        return " is not a complete zip archive (truncated?)"
    return None


_EOCD = b"PK\x05\x06"  # end of central directory: the last thing a zip writer writes


def _is_zip(path: Path, size: int) -> bool:
    """Whether the file ends in a zip's end-of-central-directory record.

    torch.save writes no archive comment, so the record is the last 22 bytes: one
    pread. Anything else (a comment, an odd writer) gets zipfile's full search.
    An OSError is not a verdict: it passes through, so that it is not remembered.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        tail = os.pread(fd, 22, max(0, size - 22))
    finally:
        os.close(fd)
    if len(tail) == 22 and tail[:4] == _EOCD and tail[20:22] == b"\0\0":
        return True
    return zipfile.is_zipfile(path)  # (it answers False to an OSError of its own)


def safetensors_problem(path: Path, size: int) -> str | None:
    """Why a safetensors file is not whole, or None."""
    if size < 8:
        return f"{size} bytes: too short for a header"
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"header length {n} runs past the end of the file ({size} bytes)"
            if n > MAX_SAFETENSORS_HEADER:
                return f"header length {n} is larger than this tool will parse"
            header = json.loads(f.read(n))
    except (ValueError, struct.error, RecursionError) as exc:  # an OSError passes through: not a verdict
        return f"unreadable header: {exc}"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data_len = size - 8 - n
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {key!r} has no data_offsets"
        end = max(end, offsets[1])
    if end > data_len:
        return f"tensors need {end} data bytes, the file has {data_len} (truncated?)"
    return None


def _matches_pin(rel: str, pins: frozenset[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(rel, p) for p in pins)
