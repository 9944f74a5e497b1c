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
and unchanged. Then the whole run is read again, strictly, and decided again by
the same rules: it acts only if that decision does the same (a file rewritten in
place, its mtime kept, changes no fingerprint, but may change which checkpoint is
best). Any doubt and it is left alone.

The journal records the intent before the rename, and each outcome after.

Fencing: where several ckptd could lead (lease.py), the reaper asks `fence` immediately
before each rename that removes something from a checkpoint or a run (into the trash,
a slim's optimizer files, the consolidated weights into place): it answers why this
process may no longer act, or None. A refusal leaves everything where it is.

Slimming (`slim_one`) removes only a checkpoint's optimizer files, the same
way: re-checked first, renamed into the trash, purged later. When the
checkpoint has no fp32 weights of its own they are consolidated first, and
nothing is removed unless that output verified; see `slim_one` for what a
crash at each step leaves. The consolidation itself only adds a directory
(`begin_consolidation`, `finish_consolidation`): the daemon runs it on a worker
of its own and slims in a later pass, as a checkpoint that holds its weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ckptd import frameworks, layouts, mounts, policy, rules, slim, space
from ckptd.config import format_size, pin_matches
from ckptd.consolidate import Consolidated, Consolidation, ConsolidationFailed
from ckptd.discover import find_run
from ckptd.evidence import Entry, TooDeep, fingerprint, read_slim_marker, resume_pointers, walk
from ckptd.journal import Journal
from ckptd.layouts import HIDDEN_TRASH, TRASH_DIR, is_rank_dir, recognise_by_name, unfinished_markers
from ckptd.model import Action, Checkpoint, ConsolidatedWeights, Run, State
from ckptd.planner import Scanner, experiments, rule_dir
from ckptd.policy import Decision

Anchors = Sequence[tuple[Checkpoint, str]]  # a run's anchors with why each is one (rules.anchors)

log = logging.getLogger(__name__)

DRY_RUN_NOTE = "(dry run; not actually removing anything)"


class Outcome(StrEnum):
    TRASHED = "trashed"  # renamed into the trash; gone from its run
    REFUSED = "refused"  # a re-check failed; left where it is
    FAILED = "failed"  # the rename failed; left where it is
    DRY_RUN = "dry-run"  # would have been trashed (or slimmed)
    SLIMMED = "slimmed"  # its optimizer files renamed into the trash; its weights verified in place
    DEFERRED = "deferred"  # a slim whose fp32 weights must be consolidated first, by the caller's worker
    CONSOLIDATED = "consolidated"  # fp32 weights verified and moved into it; slimmed in a later pass


@dataclass(frozen=True)
class Result:
    decision: Decision
    outcome: Outcome
    detail: str
    trash_path: Path | None = None
    moved_bytes: int = 0  # what went into the trash
    anchors: Anchors = ()  # DEFERRED: the run's anchors to re-check against when it begins

    def line(self) -> str:
        return f"{self.outcome} {self.decision.checkpoint.rel}: {self.detail}"


WORK_DIR = ".ckptd-consolidating"  # <root>/.ckptd-consolidating/<unique>/: where zero_to_fp32 writes


@dataclass(frozen=True)
class Work:
    """A consolidation under way: its work directory, and the checkpoint as it was when it began.

    Outside the checkpoint: while zero_to_fp32 writes for minutes, the checkpoint does not change
    (the daemon does not see it "writing"), and a deletion of it meanwhile takes nothing of ours.
    """

    decision: Decision
    name: str  # of the work directory, in <root>/.ckptd-consolidating/
    path: Path
    identity: tuple[int, int]  # (dev, inode) of the work directory
    checkpoint: tuple[int, int]  # (dev, inode) of the checkpoint directory
    before: str  # the fingerprint of the checkpoint's entries when it began
    save_dir: Path
    tag: str
    model_states: Path
    source_fingerprint: str  # of what zero_to_fp32 reads (`slim.source_fingerprint`)

    def consolidation(self, timeout: float | None) -> Consolidation:
        return Consolidation(
            self.save_dir, self.tag, self.model_states, self.path,
            source_fingerprint=self.source_fingerprint, timeout=timeout,
        )  # fmt: skip


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
        self.purged: dict[Path, int] = {}  # what purging each trash entry freed, by its path
        # Trash entries this process moved there and confirmed under its fence just after: the
        # only ones purged at once. Others wait `foreign_wait` seconds (by their ctime) and are
        # re-checked first (`purge`). The daemon sets it from its leadership (lease duration +
        # margin for a volume lease; 0 where no other process could have renamed late).
        self._finished: set[str] = set()
        self.foreign_wait = 0.0
        self.waiting = 0  # entries the last purge left to wait
        self._purging = False

    @property
    def trash(self) -> Path:
        return self.root / TRASH_DIR

    def _fenced(self, *, after: bool = False) -> str | None:
        """Why this process may not rename now (it lost the lead), or None. `after`: asked
        once more just after a rename, whose undoing the caller then owes."""
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

        `anchors` are its run's anchors as the plan saw them (`rules.anchors`): each must still
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
        # Checkpoints of a run of its own (or a pin) below it: the walk just done saw every entry.
        if fresh.holds:
            return rules.held_reason(fresh)
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
        why = self._pointer_problem(planned)
        if why is None:
            why = _last_whole_step(path.parent, planned.name, stat.S_ISDIR(st.st_mode), self.scanner.patterns)
        why = why or self._anchor_problem(planned, anchors, now)
        return why or self._decided_otherwise(decision, now)

    def _pointer_problem(self, planned: Checkpoint) -> str | None:
        """Whether the run's resume pointer names it now (rolled back to it since the plan, say)."""
        run_path = planned.path.parent
        pointer = resume_pointers(run_path, os.listdir(run_path)).get(planned.name)
        return None if pointer is None else f"named by {pointer}: the framework resumes from it"

    def _anchor_problem(self, planned: Checkpoint, anchors: Anchors, now: float) -> str | None:
        """Whether the run's anchors the plan kept are all still there, complete and unchanged.

        Looked at afresh for every target, not once per pass: the trainer's own rotation or an
        operator's `mv` can take the newest checkpoint away in the middle of a pass, and then
        the next deletion could leave the run with nothing to resume from.
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

    def _decided_otherwise(self, decision: Decision, now: float) -> str | None:
        """Whether the run, decided again from what its files say now, would not do `decision`.

        The plan rests on what was read when it was made, perhaps long before, perhaps restored
        from the verdict cache: which checkpoint trainer_state.json names best, the metrics each
        checkpoint was ranked by, pins, resume pointers, which others are complete. A file rewritten
        in place (its mtime kept) changes none of the fingerprints compared above. So every
        checkpoint of the run is read again, strictly, and the run decided again by the same rules
        (`policy.decide_run`, its `max_size`): it goes ahead only if that decision does the same.
        `min_free` weighs the whole filesystem: a checkpoint it took needs only to be one that it
        may take (complete, unprotected) in the fresh decision.
        """
        planned = decision.checkpoint
        # Its run as the plan decided it: every version_N of a Lightning experiment (planner.experiments)
        run = self.scanner.reinspect_experiment(planned.run, now=now)
        fresh = None
        if run is not None:
            retention, _ = self.scanner.root.retention_for(rule_dir(run))
            decisions = policy.decide_run(run, retention)
            if retention.max_size is not None:
                decisions, _ = policy.enforce_max_size(decisions, retention.max_size)
            fresh = next((d for d in decisions if d.checkpoint.rel == planned.rel), None)
        if fresh is None:
            return "no longer recognised as a checkpoint of its run"
        if fresh.action is decision.action:
            return None
        if (
            decision.action is Action.DELETE
            and policy.is_min_free(decision)
            and fresh.action in (Action.KEEP, Action.SLIM)
            and not fresh.protected
            and fresh.checkpoint.state is State.COMPLETE
        ):
            return None
        now_says = f"{fresh.action} ({'; '.join(fresh.reasons)})"
        return f"decided again from its run's files as they are now: {now_says}"

    def execute(self, decisions: Sequence[Decision], *, consolidate: bool = True) -> list[Result]:
        """Carry out one root's plan: trash each deletion, then slim each slim, each re-checked first.

        Each is checked against its run's anchors as the plan saw them (`rules.anchors`).
        With `consolidate=False`, a slim that needs its fp32 weights consolidated first
        comes back DEFERRED, for the caller to run (`begin_consolidation`).
        """
        anchored = self._anchored(decisions)
        ours = [d for d in decisions if d.checkpoint.root == self.root]
        results = [self.trash_one(d, anchored[d.checkpoint.rel]) for d in ours if d.action is Action.DELETE]
        results += [
            self.slim_one(d, anchored[d.checkpoint.rel], consolidate=consolidate)
            for d in ours
            if d.action is Action.SLIM
        ]
        return results

    def _anchored(self, decisions: Sequence[Decision]) -> dict[str, Anchors]:
        """Each checkpoint's run's anchors (`rules.anchors`), by its path: its directory's, or, where
        the plan took several directories as one run (`planner.experiments`: a Lightning
        experiment's version_N), that run's, merged again from the plan's checkpoints as it did."""
        by_run: dict[str, list[Checkpoint]] = {}
        for d in decisions:
            if d.checkpoint.root == self.root:
                by_run.setdefault(d.checkpoint.run, []).append(d.checkpoint)
        runs = [Run(self.root, rel, tuple(ckpts)) for rel, ckpts in by_run.items()]
        out: dict[str, Anchors] = {}
        for run in experiments(self.scanner.root, runs):
            found = rules.anchors(run.checkpoints)
            out.update((c.rel, found) for c in run.checkpoints)
        return out

    # --- trashing: a checkpoint renamed into the trash ------------------------

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

    # --- slimming: its optimizer state into the trash, its weights kept ----------

    def slim_one(self, decision: Decision, anchors: Anchors, *, consolidate: bool = True) -> Result:
        """Re-check, consolidate fp32 weights if it has none, then move its optimizer files into the trash.

        `anchors` are the run's anchors (its newest complete and full checkpoints). In order, and what a
        crash at each step leaves:
        1. if the weights it would keep are not there (no weights, or 16-bit ones
           with `slim_weights = "fp32"`): zero_to_fp32 into a work directory of
           its own under `<root>/.ckptd-consolidating/`, verified; then, if the
           checkpoint did not change meanwhile, the directory is renamed into it as
           `fp32/` (`begin_consolidation`, `finish_consolidation`). A crash leaves a
           work directory (moved to the trash at the next start) or a full checkpoint
           that also holds its fp32 weights, which the next run slims without
           consolidating. With `consolidate=False` this step is the caller's
           (DEFERRED), and the slim comes in a later pass.
        2. nothing else changed the checkpoint meanwhile.
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
            first = f"consolidate {s.source} into {slim.WEIGHTS_DIR}/, then " if s.weights is None else ""
            log.info("would slim %s: %s %s", c.rel, "; ".join(decision.reasons), DRY_RUN_NOTE)
            return Result(decision, Outcome.DRY_RUN, f"would {first}{moving}")
        if s.weights is None and not consolidate:
            first = f"consolidating fp32 weights from {s.source} first"
            return Result(decision, Outcome.DEFERRED, first, anchors=tuple(anchors))

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
        elif s.weights is None:
            try:
                weights = self._consolidate_inline(decision, before, anchors)
            except _Stop as stop:
                return refuse(stop.why) if stop.outcome is Outcome.REFUSED else fail(stop.why)
            done = f"consolidated {s.source} into {slim.WEIGHTS_DIR}/ ({_made(weights)}); "
        elif s.consolidated is not None:
            try:
                weights = self._consolidated_weights(c, s.consolidated)
            except OSError as exc:
                return refuse(f"cannot read {s.consolidated.index}: {exc}")
        else:
            weights = {"path": s.weights, "bytes": _entry_size(before, s.weights), "consolidated": False}
            if s.dtype is not None:
                weights["dtype"] = s.dtype

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
                        why_not = self._fenced(after=True)  # as after a checkpoint's rename
                        if why_not is not None:
                            undone = self._undo(name, dst_fd, name, src_fd, f"{c.rel}/{rel}", why_not,
                                                review=False)
                            return refuse(f"moved {len(moved)} of {len(s.removable)} files, then: "
                                          f"{why_not}; {undone}")
                    finally:
                        os.close(dst_fd)
                finally:
                    os.close(src_fd)
            except FileNotFoundError:
                continue  # gone already, as the marker says: nothing to move
            except OSError as exc:  # the marker says "removing": the next run tries again
                return fail(f"moved {len(moved)} of {len(s.removable)} files, then: {exc}")
            moved.append((rel, size))
        self._finished.add(target.name)
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

    def _consolidated_weights(self, c: Checkpoint, cw: ConsolidatedWeights) -> dict:
        """The marker's account of fp32 weights consolidated earlier: their index, hashed now."""
        ckpt_fd = open_dir_nofollow(self.root, f"{c.rel}/{slim.WEIGHTS_DIR}")
        try:
            fd = os.open(slim.INDEX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=ckpt_fd)
        finally:
            os.close(ckpt_fd)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        return _weights_record(cw.index, len(data), digest, cw.source, cw.files, cw.tool)

    # --- consolidation: it only adds fp32/ to a checkpoint ----------------------------

    def begin_consolidation(self, decision: Decision, anchors: Anchors) -> Work | Result:
        """Re-check a slim that needs its fp32 weights first, and make an empty work directory for
        zero_to_fp32 (`Work.consolidation` runs it, on any thread; then `finish_consolidation`)."""
        c = decision.checkpoint
        fields = self._fields(decision, 0, action="consolidate")
        why = self.recheck(decision, anchors)
        if why is None and (c.slim.source is None or c.slim.weights is not None):
            why = "nothing to consolidate"
        try:
            if why is None:
                return self._begin(decision)
        except _Stop as stop:
            why = stop.why
            if stop.outcome is Outcome.FAILED:
                log.error("not consolidating %s: %s", c.rel, why)
                self._record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
        self._record("refused", why=why, **fields)
        return Result(decision, Outcome.REFUSED, why)

    def finish_consolidation(self, work: Work, outcome: Consolidated | BaseException) -> Result:
        """Move verified weights into the checkpoint as `fp32/`, if it is still the checkpoint the
        consolidation began from; else (or on a failed one) move the work directory to the trash."""
        fields = self._fields(work.decision, 0, action="consolidate")
        try:
            if isinstance(outcome, BaseException):
                raise _Stop(Outcome.FAILED, f"consolidation failed, nothing removed: {outcome}")
            if self.dry_run:  # switched on by a reload while it ran
                raise _Stop(Outcome.REFUSED, f"dry run: not moved into place {DRY_RUN_NOTE}")
            weights = self._commit(work, outcome)
        except _Stop as stop:
            self._discard(work.name)
            self._record(str(stop.outcome), why=stop.why, **fields)
            return Result(work.decision, stop.outcome, stop.why)
        self._record("consolidated", weights=weights, **fields)
        into = f"{slim.WEIGHTS_DIR}/ ({_made(weights)})"
        detail = f"consolidated {work.tag} into {into}; slimmed once it has settled"
        return Result(work.decision, Outcome.CONSOLIDATED, detail)

    def clear_work(self) -> int:
        """Move what earlier consolidations left in the work area to the trash (at start-up: none
        of ours runs then, and a consolidator dies with the ckptd that started it)."""
        try:
            area_fd = open_dir_nofollow(self.root, WORK_DIR)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.error("not clearing %s: %s", self.root / WORK_DIR, exc)
            return 0
        try:
            names = os.listdir(area_fd)
        finally:
            os.close(area_fd)
        return sum(self._discard(name) for name in names)

    def _consolidate_inline(self, decision: Decision, before: list[Entry], anchors: Anchors) -> dict:
        """Step 1 of `slim_one` where the caller waits for it (`prune`). Raises `_Stop`."""
        c = decision.checkpoint
        work = self._begin(decision)
        try:
            out = work.consolidation(self.consolidate_timeout).run()
        except ConsolidationFailed as exc:
            self._discard(work.name)
            raise _Stop(Outcome.FAILED, f"consolidation failed, nothing removed: {exc}") from None
        try:
            weights = self._commit(work, out)
        except _Stop:
            self._discard(work.name)
            raise
        self._record("consolidated", weights=weights, **self._fields(work.decision, 0, action="consolidate"))
        # Consolidation took a while: nobody but us may have touched the checkpoint since.
        if _unchanged_but(before, slim.WEIGHTS_DIR) != _unchanged_but(walk(c.path), slim.WEIGHTS_DIR):
            raise _Stop(Outcome.REFUSED, "changed while its weights were being consolidated")
        # Consolidation took a while: are the run's anchors still there, and does the framework's
        # resume pointer (DeepSpeed's `latest`, rolled back by an operator meanwhile) name it now?
        why = self._anchor_problem(c, anchors, self.clock())
        if why is None:
            why = self._pointer_problem(c)
        if why is not None:
            raise _Stop(Outcome.REFUSED, why)
        return weights

    def _begin(self, decision: Decision) -> Work:
        c = decision.checkpoint
        assert c.slim.source is not None
        try:
            before = walk(c.path)
        except (OSError, TooDeep) as exc:
            raise _Stop(Outcome.REFUSED, f"cannot re-check it: {exc}") from None
        if fingerprint(before) != c.fingerprint:
            raise _Stop(Outcome.REFUSED, "changed since the plan was made")
        files = {e.rel: e for e in before}
        save_dir, tag, states = slim.consolidation_paths(c.layout, c.name, c.slim.source, set(files))
        is_tag = frameworks.get(c.layout).checkpoint_is_tag  # a bare DeepSpeed tag: its shards at its top
        source_fp = slim.source_fingerprint(files, "" if is_tag else f"{tag}/")
        try:
            ckpt_fd = open_dir_nofollow(self.root, c.rel)
        except OSError as exc:
            raise _Stop(Outcome.REFUSED, f"reached through a symlink or not a directory: {exc}") from None
        try:
            st = os.fstat(ckpt_fd)
            area_fd = self._open_area()
        except OSError as exc:
            os.close(ckpt_fd)
            raise _Stop(Outcome.FAILED, f"cannot prepare {WORK_DIR}/: {exc}") from None
        name = _trash_name(c, self.clock())
        try:
            # Ours alone: mkdir fails on anything planted under the name, and the mode is 0700.
            os.mkdir(name, 0o700, dir_fd=area_fd)
            work = os.stat(name, dir_fd=area_fd, follow_symlinks=False)
        except OSError as exc:
            raise _Stop(Outcome.FAILED, f"cannot create a work directory in {WORK_DIR}/: {exc}") from None
        finally:
            os.close(area_fd)
            os.close(ckpt_fd)
        if work.st_dev != st.st_dev:  # the rename into place would fail with EXDEV, hours from now
            self._discard(name)
            raise _Stop(Outcome.REFUSED, f"on another filesystem than {WORK_DIR}/ in its root")
        run_dir = c.path.parent
        return Work(
            decision,
            name,
            self.root / WORK_DIR / name,
            (work.st_dev, work.st_ino),
            (st.st_dev, st.st_ino),
            fingerprint(before),
            run_dir / save_dir,
            tag,
            run_dir / states,
            source_fp,
        )

    def _commit(self, work: Work, out: Consolidated) -> dict:
        """Rename the verified work directory into the checkpoint as `fp32/`. Raises `_Stop`.

        Everything is reached from descriptors opened without following symlinks, and what
        lands in place must be the very directory and files the consolidator wrote and the
        parent checked (`Consolidated.identities`).
        """
        c = work.decision.checkpoint
        try:
            ckpt_fd = open_dir_nofollow(self.root, c.rel)
        except FileNotFoundError:
            raise _Stop(Outcome.REFUSED, "gone while its weights were being consolidated") from None
        except OSError as exc:
            raise _Stop(Outcome.REFUSED, f"reached through a symlink or not a directory: {exc}") from None
        with contextlib.ExitStack() as fds:
            fds.callback(os.close, ckpt_fd)
            try:
                area_fd = open_dir_nofollow(self.root, WORK_DIR)
                fds.callback(os.close, area_fd)
                work_fd = os.open(work.name, _DIR_FLAGS, dir_fd=area_fd)
                fds.callback(os.close, work_fd)
                why = self._commit_problem(work, out, ckpt_fd, work_fd)
                if why is not None:
                    raise _Stop(Outcome.REFUSED, why)
                os.fchmod(work_fd, stat.S_IMODE(os.fstat(ckpt_fd).st_mode))  # readable like it, not 0700
                # (A directory planted under the name since the look above: rename(2) fails on a
                # non-empty one, and replaces only an empty one.)
                os.rename(work.name, slim.WEIGHTS_DIR, src_dir_fd=area_fd, dst_dir_fd=ckpt_fd)
                os.fsync(ckpt_fd)
                in_place = _identity(slim.WEIGHTS_DIR, ckpt_fd) == work.identity
                if not in_place or _contents(work_fd) != out.identities:
                    # Swapped between the checks and the rename. Undo our own rename: left in
                    # place, the next run would take it for verified weights.
                    try:
                        os.rename(slim.WEIGHTS_DIR, work.name, src_dir_fd=ckpt_fd, dst_dir_fd=area_fd)
                    except OSError as exc:
                        log.error("cannot take %s back out of %s: %s", slim.WEIGHTS_DIR, c.path, exc)
                    raise _Stop(Outcome.REFUSED, f"{slim.WEIGHTS_DIR}/ is not what the consolidator wrote")
            except OSError as exc:
                why = f"cannot move the consolidated weights into place: {exc}"
                raise _Stop(Outcome.FAILED, why) from None
        index = f"{slim.WEIGHTS_DIR}/{slim.INDEX}"
        files = tuple((f"{slim.WEIGHTS_DIR}/{n}", b, h) for n, b, h in out.files)
        record = _weights_record(index, out.index_bytes, out.index_sha256, work.tag, files, out.tool)
        return {**record, "tensors": out.tensors, "seconds": round(out.seconds, 3)}

    def _commit_problem(self, work: Work, out: Consolidated, ckpt_fd: int, work_fd: int) -> str | None:
        """Why the consolidated weights may not go into the checkpoint now, or None."""
        st = os.fstat(ckpt_fd)
        if (st.st_dev, st.st_ino) != work.checkpoint:
            return "moved or replaced while its weights were being consolidated"
        # Nobody but us may have touched the checkpoint since the consolidation began.
        try:
            changed = fingerprint(walk(work.decision.checkpoint.path)) != work.before
        except TooDeep:
            changed = True
        if changed:
            return "changed while its weights were being consolidated"
        if _identity(slim.WEIGHTS_DIR, ckpt_fd) is not None:
            return f"{slim.WEIGHTS_DIR}/ appeared while consolidating"
        w = os.fstat(work_fd)
        if (w.st_dev, w.st_ino) != work.identity:
            return "the consolidated weights are not where the consolidator left them"
        if _contents(work_fd) != out.identities:
            return "the consolidated files are not the ones that were verified"
        return self._fenced()  # a ckptd that lost the lead adds nothing to a checkpoint either

    def _discard(self, name: str) -> int:
        """Move a work directory (ours) into the trash, for `purge`. 1 if it moved."""
        try:
            area_fd = open_dir_nofollow(self.root, WORK_DIR)
        except OSError:
            return 0
        try:
            if _identity(name, area_fd) is None:
                return 0
            trash_fd = self._open_trash()
            try:
                os.rename(name, f"{name}%consolidating", src_dir_fd=area_fd, dst_dir_fd=trash_fd)
            finally:
                os.close(trash_fd)
            return 1
        except OSError as exc:
            log.error("cannot move %s to %s/: %s", self.root / WORK_DIR / name, TRASH_DIR, exc)
            return 0
        finally:
            os.close(area_fd)

    def _open_area(self) -> int:
        """A descriptor of `<root>/.ckptd-consolidating/`, made if needed (0700), not through a symlink."""
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.mkdir(WORK_DIR, 0o700, dir_fd=root_fd)
            except FileExistsError:
                pass
            return os.open(WORK_DIR, _DIR_FLAGS, dir_fd=root_fd)
        finally:
            os.close(root_fd)

    # --- purging: the trash emptied, never across a filesystem -----------------

    def _ensure_trash(self) -> None:
        os.close(self._open_trash())

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        """Delete what may go from the trash. Returns (entries purged, bytes freed).

        Works from a descriptor of the trash directory opened without following
        symlinks, and never follows one inside it. `stop` is asked between
        entries: a daemon shutting down leaves the rest for its next start.
        Checkpoints renamed into the root under a hidden name when there was no room
        for the trash (`HIDDEN_TRASH`) are purged first, by the same rules; then the trash
        is made if it is missing and there is room (at start-up and after each pass: on a
        full disk it is there already).

        Only what this process trashed and confirmed under its fence goes at once. Anything else
        (another host's, an earlier run's, a rename made late by a process stopped before it)
        waits until it has been in the trash `foreign_wait` seconds, enough for a late renamer
        to see it lost the lease and move it back, and is then re-checked against protection as
        it stands (`_protected`): a checkpoint pinned, named by its run's resume pointer, or
        newer than every complete one left in its run is moved back, not purged. `%review`
        entries are never purged.
        """
        if self.dry_run:
            return 0, 0
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.error("not purging %s: %s", self.root, exc)
            return 0, 0
        self._purging = True
        self.waiting = 0
        try:
            try:
                hidden = sorted(n for n in os.listdir(root_fd) if n.startswith(HIDDEN_TRASH))
                count, freed = self._purge_entries(root_fd, self.root, hidden, stop)
            finally:
                os.close(root_fd)
            try:
                trash_fd = self._open_trash()
            except OSError as exc:
                # No room (or no right) to make it: nothing is in it either; a rename says why later.
                if exc.errno in _NO_TRASH:
                    log.debug("no %s: %s", self.trash, exc)
                else:
                    log.error("not purging %s: %s", self.trash, exc)
                return count, freed
            try:
                names = sorted(os.listdir(trash_fd))
                more, more_bytes = self._purge_entries(trash_fd, self.trash, names, stop)
            finally:
                os.close(trash_fd)
        finally:
            self._purging = False
        return count + more, freed + more_bytes

    def _purge_entries(
        self, dir_fd: int, where_path: Path, names: list[str], stop: Callable[[], bool]
    ) -> tuple[int, int]:
        """Remove each of `names` in the directory `dir_fd` (at `where_path`) that may go, journalled."""
        count = freed = review = 0
        for entry in names:
            if stop():
                break
            if entry.endswith(REVIEW):
                review += 1
                continue
            if entry not in self._finished:
                why = self._not_yet(entry, dir_fd, hidden=where_path == self.root)
                if why is not None:
                    self.waiting += why == WAIT
                    continue
            size = _size(where_path / entry)
            where = dict(root=str(self.root), trash=str(where_path / entry), bytes=size)
            # The intent first, as for every other step: killed between the removal and the
            # "purged" record, the journal still says this entry was being purged. Unlike a
            # rename, a purge goes ahead when the journal cannot be written (ENOSPC): its
            # entry was journaled when it was trashed, and freeing space is the way out.
            inside = mounts.mounts_below(where_path / entry, mounts.read_mounts())
            if inside:  # mounted after it was trashed, or on a kernel where statx cannot tell
                log.error("not purging %s: it holds a mount point (%s)", where_path / entry, inside[0])
                continue
            self._record("purging", **where)
            try:
                _remove_at(entry, dir_fd)
            except OSError as exc:
                log.error("cannot purge %s: %s", where_path / entry, exc)
                continue
            count += 1
            freed += size
            self.purged[where_path / entry] = size
            self._finished.discard(entry)
            log.debug("purged %s (%d bytes)", where_path / entry, size)
            self._record("purged", **where)
        if review:
            log.warning("%s: %d entries held for review (never purged): move each back or delete it by hand",
                        where_path, review)
        return count, freed

    def trash_pending(self) -> bool:
        """Whether the trash holds what a purge should look at that this process did not put
        there (another process's, maybe a late rename): the daemon asks at each poll. A name
        listing, nothing more; False while a purge runs."""
        if self.dry_run or self._purging:
            return False
        try:
            names = os.listdir(self.trash)
        except OSError:
            return False
        return any(n not in self._finished and not n.endswith(REVIEW) for n in names)

    def _not_yet(self, entry: str, trash_fd: int, *, hidden: bool = False) -> str | None:
        """Why an entry this process did not trash is not purged now (WAIT: it has not been in
        the trash long enough; else it was moved back, or held), or None: purge it. `hidden`: a
        `.ckptd-trash.*` name at the root's top, not in the trash: one whose name does not say
        where it came from is not something ckptd moved aside (a person's, or a spoof), and is
        left alone."""
        try:
            age = self.clock() - os.stat(entry, dir_fd=trash_fd, follow_symlinks=False).st_ctime
        except FileNotFoundError:
            return "gone"
        if age < self.foreign_wait:  # a rename changes the ctime: the time it came in
            return WAIT
        origin = _trash_origin(entry)
        if origin is None and hidden:
            log.warning("%s: not named as ckptd names what it moves aside: left alone, never purged",
                        self.root / entry)
            return "not ckptd's"
        if origin is None or origin[1]:
            # Origin unknown, a slim's optimizer files, a consolidation's work: purged, unless a
            # pin is at its top (a pinned checkpoint moved in by hand, or under a name made to
            # look like a slim's): with nowhere known to move it back to, held for review.
            if _identity(f"{entry}/{layouts.PIN_FILE}", trash_fd) is not None:
                log.error("%s/%s holds a %s: held for review, never purged: move it back by hand",
                          TRASH_DIR, entry, layouts.PIN_FILE)
                with contextlib.suppress(OSError):
                    os.rename(entry, f"{entry}{REVIEW}", src_dir_fd=trash_fd, dst_dir_fd=trash_fd)
                return "pinned"
            return None
        rel = origin[0]
        try:
            why = self._protected(entry, trash_fd, rel)
        except OSError as exc:
            why = f"cannot re-check it ({exc})"
        if why is None:
            return None
        run_rel, _, name = rel.rpartition("/")
        try:
            run_fd = open_dir_nofollow(self.root, run_rel or ".")
        except OSError as exc:
            log.error("%s/%s is %s but its run cannot be opened (%s): held for review, never purged",
                      TRASH_DIR, entry, why, exc)
            with contextlib.suppress(OSError):
                os.rename(entry, f"{entry}{REVIEW}", src_dir_fd=trash_fd, dst_dir_fd=trash_fd)
            return why
        try:
            undone = self._undo(entry, trash_fd, name, run_fd, rel, f"found in the trash {why}")
        finally:
            os.close(run_fd)
        return f"{why}: {undone}"

    def _protected(self, entry: str, trash_fd: int, rel: str) -> str | None:
        """Why a checkpoint found in the trash must go back to `rel`, as the run stands now."""
        run_rel, _, name = rel.rpartition("/")
        run_rel = run_rel or "."
        run_path = self.root if run_rel == "." else self.root / run_rel
        if not run_path.is_dir():
            return None  # its run is gone as a whole: nothing to go back to
        is_dir = stat.S_ISDIR(os.stat(entry, dir_fd=trash_fd, follow_symlinks=False).st_mode)
        names = os.listdir(run_path)
        retention, _ = self.scanner.root.retention_for(run_rel)
        pin_inside = is_dir and _identity(f"{entry}/{layouts.PIN_FILE}", trash_fd) is not None
        pin_beside = f"{name}{layouts.PIN_FILE}" in names
        if pin_inside or pin_beside or any(pin_matches(rel, p) for p in retention.pins):
            return "pinned"
        pointer = resume_pointers(run_path, names).get(name)
        if pointer is not None:
            return f"named by {pointer}"
        mine = recognise_by_name(name, is_dir, self.scanner.patterns)
        if mine is None:
            return "not recognised by its name, so not known to be older than the run's newest"
        # It may go only if it would be neither of the run's anchors now: some complete checkpoint
        # left is newer by step, and some is newer by time (its save ended after every file of
        # this entry was written: a new job's lower steps, written last, are the newest by time).
        entries = walk(Path(f"/proc/self/fd/{trash_fd}") / entry)
        written = max((e.mtime_ns for e in entries if e.kind == "f"), default=entries[0].mtime_ns) / 1e9
        run = find_run(self.root, run_rel, patterns=self.scanner.patterns)
        now = self.clock()
        by_step = by_time = False
        candidates = run.candidates if run is not None else ()
        others = [c for c in candidates if c.unit == mine.unit and c.name != name]
        for cand in sorted(others, key=lambda c: c.step, reverse=True):
            fresh = self.scanner.reinspect(run_rel, cand.name, now=now)
            if fresh is None or fresh.state is not State.COMPLETE:
                continue
            by_step = by_step or fresh.step > mine.step
            by_time = by_time or fresh.written_at >= written
            if by_step and by_time:
                return None
        return "newer than every complete checkpoint left in its run (by step or by time)"

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

    # --- the journal ---------------------------------------------------------

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
            log.error("cannot write the journal %s: %s", self.journal.path, exc.strerror)


def _last_whole_step(
    run_path: Path, name: str, is_dir: bool, patterns: Sequence[re.Pattern[str]]
) -> str | None:
    """For one model-parallel rank's part of a step (`mp_rank_00/<name>.ckpt`, `layouts.is_rank_dir`):
    why it must stay, unless a newer step is there in every rank's directory beside it, with no
    unfinished marker (NeMo's) above them. Names only, afresh: the last line of defence for the newest step
    every rank holds, which the plan keeps (`planner.with_whole_steps`)."""
    if not is_rank_dir(run_path.name):
        return None
    mine = recognise_by_name(name, is_dir, patterns)
    if mine is None:
        return f"a model-parallel rank's file whose step cannot be read ({name})"
    above = os.listdir(run_path.parent)
    ranks = sorted(n for n in above if is_rank_dir(n))
    held = [set(os.listdir(run_path.parent / r)) for r in ranks]
    for other in set.intersection(*held) if held else ():
        cand = recognise_by_name(other, is_dir, patterns)
        if (cand is not None and cand.unit == mine.unit and cand.step > mine.step
                and not unfinished_markers(other).intersection(above)):
            return None
    return (
        f"no newer step is saved whole in every model-parallel rank ({', '.join(ranks[:4])}"
        f"{'...' if len(ranks) > 4 else ''}): its part of the last step they all hold"
    )


REVIEW = "%review"  # a trash entry's suffix: never purged (`Reaper._undo`)
WAIT = "not in the trash long enough"  # `Reaper._not_yet`
_SUFFIXES = ("%slim", "%consolidating", REVIEW)  # what `_trash_name` never ends with
# Why the trash cannot be made: full, over quota, read-only, not ours to write (or the root gone)
_NO_TRASH = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM})


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


def _rename_noreplace(src: str, src_fd: int, dst: str, dst_fd: int) -> None:
    """rename(2) that never replaces what is at `dst` (renameat2 RENAME_NOREPLACE: EEXIST).
    Where the filesystem or libc lacks the flag (EINVAL: some FUSE and NFS), a look, then the
    rename: the name is taken by nobody but a person in that instant."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        renameat2 = None
    if renameat2 is not None:
        if renameat2(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), 1) == 0:  # RENAME_NOREPLACE
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), src)
    if _identity(dst, dst_fd) is not None:
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


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
    checkpoint and emptied it.
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


def _pinned_at(name: str, parent_fd: int) -> str | None:
    """Why `name` (just renamed under `parent_fd`) must go back: a pin at its top, by a listing of
    it (a lookup of the pin's name alone could be answered from a negative cache), or a listing
    that cannot be had. None: neither, or a checkpoint that is a file (its pin, beside it, was
    re-checked before the rename)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except NotADirectoryError:
        return None
    except OSError as exc:
        return f"cannot look at it in the trash: {exc}"
    try:
        if layouts.PIN_FILE in os.listdir(fd):
            return "pinned (its pin seen only under its name in the trash: a mount that caches listings)"
        return None
    except OSError as exc:
        return f"cannot look at it in the trash: {exc}"
    finally:
        os.close(fd)


def _contents(dir_fd: int) -> dict[str, tuple[int, int, int, int]] | None:
    """(dev, inode, size, mtime_ns) of each entry of a directory; None if one is not a regular file."""
    out = {}
    for name in os.listdir(dir_fd):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return None
        out[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _made(weights: dict) -> str:
    """What a consolidation made, for a line: its size, the index's sha256, how long it took."""
    size = sum(f["bytes"] for f in weights["files"])
    shards = len(weights["files"])
    plural = "s" if shards > 1 else ""
    took = f"{weights['seconds']:.1f}s"
    return f"{format_size(size)} in {shards} shard{plural}, sha256 {weights['sha256'][:12]}, {took}"


def _weights_record(
    index: str, size: int, sha256: str, source: str, files: Sequence[tuple[str, int, str]], tool: str
) -> dict:
    """The slim marker's `weights` for fp32 weights ckptd consolidated: the index and its shards."""
    return {
        "path": index,
        "bytes": size,
        "consolidated": True,
        "source": source,
        "sha256": sha256,  # of the index, which holds each shard's sha256
        "files": [{"path": p, "bytes": b, "sha256": h} for p, b, h in files],
        "tool": tool,
        "dtype": "fp32",
    }


def _entry_size(entries: list[Entry], rel: str) -> int | None:
    return next((e.size for e in entries if e.rel == rel), None)


def _unchanged_but(entries: list[Entry], ours: str) -> str:
    """A fingerprint of a checkpoint's entries leaving out our own work directory `ours` (and
    what is in it) and the checkpoint directory's own size and mtime, which adding it changes."""
    kept = [e for e in entries if e.rel != ours and not e.rel.startswith(f"{ours}/")]
    return fingerprint([Entry("", e.kind, 0, 0) if e.rel == "" else e for e in kept])


def _size(path: Path) -> int:
    """What removing `path` frees now: allocated blocks of the inodes whose every link is inside
    it (a file hard-linked from a checkpoint that stays frees nothing: space.py)."""
    try:
        return space.freed_by(walk(path))
    except TooDeep as exc:
        return space.freed_by(exc.entries)
    except OSError:
        return 0


def waiting_in_trash(root: Path) -> int:
    """What purging `root`'s trash frees, however long its entries still wait (another process's
    wait `foreign_wait`; one a killed prune left): `min_free` counts it as free already, so it
    deletes nothing more for space a purge frees anyway. The trash's entries and what was renamed
    into the root's top under ckptd's hidden name; not those held for review, nor a hidden name
    ckptd did not give (never purged: `Reaper._not_yet`), nor a trash on another filesystem."""
    total = 0
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        for name in os.listdir(root_fd):
            ours = name.startswith(HIDDEN_TRASH) and _trash_origin(name) is not None
            if ours and not name.endswith(REVIEW):
                total += _size(root / name)
        try:
            trash_fd = os.open(TRASH_DIR, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return total
        try:
            if _another_filesystem(TRASH_DIR, root_fd, trash_fd, root / TRASH_DIR) is not None:
                return total
            for name in os.listdir(trash_fd):
                if not name.endswith(REVIEW):
                    total += _size(root / TRASH_DIR / name)
        finally:
            os.close(trash_fd)
    except OSError:
        return total
    finally:
        os.close(root_fd)
    return total


class LockHeld(Exception):
    pass


class RootLockUnavailable(LockHeld):
    """`<root>/.ckptd/local.lock` cannot be taken, on a root that is not read-only: deleting
    there could go on beside a ckptd with another state_dir, so nobody here deletes."""


ROOT_LOCK = "local.lock"  # in <root>/.ckptd/: the lock every ckptd on this host deleting in the root takes


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
        try:
            root_fd = self._root_lock(blocking)
        except BaseException:
            if fd is not None:
                os.close(fd)
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
                    os.close(fd)
                    if root_fd is not None:
                        os.close(root_fd)
                    raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
                log.warning("%s: no room for the holder's pid line (%s); the lock holds all the same",
                            self.path, exc.strerror)
        self._fd, self._root_fd, self._held = fd, root_fd, True

    def _root_lock(self, blocking: bool) -> int | None:
        """The flock on `<root>/.ckptd/local.lock` (None where it cannot be had: see the class).
        Opened without following a symlink planted for `.ckptd` or the lock."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(layouts.LEASE_DIR, 0o755, dir_fd=root_fd)
                dir_fd = os.open(layouts.LEASE_DIR, flags, dir_fd=root_fd)
            finally:
                os.close(root_fd)
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
            raise LockHeld(f"another ckptd is deleting in {self.root} (holds {self.root_path})") from None
        except RootLockUnavailable:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise self._unavailable(exc.strerror) from None
        return fd

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
