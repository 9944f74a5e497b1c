"""Slimming: a checkpoint's optimizer files renamed into the trash, its weights kept and verified in
place, under a marker (`.ckptd-slim.json`) that says first "removing" and then "done"; see
`Slimming.slim_one` for what a crash at each step leaves. Where it has no weights of its own to
keep, they are consolidated first (removal/consolidation.py), and nothing is removed unless that
output verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ckptd.decide.policy import Decision
from ckptd.discover.layouts import TRASH_DIR
from ckptd.formatting import format_size
from ckptd.judge import slim
from ckptd.judge.evidence import Entry, TooDeep, fingerprint, read_slim_marker, walk
from ckptd.model import Checkpoint, ConsolidatedWeights
from ckptd.removal.consolidation import Consolidating, _made, _weights_record
from ckptd.removal.fs import _unlink_at, open_dir_nofollow
from ckptd.removal.outcome import DRY_RUN_NOTE, Anchors, Outcome, Result, _Stop
from ckptd.removal.recheck import Fence, Rechecks
from ckptd.removal.record import Recorder
from ckptd.removal.trash import Trashing, _trash_name

log = logging.getLogger(__name__)


class Slimming:
    """A reaper's slimming (removal/reaper.py): a checkpoint's optimizer state into the trash,
    re-checked first (`Rechecks`), under the fence, journalled (`Recorder`); its fp32 weights
    consolidated first where it has none (`Consolidating`)."""

    def __init__(self, rechecks: Rechecks, fence: Fence, recorder: Recorder, trashing: Trashing,
                 consolidating: Consolidating, clock: Callable[[], float], *, dry_run: bool):
        self.rechecks = rechecks
        self.fence = fence
        self.recorder = recorder
        self.trashing = trashing
        self.consolidating = consolidating
        self.root = trashing.root
        self.trash = trashing.trash
        self.clock = clock
        self.dry_run = dry_run

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
        fields = self.recorder.fields(decision, s.removable_bytes, action="slim")

        def refuse(why: str) -> Result:
            log.warning("refusing to slim %s: %s", c.rel, why)
            self.recorder.record("refused", why=why, **fields)
            return Result(decision, Outcome.REFUSED, why)

        def fail(why: str) -> Result:
            log.error("not slimming %s: %s", c.rel, why)
            self.recorder.record("failed", why=why, **fields)
            return Result(decision, Outcome.FAILED, why)

        why_not = self._slim_problem(decision, anchors)
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
        try:
            weights, done = self._weights_kept(decision, before, previous, anchors)
        except _Stop as stop:
            return refuse(stop.why) if stop.outcome is Outcome.REFUSED else fail(stop.why)

        already = list(previous.removed) if previous is not None else []
        planned = already + [f for f in s.removable if f[0] not in {p for p, _ in already}]
        target = self.trash / f"{_trash_name(c, self.clock())}%slim"
        why_not = self.fence.why_not()
        if why_not is not None:
            return refuse(why_not)
        try:
            self.trashing.trash_dir.ensure()
            self.recorder.intent("slimming", trash=str(target), files=[p for p, _ in s.removable],
                                 weights=weights, **fields)
            self._write_marker(c, "removing", planned, weights, decision)
        except OSError as exc:
            return fail(f"cannot prepare {TRASH_DIR}/, journal or {slim.MARKER}: {exc}")
        try:
            moved = self._move_optimizer_files(c, target)
        except _Stop as stop:
            return refuse(stop.why) if stop.outcome is Outcome.REFUSED else fail(stop.why)
        self.trashing.ledger.finished.add(target.name)
        freed = sum(size for _, size in moved)
        try:
            self._write_marker(c, "done", planned, weights, decision)
        except OSError as exc:  # "removing" stays: harmless, the next run rewrites it
            log.error("cannot finish %s in %s: %s", slim.MARKER, c.path, exc)
        self.recorder.record("slimmed", trash=str(target), freed=freed, weights=weights, **fields)
        log.info("slimmed %s (%s to the trash): %s", c.rel, format_size(freed), "; ".join(decision.reasons))
        where = target.relative_to(self.root)
        detail = f"{done}moved {len(moved)} optimizer files ({format_size(freed)}) to {where}"
        return Result(decision, Outcome.SLIMMED, detail, target, freed)

    def _slim_problem(self, decision: Decision, anchors: Anchors) -> str | None:
        """Why `decision`'s slim must not be carried out now (its re-check, `recheck`, or nothing
        that may be removed), or None."""
        s = decision.checkpoint.slim
        why_not = self.rechecks.recheck(decision, anchors)
        if why_not is None and s.blocker is not None:
            why_not = f"cannot slim: {s.blocker}"
        if why_not is None and not s.removable:
            why_not = "no optimizer state to remove"
        return why_not

    def _weights_kept(
        self, decision: Decision, before: list[Entry], previous: slim.Marker | None, anchors: Anchors
    ) -> tuple[dict, str]:
        """Step 1 of `slim_one`: the marker's account of the weights it keeps (consolidated first
        where it has none of its own), and what was done for them, for the result's line. Raises
        `_Stop`."""
        c = decision.checkpoint
        s = c.slim
        done = ""
        if previous is not None:
            weights = previous.document["weights"]
        elif s.weights is None:
            weights = self.consolidating.consolidate_inline(decision, before, anchors)
            done = f"consolidated {s.source} into {slim.WEIGHTS_DIR}/ ({_made(weights)}); "
        elif s.consolidated is not None:
            try:
                weights = self._consolidated_weights(c, s.consolidated)
            except OSError as exc:
                raise _Stop(Outcome.REFUSED, f"cannot read {s.consolidated.index}: {exc}") from None
        else:
            weights = {"path": s.weights, "bytes": _entry_size(before, s.weights), "consolidated": False}
            if s.dtype is not None:
                weights["dtype"] = s.dtype
        return weights, done

    def _move_optimizer_files(self, c: Checkpoint, target: Path) -> list[tuple[str, int]]:
        """Step 4 of `slim_one`: each optimizer file renamed into `target` in the trash, the fence
        asked before each and again after. Returns what moved; raises `_Stop` (the marker says
        "removing" then, and the next run or leader finishes it)."""
        s = c.slim
        moved: list[tuple[str, int]] = []
        for rel, size in s.removable:
            # Both ends through descriptors opened without following symlinks: a global_step*
            # directory swapped for a link cannot bring files from elsewhere into the trash.
            sub, _, name = rel.rpartition("/")
            so_far = f"moved {len(moved)} of {len(s.removable)} files, then"
            why_not = self.fence.why_not()
            if why_not is not None:  # the marker says "removing": the next leader finishes it
                raise _Stop(Outcome.REFUSED, f"{so_far}: {why_not}")
            try:
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                src_fd = open_dir_nofollow(self.root, f"{c.rel}/{sub}" if sub else c.rel)
                try:
                    dst_fd = open_dir_nofollow(self.root, str((target / rel).parent.relative_to(self.root)))
                    try:
                        os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                        why_not = self.fence.why_not(after=True)  # as after a checkpoint's rename
                        if why_not is not None:
                            undone = self.trashing.undo(name, dst_fd, name, src_fd, f"{c.rel}/{rel}", why_not,
                                                review=False)
                            raise _Stop(Outcome.REFUSED, f"{so_far}: {why_not}; {undone}")
                    finally:
                        os.close(dst_fd)
                finally:
                    os.close(src_fd)
            except FileNotFoundError:
                continue  # gone already, as the marker says: nothing to move
            except OSError as exc:  # the marker says "removing": the next run tries again
                raise _Stop(Outcome.FAILED, f"{so_far}: {exc}") from None
            moved.append((rel, size))
        return moved

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


def _entry_size(entries: list[Entry], rel: str) -> int | None:
    return next((e.size for e in entries if e.rel == rel), None)
