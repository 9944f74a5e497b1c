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

from ckptd.evidence import walk
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
        """Re-check, then rename the checkpoint into the trash (or say what it would do)."""
        c = decision.checkpoint
        why_not = self.recheck(decision, anchor)
        fields = dict(
            root=str(self.root),
            run=c.run,
            path=str(c.path),
            step=c.step,
            bytes=c.size_bytes,
            reasons=list(decision.reasons),
        )
        if why_not is not None:
            log.warning("refusing to delete %s: %s", c.rel, why_not)
            self._record("refused", why=why_not, **fields)
            return Result(decision, Outcome.REFUSED, why_not)
        if self.dry_run:
            return Result(decision, Outcome.DRY_RUN, f"would move to {TRASH_DIR}/ and purge")
        target = self.trash / _trash_name(c, self.clock())
        try:
            self._ensure_trash()
            assert self.journal is not None
            self.journal.record("trashing", time=self.clock(), trash=str(target), **fields)
        except OSError as exc:
            why = f"cannot prepare {TRASH_DIR}/ or journal: {exc}"
            log.error("leaving %s in place: %s", c.path, why)
            return Result(decision, Outcome.FAILED, why)
        try:
            os.rename(c.path, target)
        except OSError as exc:  # EXDEV, EACCES, EROFS...: leave it, say why
            why = f"cannot move to {TRASH_DIR}/: {exc}"
            log.error("leaving %s in place: %s", c.path, why)
            self._record("failed", why=why, **fields)
            return Result(decision, Outcome.FAILED, why)
        self._record("trashed", trash=str(target), **fields)
        return Result(decision, Outcome.TRASHED, f"moved to {target.relative_to(self.root)}", target)

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        """Delete everything in the trash. Returns (entries purged, bytes freed).

        `stop` is asked between entries: a daemon shutting down leaves the rest
        for its next start.
        """
        if self.dry_run:
            return 0, 0
        try:
            st = os.lstat(self.trash)
        except FileNotFoundError:
            return 0, 0
        if not stat.S_ISDIR(st.st_mode):
            log.error("%s is not a directory; not purging it", self.trash)
            return 0, 0
        count = freed = 0
        for entry in sorted(os.listdir(self.trash)):
            if stop():
                break
            path = self.trash / entry
            size = _size(path)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError as exc:
                log.error("cannot purge %s: %s", path, exc)
                continue
            count += 1
            freed += size
            log.debug("purged %s (%d bytes)", path, size)
            self._record("purged", time=self.clock(), root=str(self.root), trash=str(path), bytes=size)
        return count, freed

    def _ensure_trash(self) -> None:
        try:
            os.mkdir(self.trash, 0o700)
        except FileExistsError:
            st = os.lstat(self.trash)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(f"{self.trash} exists and is not a directory") from None

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


def _size(path: Path) -> int:
    try:
        return sum(e.size for e in walk(path) if e.kind == "f")
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
