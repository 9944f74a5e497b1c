"""The re-check just before anything is removed, afresh from disk: still inside its root with no
symlink on the way, not a symlink itself, not inside another ckptd's root nested in ours, still
complete, unchanged since the plan was made (same fingerprint), still quiet, not pinned, holding
no mount point, not named by the framework's resume pointer, and each of the run's anchors (its
newest complete and full checkpoints by step and by time, which the plan kept) still there,
complete and unchanged. Then the whole run is read again, strictly, and decided again by the same
rules: it acts only if that decision does the same (a file rewritten in place, its mtime kept,
changes no fingerprint, but may change which checkpoint is best). Any doubt and it is left alone.

And the fence (`Fence`): where several ckptd could lead (fleet/lease.py), asked immediately before
each rename that removes something from a checkpoint or a run, and once more just after.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptd.archive.upload import Archiver
from ckptd.decide import policy, rules
from ckptd.decide.planner import Scanner, retention_for, rule_dir
from ckptd.decide.policy import Decision
from ckptd.discover.layouts import recognise_by_name, unfinished_markers
from ckptd.discover.runs import ROOT_MARKS
from ckptd.frameworks import is_rank_dir
from ckptd.judge.evidence import resume_pointers
from ckptd.model import Action, Checkpoint, State, pointer_reason
from ckptd.removal.outcome import Anchors
from ckptd.volume import mounts

FENCED = "not the leader: "  # how a refusal by the fence begins (`Fence.why_not`)


class Fence:
    """A reaper's fence (removal/reaper.py): `ask` says why this process may no longer act (it lost
    the lead), or None; None where no other process could lead (the daemon sets it per pass)."""

    def __init__(self, ask: Callable[[], str | None] | None = None):
        self.ask = ask

    def why_not(self, *, after: bool = False) -> str | None:
        """Why this process may not rename now (it lost the lead), or None. `after`: asked
        once more just after a rename, whose undoing the caller then owes."""
        if self.ask is None:
            return None
        try:
            why = self.ask()
        except Exception as exc:  # a fence that cannot answer is a no
            why = f"cannot tell whether this ckptd still leads: {exc!r}"
        return None if why is None else f"{FENCED}{why}"


class Rechecks:
    """A reaper's re-check (removal/reaper.py): why a decision must not be carried out now."""

    def __init__(self, scanner: Scanner, clock: Callable[[], float], archiver: Archiver | None, *,
                 dry_run: bool):
        self.scanner = scanner
        self.root = scanner.root.path
        self.clock = clock
        self.archiver = archiver
        self.dry_run = dry_run

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
        why = _in_another_root(self.root, planned.rel)
        if why is not None:
            return why
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
        why = self.pointer_problem(planned)
        if why is None:
            why = _last_whole_step(path.parent, planned.name, stat.S_ISDIR(st.st_mode), self.scanner.patterns)
        why = why or self.anchor_problem(planned, anchors, now)
        return why or self._decided_otherwise(decision, now) or self._archive_problem(planned)

    def _archive_problem(self, planned: Checkpoint) -> str | None:
        """With `[roots.archive] required`: whether its archive is whole, verified and of these very
        files (archive/gate.py). Asked last: it reads the store."""
        return None if self.archiver is None else self.archiver.problem(planned, dry_run=self.dry_run)

    def pointer_problem(self, planned: Checkpoint) -> str | None:
        """Whether the run's resume pointer names it now (rolled back to it since the plan, say)."""
        run_path = planned.path.parent
        pointer = resume_pointers(run_path, os.listdir(run_path)).get(planned.name)
        return None if pointer is None else pointer_reason(pointer)

    def anchor_problem(self, planned: Checkpoint, anchors: Anchors, now: float) -> str | None:
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
            retention, _ = retention_for(self.scanner.root, rule_dir(run))
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


def _in_another_root(root: Path, rel: str) -> str | None:
    """Why the checkpoint at `rel` is not ours: a directory on its way below `root`, or the
    checkpoint itself, holds `.ckptd/local.lock` or `.ckptd-trash/`, so it lies in another ckptd's root
    (`discover.ROOT_MARKS`; made there since the plan, by a ckptd started since). Or None."""
    where = root
    for part in rel.split("/"):
        where = where / part
        for mark in ROOT_MARKS:
            try:
                os.lstat(where / mark)
            except (FileNotFoundError, NotADirectoryError):
                continue
            return f"inside another ckptd's root ({where} holds {mark}): not ours to delete"
    return None


def _last_whole_step(
    run_path: Path, name: str, is_dir: bool, patterns: Sequence[re.Pattern[str]]
) -> str | None:
    """For one model-parallel rank's part of a step (`mp_rank_00/<name>.ckpt`, `frameworks.is_rank_dir`):
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
