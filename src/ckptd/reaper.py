"""The only module that deletes.

Deleting a checkpoint is two steps:
1. rename it into `<root>/.ckptd-trash/<unique>`: O(1) on one filesystem,
   and the checkpoint leaves its run atomically, so a trainer's auto-resume
   never sees half a checkpoint;
2. purge the trash from directory file descriptors, never following a
   symlink and never entering another filesystem (`_remove_tree`). Trash left
   by a crash is purged at the next start.

Just before the rename, every target is checked again, afresh from disk:
still inside its root with no symlink on the way, not a symlink itself,
still complete, unchanged since the plan was made (same fingerprint), still
quiet, not pinned, holding no mount point, not named by the framework's resume
pointer, and each of the run's anchors (its newest complete and full
checkpoints by step and by time, which the plan kept) still there, complete
and unchanged. Any doubt and it is left alone.

The journal records the intent before the rename, and each outcome after.

Fencing: where several ckptd could lead (lease.py), the reaper asks `fence` immediately
before each rename that removes something from a checkpoint or a run (into the trash,
a slim's optimizer files, the consolidated weights into place): it answers why this
process may no longer act, or None. A refusal leaves everything where it is.

Slimming (`slim_one`) removes only a checkpoint's optimizer files, the same
way: re-checked first, renamed into the trash, purged later. When the
checkpoint has no weights of its own they are consolidated first, and nothing
is removed unless that output verified; see `slim_one` for what a crash at
each step leaves.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ckptd import mounts, policy, slim
from ckptd.config import format_size
from ckptd.consolidate import ConsolidationFailed, consolidate
from ckptd.evidence import Entry, TooDeep, fingerprint, read_slim_marker, resume_pointers, walk
from ckptd.journal import Journal
from ckptd.layouts import TRASH_DIR
from ckptd.model import Action, Checkpoint, State
from ckptd.planner import Scanner
from ckptd.policy import Decision

Anchors = Sequence[tuple[Checkpoint, str]]  # a run's anchors with why each is one (policy.anchors)

log = logging.getLogger(__name__)

DRY_RUN_NOTE = "(dry run; not actually removing anything)"


class Outcome(StrEnum):
    TRASHED = "trashed"  # renamed into the trash; gone from its run
    REFUSED = "refused"  # a re-check failed; left where it is
    FAILED = "failed"  # the rename failed; left where it is
    DRY_RUN = "dry-run"  # would have been trashed (or slimmed)
    SLIMMED = "slimmed"  # its optimizer files renamed into the trash; its weights verified in place


@dataclass(frozen=True)
class Result:
    decision: Decision
    outcome: Outcome
    detail: str
    trash_path: Path | None = None
    moved_bytes: int = 0  # what went into the trash

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
        consolidate_timeout: float | None = None,
        fence: Callable[[], str | None] | None = None,
    ):
        if not dry_run and journal is None:
            raise ValueError("a reaper that deletes needs a journal")
        self.scanner = scanner
        self.root = scanner.root.path
        self.journal = journal
        self.dry_run = dry_run
        self.clock = clock
        self.consolidate_timeout = consolidate_timeout
        self.fence = fence  # asked just before each rename: why not, or None (see the module doc)

    @property
    def trash(self) -> Path:
        return self.root / TRASH_DIR

    def _fenced(self) -> str | None:
        """Why this process may not rename now (it lost the lead), or None."""
        if self.fence is None:
            return None
        try:
            why = self.fence()
        except Exception as exc:  # a fence that cannot answer is a no
            why = f"cannot tell whether this ckptd still leads: {exc!r}"
        return None if why is None else f"not the leader: {why}"

    # --- re-checks -------------------------------------------------------

    def recheck(self, decision: Decision, anchors: Anchors) -> str | None:
        """Why `decision` must not be carried out now, or None if it may.

        `anchors` are its run's anchors as the plan saw them (`policy.anchors`): each must still
        be there, complete and unchanged. A re-check that cannot be completed (an I/O error)
        is itself a reason not to act.
        """
        try:
            return self._recheck(decision, anchors)
        except OSError as exc:
            return f"cannot re-check it: {exc}"

    def _recheck(self, decision: Decision, anchors: Anchors) -> str | None:
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
        # Another filesystem inside (a bind mount of a dataset, say): the walk never entered it,
        # and a rename would carry it into the trash. The mount table is asked afresh as well,
        # for kernels where statx cannot tell a bind mount (mounts.is_mount_root).
        real = os.path.realpath(path)
        inside = fresh.mounts or tuple(
            os.path.relpath(m, real) for m in mounts.mounts_below(real, mounts.read_mounts())
        )
        if inside:
            return f"holds a mount point ({', '.join(m or 'itself' for m in inside[:3])})"
        if fresh.state is not State.COMPLETE:
            return f"no longer complete ({fresh.state})"
        if fresh.fingerprint != planned.fingerprint:
            return "changed since the plan was made"
        run_path = path.parent
        pointer = resume_pointers(run_path, os.listdir(run_path)).get(planned.name)
        if pointer is not None:  # rolled back to it since the plan, say
            return f"named by {pointer}: the framework resumes from it"
        return self._anchor_problem(planned, anchors, now)

    def _anchor_problem(self, planned: Checkpoint, anchors: Anchors, now: float) -> str | None:
        """Whether the run's anchors the plan kept are all still there, complete and unchanged.

        Looked at afresh for every target, not once per pass: the trainer's own rotation or an
        operator's `mv` can take the newest checkpoint away in the middle of a pass, and then
        the next deletion could leave the run with nothing to resume from (issue 11, item 8).
        """
        if not anchors or any(a.rel == planned.rel for a, _ in anchors):
            why = next((why for a, why in anchors if a.rel == planned.rel), "newest complete")
            return f"it is its run's {why} checkpoint"
        for anchor, why in anchors:
            fresh = self.scanner.reinspect(anchor.run, anchor.name, now=now)
            ok = fresh is not None and fresh.state is State.COMPLETE
            ok = ok and fresh.fingerprint == anchor.fingerprint  # type: ignore[union-attr]
            if not ok:
                return f"the run's {why} checkpoint {anchor.name} is gone, changed or no longer complete"
        return None

    def execute(self, decisions: Sequence[Decision]) -> list[Result]:
        """Carry out one root's plan: trash each deletion, then slim each slim, each re-checked first.

        Each is checked against its run's anchors as the plan saw them (`policy.anchors`).
        """
        by_run: dict[str, list[Checkpoint]] = {}
        for d in decisions:
            by_run.setdefault(d.checkpoint.run, []).append(d.checkpoint)
        anchored = {run: policy.anchors(ckpts) for run, ckpts in by_run.items()}
        ours = [d for d in decisions if d.checkpoint.root == self.root]
        results = [self.trash_one(d, anchored[d.checkpoint.run]) for d in ours if d.action is Action.DELETE]
        results += [self.slim_one(d, anchored[d.checkpoint.run]) for d in ours if d.action is Action.SLIM]
        return results

    # --- acting ----------------------------------------------------------

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

    def slim_one(self, decision: Decision, anchors: Anchors) -> Result:
        """Re-check, consolidate the weights if it has none, then move its optimizer files into the trash.

        `anchors` are the run's anchors (its newest complete and full checkpoints). In order, and what a
        crash at each step leaves:
        1. zero_to_fp32 into `model.safetensors.ckptd-tmp`, verified (`consolidate`):
           nothing is removed; a leftover temp file is overwritten by the next try.
        2. nothing else changed the checkpoint meanwhile (its entries, fingerprinted
           without the temp file), then rename the temp file to `model.safetensors`:
           a full checkpoint that also holds its weights; the next run slims it
           without consolidating.
        3. journal the intent, write `.ckptd-slim.json` saying "removing" and listing
           the files: from now on the census does not demand them and the
           checkpoint counts as slimmed; the next run finishes an interrupted one.
        4. rename each file into `<root>/.ckptd-trash/<unique>/`.
        5. rewrite the marker as "done", journal. `purge()` frees the space.
        """
        c = decision.checkpoint
        s = c.slim
        fields = self._fields(decision, s.removable_bytes, action="slim")

        def refuse(why: str) -> Result:
            log.warning("refusing to slim %s: %s", c.rel, why)
            self._record("refused", why=why, **fields)
            return Result(decision, Outcome.REFUSED, why)

        def fail(why: str) -> Result:
            log.error("not slimming %s: %s", c.rel, why)
            self._record("failed", why=why, **fields)
            return Result(decision, Outcome.FAILED, why)

        why_not = self.recheck(decision, anchors)
        if why_not is None and s.blocker is not None:
            why_not = f"cannot slim: {s.blocker}"
        if why_not is None and not s.removable:
            why_not = "no optimizer state to remove"
        if why_not is not None:
            return refuse(why_not)
        moving = f"move {len(s.removable)} optimizer files ({format_size(s.removable_bytes)}) to {TRASH_DIR}/"
        if self.dry_run:
            first = f"consolidate {s.source} into {slim.CONSOLIDATED}, then " if s.weights is None else ""
            log.info("would slim %s: %s %s", c.rel, "; ".join(decision.reasons), DRY_RUN_NOTE)
            return Result(decision, Outcome.DRY_RUN, f"would {first}{moving}")

        try:
            before = walk(c.path)
        except (OSError, TooDeep) as exc:
            return refuse(f"cannot re-check it: {exc}")
        if fingerprint(before) != c.fingerprint:
            return refuse("changed since the plan was made")
        previous = read_slim_marker(c.path, {e.rel: e for e in before})
        if isinstance(previous, str):
            return refuse(f"{slim.MARKER} unreadable: {previous}")
        done = ""
        if previous is not None:
            weights = previous.document["weights"]
        elif s.weights is not None:
            weights = {"path": s.weights, "bytes": _entry_size(before, s.weights), "consolidated": False}
        else:
            try:
                weights = self._consolidate(c, before, anchors)
            except _Stop as stop:
                return refuse(stop.why) if stop.outcome is Outcome.REFUSED else fail(stop.why)
            made = (
                f"{format_size(weights['bytes'])}, sha256 {weights['sha256'][:12]}, {weights['seconds']:.1f}s"
            )
            done = f"consolidated {s.source} into {slim.CONSOLIDATED} ({made}); "

        already = list(previous.removed) if previous is not None else []
        planned = already + [f for f in s.removable if f[0] not in {p for p, _ in already}]
        target = self.trash / f"{_trash_name(c, self.clock())}%slim"
        why_not = self._fenced()
        if why_not is not None:
            return refuse(why_not)
        try:
            self._ensure_trash()
            assert self.journal is not None
            self.journal.record(
                "slimming",
                time=self.clock(),
                trash=str(target),
                files=[p for p, _ in s.removable],
                weights=weights,
                **fields,
            )
            self._write_marker(c, "removing", planned, weights, decision)
        except OSError as exc:
            return fail(f"cannot prepare {TRASH_DIR}/, journal or {slim.MARKER}: {exc}")
        moved: list[tuple[str, int]] = []
        for rel, size in s.removable:
            # Both ends through descriptors opened without following symlinks: a global_step*
            # directory swapped for a link cannot bring files from elsewhere into the trash.
            sub, _, name = rel.rpartition("/")
            why_not = self._fenced()
            if why_not is not None:  # the marker says "removing": the next leader finishes it
                return refuse(f"moved {len(moved)} of {len(s.removable)} files, then: {why_not}")
            try:
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                src_fd = open_dir_nofollow(self.root, f"{c.rel}/{sub}" if sub else c.rel)
                try:
                    dst_fd = open_dir_nofollow(self.root, str((target / rel).parent.relative_to(self.root)))
                    try:
                        os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                    finally:
                        os.close(dst_fd)
                finally:
                    os.close(src_fd)
            except FileNotFoundError:
                continue  # gone already, as the marker says: nothing to move
            except OSError as exc:  # the marker says "removing": the next run tries again
                return fail(f"moved {len(moved)} of {len(s.removable)} files, then: {exc}")
            moved.append((rel, size))
        freed = sum(size for _, size in moved)
        try:
            self._write_marker(c, "done", planned, weights, decision)
        except OSError as exc:  # "removing" stays: harmless, the next run rewrites it
            log.error("cannot finish %s in %s: %s", slim.MARKER, c.path, exc)
        self._record("slimmed", trash=str(target), freed=freed, weights=weights, **fields)
        log.info("slimmed %s (%s to the trash): %s", c.rel, format_size(freed), "; ".join(decision.reasons))
        where = target.relative_to(self.root)
        detail = f"{done}moved {len(moved)} optimizer files ({format_size(freed)}) to {where}"
        return Result(decision, Outcome.SLIMMED, detail, target, freed)

    def _consolidate(self, c: Checkpoint, before: list[Entry], anchors: Anchors) -> dict:
        """Steps 1 and 2 of `slim_one`: the weights in place as model.safetensors, described for
        the marker. Raises `_Stop` with why not; nothing of the checkpoint is removed then."""
        assert c.slim.source is not None
        run_dir = c.path.parent
        save_dir, tag, states = slim.consolidation_paths(
            c.layout, c.name, c.slim.source, {e.rel for e in before}
        )
        # The child writes into a directory we create ourselves (mkdir fails on anything
        # planted under that name, and the mode is 0700), reached from a descriptor of the
        # checkpoint opened without following symlinks; the result is moved into place from
        # descriptors too, and must be the very file the child wrote.
        try:
            ckpt_fd = open_dir_nofollow(self.root, c.rel)
        except OSError as exc:
            raise _Stop(Outcome.REFUSED, f"reached through a symlink or not a directory: {exc}") from None
        try:
            _remove_at(slim.CONSOLIDATING, ckpt_fd)  # a leftover of an interrupted try
            try:
                os.mkdir(slim.CONSOLIDATING, 0o700, dir_fd=ckpt_fd)
                work_fd = os.open(slim.CONSOLIDATING, _DIR_FLAGS, dir_fd=ckpt_fd)
            except OSError as exc:
                raise _Stop(Outcome.FAILED, f"cannot create {slim.CONSOLIDATING}/: {exc}") from None
            try:
                out_path = c.path / slim.CONSOLIDATING / _PARTIAL
                try:
                    out = consolidate(
                        run_dir / save_dir, tag, run_dir / states, out_path, timeout=self.consolidate_timeout
                    )
                except ConsolidationFailed as exc:
                    raise _Stop(Outcome.FAILED, f"consolidation failed, nothing removed: {exc}") from None
                wrote = _identity(_PARTIAL, work_fd, contents=True)
                # Consolidation took a while: nobody but us may have touched the checkpoint since.
                if _unchanged_but(before, slim.CONSOLIDATING) != _unchanged_but(
                    walk(c.path), slim.CONSOLIDATING
                ):
                    raise _Stop(Outcome.REFUSED, "changed while its weights were being consolidated")
                # Consolidation took a while: are the run's anchors still there?
                why = self._anchor_problem(c, anchors, self.clock())
                if why is None and _identity(slim.CONSOLIDATED, ckpt_fd) is not None:
                    why = f"{slim.CONSOLIDATED} appeared while consolidating"
                if why is None and (wrote is None or not _is_regular(_PARTIAL, work_fd)):
                    why = "the consolidated file is not where the consolidator left it"
                if why is None:
                    why = self._fenced()
                if why is not None:
                    raise _Stop(Outcome.REFUSED, why)
                try:
                    os.rename(_PARTIAL, slim.CONSOLIDATED, src_dir_fd=work_fd, dst_dir_fd=ckpt_fd)
                    os.fsync(ckpt_fd)
                except OSError as exc:
                    raise _Stop(
                        Outcome.FAILED, f"cannot move the consolidated file into place: {exc}"
                    ) from None
                if _identity(slim.CONSOLIDATED, ckpt_fd, contents=True) != wrote:
                    # Swapped between the check and the rename. Undo our own rename: left in
                    # place, the next run would take it for verified weights.
                    try:
                        os.rename(slim.CONSOLIDATED, _PARTIAL, src_dir_fd=ckpt_fd, dst_dir_fd=work_fd)
                    except OSError as exc:
                        log.error("cannot take %s back out of %s: %s", slim.CONSOLIDATED, c.path, exc)
                    raise _Stop(
                        Outcome.REFUSED, f"{slim.CONSOLIDATED} is not the file the consolidator wrote"
                    )
            finally:
                os.close(work_fd)
                _remove_at(slim.CONSOLIDATING, ckpt_fd)
        finally:
            os.close(ckpt_fd)
        return {
            "path": slim.CONSOLIDATED,
            "bytes": out.bytes,
            "consolidated": True,
            "source": c.slim.source,
            "sha256": out.sha256,
            "tensors": out.tensors,
            "seconds": round(out.seconds, 3),
            "tool": out.tool,
        }

    def _write_marker(
        self, c: Checkpoint, state: str, removed: list[tuple[str, int]], weights: dict, decision: Decision
    ) -> None:
        """Atomically: a temp file, fsynced, renamed over the marker, the directory fsynced."""
        doc = slim.marker_document(
            state=state, time=self.clock(), removed=removed, weights=weights, reasons=decision.reasons
        )
        tmp = f"{slim.MARKER}.tmp"
        ckpt_fd = open_dir_nofollow(self.root, c.rel)  # no symlink on the way, none under the temp name
        try:
            _unlink_at(tmp, ckpt_fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o644, dir_fd=ckpt_fd)
            try:
                os.write(fd, (json.dumps(doc, indent=2) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, slim.MARKER, src_dir_fd=ckpt_fd, dst_dir_fd=ckpt_fd)
            os.fsync(ckpt_fd)
        finally:
            os.close(ckpt_fd)

    def _ensure_trash(self) -> None:
        os.close(self._open_trash())

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        """Delete everything in the trash. Returns (entries purged, bytes freed).

        Works from a descriptor of the trash directory opened without following
        symlinks, and never follows one inside it. `stop` is asked between
        entries: a daemon shutting down leaves the rest for its next start.
        """
        if self.dry_run:
            return 0, 0
        try:
            trash_fd = self._open_trash(create=False)
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
                where = dict(root=str(self.root), trash=str(self.trash / entry), bytes=size)
                # The intent first, as for every other step: killed between the removal and the
                # "purged" record, the journal still says this entry was being purged. Unlike a
                # rename, a purge goes ahead when the journal cannot be written (ENOSPC): its
                # entry was journaled when it was trashed, and freeing space is the way out.
                inside = mounts.mounts_below(self.trash / entry, mounts.read_mounts())
                if inside:  # mounted after it was trashed, or on a kernel where statx cannot tell
                    log.error("not purging %s: it holds a mount point (%s)", self.trash / entry, inside[0])
                    continue
                self._record("purging", **where)
                try:
                    _remove_at(entry, trash_fd)
                except OSError as exc:
                    log.error("cannot purge %s: %s", self.trash / entry, exc)
                    continue
                count += 1
                freed += size
                log.debug("purged %s (%d bytes)", self.trash / entry, size)
                self._record("purged", **where)
        finally:
            os.close(trash_fd)
        return count, freed

    def _open_trash(self, *, create: bool = True) -> int:
        """A descriptor of the trash directory (made if missing and `create`), never a symlink, and
        never another filesystem: a mount at <root>/.ckptd-trash (a bind mount of a dataset, a
        disk) would be emptied by the purge, and renames into it fail with EXDEV anyway (red team).
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

    def _fields(self, decision: Decision, nbytes: int, **extra: object) -> dict[str, object]:
        """What every journal record about a decision carries."""
        c = decision.checkpoint
        return dict(
            **extra,
            root=str(self.root),
            run=c.run,
            path=str(c.path),
            step=c.step,
            bytes=nbytes,
            reasons=list(decision.reasons),
        )

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


def _another_filesystem(name: str, parent_fd: int, fd: int, path: Path) -> str | None:
    """Why the directory `fd` (`name` under `parent_fd`, at `path`) is not on its parent's
    filesystem, or None: another device, or where a mount is attached (a bind mount keeps its
    device number; the mount table where statx cannot tell)."""
    if os.fstat(fd).st_dev != os.fstat(parent_fd).st_dev:
        return "on another filesystem than the root"
    is_root = mounts.is_mount_root(name, parent_fd)
    if is_root is None:
        real = os.path.realpath(path)
        is_root = any(m.point == real for m in mounts.read_mounts())
    return "a mount point" if is_root else None


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


def _identity(path: str, dir_fd: int | None = None, *, contents: bool = False) -> tuple[int, ...] | None:
    """(dev, inode) of `path`, not following a symlink; None if it is not there.

    With `contents`, also its size and mtime: a file unlinked and written again often gets
    the same inode number back at once. (Not the ctime: a rename changes it.)
    """
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if contents else (st.st_dev, st.st_ino)


_PARTIAL = "weights.partial"  # the consolidator's output inside slim.CONSOLIDATING/


def _unlink_at(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)  # never follows: removes a symlink itself
    except FileNotFoundError:
        pass


def _remove_at(name: str, dir_fd: int) -> None:
    """Remove `name` under `dir_fd` (a file, a link itself, or a whole tree), never following links."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_tree(name, dir_fd, os.fstat(dir_fd).st_dev)
    else:
        os.unlink(name, dir_fd=dir_fd)


_MAX_REMOVE_DEPTH = 512


def _remove_tree(name: str, parent_fd: int, dev: int, depth: int = 0) -> None:
    """Remove directory `name` under `parent_fd` and all it holds, from descriptors.

    Never follows a symlink (a link is unlinked, not entered) and never enters another
    filesystem: a directory on another device, or where a mount is attached (a bind mount
    keeps its device number: `mounts.is_mount_root`), raises EXDEV and stays, with the
    directories holding it. shutil.rmtree crossed into a bind mount inside a trashed
    checkpoint and emptied it (issue 11, item 3).
    """
    if depth > _MAX_REMOVE_DEPTH:
        raise OSError(errno.ELOOP, f"deeper than {_MAX_REMOVE_DEPTH} levels", name)
    if mounts.is_mount_root(name, parent_fd):
        raise OSError(errno.EXDEV, "a mount point: another filesystem is never removed", name)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_dev != dev:
            raise OSError(errno.EXDEV, "on another filesystem: never removed", name)
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                _remove_tree(child, fd, dev, depth + 1)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _is_regular(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


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


class _Stop(Exception):
    """Slimming stops before removing anything: refused (a re-check) or failed."""

    def __init__(self, outcome: Outcome, why: str):
        super().__init__(why)
        self.outcome = outcome
        self.why = why


def _entry_size(entries: list[Entry], rel: str) -> int | None:
    return next((e.size for e in entries if e.rel == rel), None)


def _unchanged_but(entries: list[Entry], ours: str) -> str:
    """A fingerprint of a checkpoint's entries leaving out our own work directory `ours` (and
    what is in it) and the checkpoint directory's own size and mtime, which adding it changes."""
    kept = [e for e in entries if e.rel != ours and not e.rel.startswith(f"{ours}/")]
    return fingerprint([Entry("", e.kind, 0, 0) if e.rel == "" else e for e in kept])


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

    @property
    def held(self) -> bool:
        return self._fd is not None

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
