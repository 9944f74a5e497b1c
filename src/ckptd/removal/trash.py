"""Trashing: a checkpoint renamed into `<root>/.ckptd-trash/<unique>`, O(1) on one filesystem, so it
leaves its run atomically and a trainer's auto-resume never sees half a checkpoint. The journal
records the intent before the rename and the outcome after. A rename found made without the lease
(the fence asked again just after), or onto a checkpoint pinned after all, is undone (`_undo`).

The trash's names say where each entry came from (`_trash_name`, `_trash_origin`), for a purge that
re-checks an entry another process trashed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path

from ckptd.journal import Journal
from ckptd.layouts import HIDDEN_TRASH, TRASH_DIR
from ckptd.model import Checkpoint
from ckptd.policy import Decision
from ckptd.removal.fs import (
    _DIR_FLAGS,
    _another_filesystem,
    _identity,
    _pinned_at,
    _rename_noreplace,
    _still_at,
    open_dir_nofollow,
)
from ckptd.removal.outcome import Anchors, Outcome, Result

log = logging.getLogger(__name__)

REVIEW = "%review"  # a trash entry's suffix: never purged (`Trashing._undo`)


class Trashing:
    """Part of `Reaper` (removal/reaper.py): a checkpoint into the trash, and back where a rename
    was made without the lease."""

    root: Path
    journal: Journal | None
    dry_run: bool
    clock: Callable[[], float]
    _finished: set[str]

    @property
    def trash(self) -> Path:
        return self.root / TRASH_DIR

    def trash_one(self, decision: Decision, anchors: Anchors) -> Result:
        """Re-check, then rename the checkpoint into the trash (or say what it would do).

        The rename goes through directory file descriptors opened from the root
        with O_NOFOLLOW, one component at a time: a run directory swapped for a
        symlink after the checks cannot redirect it outside the root.
        """
        c = decision.checkpoint
        fields = self._fields(decision, c.size_bytes)

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
            why_not = self.recheck(decision, anchors)
            if why_not is not None:
                return refuse(why_not)
            moved = _identity(c.name, run_fd) != before or not _still_at(self.root, c.run, run_fd)
            if before is None or moved:
                return refuse("moved or replaced while it was being checked")
            # What remains is a window of microseconds in which only the very checkpoint
            # verified above (this inode, in this directory) can be moved: nothing else.
            if self.dry_run:
                return Result(decision, Outcome.DRY_RUN, f"would move to {TRASH_DIR}/ and purge")
            why_not = self._fenced()
            if why_not is not None:
                return refuse(why_not)
            target = _trash_name(c, self.clock())
            try:
                trash_fd = self._open_trash()
                into = self.trash
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    why = f"cannot prepare {TRASH_DIR}/: {exc}"
                    self._record("failed", why=why, **fields)
                    return Result(decision, Outcome.FAILED, why)
                # No room for a directory, on the very occasion min_free exists for: a rename needs
                # no new block or inode. Into the root under a hidden name the purge recognises
                # (HIDDEN_TRASH), at this pass or the next start.
                trash_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                into, target = self.root, f"{HIDDEN_TRASH}{target}"
            try:
                assert self.journal is not None
                try:  # the intent first: a crash after the rename must find it in the journal
                    self.journal.record("trashing", time=self.clock(), trash=str(into / target), **fields)
                except OSError as exc:  # ENOSPC with state_dir on the full volume
                    why = f"not moved: the journal records each move first, and cannot be written ({exc})"
                    self._record("failed", why=why, **fields)
                    return Result(decision, Outcome.FAILED, why)
                try:
                    os.rename(c.name, target, src_dir_fd=run_fd, dst_dir_fd=trash_fd)
                except OSError as exc:  # EXDEV, EACCES, EROFS, EBUSY
                    why = f"cannot move to {TRASH_DIR}/: {exc}"
                    self._record("failed", why=why, **fields)
                    return Result(decision, Outcome.FAILED, why)
                # Asked again: a process stopped between the fence above and the rename (SIGSTOP,
                # a paused VM, a hung mount) renames after its lease ran out, maybe after the new
                # leader saw the checkpoint pinned. Not held at that epoch now: undone.
                why_not = self._fenced(after=True)
                if why_not is not None:
                    undone = self._undo(target, trash_fd, c.name, run_fd, c.rel, why_not)
                    return refuse(f"{why_not}; {undone}")
                # Looked at once more under its new name, which no cache has seen: a FUSE client
                # that caches listings (sshfs, rclone, s3fs, gcsfuse) showed the re-check above
                # its listing from before a pin written on another host.
                why_not = _pinned_at(target, trash_fd)
                if why_not is not None:
                    undone = self._undo(target, trash_fd, c.name, run_fd, c.rel, why_not,
                                        how="on a stale look")
                    return refuse(f"{why_not}; {undone}")
                self._finished.add(target)
            finally:
                os.close(trash_fd)
        finally:
            os.close(run_fd)
        self._record("trashed", trash=str(into / target), **fields)
        shown = f"{TRASH_DIR}/{target}" if into == self.trash else f"{target} (no room for {TRASH_DIR}/)"
        return Result(decision, Outcome.TRASHED, f"moved to {shown}", into / target)

    def _undo(self, name: str, trash_fd: int, back: str, back_fd: int, rel: str, why: str, *,
              review: bool = True, how: str = "without the lease") -> str:
        """Move `name` (under `trash_fd`) back to `back` (under `back_fd`), where a rename made
        without the lease took it from; never over what is there now. Where that name is taken,
        it stays in the trash, renamed `<name>%review` (`review`), which no purge removes.
        Says what happened, loudly: a person should know."""
        where = dict(root=str(self.root), path=str(self.root / rel), why=why)
        try:
            _rename_noreplace(name, trash_fd, back, back_fd)
        except FileNotFoundError:
            log.error("%s was renamed into %s/ %s (%s) and is no longer there: the "
                      "leader that holds it now restored or purged it", rel, TRASH_DIR, how, why)
            return "gone from the trash since (see the leader's journal)"
        except OSError as exc:
            kept = name
            if review:
                try:
                    os.rename(name, f"{name}{REVIEW}", src_dir_fd=trash_fd, dst_dir_fd=trash_fd)
                    kept = f"{name}{REVIEW}"
                except OSError as again:
                    log.error("cannot mark %s/%s for review: %s", TRASH_DIR, name, again)
            log.error("%s was renamed into %s/ %s (%s) and cannot be moved back (%s): "
                      "it is in %s, never purged: look at it and move it back or delete it by hand",
                      rel, TRASH_DIR, how, why, exc, self.trash / kept)
            self._record("review", trash=str(self.trash / kept), **where)
            return f"cannot move it back ({exc.strerror}): left in {TRASH_DIR}/{kept} for review"
        log.error("%s was renamed into %s/ %s (%s): moved back", rel, TRASH_DIR, how, why)
        self._record("restored", **where)
        return "moved back"

    def _open_trash(self, *, create: bool = True) -> int:
        """A descriptor of the trash directory (made if missing and `create`), never a symlink, and
        never another filesystem: a mount at <root>/.ckptd-trash (a bind mount of a dataset, a
        disk) would be emptied by the purge, and renames into it fail with EXDEV anyway.
        Raises OSError saying why."""
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                try:
                    os.mkdir(TRASH_DIR, 0o700, dir_fd=root_fd)
                except FileExistsError:
                    pass
            fd = os.open(TRASH_DIR, _DIR_FLAGS, dir_fd=root_fd)
            try:
                why = _another_filesystem(TRASH_DIR, root_fd, fd, self.trash)
            except BaseException:
                os.close(fd)
                raise
            if why is not None:
                os.close(fd)
                raise OSError(errno.EXDEV, f"{self.trash} is {why}: never purged, nothing moved into it")
            return fd
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise OSError(exc.errno, f"{self.trash} exists and is not a directory") from None
            raise
        finally:
            os.close(root_fd)

    def _ensure_trash(self) -> None:
        os.close(self._open_trash())


def _trash_name(c: Checkpoint, now: float) -> str:
    """`<time>-<random>-<rel, percent-encoded>`: where it came from, for a purge that re-checks an
    entry another process trashed (`_trash_origin`). A rel too long for a name keeps its tail
    after a `%%`, which no encoding produces: its origin is then unknown."""
    flat = urllib.parse.quote(os.fsencode(c.rel), safe="")  # bytes: a name need not be UTF-8
    if len(flat) > 200:
        flat = "%%" + flat[-180:]
    return f"{int(now)}-{uuid.uuid4().hex[:8]}-{flat}"


def _trash_origin(entry: str) -> tuple[str, str] | None:
    """(the rel a trash entry came from, its suffix: "", "%slim", "%consolidating") or None where
    the name does not say (an older ckptd's name, a truncated rel, anything else)."""
    entry = entry.removeprefix(HIDDEN_TRASH)  # renamed into the root when the trash could not be made
    m = re.fullmatch(r"\d+-[0-9a-f]+-((?:[^%]|%[0-9A-F]{2})+?)(%slim|%consolidating)?", entry)
    if m is None:
        return None
    rel = os.path.normpath(os.fsdecode(urllib.parse.unquote_to_bytes(m[1])))
    if rel.startswith(("/", "..")) or rel == ".":
        return None
    return rel, m[2] or ""
