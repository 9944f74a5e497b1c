"""Retention: which checkpoints to keep, and why. Pure functions.

Rules combine as a union: a checkpoint is kept if any rule keeps it, and
every rule that keeps it is named in its reasons. Whatever the config says:
- the newest complete checkpoint of every run is kept, and so is the newest
  complete *full* one (not slimmed: the newest a trainer can resume from);
- incomplete and writing checkpoints are never deleted;
- budgets (`max_size`, `min_free`) take the oldest *unprotected* checkpoints
  first, and stop with a warning rather than touch a protected one
  (protected: newest complete, newest full, best, pinned, not complete).

Slimming (`keep_full_last`) is a third action: a checkpoint some rule keeps but
that is not among the N newest complete full checkpoints keeps its weights and
loses its optimizer state. Slimmed checkpoints are complete but not full, so
they never count toward the N, and the newest full one is never slimmed. A
planned slim counts as freeing its optimizer bytes in the budgets, which
delete whole checkpoints and never slim on their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ckptd.config import FreeSpace, Retention, format_duration, format_size
from ckptd.model import Action, Checkpoint, Run, State, Verdict, is_rankable


@dataclass(frozen=True)
class Decision:
    checkpoint: Checkpoint
    action: Action
    reasons: tuple[str, ...]
    protected: bool = False  # budgets may not delete it
    metric: float | str | None = None

    @property
    def bytes_freed(self) -> int:
        """What carrying it out frees: the checkpoint, its optimizer state, or nothing.

        A slim's consolidated weights (4 bytes a parameter, when it had none) are not subtracted.
        """
        if self.action is Action.DELETE:
            return self.checkpoint.size_bytes
        if self.action is Action.SLIM:
            return self.checkpoint.slim.removable_bytes
        return 0

    def line(self) -> str:
        """`delete run42/checkpoint-1200: outside keep_last=2 and keep_best=1 (eval_loss, min)`."""
        return f"{self.action} {self.checkpoint.rel}: {'; '.join(self.reasons)}"


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    warnings: tuple[str, ...] = ()

    @property
    def deletions(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action is Action.DELETE)

    @property
    def slims(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action is Action.SLIM)


def decide_run(run: Run, r: Retention) -> list[Decision]:
    """Keep, slim or delete each checkpoint of one run, oldest first, each with its reasons."""
    ckpts = sorted(run.checkpoints, key=Checkpoint.sort_key)
    complete = [c for c in ckpts if c.state is State.COMPLETE]
    keep: dict[int, list[str]] = {id(c): [] for c in ckpts}
    protected: set[int] = set()
    metrics: dict[int, float | str | None] = {}

    def kept(c: Checkpoint, reason: str, protect: bool = False) -> None:
        keep[id(c)].append(reason)
        if protect:
            protected.add(id(c))

    if complete:
        kept(complete[-1], "newest complete", protect=True)
    full = [c for c in complete if not c.slimmed]
    if full and full[-1] is not complete[-1]:
        kept(full[-1], "newest full (resumable)", protect=True)
    if r.keep_last > 1:
        for i, c in enumerate(reversed(complete[-r.keep_last : -1]), start=2):
            kept(c, f"keep_last={r.keep_last} (#{i} newest)")

    if r.keep_best and r.metric:
        for c in ckpts:
            metrics[id(c)] = run.metric(c, r.metric)
        rankable = [c for c in complete if is_rankable(metrics[id(c)])]
        sign = 1.0 if r.mode == "min" else -1.0
        # Ties go to the newer checkpoint: it saw more training for the same score.
        ranked = sorted(rankable, key=lambda c: (sign * metrics[id(c)], -c.step))  # type: ignore[operator]
        for c in ranked[: r.keep_best]:
            kept(c, f"best {r.metric}={_fmt(metrics[id(c)])} ({r.mode})", protect=True)
        if r.keep_missing_metric:
            for c in complete:
                if metrics[id(c)] is None or isinstance(metrics[id(c)], str):
                    kept(c, f"no usable {r.metric} logged (keep_missing_metric)")
    elif r.keep_best:
        ts = run.trainer_state()
        for c in complete:
            if ts is not None and c.name == ts.best_model_checkpoint:
                metrics[id(c)] = ts.best_metric
                value = f" (best_metric={_fmt(ts.best_metric)})" if ts.best_metric is not None else ""
                kept(c, f"trainer's best_model_checkpoint{value}", protect=True)

    if r.keep_every_steps:
        for c in complete:
            if c.step % r.keep_every_steps == 0:
                kept(c, f"keep_every_steps={r.keep_every_steps}")

    if r.keep_within is not None and complete:
        newest = max(c.newest_mtime for c in complete)
        for c in complete:
            if newest - c.newest_mtime <= r.keep_within:
                kept(c, f"within keep_within={format_duration(r.keep_within)} of the run's newest")

    for c in ckpts:
        if c.pinned:
            kept(c, "pinned", protect=True)
        if c.state is not State.COMPLETE:
            kept(c, f"{c.state}, never deleted: {_first_problem(c)}", protect=True)

    slims = _slims(ckpts, full, keep, r)
    outside = f"outside {r.describe()}"
    decisions = []
    for c in ckpts:
        reasons = keep[id(c)]
        metric = metrics.get(id(c))
        if id(c) in slims:
            decisions.append(Decision(c, Action.SLIM, (slims[id(c)],), id(c) in protected, metric))
        elif reasons:
            decisions.append(Decision(c, Action.KEEP, tuple(reasons), id(c) in protected, metric))
        else:
            incomparable = isinstance(metric, float) and not is_rankable(metric)
            note = f" ({r.metric}={_fmt(metric)} is not comparable)" if incomparable else ""
            decisions.append(Decision(c, Action.DELETE, (outside + note,), False, metric))
    return decisions


def _slims(
    ckpts: list[Checkpoint], full: list[Checkpoint], keep: dict[int, list[str]], r: Retention
) -> dict[int, str]:
    """The kept checkpoints to slim, with their reason; notes in `keep` why others are not.

    Pinned checkpoints are kept as they are. A slimmed checkpoint that still holds
    optimizer files was interrupted while they were being removed: it is finished.
    """
    newest_full = {id(c) for c in full[-r.keep_full_last :]} if r.keep_full_last else set()
    out: dict[int, str] = {}
    for c in ckpts:
        reasons = keep[id(c)]
        if not reasons or c.state is not State.COMPLETE or c.pinned:
            continue
        if c.slimmed:
            if c.slim.removable and c.slim.blocker is None:
                out[id(c)] = f"slim: finish interrupted slimming (kept for: {'; '.join(reasons)})"
            else:
                reasons.append("slimmed")
            continue
        if r.keep_full_last is None or id(c) in newest_full or not c.slim.removable:
            continue
        if c.slim.blocker is not None:
            reasons.append(f"not slimmed: {c.slim.blocker}")
        else:
            keeps = f"; keeps {c.slim.keeps}" if c.slim.keeps else ""
            kept_for = "; ".join(reasons)
            out[id(c)] = f"slim: outside keep_full_last={r.keep_full_last} (kept for: {kept_for}){keeps}"
    return out


def enforce_max_size(decisions: list[Decision], max_size: int) -> tuple[list[Decision], list[str]]:
    """Delete the run's oldest unprotected checkpoints until it fits in `max_size`.

    A checkpoint planned for slimming counts with what slimming leaves of it.
    """
    total = sum(d.checkpoint.size_bytes - d.bytes_freed for d in decisions if d.action is not Action.DELETE)
    if total <= max_size:
        return decisions, []
    out = list(decisions)
    reason = f"max_size={format_size(max_size)} exceeded (run holds {format_size(total)})"
    for i, d in enumerate(out):  # oldest first
        if total <= max_size:
            break
        if _budget_may_take(d):
            out[i] = replace(d, action=Action.DELETE, reasons=(reason,))
            total -= d.checkpoint.size_bytes - d.bytes_freed
    warnings = []
    if total > max_size and decisions:
        run = decisions[0].checkpoint
        warnings.append(
            f"{run.root / run.run}: {format_size(total)} still over max_size={format_size(max_size)}; "
            "the rest is protected (newest complete, best, pinned or not complete)"
        )
    return out, warnings


def enforce_min_free(
    decisions: Sequence[Decision], *, free: int, total: int, floor: FreeSpace, where: str
) -> tuple[list[Decision], list[str]]:
    """Delete the oldest unprotected checkpoints on one filesystem until `floor` is free.

    `decisions` are every decision on that filesystem, across runs and roots;
    space already freed by planned deletions and slims counts.
    """
    required = floor.required(total)
    expected = free + sum(d.bytes_freed for d in decisions)
    if expected >= required:
        return list(decisions), []
    out = list(decisions)
    order = sorted(range(len(out)), key=lambda i: (out[i].checkpoint.newest_mtime, out[i].checkpoint.rel))
    reason = f"min_free={floor} not met on {where} ({format_size(free)} free)"
    for i in order:
        if expected >= required:
            break
        if _budget_may_take(out[i]):
            expected += out[i].checkpoint.size_bytes - out[i].bytes_freed
            out[i] = replace(out[i], action=Action.DELETE, reasons=(reason,))
    warnings = []
    if expected < required:
        warnings.append(
            f"{where}: only {format_size(expected)} free after deletions, min_free={floor} wants "
            f"{format_size(required)}; the rest is protected (newest complete, best, pinned or not complete)"
        )
    return out, warnings


def _budget_may_take(d: Decision) -> bool:
    return d.action in (Action.KEEP, Action.SLIM) and not d.protected and d.checkpoint.state is State.COMPLETE


def _first_problem(c: Checkpoint) -> str:
    for check in c.checks:
        if check.verdict is not Verdict.PASSED:
            return f"{check.name} {check.verdict}: {check.detail}"
    return "state reported by the daemon"


def _fmt(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value) if isinstance(value, str) else "none"


def summarise(decisions: Iterable[Decision]) -> dict[str, int]:
    out = {"keep": 0, "delete": 0, "slim": 0, "bytes_to_free": 0}
    for d in decisions:
        out[str(d.action)] += 1
        out["bytes_to_free"] += d.bytes_freed
    return out
