"""The only module that deletes.

Deleting a checkpoint is two steps:
1. rename it into `<root>/.ckptd-trash/<unique>`: O(1) on one filesystem,
   and the checkpoint leaves its run atomically, so a trainer's auto-resume
   never sees half a checkpoint;
2. purge the trash, without following symlinks (`shutil.rmtree` works from
   directory file descriptors on Linux). Trash left by a crash is purged at
   the next start.

Just before the rename, every target is checked again, afresh from disk:
still inside its root with no symlink on the way, not a symlink itself,
still complete, unchanged since the plan was made (same fingerprint), still
quiet, not pinned, and the run's newest complete checkpoint (which the plan
kept) still there and complete. Any doubt and it is left alone.

The journal records the intent before the rename, and each outcome after.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ckptd.evidence import TooDeep, walk
from ckptd.journal import Journal
from ckptd.layouts import TRASH_DIR
from ckptd.model import Action, Checkpoint, State
from ckptd.planner import Scanner
from ckptd.policy import Decision

log = logging.getLogger(__name__)

DRY_RUN_NOTE = "(dry run; not actually removing anything)"

# Refuse to run on a platform whose rmtree would follow a symlink swapped in mid-purge.
assert shutil.rmtree.avoids_symlink_attacks or os.name != "posix"


class Outcome(StrEnum):
    TRASHED = "trashed"  # renamed into the trash; gone from its run
    REFUSED = "refused"  # a re-check failed; left where it is
    FAILED = "failed"  # the rename failed; left where it is
    DRY_RUN = "dry-run"  # would have been trashed


@dataclass(frozen=True)
class Result:
    decision: Decision
    outcome: Outcome
    detail: str
    trash_path: Path | None = None

    def line(self) -> str:
        return f"{self.outcome} {self.decision.checkpoint.rel}: {self.detail}"


class Reaper:
    def __init__(
        self,
        scanner: Scanner,
        journal: Journal | None,
        *,
        dry_run: bool,
        clock: Callable[[], float] = time.time,
    ):
        if not dry_run and journal is None:
            raise ValueError("a reaper that deletes needs a journal")
        self.scanner = scanner
        self.root = scanner.root.path
        self.journal = journal
        self.dry_run = dry_run
        self.clock = clock

    @property
    def trash(self) -> Path:
        return self.root / TRASH_DIR

    # --- re-checks -------------------------------------------------------

    def recheck(self, decision: Decision, anchor: Checkpoint | None) -> str | None:
        """Why `decision` must not be carried out now, or None if it may."""
        planned = decision.checkpoint
        if planned.root != self.root:
            return f"belongs to root {planned.root}, not {self.root}"
        path = planned.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return "no longer exists"
        if stat.S_ISLNK(st.st_mode):
            return "is a symlink"
        real_root = os.path.realpath(self.root)
        if os.path.realpath(path) != os.path.join(real_root, planned.rel):
            return f"reached through a symlink or outside {self.root} (resolves to {os.path.realpath(path)})"
        now = self.clock()
        fresh = self.scanner.reinspect(planned.run, planned.name, now=now)
        if fresh is None:
            return "no longer recognised as a checkpoint"
        if fresh.pinned:
            return "pinned"
        if fresh.state is not State.COMPLETE:
            return f"no longer complete ({fresh.state})"
        if fresh.fingerprint != planned.fingerprint:
            return "changed since the plan was made"
        # The plan kept the run's newest complete checkpoint; if that is gone, this
        # one may now be the newest, which is never deleted.
        if anchor is None or anchor.rel == planned.rel:
            return "it is its run's newest complete checkpoint"
        fresh_anchor = self.scanner.reinspect(anchor.run, anchor.name, now=now)
        if fresh_anchor is None or fresh_anchor.state is not State.COMPLETE:
            return f"the run's newest complete checkpoint {anchor.name} is gone or no longer complete"
        return None

    def execute(self, decisions: Sequence[Decision]) -> list[Result]:
        """Trash every deletion in `decisions` (one root's plan), each re-checked first."""
        anchors: dict[str, Checkpoint] = {}
        for d in decisions:
            c = d.checkpoint
            if c.state is State.COMPLETE and (
                c.run not in anchors or c.sort_key() > anchors[c.run].sort_key()
            ):
                anchors[c.run] = c
        return [
            self.trash_one(d, anchors.get(d.checkpoint.run))
            for d in decisions
            if d.action is Action.DELETE and d.checkpoint.root == self.root
        ]

    # --- acting ----------------------------------------------------------

    def trash_one(self, decision: Decision, anchor: Checkpoint | None) -> Result:
        """Re-check, then rename the checkpoint into the trash (or say what it would do).

        The rename goes through directory file descriptors opened from the root
        with O_NOFOLLOW, one component at a time: a run directory swapped for a
        symlink after the checks cannot redirect it outside the root.
        """
        c = decision.checkpoint
        fields = dict(
            root=str(self.root),
            run=c.run,
            path=str(c.path),
            step=c.step,
            bytes=c.size_bytes,
            reasons=list(decision.reasons),
        )

        def refuse(why: str) -> Result:
            self._record("refused", why=why, **fields)
            return Result(decision, Outcome.REFUSED, why)

        try:
            run_fd = open_dir_nofollow(self.root, c.run)
        except FileNotFoundError:
            return refuse("no longer exists")
        except OSError as exc:
            return refuse(f"reached through a symlink or not a directory: {c.run} ({exc.strerror})")
        try:
            before = _identity(c.name, run_fd)
            why_not = self.recheck(decision, anchor)
            if why_not is not None:
                return refuse(why_not)
            moved = _identity(c.name, run_fd) != before or not _still_at(self.root, c.run, run_fd)
            if before is None or moved:
                return refuse("moved or replaced while it was being checked")
            # What remains is a window of microseconds in which only the very checkpoint
            # verified above (this inode, in this directory) can be moved: nothing else.
            if self.dry_run:
                return Result(decision, Outcome.DRY_RUN, f"would move to {TRASH_DIR}/ and purge")
            target = _trash_name(c, self.clock())
            try:
                trash_fd = self._open_trash()
            except OSError as exc:
                why = f"cannot prepare {TRASH_DIR}/: {exc}"
                self._record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
            try:
                assert self.journal is not None
                self.journal.record("trashing", time=self.clock(), trash=str(self.trash / target), **fields)
                os.rename(c.name, target, src_dir_fd=run_fd, dst_dir_fd=trash_fd)
            except OSError as exc:  # ENOSPC on the journal; EXDEV, EACCES, EROFS, EBUSY on the rename
                why = f"cannot move to {TRASH_DIR}/: {exc}"
                self._record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
            finally:
                os.close(trash_fd)
        finally:
            os.close(run_fd)
        self._record("trashed", trash=str(self.trash / target), **fields)
        return Result(decision, Outcome.TRASHED, f"moved to {TRASH_DIR}/{target}", self.trash / target)

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        """Delete everything in the trash. Returns (entries purged, bytes freed).

        Works from a descriptor of the trash directory opened without following
        symlinks, and never follows one inside it. `stop` is asked between
        entries: a daemon shutting down leaves the rest for its next start.
        """
        if self.dry_run:
            return 0, 0
        try:
            trash_fd = open_dir_nofollow(self.root, TRASH_DIR)
        except FileNotFoundError:
            return 0, 0
        except OSError as exc:
            log.error("not purging %s: %s", self.trash, exc)
            return 0, 0
        count = freed = 0
        try:
            for entry in sorted(os.listdir(trash_fd)):
                if stop():
                    break
                size = _size(self.trash / entry)
                try:
                    st = os.stat(entry, dir_fd=trash_fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(entry, dir_fd=trash_fd)
                    else:
                        os.unlink(entry, dir_fd=trash_fd)
                except (OSError, RecursionError) as exc:
                    log.error("cannot purge %s: %s", self.trash / entry, exc)
                    continue
                count += 1
                freed += size
                log.debug("purged %s (%d bytes)", self.trash / entry, size)
                self._record(
                    "purged",
                    time=self.clock(),
                    root=str(self.root),
                    trash=str(self.trash / entry),
                    bytes=size,
                )
        finally:
            os.close(trash_fd)
        return count, freed

    def _open_trash(self) -> int:
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.mkdir(TRASH_DIR, 0o700, dir_fd=root_fd)
            except FileExistsError:
                pass
            return os.open(TRASH_DIR, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise OSError(exc.errno, f"{self.trash} exists and is not a directory") from None
            raise
        finally:
            os.close(root_fd)

    def _record(self, event: str, **fields: object) -> None:
        if self.journal is None or self.dry_run:
            return
        fields.setdefault("time", self.clock())
        try:
            self.journal.record(event, **fields)
        except OSError as exc:
            log.error("cannot write the journal %s: %s", self.journal.path, exc)


def _trash_name(c: Checkpoint, now: float) -> str:
    flat = c.rel.replace("/", "%")[-120:]
    return f"{int(now)}-{uuid.uuid4().hex[:8]}-{flat}"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_nofollow(root: Path, rel: str) -> int:
    """A descriptor of `root/rel`, opened one component at a time, refusing symlinks below the root.

    The root itself may be a symlink (it is configured); nothing under it may be.
    Raises OSError (ELOOP, ENOTDIR, ENOENT) otherwise.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [] if rel == "." else rel.split("/"):
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _identity(path: str, dir_fd: int | None = None) -> tuple[int, int] | None:
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _still_at(root: Path, rel: str, fd: int) -> bool:
    """Whether the directory `fd` is still what `root/rel` names, reached without symlinks."""
    try:
        again = open_dir_nofollow(root, rel)
    except OSError:
        return False
    try:
        a, b = os.fstat(fd), os.fstat(again)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        os.close(again)


def _size(path: Path) -> int:
    try:
        return sum(e.size for e in walk(path) if e.kind == "f")
    except TooDeep as exc:
        return sum(e.size for e in exc.entries if e.kind == "f")
    except OSError:
        return 0


class LockHeld(Exception):
    pass


class RootLock:
    """One deleter per root: an exclusive flock on a file in `state_dir`, keyed by the root.

    The kernel releases it when the holder exits, however it exits.
    """

    def __init__(self, state_dir: Path, root: Path):
        digest = hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:16]
        self.path = state_dir / "locks" / f"{digest}.lock"
        self.root = root
        self._fd: int | None = None

    def acquire(self, *, blocking: bool = False) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(f"another ckptd is deleting in {self.root} (holds {self.path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.root}\n".encode(errors="surrogateescape"))
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RootLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lower_priority() -> None:
    """Make the calling thread nice 19 and idle I/O class, so purging yields to training I/O.

    Both are per-thread on Linux (setpriority and ioprio_set take a thread id).
    Best effort: a sandbox may forbid either.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError as exc:
        log.debug("cannot lower CPU priority: %s", exc)
    number = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
    if number is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ioprio_who_process, ioprio_class_idle = 1, 3
        if libc.syscall(number, ioprio_who_process, tid, ioprio_class_idle << 13) != 0:
            log.debug("cannot set idle I/O priority: %s", os.strerror(ctypes.get_errno()))
    except OSError as exc:
        log.debug("cannot set idle I/O priority: %s", exc)
