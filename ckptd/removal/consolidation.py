"""The consolidation hand-off: fp32 weights for a checkpoint that has none of its own, before a
slim removes its optimizer state. It only ever adds a directory: zero_to_fp32 writes into a work
directory of its own under `<root>/.ckptd-consolidating/` (`begin_consolidation`; the daemon runs it
on a worker of its own, `Work.consolidation`), and the verified output is renamed into the
checkpoint as `fp32/` only if the checkpoint did not change meanwhile (`finish_consolidation`).
Anything else, and the work directory goes to the trash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd import frameworks
from ckptd.decide.policy import Decision
from ckptd.discover.layouts import TRASH_DIR
from ckptd.formatting import format_size
from ckptd.judge import slim
from ckptd.judge.evidence import Entry, TooDeep, fingerprint, walk
from ckptd.removal.fs import _DIR_FLAGS, _contents, _identity, open_dir_nofollow, open_private_dir
from ckptd.removal.outcome import DRY_RUN_NOTE, Anchors, Outcome, Result, _Stop
from ckptd.removal.recheck import Fence, Rechecks
from ckptd.removal.record import Recorder
from ckptd.removal.trash import TrashDir, _trash_name
from ckptd.removal.zero_to_fp32 import Consolidated, Consolidation, ConsolidationFailed

log = logging.getLogger(__name__)

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


class Consolidating:
    """A reaper's consolidations (removal/reaper.py): fp32 weights consolidated into a checkpoint,
    re-checked first (`Rechecks`), under the fence, journalled (`Recorder`); what fails or is
    refused goes to the trash (`TrashDir`)."""

    def __init__(self, rechecks: Rechecks, fence: Fence, recorder: Recorder, trash: TrashDir,
                 clock: Callable[[], float], *, dry_run: bool, consolidate_timeout: float | None):
        self.rechecks = rechecks
        self.fence = fence
        self.recorder = recorder
        self.trash_dir = trash
        self.root = trash.root
        self.clock = clock
        self.dry_run = dry_run
        self.consolidate_timeout = consolidate_timeout

    def begin_consolidation(self, decision: Decision, anchors: Anchors) -> Work | Result:
        """Re-check a slim that needs its fp32 weights first, and make an empty work directory for
        zero_to_fp32 (`Work.consolidation` runs it, on any thread; then `finish_consolidation`)."""
        c = decision.checkpoint
        fields = self.recorder.fields(decision, 0, action="consolidate")
        why = self.rechecks.recheck(decision, anchors)
        if why is None and (c.slim.source is None or c.slim.weights is not None):
            why = "nothing to consolidate"
        try:
            if why is None:
                return self._begin(decision)
        except _Stop as stop:
            why = stop.why
            if stop.outcome is Outcome.FAILED:
                log.error("not consolidating %s: %s", c.rel, why)
                self.recorder.record("failed", why=why, **fields)
                return Result(decision, Outcome.FAILED, why)
        self.recorder.record("refused", why=why, **fields)
        return Result(decision, Outcome.REFUSED, why)

    def finish_consolidation(self, work: Work, outcome: Consolidated | BaseException) -> Result:
        """Move verified weights into the checkpoint as `fp32/`, if it is still the checkpoint the
        consolidation began from; else (or on a failed one) move the work directory to the trash."""
        fields = self.recorder.fields(work.decision, 0, action="consolidate")
        try:
            if isinstance(outcome, BaseException):
                raise _Stop(Outcome.FAILED, f"consolidation failed, nothing removed: {outcome}")
            if self.dry_run:  # switched on by a reload while it ran
                raise _Stop(Outcome.REFUSED, f"dry run: not moved into place {DRY_RUN_NOTE}")
            weights = self._commit(work, outcome)
        except _Stop as stop:
            self._discard(work.name)
            self.recorder.record(str(stop.outcome), why=stop.why, **fields)
            return Result(work.decision, stop.outcome, stop.why)
        self.recorder.record("consolidated", weights=weights, **fields)
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

    def consolidate_inline(self, decision: Decision, before: list[Entry], anchors: Anchors) -> dict:
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
        fields = self.recorder.fields(work.decision, 0, action="consolidate")
        self.recorder.record("consolidated", weights=weights, **fields)
        # Consolidation took a while: nobody but us may have touched the checkpoint since.
        if _unchanged_but(before, slim.WEIGHTS_DIR) != _unchanged_but(walk(c.path), slim.WEIGHTS_DIR):
            raise _Stop(Outcome.REFUSED, "changed while its weights were being consolidated")
        # Consolidation took a while: are the run's anchors still there, and does the framework's
        # resume pointer (DeepSpeed's `latest`, rolled back by an operator meanwhile) name it now?
        why = self.rechecks.anchor_problem(c, anchors, self.clock())
        if why is None:
            why = self.rechecks.pointer_problem(c)
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
        return self.fence.why_not()  # a ckptd that lost the lead adds nothing to a checkpoint either

    def _discard(self, name: str) -> int:
        """Move a work directory (ours) into the trash, for `purge`. 1 if it moved."""
        try:
            area_fd = open_dir_nofollow(self.root, WORK_DIR)
        except OSError:
            return 0
        try:
            if _identity(name, area_fd) is None:
                return 0
            trash_fd = self.trash_dir.open()
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
        return open_private_dir(self.root, WORK_DIR, 0o700)


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


def _unchanged_but(entries: list[Entry], ours: str) -> str:
    """A fingerprint of a checkpoint's entries leaving out our own work directory `ours` (and
    what is in it) and the checkpoint directory's own size and mtime, which adding it changes."""
    kept = [e for e in entries if e.rel != ours and not e.rel.startswith(f"{ours}/")]
    return fingerprint([Entry("", e.kind, 0, 0) if e.rel == "" else e for e in kept])
