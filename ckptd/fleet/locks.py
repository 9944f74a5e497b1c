"""One deleter per root on this host: `RootLock`, the flocks every ckptd that deletes in a root
takes, in its `state_dir` and in `<root>/.ckptd/local.lock`. The local leadership is that lock
(`lease.LocalLeadership`); a volume lease's leader holds the root's own for its tenure
(`leaserecord.RecordIO.lock_root`), and so does a leader by an engine (`take_root_lock`, the rule
for a frozen, lapsed leader's hold that etcd's and the Lease's leaders share).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptd.discover import layouts
from ckptd.removal.fs import open_private_dir

log = logging.getLogger(__name__)


class LockHeld(Exception):
    pass


class RootLockHeld(LockHeld):
    """The root's own lock (`<root>/.ckptd/local.lock` or the root directory's flock) is held by
    another process: not the state_dir lock, nor a live root above this one."""


class RootLockUnavailable(LockHeld):
    """`<root>/.ckptd/local.lock` cannot be taken, on a root that is not read-only: deleting
    there could go on beside a ckptd with another state_dir, so nobody here deletes."""


ROOT_LOCK = layouts.ROOT_LOCK_FILE.rpartition("/")[2]  # in <root>/.ckptd/: the lock every ckptd on this host deleting in the root takes


class RootLock:
    """One deleter per root: an exclusive flock on a file in `state_dir`, keyed by the root, and
    one on `<root>/.ckptd/local.lock`, the root's own.

    The first alone let a prune with another state_dir (a user's cron, a sidecar with its own
    state volume) delete beside the daemon leading the root: the second is the same
    file for every ckptd on this host, whatever its state_dir or its spelling of the root. It is
    taken where it can be: a root on a read-only filesystem (where nothing is deleted anyway) has
    the state_dir lock alone, and so, with a warning, has a full one where the lock was never made
    (it is made at the first run with room, and stays). Anything else that keeps it from being
    taken (`.ckptd` a file, not ours to write, the lock not a regular file, a flock refused)
    raises `RootLockUnavailable`: the state_dir lock alone would let two ckptds delete at once.
    The kernel releases both when the holder exits, however it exits.

    A root inside a live ckptd's root (X/root/run below a daemon's X/root, whatever either's
    state_dir) is that one's territory: not taken while it holds its lock (`_no_live_root_above`).
    The enclosing one, for its part, leaves a root nested in it alone (`discover.find_runs`).

    Without a `state_dir`, the root's own lock alone: what a volume lease's leader holds for its
    tenure (`VolumeLease`), so that it and a ckptd with `leadership = "local"` exclude each
    other. On NFS the Linux client sends a flock to the server as a whole-file POSIX lock, so
    this holds across hosts there too; on a FUSE filesystem it holds on this host only.
    """

    def __init__(self, state_dir: Path | None, root: Path):
        digest = hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:16]
        self.path = state_dir / "locks" / f"{digest}.lock" if state_dir is not None else None
        self.root = root
        self.root_path = root / layouts.LEASE_DIR / ROOT_LOCK
        self._fd: int | None = None
        self._root_fd: int | None = None
        self._dir_fd: int | None = None  # the root directory itself, flocked beside local.lock
        self._held = False

    def acquire(self, *, blocking: bool = False) -> None:
        fd = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                raise LockHeld(f"another ckptd is deleting in {self.root} (holds {self.path})") from None
        root_fd = dir_fd = None
        try:
            # First, so that one refused makes no .ckptd/ here (the enclosing one would skip it).
            self._no_live_root_above()
            root_fd = self._root_lock(blocking)
            dir_fd = self._dir_lock(blocking) if root_fd is not None else None
            self._no_live_root_above()  # again: one started in between finds this .ckptd/ and stays out
        except BaseException:
            for opened in (fd, root_fd, dir_fd):
                if opened is not None:
                    os.close(opened)
            raise
        if fd is not None:
            # Who holds it, for a person reading the file; the flock is what excludes. On a full
            # disk (state_dir on the very volume to be freed) the line may need a block there is
            # not: left out, or the prune that would free it could not start.
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {self.root}\n".encode(errors="surrogateescape"))
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    for opened in (fd, root_fd, dir_fd):
                        if opened is not None:
                            os.close(opened)
                    raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
                log.warning("%s: no room for the holder's pid line (%s); the lock holds all the same",
                            self.path, exc.strerror)
        self._fd, self._root_fd, self._dir_fd, self._held = fd, root_fd, dir_fd, True

    def _root_lock(self, blocking: bool) -> int | None:
        """The flock on `<root>/.ckptd/local.lock` (None where it cannot be had: see the class).
        Opened without following a symlink planted for `.ckptd` or the lock."""
        try:
            dir_fd = open_private_dir(self.root, layouts.LEASE_DIR, 0o755)
            try:
                fd = os.open(ROOT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             0o644, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                log.debug("%s: no lock in the root itself (%s): the state_dir lock alone", self.root, exc)
                return None
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self.path is not None:
                # A full disk, the very occasion min_free exists for, with no lock made here while
                # there was room: refusing would leave it full. Said, not silent.
                log.warning("%s: cannot create %s (%s): only the state_dir lock %s excludes other "
                            "ckptds here; one with another state_dir could delete at the same time",
                            self.root, self.root_path, exc.strerror, self.path)
                return None
            raise self._unavailable(exc.strerror) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self._unavailable("not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise RootLockHeld(f"another ckptd is deleting in {self.root} (holds {self.root_path})") from None
        except RootLockUnavailable:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise self._unavailable(exc.strerror) from None
        return fd

    def _dir_lock(self, blocking: bool) -> int | None:
        """A flock on the root directory itself: what `rm -rf <root>/.ckptd` cannot take away, so
        that a ckptd with another state_dir stays out while this one lives even then (it would
        make a new local.lock and lock that). None where the filesystem has no flock on a
        directory (NFS turns a flock into a POSIX lock, which needs a file open for writing):
        local.lock alone there, as before."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise RootLockHeld(f"another ckptd is deleting in {self.root} (holds the directory's lock)") \
                from None
        except OSError as exc:
            os.close(fd)
            log.debug("%s: no flock on the directory (%s): %s alone", self.root, exc.strerror, self.root_path)
            return None
        return fd

    def _no_live_root_above(self) -> None:
        """LockHeld if a directory above the root is the root of a live ckptd: one holds its
        `.ckptd/local.lock` (asked with a shared flock, let go at once). That one deletes here,
        with its own pins and trash. Asked before this root's own `.ckptd/` is made (a refused
        ckptd leaves no mark that would make the enclosing one skip this root) and again after,
        so that one, if it starts later, finds it and leaves this root alone (`discover.find_runs`);
        nothing need be held. A lock that cannot be opened or flocked (none there, a filesystem without
        flock) says nothing more than its absence."""
        for above in Path(os.path.realpath(self.root)).parents:
            lock = above / layouts.LEASE_DIR / ROOT_LOCK
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeld(f"{self.root} is inside {above}, the root of a live ckptd (it holds {lock}): "
                               "that one deletes here") from None
            except OSError as exc:
                log.debug("%s: no flock on %s (%s)", self.root, lock, exc.strerror)
            finally:
                os.close(fd)

    def footing(self) -> str | None:
        """Why the files this lock holds are no longer the ones at its paths (removed, replaced: a
        ckptd with another state_dir would lock a new file there and delete beside this one), or None."""
        if not self._held:
            return None
        for fd, path in ((self._root_fd, self.root_path), (self._fd, self.path)):
            if fd is not None and path is not None and (why := _not_the_file(fd, path)) is not None:
                return f"{path}, the lock this ckptd holds, {why}"
        return None

    def retake(self) -> None:
        """Lock again, afresh, what `footing` says was lost (LockHeld: another process holds the
        new file; RootLockUnavailable, OSError: it cannot be made). Safe while the directory lock
        is held: no ckptd that takes this lock can have entered since."""
        if self._root_fd is not None and _not_the_file(self._root_fd, self.root_path) is not None:
            fd = self._root_lock(blocking=False)
            os.close(self._root_fd)
            self._root_fd = fd
        if self._fd is not None and self.path is not None and _not_the_file(self._fd, self.path) is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockHeld(f"another ckptd holds {self.path}") from None
            os.close(self._fd)
            self._fd = fd

    def _unavailable(self, why: str) -> RootLockUnavailable:
        return RootLockUnavailable(
            f"cannot take {self.root_path} ({why}): deleting nothing in {self.root}, since a ckptd with "
            f"another state_dir could delete there at the same time; make {self.root / layouts.LEASE_DIR} "
            "a directory ckptd can write"
        )

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        self._held = False
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RootLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holders(*paths: Path) -> list[set[int]]:
    """For each path, the processes of this host that hold a lock on it (flock or POSIX), by the
    kernel's table of locks (/proc/locks: each granted lock's kind, pid and major:minor:inode).
    Another host's locks are not in it (an NFS server's lock manager or a cluster filesystem
    keeps those), so an empty set means: held from another host, or free. A path that cannot be
    looked at has an empty set."""
    wanted: dict[tuple[int, int, int], int] = {}
    for i, path in enumerate(paths):
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        wanted[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = i
    pids: list[set[int]] = [set() for _ in paths]
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return pids
    for line in table:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # "->": a waiter, not a holder
            continue
        pid, where = fields[4], fields[5].split(":")
        if not pid.isdigit() or len(where) != 3:
            continue
        try:
            key = (int(where[0], 16), int(where[1], 16), int(where[2]))
        except ValueError:
            continue
        if key in wanted:
            pids[wanted[key]].add(int(pid))
    return pids


def root_lock_holders(root: Path) -> set[int]:
    """The processes of this host that hold the root's own lock (`RootLock`: the root directory's
    flock or `<root>/.ckptd/local.lock`), by the kernel's table (`lock_holders`: nothing is tried,
    so nobody's lock is disturbed); empty where none does or it cannot be seen."""
    return set().union(*lock_holders(root, root / layouts.LEASE_DIR / ROOT_LOCK))


@dataclass(frozen=True)
class LapsedLeader:
    """A leader by an engine (etcd, Kubernetes) whose lease has ended (etcd let go of its key, its
    Lease went unrenewed), as the engine or the volume's `engine.json` names it; `passed_over`: the
    frozen leaders it had passed over in turn (`engine.json`'s `passed_over`: their leases ended
    before its)."""

    host: str | None
    pid: object
    passed_over: frozenset[int] = frozenset()

    def describe(self) -> str:
        return f"{self.host} pid {self.pid}"

    def alone_holds(self, held: set[int], host: str) -> bool:
        """Whether `held`, this host's holders of the root's lock by its lock table, are this leader
        or frozen ones it passed over, with this leader on `host`; or, none showing here, whether
        this leader is on another host (a lock held from there is not in this host's table)."""
        if held:
            return self.host == host and held <= {self.pid} | self.passed_over
        return self.host is not None and self.host != host


@dataclass(frozen=True)
class PassedOver:
    """The root's lock found held by a lapsed leader alone, and passed over at a take: by which
    processes (recorded in `engine.json`'s `passed_over` until the new leader holds it), and who."""

    pids: frozenset[int]
    who: str


def take_root_lock(lock: RootLock, lapsed: Callable[[], LapsedLeader | None], host: str, *,
                   lease: str) -> tuple[str | None, PassedOver | None]:
    """For a leader by an engine at its take: the root's own lock (`lock`, without a state_dir) for
    its tenure, as a volume lease's leader holds it (`RecordIO.lock_root`), so that it and a ckptd
    with `leadership = "local"` or a prune exclude each other. (None, None): taken. (why, None): not.

    (None, PassedOver): held only by the leader whose `lease` ended (`lapsed()`, asked once the lock
    is found held; None where there is none), as `LapsedLeader.alone_holds` says. A process frozen
    by SIGSTOP, a debugger or a hung mount keeps its locks until it exits; when it runs again its
    renewal and its fence find the lead gone. The rule is the volume lease's
    (`lease.VolumeLease._take_locks`); the new leader takes the lock at a later renewal, once free."""
    try:
        lock.acquire()
        return None, None
    except RootLockHeld as exc:
        held = root_lock_holders(lock.root)
        leader = lapsed()
        if leader is None or not leader.alone_holds(held, host):
            pids = ", ".join(map(str, sorted(held))) or "(another host)"
            return (f"{exc}: held by pid {pids}, neither the lapsed leader's nor a frozen one it passed "
                    "over: a ckptd with leadership = \"local\" or a prune deletes here (every ckptd that "
                    "deletes in a root must use the same leadership), or a leader that is still live"), None
        log.warning("%s: %s, whose %s ended, still holds the root's lock (a frozen process: SIGSTOP, a "
                    "debugger, a hung mount): taking over; its fence refuses its renames when it runs again",
                    lock.root, leader.describe(), lease)
        return None, PassedOver(frozenset(held), leader.describe())
    except (RootLockUnavailable, LockHeld) as exc:
        return str(exc), None


def _not_the_file(fd: int, path: Path) -> str | None:
    """Why `path` no longer names the file open at `fd`, or None."""
    held = os.fstat(fd)
    try:
        now = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # it, or the directory it was in
        return "was removed"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror})"
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return "was replaced by another file"
    return None
