"""Trashing: a checkpoint renamed into `<root>/.ckptd-trash/<unique>`, O(1) on one filesystem, so it
leaves its run atomically and a trainer's auto-resume never sees half a checkpoint. The journal
records the intent before the rename and the outcome after. A rename found made without the lease
(the fence asked again just after), or onto a checkpoint pinned after all, is undone (`Trashing.undo`).
The trash directory itself (`TrashDir`), and what this process put there (`Ledger`), which the
purge reads.

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
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.decide.policy import Decision
from ckptd.discover import layouts
from ckptd.discover.layouts import HIDDEN_TRASH, TRASH_DIR
from ckptd.model import Checkpoint
from ckptd.removal.decision import Snapshot, changed, digest, drop_record, pins_inside, snapshot, write_record
from ckptd.removal.fs import (
    _identity,
    _pinned_at,
    _rename_noreplace,
    _still_at,
    open_dir_nofollow,
    open_private_dir,
)
from ckptd.removal.outcome import Anchors, Outcome, Result
from ckptd.removal.recheck import Fence, Rechecks
from ckptd.removal.record import Recorder

log = logging.getLogger(__name__)

REVIEW = "%review"  # a trash entry's suffix: never purged (`Trashing.undo`)
# A checkpoint restored beside its origin, whose name was taken meanwhile: `<name>.ckptd-restored-<time>`,
# a name no framework resumes from (`Trashing.undo`)
RESTORED = ".ckptd-restored-"


@dataclass
class Ledger:
    """What this process moved into the trash and confirmed under its fence just after: the only
    entries purged without waiting `foreign_wait` (removal/purge.py). A checkpoint waits there
    `grace` seconds (config's trash_grace; 0: at the first purge) before its purge judges it
    again, from when it is `due`; a slim's files go at once."""

    grace: float = 0.0
    finished: set[str] = field(default_factory=set)
    due: dict[str, float] = field(default_factory=dict)


class TrashDir:
    """`<root>/.ckptd-trash/`, where every removal goes first."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / TRASH_DIR

    def open(self, *, create: bool = True) -> int:
        """A descriptor of the trash directory (made if missing and `create`), never a symlink, and
        never another filesystem: a mount at <root>/.ckptd-trash (a bind mount of a dataset, a
        disk) would be emptied by the purge, and renames into it fail with EXDEV anyway.
        Raises OSError saying why."""
        try:
            return open_private_dir(self.root, TRASH_DIR, 0o700, create=create, same_filesystem=True)
        except OSError as exc:
            # The trash's own name refused (a symlink or a file planted there); not the root's
            if exc.errno in (errno.ENOTDIR, errno.ELOOP) and exc.filename == TRASH_DIR:
                raise OSError(exc.errno, f"{self.path} exists and is not a directory") from None
            if exc.errno == errno.EXDEV:  # on another filesystem (`open_private_dir`)
                raise OSError(errno.EXDEV, f"{exc.strerror}: never purged, nothing moved into it") from None
            raise

    def ensure(self) -> None:
        os.close(self.open())


class Trashing:
    """A reaper's trashing (removal/reaper.py): a checkpoint into the trash, re-checked first
    (`Rechecks`), under the fence, journalled (`Recorder`); and back where a rename was made
    without the lease (`undo`, which slimming and the purge use too)."""

    def __init__(self, rechecks: Rechecks, fence: Fence, recorder: Recorder, trash: TrashDir, ledger: Ledger,
                 clock: Callable[[], float], *, dry_run: bool):
        self.rechecks = rechecks
        self.fence = fence
        self.recorder = recorder
        self.trash_dir = trash
        self.ledger = ledger
        self.root = trash.root
        self.trash = trash.path
        self.clock = clock
        self.dry_run = dry_run

    def trash_one(self, decision: Decision, anchors: Anchors) -> Result:
        """Re-check, then rename the checkpoint into the trash (or say what it would do).

        The rename goes through directory file descriptors opened from the root
        with O_NOFOLLOW, one component at a time: a run directory swapped for a
        symlink after the checks cannot redirect it outside the root.
        """
        c = decision.checkpoint
        fields = self.recorder.fields(decision, c.size_bytes)

        def refuse(why: str) -> Result:
            self.recorder.record("refused", why=why, **fields)
            return Result(decision, Outcome.REFUSED, why)

        try:
            run_fd = open_dir_nofollow(self.root, c.run)
        except FileNotFoundError:
            return refuse("no longer exists")
        except OSError as exc:
            return refuse(f"reached through a symlink or not a directory: {c.run} ({exc.strerror})")
        try:
            before = _identity(c.name, run_fd)
            try:  # before the re-check: whatever changes after it shows after the rename
                seen: Snapshot | OSError = snapshot(c.name, run_fd)
            except OSError as exc:
                seen = exc
            why_not = self.rechecks.recheck(decision, anchors)
            if why_not is not None:
                return refuse(why_not)
            if isinstance(seen, OSError):
                return refuse(f"cannot look at it: {seen}")
            moved = _identity(c.name, run_fd) != before or not _still_at(self.root, c.run, run_fd)
            if before is None or moved:
                return refuse("moved or replaced while it was being checked")
            if self.dry_run:
                return Result(decision, Outcome.DRY_RUN, f"would move to {TRASH_DIR}/ and purge")
            why_not = self.fence.why_not()
            if why_not is not None:
                return refuse(why_not)
            moved_to = self._move(decision, run_fd, seen, fields)
            if isinstance(moved_to, Result):
                return moved_to
            into, target = moved_to
        finally:
            os.close(run_fd)
        self.recorder.record("trashed", trash=str(into / target), **fields)
        shown = f"{TRASH_DIR}/{target}" if into == self.trash else f"{target} (no room for {TRASH_DIR}/)"
        return Result(decision, Outcome.TRASHED, f"moved to {shown}", into / target)

    def _move(self, decision: Decision, run_fd: int, seen: Snapshot,
              fields: dict[str, object]) -> tuple[Path, str] | Result:
        """Rename the re-checked checkpoint into the trash, its decision recorded first, and look
        at it again there: undone if what the decision was about is not what moved (`_arrived`).
        Where it went (directory, name), or the Result of a refusal or failure."""
        c = decision.checkpoint
        target = _trash_name(c, self.clock())
        try:
            trash_fd = self.trash_dir.open()
            into = self.trash
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                why = f"cannot prepare {TRASH_DIR}/: {exc}"
                self.recorder.record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
            # No room for a directory, on the very occasion min_free exists for: a rename needs
            # no new block or inode. Into the root under a hidden name the purge recognises
            # (HIDDEN_TRASH), at this pass or the next start.
            trash_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            into, target = self.root, f"{HIDDEN_TRASH}{target}"
        try:
            record = self._decision_record(decision, run_fd, seen)
            why = self._intent(target, into, trash_fd, record, fields)
            if why is None:
                self._before_rename(c)
                try:
                    os.rename(c.name, target, src_dir_fd=run_fd, dst_dir_fd=trash_fd)
                except OSError as exc:  # EXDEV, EACCES, EROFS, EBUSY
                    why = f"cannot move to {TRASH_DIR}/: {exc}"
            if why is not None:
                drop_record(target, trash_fd)
                self.recorder.record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
            why_not = self._arrived(c, target, trash_fd, run_fd, seen)
            if why_not is not None:
                drop_record(target, trash_fd)
                self.recorder.record("refused", why=why_not, **fields)
                return Result(decision, Outcome.REFUSED, why_not)
            self.ledger.finished.add(target)
            self.ledger.due[target] = self.clock() + self.ledger.grace
        finally:
            os.close(trash_fd)
        return into, target

    def _decision_record(self, decision: Decision, run_fd: int, seen: Snapshot) -> dict[str, object]:
        """What the trash keeps of the decision beside the entry (removal/decision.py)."""
        c = decision.checkpoint
        st = os.fstat(run_fd)
        return dict(root=str(self.root), run=c.run, name=c.name, run_id=[st.st_dev, st.st_ino],
                    reasons=list(decision.reasons), time=self.clock(), contents=seen)

    def _intent(self, target: str, into: Path, trash_fd: int, record: dict[str, object],
                fields: dict[str, object]) -> str | None:
        """Journal the move, then write its record beside where it goes: why not, or None."""
        contents = record["contents"]
        assert isinstance(contents, list)
        try:  # the intent first: a crash after the rename must find it in the journal
            self.recorder.intent("trashing", trash=str(into / target), run_id=record["run_id"],
                                 contents=digest(contents), entries=len(contents), **fields)
        except OSError as exc:  # ENOSPC with state_dir on the full volume
            return f"not moved: the journal records each move first, and cannot be written ({exc})"
        if into != self.trash:
            return None  # no room for the trash, nor for a record: the journal has the decision
        try:
            write_record(target, trash_fd, record)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                return f"not moved: its record in {TRASH_DIR}/ cannot be written ({exc})"
            # Freeing space is the way out of a full disk: the journal holds the decision, and the
            # purge judges an entry without a record on what it can read (its origin, pins, run).
            log.warning("%s: no room for the record of %s (%s): its purge re-checks without it",
                        self.root, target, exc.strerror)
        return None

    def _before_rename(self, c: Checkpoint) -> None:
        """Called between the last re-check and the rename: nothing here. The window a hung NFS
        server or a reload holds open for seconds; tests hold it (tests/support/renameseam.py)."""

    def _arrived(self, c: Checkpoint, target: str, trash_fd: int, run_fd: int, seen: Snapshot) -> str | None:
        """Looked at just after the rename, through the descriptors it used: why the move is undone
        (and that it was), or None. Undone where this process no longer leads (the fence asked
        again), where the run is no longer where the root says (moved out of the root in the
        window: it gets its checkpoint back wherever it is now), where a pin is beside it or
        anywhere inside, and where anything inside changed since before the re-check (a resumed
        writer re-saving in place in the window)."""
        # Asked again: a process stopped between the fence above and the rename (SIGSTOP,
        # a paused VM, a hung mount) renames after its lease ran out, maybe after the new
        # leader saw the checkpoint pinned. Not held at that epoch now: undone.
        why_not = self.fence.why_not(after=True)
        if why_not is not None:
            return f"{why_not}; {self.undo(target, trash_fd, c.name, run_fd, c.rel, why_not)}"
        # Looked at once more under its new name, which no cache has seen: a FUSE client
        # that caches listings (sshfs, rclone, s3fs, gcsfuse) showed the re-check above
        # its listing from before a pin written on another host.
        why_not = _pinned_at(target, trash_fd)
        if why_not is not None:
            return f"{why_not}; {self.undo(target, trash_fd, c.name, run_fd, c.rel, why_not, how='on a stale look')}"
        why_not = self._arrived_otherwise(c, target, trash_fd, run_fd, seen)
        if why_not is None:
            return None
        undone = self.undo(target, trash_fd, c.name, run_fd, c.rel, why_not, how="just after the re-check",
                            beside=True)
        return f"{why_not}; {undone}"

    def _arrived_otherwise(self, c: Checkpoint, target: str, trash_fd: int, run_fd: int,
                           seen: Snapshot) -> str | None:
        """What makes the entry just renamed not the checkpoint the decision was about, or None."""
        if not _still_at(self.root, c.run, run_fd):
            # The rename went through the run's descriptor, which follows the directory wherever
            # it was moved: the checkpoint came from outside the root, or from a run replaced.
            log.warning("%s: %s moved or replaced while %s was being deleted: moving it back into it",
                        self.root, c.run, c.name)
            return f"its run {c.run} was moved or replaced in the meantime"
        if _identity(f"{c.name}{layouts.PIN_FILE}", run_fd) is not None:
            return f"pinned ({c.name}{layouts.PIN_FILE} beside it)"
        try:
            now = snapshot(target, trash_fd)
        except OSError as exc:
            return f"cannot look at it in the trash: {exc}"
        pins = pins_inside(now)
        if pins:
            return f"pinned ({pins[0]} inside it)"
        diff = changed(seen, now)
        return None if diff is None else f"changed since it was re-checked ({diff})"

    def undo(self, name: str, trash_fd: int, back: str, back_fd: int, rel: str, why: str, *,
              review: bool = True, how: str = "without the lease", beside: bool = False) -> str:
        """Move `name` (under `trash_fd`) back to `back` (under `back_fd`), where a rename made
        without the lease took it from; never over what is there now. Where that name is taken,
        it goes beside it as `<back>.ckptd-restored-<time>` (`beside`), or stays in the trash,
        renamed `<name>%review` (`review`), which no purge removes.
        Says what happened, loudly: a person should know."""
        where = dict(root=str(self.root), path=str(self.root / rel), why=why)
        try:
            _rename_noreplace(name, trash_fd, back, back_fd)
        except FileNotFoundError:
            log.error("%s was renamed into %s/ %s (%s) and is no longer there: the "
                      "leader that holds it now restored or purged it", rel, TRASH_DIR, how, why)
            return "gone from the trash since (see the leader's journal)"
        except OSError as exc:
            if beside and exc.errno == errno.EEXIST:
                aside = f"{back}{RESTORED}{int(self.clock())}"
                try:
                    _rename_noreplace(name, trash_fd, aside, back_fd)
                except OSError:
                    pass
                else:
                    drop_record(name, trash_fd)
                    log.warning("%s was renamed into %s/ %s (%s); its name is taken now: moved back "
                                "beside it as %s", rel, TRASH_DIR, how, why, aside)
                    self.recorder.record("restored", beside=aside, **where)
                    return f"moved back beside it as {aside} (its name is taken)"
            kept = name
            if review:
                try:
                    os.rename(name, f"{name}{REVIEW}", src_dir_fd=trash_fd, dst_dir_fd=trash_fd)
                    kept = f"{name}{REVIEW}"
                    drop_record(name, trash_fd)  # a person decides now; the journal keeps the decision
                except OSError as again:
                    log.error("cannot mark %s/%s for review: %s", TRASH_DIR, name, again)
            log.error("%s was renamed into %s/ %s (%s) and cannot be moved back (%s): "
                      "it is in %s, never purged: look at it and move it back or delete it by hand",
                      rel, TRASH_DIR, how, why, exc, self.trash / kept)
            self.recorder.record("review", trash=str(self.trash / kept), **where)
            return f"cannot move it back ({exc.strerror}): left in {TRASH_DIR}/{kept} for review"
        drop_record(name, trash_fd)
        log.error("%s was renamed into %s/ %s (%s): moved back", rel, TRASH_DIR, how, why)
        self.recorder.record("restored", **where)
        return "moved back"

    def restore(self, entry: str, *, pin: bool = True) -> str:
        """Put the trash entry `entry` back where it came from, by an operator's hand (`ckptd trash
        restore`): beside its origin as `<name>.ckptd-restored-<time>` where that name is taken, never
        over it. With `pin`, a `.ckptd-keep` is written first (at its top, or beside a checkpoint
        that is a file), so no pass deletes it again. Needs no lock: a purge renames an entry
        `%purging` before removing it, and one of the two renames wins. Says what happened;
        raises OSError (ENOENT: not in the trash, or its purge has begun) or ValueError."""
        name = entry.removesuffix(REVIEW)
        origin = _trash_origin(name)
        if entry.endswith("%purging"):
            raise ValueError(f"{entry}: its purge has begun (or a purge was killed after it began): "
                             "`ckptd trash purge` judges it again: a whole one pinned (a .ckptd-keep inside, "
                             "or the config's pins) goes back to the trash, a part-removed one pinned is "
                             "held for review; or look at it and move it back by hand")
        if origin is None or origin[1]:
            raise ValueError(f"{entry}: its name does not say which checkpoint it was: move it back by hand")
        rel = origin[0]
        run_rel, _, back = rel.rpartition("/")
        hidden = entry.startswith(HIDDEN_TRASH)
        where = self.root if hidden else self.trash
        trash_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                run_fd = open_dir_nofollow(self.root, run_rel or ".")
            except FileNotFoundError:
                raise ValueError(
                    f"{entry}: its run {self.root / (run_rel or '.')} is no longer there (moved, renamed or "
                    f"removed): move {where / entry} by hand into the run where it is now, as {back} "
                    "(with a .ckptd-keep inside to keep it), or delete it; no purge takes it by itself"
                ) from None
            try:
                # The rename first: it is the claim (a purge renames `%purging` first, too); the pin
                # after, into what is then this restore's
                aside = back
                try:
                    _rename_noreplace(entry, trash_fd, back, run_fd)
                except FileExistsError:
                    aside = f"{back}{RESTORED}{int(self.clock())}"
                    _rename_noreplace(entry, trash_fd, aside, run_fd)
                except FileNotFoundError:
                    if _exists(f"{name}%purging", trash_fd):
                        raise ValueError(f"{entry}: a purge took it first (it is {name}%purging now): "
                                         "not restored; `ckptd trash list` shows what is left") from None
                    raise ValueError(f"{entry}: no longer in the trash: restored or purged meanwhile "
                                     "(see the journal)") from None
                if pin:
                    _pin(aside, run_fd, back, run_fd)
            finally:
                os.close(run_fd)
            drop_record(name, trash_fd)
        finally:
            os.close(trash_fd)
        shown = rel if aside == back else f"{run_rel + '/' if run_rel else ''}{aside} (beside {back}: its name is taken)"
        self.recorder.record("restored", root=str(self.root), path=str(self.root / rel), beside=aside,
                     why="restored by hand (ckptd trash restore)", pinned=pin)
        log.warning("%s: restored %s from %s/ by hand%s", self.root, shown, TRASH_DIR, " and pinned" if pin else "")
        return shown


def _pin(entry: str, trash_fd: int, name: str, run_fd: int) -> None:
    """A `.ckptd-keep` for the checkpoint `entry` in the trash, about to go back as `name`: at its
    top, or, for a checkpoint that is one file, beside where it goes."""
    try:
        fd = os.open(f"{entry}/{layouts.PIN_FILE}", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=trash_fd)
    except NotADirectoryError:
        fd = os.open(f"{name}{layouts.PIN_FILE}", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=run_fd)
    os.close(fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


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
