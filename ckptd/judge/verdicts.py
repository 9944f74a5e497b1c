"""What was read from a checkpoint's files, remembered while they stay the same, and across restarts.

Proving a checkpoint complete means opening files: every torch file's zip
directory, the DeepSpeed model-states pickle, trainer_state.json. Those reads
are what a scan costs beyond `find`. A verdict read from a file is remembered
here and used again only for a file whose identity is the same: (dev, inode,
size, mtime_ns, ctime_ns), as the walk's lstat saw it. When in doubt, the file
is read again.

- **Racily clean files are read again.** A file rewritten in place to the same
  size within one timestamp tick keeps its size, mtime and ctime: no stat can
  tell. So a verdict is remembered only when the file's mtime and ctime were at
  least RACY_NS older than the moment the reading began (git's "racily clean"
  rule): anything written after our read then has a later ctime. ctime cannot be
  set by `utime` or a copy that preserves times. Where the volume's clock lags
  ours by more than RACY_NS (a skewed NFS server), this rule is weaker; the
  reaper's own re-check never relies on remembered verdicts at all (below).
- **An I/O error is not a verdict.** A reader that raised OSError leaves nothing
  behind (its look says "could not be read", and the next look reads again).
- **Per checkpoint, not per file.** A checkpoint's record holds a digest of
  every entry's identity and the verdicts read at that look; while the digest
  is the same, every verdict is reused without a per-file lookup. Only the
  verdicts that are not "intact" are stored (world sizes, the parsed
  trainer_state.json, any file's problem), so a complete checkpoint costs a
  few hundred bytes, not one cache entry per shard. While a checkpoint is young
  (changed within YOUNG_NS) its per-file verdicts are kept too, so a look at a
  checkpoint being written reads only the files that changed.
- **On disk** (`state_dir/verdicts-<root digest>.json`): the complete records,
  so that a restart, or `ckptd plan`, re-reads nothing but stats on an
  unchanged volume. Versioned by the source of the modules whose readers
  produce the verdicts (any change to them discards the file), checksummed,
  and ignored whole when unreadable, corrupt or for another root.
- **A restore stats what it gives back.** A saved checkpoint is given back whole
  (`restorable`) only while every stamp of its record holds: its directories (a
  file created, removed or renamed inside changes one), and every file whose
  contents a decision rests on (trainer_state.json and any other file with a
  verdict other than "intact", the JSON and metadata files a look reads whole),
  each by (dev, inode, size, mtime_ns, ctime_ns). A file rewritten in place with
  its mtime kept changes no directory, but its ctime.
- **Strict** (`with verdicts.strict():`): the reaper's re-check just before it
  deletes reads every file again and uses no remembered verdict, neither a record
  loaded from disk nor this process's own (a file rewritten in place within one
  tick of a lagging volume clock keeps its identity): a deletion rests on what the
  files say now, never on this cache.
- **Versioned by code**: the logic digest covers every module a look or a restore
  depends on (evidence, dsmeta, model, slim, layouts, mounts, config,
  planner, this one); a restored checkpoint carries every field evidence computes
  (save times, rank count, mount points, metrics) so that the sibling census and
  the anchors see what a fresh look would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd import __version__
from ckptd.frameworks.base import MemoryKind
from ckptd.frameworks.dsmeta import WorldSizes
from ckptd.model import (
    ATTESTED,
    COMMIT_RECORDS,
    QUIET,
    SAVE_LEASE,
    STALL,
    Check,
    Checkpoint,
    ConsolidatedWeights,
    Reading,
    Slimming,
    TrainerState,
    Verdict,
)
from ckptd.volume.space import Shared

if TYPE_CHECKING:
    from ckptd.model import Entry

log = logging.getLogger(__name__)

FORMAT = "ckptd-verdicts"
VERSION = 1  # the first line: FORMAT VERSION logic checksum; then the JSON document, zlib-compressed
RACY_NS = 1_000_000_000  # above every local filesystem's timestamp tick (ext4/xfs: one jiffy)
YOUNG_NS = 600 * 1_000_000_000  # keep per-file verdicts of checkpoints changed this recently
MAX_PERSISTED_HISTORY = 100_000  # log-history steps per trainer state written to disk; more: read again
_ATTESTATION = (ATTESTED, COMMIT_RECORDS, SAVE_LEASE)  # checks from commit records (attestation.py)


Identity = tuple[int, int, int, int, int]  # (dev, ino, size, mtime_ns, ctime_ns)
Key = tuple[str, str]  # (kind, path relative to the checkpoint)
# A directory's (or a file checkpoint's) stamp: (rel, dev, ino, size, mtime_ns, ctime_ns)
Stamp = tuple[str, int, int, int, int, int]


def identity(e: Entry) -> Identity:
    return (e.dev, e.ino, e.size, e.mtime_ns, e.ctime_ns)


class Record:
    """The verdicts of one look at one checkpoint."""

    __slots__ = (
        "checkpoint", "context", "digest", "dirs", "files", "fingerprint", "proven", "verdicts", "whole",
    )  # fmt: skip

    def __init__(
        self,
        digest: bytes,
        verdicts: dict[Key, Any],
        *,
        whole: bool,
        proven: bool,
        files: dict[Key, tuple[Identity, Any]] | None = None,
        fingerprint: str = "",
        dirs: tuple[Stamp, ...] = (),
    ):
        self.digest = digest  # of every entry's identity at that look
        self.verdicts = verdicts  # (kind, rel) -> verdict; file verdicts only when not intact (None)
        self.whole = whole  # every verdict that look asked for was remembered: no file verdict: intact
        self.proven = proven  # read by this process (False: loaded from disk, or reused from such)
        self.files = files  # per-file, while young: (kind, rel) -> (identity, verdict)
        self.fingerprint = fingerprint  # the checkpoint's fingerprint at that look (evidence.fingerprint)
        self.dirs = dirs  # its directories' stamps at that look: see `Verdicts.dirs_unchanged`
        self.checkpoint: Checkpoint | None = None  # what that look made of it (`keep_checkpoint`)
        self.context = ""  # what else it depended on (the config, its run directory): `restorable`


class Look:
    """One inspection of one checkpoint: serves remembered verdicts, collects the new record."""

    __slots__ = ("digest", "files", "key", "newest_ns", "old", "proven", "started_ns", "verdicts", "whole")

    def __init__(self, key: str, digest: bytes, old: Record | None, started_ns: int, newest_ns: int):
        self.key = key
        self.digest = digest
        self.old = old  # the record it may reuse (None: read everything)
        self.started_ns = started_ns  # wall clock before any read: the racy-clean rule's reference
        self.newest_ns = newest_ns  # the newest mtime of any entry
        self.verdicts: dict[Key, Any] = {}
        self.files: dict[Key, tuple[Identity, Any]] = {}
        self.whole = True
        self.proven = True

    def verdict(self, kind: str, entry: Entry, read: Callable[[], Any]) -> Any:
        """The verdict on `entry` from a remembered read, or `read()`'s (an OSError passes through)."""
        key = (kind, entry.rel)
        ident = identity(entry)
        old = self.old
        if old is not None:
            found: tuple[Any] | None = None
            if old.whole and old.digest == self.digest:  # nothing in the checkpoint changed
                if key in old.verdicts:
                    found = (old.verdicts[key],)
                elif kind == MemoryKind.FILE:
                    found = (None,)
            if found is None and old.files is not None:
                hit = old.files.get(key)
                if hit is not None and hit[0] == ident:
                    found = (hit[1],)
            if found is not None:
                self.proven = self.proven and old.proven
                self._keep(key, ident, found[0])
                return found[0]
        try:
            value = read()
        except OSError:
            self.whole = False
            raise
        if self.started_ns - max(entry.mtime_ns, entry.ctime_ns) >= RACY_NS:
            self.files[key] = (ident, value)  # `_keep`, inline: asked of every torch file
            if kind != MemoryKind.FILE or value is not None:
                self.verdicts[key] = value
        else:
            self.whole = False  # racily clean: read again next time
        return value

    def _keep(self, key: Key, ident: Identity, value: Any) -> None:
        self.files[key] = (ident, value)
        if key[0] != MemoryKind.FILE or value is not None:
            self.verdicts[key] = value


class Verdicts:
    """The records of one root's checkpoints, by checkpoint path. Used from one thread at a time."""

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns):
        self.clock_ns = clock_ns  # the wall clock, for the racy-clean rule only
        self._records: dict[str, Record] = {}
        self._strict = 0
        self.dirty = False  # records changed since the last save
        self.loaded = 0  # records read from disk at start
        self._histories: dict[str, _RunHistory] = {}  # by run directory: see `share_history`
        self._checks: dict[Check, Check] = {}  # see `share_checks`

    def __len__(self) -> int:
        return len(self._records)

    @contextlib.contextmanager
    def strict(self) -> Iterator[None]:
        """Within: only verdicts this process read itself (the reaper's re-check)."""
        self._strict += 1
        try:
            yield
        finally:
            self._strict -= 1

    # --- one look --------------------------------------------------------------

    def begin(self, key: str, entries: list[Entry]) -> Look:
        rows = sorted((e.rel, e.kind, e.dev, e.ino, e.size, e.mtime_ns, e.ctime_ns) for e in entries)
        digest = hashlib.blake2b(repr(rows).encode("utf-8", "surrogateescape"), digest_size=16).digest()
        # Strict (the reaper's re-check): nothing remembered is used, not even this process's own
        # reads: a file rewritten in place within one timestamp tick of a volume whose clock lags
        # ours keeps its whole identity, and a deletion must rest on what the files say now.
        old = None if self._strict else self._records.get(key)
        newest = max(e.mtime_ns for e in entries)  # (youth only chooses what to keep: mtime will do)
        return Look(key, digest, old, self.clock_ns(), newest)

    def end(self, look: Look, entries: list[Entry], fingerprint: str, content: Iterable[Entry] = ()) -> None:
        """The look finished: its verdicts become the checkpoint's record.

        `content`: the files whose contents the look read for what they say (JSON it parsed), beyond
        the verdicts it asked for. They, and every file with a verdict other than "intact" (world
        sizes, the trainer state, a problem), are stamped with the directories: a restore stats
        each (`restorable`), so a file rewritten in place, which changes no directory but its own
        ctime, is read again.
        """
        files = look.files
        if look.whole and look.started_ns - look.newest_ns >= YOUNG_NS:
            # Settled: the digest stands for the intact files; keep the rest (world sizes, trainer
            # state, problems: the files a backed-off look stats).
            files = {k: v for k, v in files.items() if v[1] is not None}
        old = self._records.get(look.key)
        self._records[look.key] = Record(
            look.digest,
            look.verdicts,
            whole=look.whole,
            proven=look.proven,
            files=files,
            fingerprint=fingerprint,
            dirs=_stamps(entries, content, look.files),
        )
        if old is None or old.digest != look.digest or old.whole != look.whole:
            self.dirty = True

    # --- what the tracker asks ---------------------------------------------------

    def dirs_unchanged(
        self, path: str, fingerprint: str, also: Iterable[str] = (), *, whole: bool = True
    ) -> bool:
        """Whether every directory of the checkpoint at `path` (the checkpoint itself, if a file)
        still has the stamp (inode, size, mtime, ctime) of the look that gave `fingerprint`,
        and so do the files named in `also` (relative to it). With `whole`, also whether that
        look remembered every verdict (else one more look lets it: a racily clean file).

        A file created, removed or renamed anywhere inside changes its directory's mtime and
        ctime; a file rewritten in place does not, which is why the stamps hold the files whose
        contents a decision rests on too (`end`), and why this is the tracker's cheap question
        between looks and never the reaper's.
        """
        rec = self._records.get(path)
        if rec is None or rec.fingerprint != fingerprint or not rec.dirs or (whole and not rec.whole):
            return False
        stamps = rec.dirs
        if also:
            files = rec.files or {}
            wanted = set(also)
            extra = [
                (rel, *ident)
                for (kind, rel), (ident, _) in files.items()
                if kind == MemoryKind.FILE and rel in wanted
            ]
            if len(extra) < len(wanted):
                return False  # no stamp for one of them: look
            stamps = (*stamps, *extra)
        for rel, dev, ino, size, mtime, ctime in stamps:
            try:
                st = os.stat(os.path.join(path, rel) if rel else path, follow_symlinks=False)
            except OSError:
                return False
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if now != (dev, ino, size, mtime, ctime):
                return False
        return True

    def keep_checkpoint(self, path: str, checkpoint: Checkpoint, context: str) -> None:
        """What the look just ended made of the checkpoint at `path` (saved with its verdicts)."""
        rec = self._records.get(path)
        if rec is not None and rec.fingerprint == checkpoint.fingerprint:
            if rec.checkpoint is None or rec.context != context:
                self.dirty = True
            rec.checkpoint, rec.context = checkpoint, context

    def restorable(self, path: str, context: str) -> Checkpoint | None:
        """The checkpoint at `path` as a whole earlier look found it, if its directories and the
        files whose contents it rests on (`end`), and what else it depended on (`context`), are as
        they were then (a stat each)."""
        rec = self._records.get(path)
        if rec is None or rec.checkpoint is None or rec.context != context:
            return None
        if self._strict:
            return None  # the re-check walks and reads everything itself
        if any(k.name in _ATTESTATION for k in rec.checkpoint.checks):
            return None  # its records' verdict hangs on a lease's heartbeat and the wall clock: look again
        if not self.dirs_unchanged(path, rec.fingerprint):
            return None
        return rec.checkpoint

    def problems(self, path: str) -> list[str]:
        """The files of the checkpoint at `path` whose last verdict was a problem."""
        rec = self._records.get(path)
        if rec is None:
            return []
        return [rel for (kind, rel), v in rec.verdicts.items() if kind == MemoryKind.FILE and v is not None]

    def forget(self, path: str) -> None:
        if self._records.pop(path, None) is not None:
            self.dirty = True

    def retain(self, paths: Iterable[str]) -> None:
        """Keep the records of these checkpoints only (the rest vanished)."""
        keep = set(paths)
        gone = [k for k in self._records if k not in keep]
        for k in gone:
            del self._records[k]
        if gone:
            self.dirty = True
            runs = {k.rpartition("/")[0] for k in keep}
            self._histories = {k: h for k, h in self._histories.items() if k in runs}

    def share_checks(self, checks: tuple[Check, ...]) -> tuple[Check, ...]:
        """The same check (name, verdict, detail) as one object for every checkpoint that has it:
        a census or integrity line is the same for every checkpoint of a run. Not the quiet check
        (its detail says for how long)."""
        table = self._checks
        if len(table) > 100_000:  # details that name steps or counts pile up: start again
            table.clear()
        return tuple(c if c.name == QUIET else table.setdefault(c, c) for c in checks)

    # --- trainer states: one log history per run ------------------------------------

    def share_history(self, ts: TrainerState, run: str) -> TrainerState:
        """`ts` with its log history kept once per run: each checkpoint of a run logs the same
        history up to its own step, so a copy per checkpoint would grow with checkpoints × run
        length (most of a daemon's memory on a large volume)."""
        history = self._history(run, list(ts.history.items()))
        return TrainerState(ts.global_step, ts.best_model_checkpoint, ts.best_metric, history)

    def _history(self, run: str, items: list[tuple[int, Any]]) -> Mapping[int, Any]:
        """A view of the run's history when `items` are its first steps (extending it if they go
        further); else `items` as a dict of their own (a run restarted with another history)."""
        h = self._histories.get(run)
        if h is None:
            h = self._histories[run] = _RunHistory()
        steps, index = h.steps, h.index
        known = len(steps)
        for i, (step, row) in enumerate(items[:known]):
            if steps[i] != step or index[step][1] != row:
                return dict(items)
        more = items[known:]
        if any(step in index for step, _ in more) or len({step for step, _ in more}) != len(more):
            return dict(items)
        for step, row in more:
            index[step] = (len(steps), row)
            steps.append(step)
        return SharedHistory(h, len(items))

    # --- on disk -----------------------------------------------------------------

    def load(self, path: Path, root: Path) -> None:
        """Take in the records saved for `root`; anything unreadable is ignored (and read again)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.info("verdict cache %s not read: %s", path, exc)
            return
        try:
            records = self._decode(data, root)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            log.info("verdict cache %s ignored: %s", path, exc)
            return
        for key, rec in records.items():
            self._records.setdefault(key, rec)
        self.loaded = len(records)
        log.debug("verdict cache %s: %d checkpoints", path, len(records))

    def save(self, path: Path, root: Path) -> None:
        """Write the complete records for `root`, atomically; an error is logged, not raised."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            data = self._encode(root)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self.dirty = False
        except (OSError, ValueError) as exc:
            log.warning("cannot write the verdict cache %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _encode(self, root: Path) -> bytes:
        """The file: a head line, then zlib of a JSON line (the root, the history rows) and a JSON
        line per checkpoint. A line at a time: the L volume's 22 MB of JSON is never one object."""
        prefix = str(root).rstrip("/") + "/"
        saved = [(key, rec) for key, rec in self._records.items() if rec.whole and key.startswith(prefix)]
        rows: dict[int, int] = {}  # id(row) -> index in `table`
        table: list[list[Any]] = []
        for _, rec in saved:
            found = rec.verdicts.get((MemoryKind.TRAINER_STATE, "trainer_state.json"))
            if found is not None and found[1] is not None and len(found[1].history) <= MAX_PERSISTED_HISTORY:
                for step, row in found[1].history.items():
                    if id(row) not in rows:
                        rows[id(row)] = len(table)
                        table.append([step, row])
        z = zlib.compressobj(1)  # 22 MB of JSON on the L volume: 1.9 MB, 0.1 s
        chunks = [z.compress(_line({"root": str(root), "rows": table}))]
        for key, rec in saved:
            verdicts = []
            for (kind, rel), value in rec.verdicts.items():
                encoded = _encode_verdict(kind, value, rows, table)
                if encoded is not None:
                    verdicts.append([kind, rel, encoded])
            line: list[Any] = [key[len(prefix) :], rec.digest.hex(), verdicts]
            summary = _encode_checkpoint(rec)
            if summary is not None:
                line.append(summary)
            chunks.append(z.compress(_line(line)))
        chunks.append(z.flush())
        body = b"".join(chunks)
        head = f"{FORMAT} {VERSION} {logic_version()} {hashlib.blake2b(body, digest_size=16).hexdigest()}\n"
        return head.encode() + body

    def _decode(self, data: bytes, root: Path) -> dict[str, Record]:
        head, _, body = data.partition(b"\n")
        fmt, version, logic, checksum = head.decode("ascii").split(" ")
        if (fmt, version) != (FORMAT, str(VERSION)):
            raise ValueError(f"not a version {VERSION} verdict cache")
        if logic != logic_version():
            raise ValueError("written by another version of ckptd's checks")
        if hashlib.blake2b(body, digest_size=16).hexdigest() != checksum:
            raise ValueError("checksum mismatch (a torn or damaged write)")
        try:
            lines = io.BytesIO(zlib.decompress(body))
        except zlib.error as exc:
            raise ValueError(f"not compressed as written: {exc}") from None
        doc = json.loads(lines.readline())
        if doc["root"] != str(root):
            raise ValueError(f"written for root {doc['root']!r}")
        table = [(int(step), _row(row)) for step, row in doc["rows"]]
        prefix = str(root).rstrip("/") + "/"
        records: dict[str, Record] = {}
        checks: dict[tuple[str, Any, str], Check] = {}  # as saved -> the one Check object (`share_checks`)

        def check(name: Any, verdict: Any, detail: Any) -> Check:
            key = (str(name), verdict, str(detail))  # by text: 1, 1.0 and True are one dict key, not one str
            found = checks.get(key)
            if found is None:
                found = checks[key] = self.share_checks((Check(key[0], Verdict(verdict), key[2]),))[0]
            return found

        for raw in lines:  # a line at a time: its objects are made and kept, or freed, one by one
            rel, digest, verdicts, *summary = json.loads(raw)
            if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"bad checkpoint path {rel!r}")
            run = (prefix + rel).rpartition("/")[0]

            def history(items: list[tuple[int, Any]], run: str = run) -> Mapping[int, Any]:
                return self._history(run, items)

            decoded = {
                (str(kind), str(r)): _decode_verdict(kind, v, table, history) for kind, r, v in verdicts
            }
            rec = records[prefix + rel] = Record(bytes.fromhex(digest), decoded, whole=True, proven=False)
            if summary:
                _decode_checkpoint(rec, summary[0], check)
        return records


def _line(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _row(row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise TypeError("a history row is not an object")
    return row


class _RunHistory:
    """One run's log history, step by step in the order logged: what its checkpoints share."""

    __slots__ = ("index", "steps")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.index: dict[int, tuple[int, Any]] = {}  # step -> (its place in `steps`, its row)


class SharedHistory(Mapping[int, Any]):
    """A checkpoint's log history: the first `n` steps of its run's (`_RunHistory`)."""

    __slots__ = ("_h", "_n")

    def __init__(self, h: _RunHistory, n: int):
        self._h = h
        self._n = n

    def __getitem__(self, step: int) -> Any:
        at, row = self._h.index[step]
        if at >= self._n:
            raise KeyError(step)
        return row

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._h.steps, self._n)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"SharedHistory({dict(self)!r})"


def _encode_checkpoint(rec: Record) -> dict[str, Any] | None:
    """What `restorable` needs to give back the checkpoint without walking it, or None."""
    c = rec.checkpoint
    if c is None or not rec.dirs:
        return None
    ts = rec.verdicts.get((MemoryKind.TRAINER_STATE, "trainer_state.json"))
    if c.trainer_state is not None and (ts is None or ts[1] is not c.trainer_state):
        return None  # its trainer state is not among the verdicts (or not this one)
    if ts is not None and ts[1] is not None and len(ts[1].history) > MAX_PERSISTED_HISTORY:
        return None
    s = c.slim
    return {
        "fp": c.fingerprint,
        "size": c.size_bytes,
        "shared": [list(x) for x in c.shared],
        "newest": c.newest_mtime,
        "pinned": c.pinned,
        "ts": c.trainer_state is not None,
        "checks": [[k.name, k.verdict.value, k.detail] for k in c.checks if k.name not in (QUIET, STALL)],
        "slim": [s.slimmed, [list(r) for r in s.removable], s.weights, s.source, s.blocker, s.keeps, s.dtype],
        "consolidated": None if (w := s.consolidated) is None else [
            w.index, w.source, w.source_fingerprint, [list(f) for f in w.files], w.tool
        ],
        "saved_at": c.saved_at,
        "written_at": c.written_at,
        "touched_at": c.touched_at,
        "mounts": list(c.mounts),
        "holds": list(c.holds),
        "ranks": c.ranks,
        "kinds": None if c.kinds is None else sorted(c.kinds),
        "metrics": [[n, r.value, r.source] for n, r in c.metrics],
        "metric_problem": c.metric_problem,
        "ctx": rec.context,
        "dirs": [list(d) for d in rec.dirs],
    }


_NOWHERE = Path("/")  # a restored checkpoint's root until `Scanner.restore` gives it its own


def _decode_checkpoint(rec: Record, doc: dict[str, Any], check: Callable[[Any, Any, Any], Check]) -> None:
    ts = rec.verdicts.get((MemoryKind.TRAINER_STATE, "trainer_state.json"))
    if doc["ts"] and (ts is None or ts[1] is None):
        return
    slimmed, removable, weights, source, blocker, keeps, dtype = doc["slim"]
    # [path, bytes] pairs; null, false or 0 is refused (TypeError) as a loop over it would
    paths, sizes = zip(*removable, strict=True) if len(removable) else ((), ())
    w = doc["consolidated"]
    consolidated = None if w is None else ConsolidatedWeights(
        str(w[0]), str(w[1]), str(w[2]), tuple((str(p), int(n), str(h)) for p, n, h in w[3]), str(w[4])
    )
    rec.fingerprint = str(doc["fp"])
    rec.dirs = tuple((str(d[0]), *map(int, d[1:6])) for d in doc["dirs"])  # type: ignore[misc]
    rec.context = str(doc["ctx"])
    rec.checkpoint = Checkpoint(
        root=_NOWHERE,
        run=".",
        name="",
        step=0,
        layout="",  # the caller's: `Scanner.restore`
        checks=tuple(check(n, v, d) for n, v, d in doc["checks"]),
        size_bytes=int(doc["size"]),
        shared=tuple(Shared(*map(int, x)) for x in doc["shared"]),
        newest_mtime=float(doc["newest"]),
        fingerprint=rec.fingerprint,
        pinned=bool(doc["pinned"]),
        trainer_state=ts[1] if doc["ts"] else None,  # type: ignore[index]
        slim=Slimming(
            bool(slimmed),
            tuple(zip(map(str, paths), map(int, sizes), strict=True)),
            weights, source, blocker, str(keeps), consolidated, dtype,
        ),
        saved_at=float(doc["saved_at"]),
        written_at=float(doc["written_at"]),
        touched_at=float(doc["touched_at"]),
        mounts=tuple(str(m) for m in doc["mounts"]),
        holds=tuple(str(h) for h in doc["holds"]),
        ranks=None if doc["ranks"] is None else int(doc["ranks"]),
        kinds=None if (k := doc.get("kinds")) is None else frozenset(map(str, k)),
        metrics=tuple(
            (str(n), Reading(v if isinstance(v, str) else float(v), str(src))) for n, v, src in doc["metrics"]
        ),
        metric_problem=None if doc["metric_problem"] is None else str(doc["metric_problem"]),
    )


def _stamps(
    entries: list[Entry], content: Iterable[Entry], files: Mapping[Key, tuple[Identity, Any]]
) -> tuple[Stamp, ...]:
    """The stamps a restore checks: every directory (a file created, removed or renamed inside
    changes one), the checkpoint itself, and every file whose contents a decision rests on."""
    read = {rel for (kind, rel), (_, value) in files.items() if kind != MemoryKind.FILE or value is not None}
    read.update(e.rel for e in content)
    return tuple(
        (e.rel, e.dev, e.ino, e.size, e.mtime_ns, e.ctime_ns)
        for e in entries
        # "m": a mount point (unmounted, it stats otherwise)
        if e.kind in ("d", "m") or not e.rel or (e.kind == "f" and e.rel in read)
    )


# --- verdicts as JSON ------------------------------------------------------------------


def _encode_verdict(kind: str, value: Any, rows: dict[int, int], table: list[list[Any]]) -> Any:
    """JSON for one verdict; None where it is not worth keeping on disk (read again instead)."""
    if kind == MemoryKind.FILE:
        return value if isinstance(value, str) else None
    if kind == MemoryKind.WORLD:
        if isinstance(value, WorldSizes):
            return dataclasses.asdict(value)  # every field: a census depends on each (shards, bf16)
        return value if isinstance(value, str) else None
    if kind == MemoryKind.TRAINER_STATE:
        check, ts = value
        encoded: dict[str, Any] = {"name": check.name, "verdict": check.verdict.value, "detail": check.detail}
        if ts is not None:
            if len(ts.history) > MAX_PERSISTED_HISTORY:
                return None
            refs = []
            for step, row in ts.history.items():
                i = rows.get(id(row))
                if i is None:
                    i = rows[id(row)] = len(table)
                    table.append([step, row])
                refs.append(i)
            encoded["ts"] = [ts.global_step, ts.best_model_checkpoint, ts.best_metric, refs]
        return encoded
    if kind == MemoryKind.FRAMEWORK:
        return {"v": value}
    return None


def _decode_verdict(
    kind: str,
    value: Any,
    table: list[tuple[int, dict[str, Any]]],
    history: Callable[[list[tuple[int, Any]]], Mapping[int, Any]],
) -> Any:
    if kind == MemoryKind.FILE:
        if not isinstance(value, str):
            raise TypeError("a file verdict is not a string")
        return value
    if kind == MemoryKind.WORLD:
        if isinstance(value, str):
            return value
        if set(value) != _world_fields():  # written with other fields: not this version's verdict
            raise ValueError(f"world sizes with fields {sorted(value)}")
        return WorldSizes(**value)
    if kind == MemoryKind.TRAINER_STATE:
        check = Check(str(value["name"]), Verdict(value["verdict"]), str(value["detail"]))
        ts = None
        if "ts" in value:
            global_step, best, best_metric, refs = value["ts"]
            ts = TrainerState(global_step, best, best_metric, history([table[i] for i in refs]))
        return (check, ts)
    if kind == MemoryKind.FRAMEWORK:
        return value["v"]
    raise ValueError(f"unknown verdict kind {kind!r}")


@functools.cache
def _world_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(WorldSizes))


_LOGIC: str | None = None


_CODE_DIR = Path(__file__).resolve().parents[1]  # the ckptd package
LOGIC_MODULES = (
    "judge/evidence", "judge/wholefile", "model", "judge/slim", "discover/layouts",
    "volume/mounts", "decide/planner", "volume/volread", "judge/weights", "volume/space", "judge/attestation", "attest",
    "formatting",  # the sizes and ages a check's detail names (moved out of config/units.py)
)
# Packages whose every module is logic: each framework's save contract decides what a look finds;
# the config's models decide the patterns and the evidence a user names.
LOGIC_PACKAGES = ("frameworks", "config")


def logic_files() -> list[Path]:
    """The files `logic_version` digests: LOGIC_MODULES, and every module of LOGIC_PACKAGES."""
    modules = [_CODE_DIR / f"{name}.py" for name in LOGIC_MODULES]
    return modules + [path for pkg in LOGIC_PACKAGES for path in sorted((_CODE_DIR / pkg).glob("*.py"))]


def logic_version() -> str:
    """A digest of the code that produces and encodes verdicts: any change to it discards saved ones."""
    global _LOGIC
    if _LOGIC is None:
        h = hashlib.blake2b(__version__.encode(), digest_size=8)
        # Every module whose code decides what a look finds or what a restore gives back: the
        # checks, the layouts they follow, metrics, mount points, patterns, the restore itself.
        # Read as files beside this one, not imported: verdicts imports none of them.
        for path in logic_files():
            try:
                h.update(path.read_bytes())
            except OSError:
                h.update(path.name.encode())
        h.update(Path(__file__).read_bytes())
        _LOGIC = h.hexdigest()
    return _LOGIC


def cache_path(state_dir: Path, root: Path) -> Path:
    """Where the verdicts of `root` are saved: one file per root."""
    name = hashlib.blake2b(str(root).encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    return state_dir / f"verdicts-{name}.json"
