"""The volume lease as it is on the volume, in `<root>/.ckptd/`, and its I/O (`RecordIO`): the
files, what each write and read does, and why. The rules that decide who leads from it are
lease.py's.

The files:

- `leader.lock`: held with a POSIX lock (`lockf`, F_SETLK) for the whole tenure. NFSv4 (and v3
  with the NLM), Lustre mounted with `flock`, GPFS and CephFS enforce these across the cluster;
  where they do not (NFS `nolock` or `local_lock=posix|all`, a FUSE filesystem), the lock only
  keeps this host's processes apart and the lease below does the work. It is never relied on
  alone: a lock server can hand a lock on after a partition, and `nolock` succeeds everywhere.
- `epoch-<N>`: the claim of epoch N, created with O_CREAT|O_EXCL. Exclusive create is atomic
  on the server for NFSv3 and v4 (the Linux client sends an EXCLUSIVE CREATE with a verifier),
  and on Lustre, GPFS and CephFS: two standbys that decide to take over at once cannot both
  claim the same epoch. The holder of the highest epoch is the only one that may lead.
- `leader.json`: the lease record: the holder (host, pid, process start, a random id), the
  epoch, a wall-clock expiry, a renewal counter `seq`, the holder's duration and margin.
- `beat-<epoch>-<seq>`: each write of the record also makes a new name, for a client that caches
  a file's contents (`Seen.stale`).

What the filesystem must give for this to hold (why the record is written as it is):

- Atomic replacement: the record is written to a temp file, fsynced, closed, renamed over
  `leader.json`, and the directory fsynced. A reader sees the old record or the new one,
  never half of one: rename is atomic on the NFS server, and on Lustre, GPFS and CephFS.
- Fresh reads. NFS close-to-open consistency promises that an open() after another client's
  close() sees that client's data: the Linux client revalidates a file's attributes on every
  open (and drops cached pages when they changed). A rename, though, changes the directory,
  and a cached name may still lead to the old file until the directory's attributes are
  looked at again; so a reader first opens `.ckptd/` itself (an open revalidates a directory
  too, and a changed directory invalidates the names cached under it), then opens
  `leader.json` relative to that descriptor. Mounted `nocto`, none of this holds: volume
  leadership refuses to lead there (a daemon that cannot be sure deletes nothing). Lustre,
  GPFS and CephFS are cache-coherent (LDLM locks, tokens, caps): every read is fresh.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.locks import ROOT_LOCK, LockHeld, RootLock, RootLockUnavailable, lock_holders
from ckptd.removal.fs import open_private_dir

log = logging.getLogger(__name__)

RECORD = "leader.json"
LOCK = "leader.lock"
CLAIM_PREFIX = "epoch-"
BEAT_PREFIX = "beat-"  # beat-<epoch>-<seq>: each write of the record also makes a new name
PROBE_PREFIX = ".probe-"  # made and removed before a takeover (RecordIO.probe)
ENGINE_RECORD = "engine.json"  # an engine's token on the volume (etcdlease, kubelease), touched at renewals


def _process_start() -> float:
    """This process's start time, by the wall clock."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def holder_gone(holder: Holder, slack: float = 2.0) -> bool:
    """True when `holder` is a process of this host that no longer runs: its pid absent, or held by a
    process started more than `slack` seconds from the holder's start (the pid reused). False for a
    holder on another host, or when this host cannot tell."""
    if holder.host != socket.gethostname():
        return False
    try:
        ticks = int(Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return abs(time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK") - holder.start) > slack


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start: float  # the process's start, wall clock
    id: str  # random: tells this process from a later one with the same host and pid

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), round(_process_start(), 3), uuid.uuid4().hex)

    def describe(self) -> str:
        return f"{self.host} pid {self.pid}"


@dataclass(frozen=True)
class Record:
    """`leader.json`."""

    epoch: int
    holder: Holder
    expires: float  # wall clock
    renewed: float  # wall clock
    seq: int  # renewals at this epoch
    duration: float
    margin: float
    since: float = 0.0  # wall clock: when this epoch was taken
    released: bool = False

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes) -> Record:
        """Raises ValueError on anything that is not a whole record."""
        try:
            doc = json.loads(raw)
            holder = Holder(**doc.pop("holder"))
            rec = cls(holder=holder, **doc)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a lease record: {exc}") from None
        if not isinstance(rec.epoch, int) or not isinstance(rec.seq, int):
            raise ValueError("not a lease record: epoch and seq must be integers")
        for value in (rec.expires, rec.renewed, rec.duration, rec.margin, rec.since):
            if not isinstance(value, int | float):
                raise ValueError("not a lease record: times must be numbers")
        return rec


@dataclass(frozen=True)
class Seen:
    """One look at `.ckptd/`: the record as read (raw, and parsed if it parses), the highest claim,
    and the renewal the directory's names show (`beat-<epoch>-<seq>`)."""

    raw: bytes | None  # None: no record
    record: Record | None  # None: none, or it does not parse
    max_claim: int  # 0: none
    beat: tuple[int, int] | None = None  # (epoch, seq) of the newest beat entry; None: none

    @property
    def stale(self) -> bool:
        """Whether the record read is older than the renewal the directory shows: a read served
        from a cache (a FUSE mount with kernel_cache or a long attr/entry timeout)."""
        if self.beat is None or self.record is None:  # none, or unreadable: watched as before
            return False
        return (self.record.epoch, self.record.seq) < self.beat

    @property
    def epoch(self) -> int:
        return max(self.record.epoch if self.record else 0, self.max_claim)


class RecordIO:
    """The lease's I/O on the volume, one method per operation.

    This is the seam through which tests inject what a network filesystem does to the record
    (EIO, ESTALE): no filesystem that runs here can be made to fail one file on demand.
    """

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / LEASE_DIR
        self._lock_fd: int | None = None
        self._root_lock: RootLock | None = None  # on <root>/.ckptd/local.lock, while leading
        self.root_busy = False  # the last lock_root found it held by another process

    def _open_dir(self, create: bool = True) -> int:
        """`.ckptd/` opened afresh (an open revalidates the directory on NFS: see the module doc).

        Without `create`, raises FileNotFoundError when it is not there."""
        return open_private_dir(self.root, LEASE_DIR, 0o755, create=create, look_first=True)

    def read(self) -> Seen:
        try:
            dir_fd = self._open_dir(create=False)  # an observer (a dry run) writes nothing
        except FileNotFoundError:
            return Seen(None, None, 0)
        try:
            try:
                # O_NONBLOCK and a regular-file check: a FIFO planted here would block the open
                # forever (volread's rule, from a descriptor here).
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                fd = os.open(RECORD, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                raw = None
            else:
                try:
                    raw = os.read(fd, 1 << 16) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
                finally:
                    os.close(fd)
            names = os.listdir(dir_fd)
        finally:
            os.close(dir_fd)
        record = None
        if raw is not None:
            try:
                record = Record.parse(raw)
            except ValueError:
                pass
        claims = [c for c in map(_claim_number, names) if c is not None]
        beats = [b for b in map(_beat, names) if b is not None]
        return Seen(raw, record, max(claims, default=0), max(beats, default=None))

    def write(self, record: Record) -> None:
        """Atomically: a temp file, fsynced, renamed over the record, the directory fsynced."""
        dir_fd = self._open_dir()
        try:
            tmp = f".{RECORD}.{record.holder.id[:12]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
            try:
                os.write(fd, record.to_bytes())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, RECORD, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            # The renewal as a new name too: a client that caches a file's contents and the
            # lookup of its name (FUSE kernel_cache, entry_timeout) goes on returning the old
            # record, but a directory opened afresh is listed by the filesystem itself.
            beat = f"{BEAT_PREFIX}{record.epoch}-{record.seq}"
            with contextlib.suppress(FileExistsError):  # a release rewrites the last renewal's
                os.close(os.open(beat, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o644, dir_fd=dir_fd))
            for name in os.listdir(dir_fd):
                if name != beat and _beat(name) is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def probe(self, holder: Holder) -> None:
        """Create and remove a name in `.ckptd/`: a FUSE client that caches directory listings and
        contents (sshfs, rclone, s3fs, gcsfuse) drops what it holds for a directory it changes
        itself, so the look after this is the filesystem's own, not the cache's."""
        dir_fd = self._open_dir()
        try:
            name = f"{PROBE_PREFIX}{holder.id[:12]}"
            with contextlib.suppress(FileExistsError):
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                os.close(os.open(name, flags, 0o644, dir_fd=dir_fd))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def claim(self, epoch: int, holder: Holder) -> bool:
        """Create `epoch-<N>` exclusively; False if another host claimed it first."""
        dir_fd = self._open_dir()
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(f"{CLAIM_PREFIX}{epoch}", flags, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                return False
            try:
                os.write(fd, f"{holder.host} {holder.pid} {holder.id}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dir_fd)
            return True
        finally:
            os.close(dir_fd)

    def forget_claims_before(self, epoch: int) -> None:
        dir_fd = self._open_dir()
        try:
            for name in os.listdir(dir_fd):
                n = _claim_number(name)
                if n is not None and n < epoch:
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(dir_fd)

    def lock(self) -> str | None:
        """Take the POSIX lock on `leader.lock`: None if taken (or locks are not available
        here, which the lease covers), else who has it."""
        if self._lock_fd is not None:
            return None
        dir_fd = self._open_dir()
        try:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return "another process holds its lock"
            # ENOLCK: NFS without a lock manager; ENOSYS: Lustre mounted noflock (its default).
            if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                log.info("%s: no POSIX locks here (%s): the lease alone decides", self.dir, exc.strerror)
                return None
            raise
        self._lock_fd = fd
        return None

    def unlock(self) -> None:
        # Closing the descriptor drops the POSIX lock (and every POSIX lock this process holds
        # on the file: nothing else in ckptd opens it).
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def lock_root(self) -> str | None:
        """Take `<root>/.ckptd/local.lock` (`locks.RootLock`, the root's own lock alone) for the
        tenure: a ckptd with `leadership = "local"` holds it while it deletes here, and the two
        must never both delete. None if taken (or on a read-only root: the lease alone decides),
        else why not."""
        if self._root_lock is None:
            self._root_lock = RootLock(None, self.root)
        self.root_busy = False
        if self._root_lock.held:
            return None
        try:
            self._root_lock.acquire()
        except RootLockUnavailable as exc:
            return str(exc)
        except LockHeld:
            self.root_busy = True  # another process holds it (not: it cannot be taken at all)
            return (f"a ckptd with leadership = \"local\" deletes here (it holds "
                    f"{self._root_lock.root_path}): every ckptd that deletes in a root must use the same "
                    "leadership")
        return None

    def unlock_root(self) -> None:
        if self._root_lock is not None:
            self._root_lock.release()

    @property
    def locked(self) -> bool:
        """Whether this process holds both of the tenure's locks (a leader that took over from a
        frozen holder has neither until that holder lets go: `VolumeLease._take_locks`)."""
        return self._lock_fd is not None and self._root_lock is not None and self._root_lock.held

    def lock_pids(self) -> tuple[set[int], set[int]]:
        """The processes of this host that hold `leader.lock` and `<root>/.ckptd/local.lock`
        (`locks.lock_holders`: empty sets mean held from another host, or free)."""
        lead, root = lock_holders(self.dir / LOCK, self.dir / ROOT_LOCK)
        return lead, root


def _beat(name: str) -> tuple[int, int] | None:
    if not name.startswith(BEAT_PREFIX):
        return None
    epoch, _, seq = name[len(BEAT_PREFIX):].partition("-")
    return (int(epoch), int(seq)) if epoch.isdigit() and seq.isdigit() else None


def _claim_number(name: str) -> int | None:
    if name.startswith(CLAIM_PREFIX) and name[len(CLAIM_PREFIX):].isdigit():
        return int(name[len(CLAIM_PREFIX):])
    return None


def read_engine_record(root: Path) -> dict[str, Any] | None:
    """The volume's record of the engine's token, or None (none, or not one)."""
    try:
        doc = json.loads((root / LEASE_DIR / ENGINE_RECORD).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("epoch"), int) else None


def write_engine_record(root: Path, doc: dict[str, Any]) -> None:
    """Atomically: a temp file, fsynced, renamed over the record, the directory fsynced."""
    lease_dir = root / LEASE_DIR
    tmp = lease_dir / f".{ENGINE_RECORD}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (json.dumps(doc, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, lease_dir / ENGINE_RECORD)
    dir_fd = os.open(lease_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _names_leader(rec: dict[str, Any] | None, epoch: int, holder_id: str, key: str) -> bool:
    """Whether an `engine.json` names the token `epoch` of `key` and the holder `holder_id`."""
    return rec is not None and rec.get("epoch") == epoch and rec.get("key") == key \
        and (rec.get("holder") or {}).get("id") == holder_id


def engine_record_refusal(root: Path, epoch: int, holder_id: str, key: str) -> str | None:
    """For an engine's leader before a rename: why the volume's record (`engine.json`) does not
    name its token `epoch` of `key` and its holder, or None where it does."""
    rec = read_engine_record(root)
    if not _names_leader(rec, epoch, holder_id, key):
        other = (f"{rec.get('backend')} {rec.get('key')} token {rec.get('epoch')}" if rec
                 else "no readable record")
        return f"the volume's record ({LEASE_DIR}/{ENGINE_RECORD}) no longer names token {epoch} ({other})"
    return None


def engine_leadership_ended(root: Path, epoch: int, holder_id: str, key: str) -> None:
    """For an engine's leader that stops cleanly (etcd's and the Lease's `release`): `engine.json`
    marked released where it still names its token `epoch` of `key` and its holder, so that a ckptd
    configured otherwise need not wait for the record to go stale (`engine_record_live`). A record
    another leader wrote since is left as it is; one that cannot be written goes stale by itself."""
    rec = read_engine_record(root)
    if rec is not None and _names_leader(rec, epoch, holder_id, key):
        with contextlib.suppress(OSError):
            write_engine_record(root, {**rec, "released": True})


def engine_record_live(root: Path, margin: float, now: float | None = None) -> dict[str, Any] | None:
    """`engine.json` while its holder renews (it touches the file at each renewal, so a
    modification time within the holder's duration plus `margin` is a live one) and has not
    handed the lead back; else None."""
    path = root / LEASE_DIR / ENGINE_RECORD
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    rec = read_engine_record(root)
    if rec is None or rec.get("released") is True:
        return None
    duration = rec.get("duration") if isinstance(rec.get("duration"), int | float) else 30.0
    if (time.time() if now is None else now) > mtime + duration + margin:
        return None
    return rec


def passed_over_pids(rec: dict[str, Any] | None, host: str) -> set[int]:
    """The processes of `host` holding `local.lock` that the leader `rec` (an `engine.json`) names
    passed over at its take: frozen earlier leaders, whose engine lease had ended. Its successor may
    pass over the same ones (they are no ckptd with `leadership = "local"` nor a prune)."""
    doc = (rec or {}).get("passed_over")
    if not isinstance(doc, dict) or doc.get("host") != host or not isinstance(doc.get("pids"), list):
        return set()
    return {pid for pid in doc["pids"] if isinstance(pid, int) and not isinstance(pid, bool)}


def passed_over_doc(host: str, pids: Iterable[int]) -> dict[str, Any]:
    """`engine.json`'s `passed_over`, as `passed_over_pids` reads it."""
    return {"passed_over": {"host": host, "pids": sorted(pids)}} if pids else {}


def engine_leader_seen(root: Path, margin: float, now: float | None = None) -> str | None:
    """Who leads `root` by an engine (etcd, Kubernetes), as a live `engine.json` says (`engine_record_live`),
    or None. For a volume lease's holder and a ckptd with `leadership = "local"`, which must not
    delete beside it."""
    rec = engine_record_live(root, margin, now)
    if rec is None:
        return None
    holder = rec.get("holder") or {}
    return (f"{holder.get('host')} pid {holder.get('pid')} leads {root} by {rec.get('backend')} (token "
            f"{rec.get('epoch')}): every ckptd that deletes in a root must use the same leadership")


def volume_lease_live(root: Path, now: float | None = None) -> str | None:
    """Who holds `root`'s volume lease while it is live by its record, or None. For a leader by an
    engine (etcd), which must not delete beside it."""
    try:
        rec = RecordIO(root).read().record
    except OSError as exc:
        return f"cannot read {LEASE_DIR}/{RECORD}: {exc}"
    if rec is None or rec.released or (time.time() if now is None else now) > rec.expires + rec.margin:
        return None
    return (f"{rec.holder.describe()} leads {root} under a volume lease (epoch {rec.epoch}): every ckptd "
            "that deletes in a root must use the same leadership")
