"""`Archiver`: one root's checkpoints copied to its store, each verified, the manifest written last.

For each checkpoint: its leftover multipart uploads (an attempt killed mid-file) are aborted, its
files listed with their identities (manifest.snapshot), the intent journaled; then each file is
uploaded with the CRC32C and SHA-256 computed from the bytes read, in that one read (in parts where
it is larger than part_size: memory is at most concurrency x part_size, whatever the checkpoint's
size), and checked: the store's HEAD must report the same size and CRC32C, of the full object, and
the file must have kept its identity while it was read. A file an earlier attempt left whole (same size, same CRC32C) is not
sent again. Then the checkpoint is listed again (nothing added, removed or changed), a file
changed within a timestamp tick of its read is read once more after that tick, and the manifest
written create-only. The journal records the outcome; a local record (state_dir/archive/)
says this ckptd computed the manifest's checksums from these very files (`gate.archive_problem`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptd.archive.manifest import (
    Digest,
    FileEntry,
    Identity,
    Manifest,
    NotArchivable,
    crc32c_b64,
    fd_digest,
    file_digest,
    file_key,
    identity,
    manifest_key,
    snapshot,
)
from ckptd.archive.store import Store, StoreError, object_url
from ckptd.archive.throttle import TokenBucket
from ckptd.config.archive import Archive
from ckptd.journal import Journal
from ckptd.model import Action, Checkpoint, State

log = logging.getLogger(__name__)

PAUSE_FIFO_ENV = "CKPTD_TEST_ARCHIVE_FIFO"  # tests: hold an upload after its first part (`_pause_for_tests`)
BACKOFF = (60.0, 3600.0)  # after a failed attempt: first wait, longest wait (seconds)
RACY_NS = 1_000_000_000  # above every local filesystem's timestamp tick (as verdicts.RACY_NS)
PROGRESS_EVERY = 60.0  # seconds between the log's progress lines of one long upload
RECORDS = "archive"  # under state_dir: one record per manifest this ckptd wrote or verified in full


class Changed(Exception):
    """A file changed (or went) while it was read for upload."""


def record_path(state_dir: Path, store_url: str, mkey: str) -> Path:
    digest = hashlib.sha256(f"{store_url}\0{mkey}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return state_dir / RECORDS / digest


def write_record(state_dir: Path | None, store_url: str, mkey: str, manifest: bytes) -> None:
    """Note that this ckptd computed `manifest`'s checksums from the files themselves."""
    if state_dir is None:
        return
    path = record_path(state_dir, store_url, mkey)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(hashlib.sha256(manifest).hexdigest())
        os.replace(tmp, path)
    except OSError as exc:  # only costs a full re-read at the gate
        log.warning("cannot write %s: %s", path, exc)


def has_record(state_dir: Path | None, store_url: str, mkey: str, manifest: bytes) -> bool:
    if state_dir is None:
        return False
    try:
        return record_path(state_dir, store_url, mkey).read_text() == hashlib.sha256(manifest).hexdigest()
    except OSError:
        return False


def _pause_for_tests() -> None:
    """Tests only: say this process is mid-upload (its pid into the FIFO named by the environment),
    then hold for at most a minute, for a test to kill it there."""
    fifo = os.environ.get(PAUSE_FIFO_ENV)
    if not fifo:
        return
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO if no test is listening: fail, never hang
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    threading.Event().wait(60)


class Unavailable:
    """A store that could not be made (boto3 missing, a client that cannot be built): every use
    says why, as a store that is down would."""

    def __init__(self, url: str, why: str):
        self.url = url
        self.why = why

    def key(self, *parts: str) -> str:
        return "/".join(parts)

    def __getattr__(self, name: str) -> Callable[..., object]:
        def refuse(*args: object, **kwargs: object) -> object:
            raise StoreError(self.why)

        return refuse


def archiver_for(root: object, journal: Journal | None, clock: Callable[[], float]) -> Archiver | None:
    """The archiver of a root with `[roots.archive]`, or None."""
    cfg: Archive | None = getattr(root, "archive", None)
    if cfg is None:
        return None
    from ckptd.archive.s3 import open_store

    try:
        store: Store = open_store(cfg)
    except StoreError as exc:
        store = Unavailable(cfg.url, str(exc))  # type: ignore[assignment]
    state_dir = journal.path.parent if journal is not None else None
    return Archiver(cfg, store, journal=journal, state_dir=state_dir, clock=clock)


def archiver_for_plan(root: object, state_dir: Path | None) -> Archiver:
    """A root's archiver for `plan` and `archive list`: no journal; the local records of an existing
    state_dir (a full re-read verified is noted there, as the verdict cache notes what was read)."""
    archiver = archiver_for(root, None, time.time)
    assert archiver is not None
    archiver.state_dir = state_dir if state_dir is not None and state_dir.is_dir() else None
    return archiver


class Archiver:
    """Archives one root's checkpoints to `store`; remembers why the last attempt at each failed."""

    def __init__(
        self,
        cfg: Archive,
        store: Store,
        *,
        journal: Journal | None,
        state_dir: Path | None,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.store = store
        self.journal = journal
        self.state_dir = state_dir
        self.clock = clock
        self.failures: dict[str, str] = {}  # rel -> why its last attempt failed
        self.retry_at: dict[str, tuple[float, float]] = {}  # rel -> (not before, the wait that gave)
        self.failing_since: dict[str, float] = {}  # rel -> when its first failed attempt in a row was
        # rel -> when it was first wanted and not yet archived (a retention that would delete it, or
        # 'on-complete'); gone once archived or no longer wanted. The metrics' pending checkpoints.
        self.pending_since: dict[str, float] = {}
        self.uploaded_bytes = 0
        self.throttle = TokenBucket(cfg.max_bandwidth) if cfg.max_bandwidth else None
        # Told each time a part or file is sent (or found whole): (rel, bytes done, bytes in all);
        # `ckptd prune` draws it on a terminal. The log says it every PROGRESS_EVERY of a long upload.
        self.on_progress: Callable[[str, int, int], None] | None = None
        self._progress_lock = threading.Lock()
        self._sending = _Sending("", 0, 0, 0.0)  # the checkpoint being uploaded

    def wanted(self, decisions: Sequence[object]) -> list[Checkpoint]:
        """The checkpoints to archive now: those about to be deleted or slimmed ('before-delete'),
        or every complete one ('on-complete')."""
        out = []
        for d in decisions:
            c = d.checkpoint  # type: ignore[attr-defined]
            act = d.action in (Action.DELETE, Action.SLIM)  # type: ignore[attr-defined]
            if act or (self.cfg.when == "on-complete" and c.state is State.COMPLETE):
                out.append(c)
        return out

    def archive_all(self, decisions: Sequence[object]) -> None:
        """Archive each checkpoint `wanted`; one whose last attempt failed waits (`BACKOFF`, doubling
        each time) before the next, so a store that is down is not asked at every pass."""
        now = self.clock()
        acting = {d.checkpoint.rel for d in decisions if d.action in (Action.DELETE, Action.SLIM)}  # type: ignore[attr-defined]
        wanted = self.wanted(decisions)
        self.pending_since = {c.rel: self.pending_since.get(c.rel, now) for c in wanted}
        for c in wanted:
            if now < self.retry_at.get(c.rel, (0.0, 0.0))[0]:
                continue
            why = self.archive(c, trust_record=c.rel not in acting)
            if why is None:
                self.pending_since.pop(c.rel, None)
                self.failures.pop(c.rel, None)
                self.retry_at.pop(c.rel, None)
                self.failing_since.pop(c.rel, None)
            else:
                self.failures[c.rel] = why
                self.failing_since.setdefault(c.rel, now)
                wait = min(BACKOFF[1], self.retry_at.get(c.rel, (0.0, BACKOFF[0] / 2))[1] * 2)
                self.retry_at[c.rel] = (now + wait, wait)
                log.warning("%s: not archived to %s (tried again in %ds): %s", c.rel, self.store.url, wait, why)

    def problem(self, c: Checkpoint, *, dry_run: bool = False) -> str | None:
        """Why `c` may not be deleted or slimmed now for want of a verified archive, or None
        (`gate.archive_problem`); None always where the archive is not required."""
        return self.problem_at(c.run, c.name, c.path, dry_run=dry_run)

    def problem_at(
        self, run: str, name: str, path: Path, *, dry_run: bool = False, part_removed: bool = False
    ) -> str | None:
        """`problem` of checkpoint `name` of `run` whose files are at `path` now: in its run, or in
        the trash, where the purge asks again just before the irreversible removal (`part_removed`:
        of what a purge killed halfway left, `gate.problem_at`)."""
        from ckptd.archive.gate import problem_at

        if not self.cfg.required:
            return None
        why = problem_at(self.store, run, name, path, self.state_dir, missing_ok=dry_run,
                         read_back=self.cfg.verify == "read-back" and not dry_run, part_removed=part_removed)
        last = self.failures.get(name if run == "." else f"{run}/{name}")
        if why is not None and last is not None and last not in why:
            why = f"{why} (its last attempt: {last})"
        return None if why is None else f"archive required: {why}"

    def _key(self, c: Checkpoint) -> str:
        return self.store.key(c.run, c.name)

    def archive(self, c: Checkpoint, *, trust_record: bool = False) -> str | None:
        """Archive `c` unless its manifest is there already; None once it is whole, else why not.
        `trust_record` (a checkpoint that stays, 'on-complete'): this ckptd's record that it wrote
        the manifest is enough, with no request to the store; one about to go is looked at there."""
        ckey = self._key(c)
        mkey = manifest_key(ckey)
        try:
            recorded = self.state_dir is not None and record_path(self.state_dir, self.store.url, mkey).exists()
            if trust_record and recorded:
                return None  # written or verified in full by this ckptd; the gate checks it before any deletion
            if self.store.head(mkey) is not None:
                return None  # the gate judges it
            return self._upload(c, ckey, mkey)
        except StoreError as exc:
            why = str(exc)
        except (NotArchivable, Changed) as exc:
            why = str(exc)
        except OSError as exc:
            why = f"cannot read it: {exc}"
        except Exception as exc:  # a bug, or a store's answer nobody foresaw: never a reason to delete
            log.exception("%s: archiving to %s failed", c.rel, self.store.url)
            why = f"archiving failed: {type(exc).__name__}: {exc}"
        self._record("archive-failed", c, why=why)
        return why

    def _upload(self, c: Checkpoint, ckey: str, mkey: str) -> str | None:
        is_file = c.path.is_file()
        for left in self.store.uploads(ckey if is_file else f"{ckey}/"):
            if is_file and left.key != ckey:
                continue  # another checkpoint's name that begins with this one's
            # An attempt killed mid-file: its parts cost money until aborted, and are redone.
            self.store.abort(left)
            log.info("aborted an unfinished upload of %s left by an earlier attempt", left.key)
        read_ns = time.time_ns()  # the filesystem's clock, not self.clock: compared with ctimes
        before = snapshot(c.path, key=f"{c.run}/{c.name}")
        total = sum(i[2] for i in before.files.values())
        self._record("archiving", c, key=ckey, files=len(before.files), bytes=total)
        started = self.clock()
        self._sending = _Sending(c.rel, total, 0, started)
        with ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="ckptd-archive") as pool:
            futures = {
                rel: pool.submit(self._one_file, c.path / rel if rel else c.path, file_key(ckey, rel), ident)
                for rel, ident in sorted(before.files.items())
            }
            entries = []
            for rel, fut in futures.items():
                d, sent = fut.result()
                ident = before.files[rel]
                entries.append(FileEntry(rel, file_key(ckey, rel), ident[2], d.crc32c, ident, d.sha256))
                self.uploaded_bytes += sent
        after = snapshot(c.path)
        if (what := before.differs(after)) is not None:
            raise Changed(f"changed while it was archived ({what}): tried again at the next pass")
        self._after_tick(c.path, entries, read_ns)
        manifest = Manifest(c.run, c.name, tuple(entries), before.dirs, before.is_file, self._meta(c))
        data = manifest.dumps()
        if not self.store.create_only(mkey, data):
            return None  # another writer's manifest: the gate judges it against these files
        write_record(self.state_dir, self.store.url, mkey, data)
        seconds = self.clock() - started
        self._record("archived", c, key=mkey, files=len(entries), bytes=total, seconds=round(seconds, 3))
        log.info("%s: archived to %s (%d files, %d bytes, verified)", c.rel, object_url(self.store, mkey),
                 len(entries), total)
        return None

    def _meta(self, c: Checkpoint) -> dict[str, object]:
        metrics: dict[str, object] = {name: r.value for name, r in c.metrics}
        if c.trainer_state is not None:  # the Trainer's log_history at its step
            metrics.update(c.trainer_state.history.get(c.step, {}))
        return {
            "framework": c.layout,
            "step": c.step,
            "unit": c.unit,
            "metrics": metrics,
            "verdict": {"state": str(c.state), "checks": [str(k) for k in c.checks]},
            "archived_at": self.clock(),
            "source": f"{socket.gethostname()}:{c.path}",
        }

    def _one_file(self, path: Path, key: str, ident: Identity) -> tuple[Digest, int]:
        """Upload one file unless an earlier attempt left it whole; check the store's copy and that
        the file kept `ident` while it was read. Its digest (CRC32C and SHA-256, of the bytes read
        for upload, in that one read), and the bytes sent."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if identity(os.fstat(fd)) != ident:
                raise Changed(f"changed before it was read ({path.name})")
            size = ident[2]
            there = self.store.head(key)
            if there is not None and there.size == size and there.crc32c is not None:
                d = fd_digest(fd)
                if there.crc32c == d.crc32c and there.checksum_type in (None, "FULL_OBJECT"):
                    self._unchanged(fd, path, ident)
                    self._advance(size)
                    # The object is taken as whole by the store's CRC32C (or read back by the gate
                    # where verify = "read-back"); the SHA-256 recorded is of the file's bytes.
                    return d, 0  # left whole by an earlier attempt
                os.lseek(fd, 0, os.SEEK_SET)
            if size <= self.cfg.part_size:
                data = _read(fd, size)
                d = Digest()
                d.update(data)
                self._throttle(len(data))
                self.store.put(key, data, d.crc32c)
                self._advance(len(data))
            else:
                d = self._multipart(fd, key, size)
            self._unchanged(fd, path, ident)
            there = self.store.head(key)
            if there is None:
                raise StoreError(f"{key} is not there after its upload")
            crc = d.crc32c
            if there.size != size or there.crc32c != crc or there.checksum_type not in (None, "FULL_OBJECT"):
                raise StoreError(
                    f"{key}: the store reports {there.size} bytes, CRC32C {there.crc32c} "
                    f"({there.checksum_type or 'single part'}), not the {size} bytes, CRC32C {crc} read here"
                )
            return d, size
        finally:
            os.close(fd)

    def _advance(self, n: int) -> None:
        """`n` more bytes of the current checkpoint sent (or found whole): told to `on_progress`,
        and logged once every PROGRESS_EVERY seconds of a long upload."""
        with self._progress_lock:
            p = self._sending
            p.done += n
            done, now = p.done, self.clock()
            say = now - p.logged >= PROGRESS_EVERY
            if say:
                p.logged = now
        if say:
            pct = 100 * done // p.total if p.total else 100
            log.info("%s: archiving to %s: %d of %d bytes sent (%d%%)", p.rel, self.store.url, done, p.total,
                     pct)
        if self.on_progress is not None:
            self.on_progress(p.rel, done, p.total)

    def _throttle(self, n: int) -> None:
        """`max_bandwidth`: wait until `n` more bytes may be sent (archive/throttle.py)."""
        if self.throttle is not None:
            self.throttle.take(n)

    def _multipart(self, fd: int, key: str, size: int) -> Digest:
        import crc32c

        upload_id = self.store.begin(key)
        etags: list[str] = []
        d = Digest()
        while d.size < size:
            data = _read(fd, min(self.cfg.part_size, size - d.size))
            d.update(data)
            self._throttle(len(data))
            etags.append(self.store.put_part(key, upload_id, len(etags) + 1, data,
                                             crc32c_b64(crc32c.crc32c(data))))
            self._advance(len(data))
            if len(etags) == 1:
                _pause_for_tests()
        self.store.complete(key, upload_id, etags, d.crc32c)
        return d

    def _after_tick(self, path: Path, entries: list[FileEntry], read_ns: int) -> None:
        """Each racily clean file read once more, after its timestamp tick is over: a file whose ctime
        is within RACY_NS before its read began (git's rule, as the verdict cache's) could be rewritten
        in that same tick after it was read, keeping its size, mtime and ctime, so that no identity
        tells. Once the tick is over, any later change moves its ctime; its bytes are compared now.
        Rare outside tests: a checkpoint is archived once it has been quiet for its quiet period.
        Waits at most RACY_NS (a volume clock ahead of this host's is not waited for: read now)."""
        # By ctime alone: any change moves it, utime included (an mtime set ahead changes nothing here)
        racy = [e for e in entries if read_ns - e.identity[4] < RACY_NS]
        if not racy:
            return
        last_ns = max(e.identity[4] for e in racy)
        wait_ns = min(RACY_NS, last_ns + RACY_NS - time.time_ns())
        if wait_ns > 0:
            time.sleep(wait_ns / 1e9)  # the filesystem's clock must move on: nothing to wait on but time
        for e in racy:
            fpath = path / e.path if e.path else path
            same = e.matches(file_digest(fpath))
            if not same or identity(os.stat(fpath, follow_symlinks=False)) != e.identity:  # after the read
                raise Changed(f"{e.path or path.name} was rewritten within its timestamp tick while it was "
                              "archived: tried again at the next pass")

    def _unchanged(self, fd: int, path: Path, ident: Identity) -> None:
        try:
            now = identity(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            raise Changed(f"{path.name} went while it was read") from None
        if identity(os.fstat(fd)) != ident or now != ident:
            raise Changed(f"{path.name} changed while it was read")

    def _record(self, event: str, c: Checkpoint, **fields: object) -> None:
        if self.journal is None:
            return
        try:
            self.journal.record(event, time=self.clock(), root=str(c.root), run=c.run, path=str(c.path),
                                step=c.step, store=self.store.url, **fields)
        except OSError as exc:
            log.error("cannot write the journal %s: %s", self.journal.path, exc.strerror)


@dataclass
class _Sending:
    """The upload in progress: its checkpoint, its bytes in all and done, when the log last said so."""

    rel: str
    total: int
    done: int
    logged: float


def _read(fd: int, n: int) -> bytearray:
    """Exactly `n` bytes from `fd`, read into one buffer (no copy: a part is up to part_size); a
    file that ends sooner changed while it was read."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                raise Changed("a file ended before its size: it changed while it was read")
            got += k
    finally:
        view.release()
    return buf
