"""Retention: which checkpoints to keep, and why. Pure functions.

The rules are in `rules`, one small object each. They combine as a union:
a checkpoint is kept if any rule keeps it, and every rule that keeps it is
named in its reasons. Whatever the config says:
- each run's *anchors* are kept and protected: its newest complete checkpoint
  by step and the one written last (by time: a new job writing checkpoint-100
  into a directory that holds a day-old checkpoint-5000 must not lose it as
  "old"), and likewise its newest complete *full* ones (not slimmed: what a
  trainer can resume from). The reaper re-checks every anchor before each
  deletion of the run;
- incomplete and writing checkpoints are never deleted; nor is a pinned one, the
  one the framework's own resume pointer names (DeepSpeed's `latest`, Megatron's
  tracker), or one that holds a mount point (another filesystem);
- budgets (`max_size`, `min_free`) take the oldest *unprotected* checkpoints
  first, and only when that can meet them: a budget that cannot be met deletes
  nothing and says so (deleting every unprotected checkpoint and still missing
  the floor would lose checkpoints for nothing).

`keep_total` is the other way to count, the Hugging Face Trainer's `save_total_limit`
(transformers trainer_utils.py `rotate_checkpoints`): at most N, the newest and the best
counted inside the N. It replaces keep_last and keep_best; the anchors and every protection
above still hold, over the limit if need be, and say so.

Slimming (`keep_full_last`) is a third action: a checkpoint some rule keeps but
that is not among the N newest complete full checkpoints keeps its weights and
loses its optimizer state. Slimmed checkpoints are complete but not full, so
they never count toward the N, and the newest full ones are never slimmed. A
planned slim counts as freeing its optimizer bytes in the budgets, which
delete whole checkpoints and never slim on their own.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ckptd.config import FreeSpace, Retention, Root
from ckptd.decide.rules import OrderedRun, _fmt, rules_for
from ckptd.formatting import format_size
from ckptd.model import (
    Action,
    Checkpoint,
    Run,
    State,
    is_rankable,
    trainer_metric,
)
from ckptd.volume.space import Ledger, own_bytes


@dataclass(frozen=True, init=False)
class Decision:
    checkpoint: Checkpoint
    action: Action
    reasons: tuple[str, ...]
    protected: bool = False  # budgets may not delete it
    metric: float | str | None = None
    metric_source: str | None = None  # where `metric` was read (model.TRAINER_STATE, FILE_NAME, ...)

    def __init__(
        self,
        checkpoint: Checkpoint,
        action: Action,
        reasons: tuple[str, ...],
        protected: bool = False,
        metric: float | str | None = None,
        metric_source: str | None = None,
    ) -> None:
        # The dataclass's own __init__, with one object.__setattr__ where a frozen one makes six: a
        # plan makes a Decision for every checkpoint, and a budget another for each it deletes.
        # Every field, in order (test_plan_equivalence checks these names are the fields).
        _set_attr(self, "__dict__", {
            "checkpoint": checkpoint,
            "action": action,
            "reasons": reasons,
            "protected": protected,
            "metric": metric,
            "metric_source": metric_source,
        })

    @property
    def bytes_freed(self) -> int:
        """What carrying it out alone frees: the checkpoint's blocks that nothing else links, its
        optimizer state, or nothing (several deletions together: `freed`).

        A slim's consolidated weights (4 bytes a parameter, when it had none) are not subtracted.
        """
        if self.action is Action.DELETE:
            return own_bytes(self.checkpoint)  # alone: a file also linked from elsewhere frees nothing
        if self.action is Action.SLIM:
            return self.checkpoint.slim.removable_bytes
        return 0

    def line(self) -> str:
        """`delete run42/checkpoint-1200: outside keep_last=2 and keep_best=1 (eval_loss, min)`."""
        return f"{self.action} {self.checkpoint.rel}: {'; '.join(self.reasons)}"


_set_attr = object.__setattr__


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
    """Keep, slim or delete each checkpoint of one run, oldest first, each with its reasons.

    The union of the retention's rules (`rules.rules_for`): a checkpoint any rule keeps is kept
    with every keeping rule's reason, protected if one of them protects it; what none keeps is
    deleted. Planning decides for every checkpoint of every run: each rule is a plain loop over
    the run's list, and what a reason says about the rules is formatted once per run.
    """
    ordered = OrderedRun.of(run, r)
    ckpts = ordered.ckpts
    keep: dict[int, list[str]] = {id(c): [] for c in ckpts}
    protected: set[int] = set()
    readings = ordered.readings
    for rule in rules_for(r):
        for c, reason, protect, reading in rule.keeps(ordered, protected):
            keep[id(c)].append(reason)
            if protect:
                protected.add(id(c))
            if reading is not None:
                readings[id(c)] = reading

    full_anchors = {id(c) for c in ordered.anchors[1]}
    # What the framework's resume pointer names is resumed from with its optimizer state: never slimmed.
    resume = run.resume
    if resume:
        full_anchors |= {id(c) for c in ckpts if c.name in resume}
    slims = _slims(ckpts, full_anchors=full_anchors, keep=keep, r=r) if r.keep_full_last is not None or any(
        c.slim.slimmed for c in ckpts
    ) else {}
    outside = _outside(r)
    decisions = []
    append = decisions.append
    keep_, delete, slim_ = Action.KEEP, Action.DELETE, Action.SLIM
    for c in ckpts:
        i = id(c)
        reasons = keep[i]
        found = readings.get(i)
        value, source = (found.value, found.source) if found is not None else (None, None)
        if slims and i in slims:
            append(Decision(c, slim_, (slims[i],), i in protected, value, source))
        elif reasons:
            append(Decision(c, keep_, tuple(reasons), i in protected, value, source))
        else:
            incomparable = isinstance(value, float) and not is_rankable(value)
            note = f" ({r.metric}={_fmt(value)} is not comparable)" if incomparable else ""
            append(Decision(c, delete, (outside + note,), False, value, source))
    return decisions


_OUTSIDE: dict[int, tuple[Retention, str]] = {}  # by id: the retention (kept alive), its delete reason


def _outside(r: Retention) -> str:
    """`outside {r.describe()}`, the reason a checkpoint no rule keeps is deleted, once per retention
    (frozen) rather than once per run: a plan of 1,000 runs asks for it 1,000 times."""
    hit = _OUTSIDE.get(id(r))
    if hit is None or hit[0] is not r:
        if len(_OUTSIDE) >= 64:  # run rules make a retention per run and plan
            _OUTSIDE.clear()
        hit = _OUTSIDE[id(r)] = (r, f"outside {r.describe()}")
    return hit[1]


# Name fields that order checkpoints rather than rate them.
_ORDER_FIELDS = frozenset({"epoch", "step", "consumed_samples"})


def metric_warnings(run: Run, r: Retention, decisions: Sequence[Decision] | None = None) -> list[str]:
    """What `plan` should say about a run's metric rather than fall back silently: a configured
    metric that appears in none of its checkpoints (keep_best then keeps nothing by it,
    keep_missing_metric keeps everything), values from more than one source, some checkpoints
    without one, a value that could not be read (a Lightning .ckpt without torch); and, with no
    metric configured, a framework that records its metrics where only a named metric is read.
    `decisions`, the run's from `decide_run`, carry each checkpoint's reading already."""
    if not run.checkpoints or not (r.keep_best or r.keep_total is not None):
        return []
    if not r.metric:
        return _no_metric_warnings(run)
    sources: list[tuple[Checkpoint, str | None]]  # where each checkpoint's value came from; None: nowhere
    if decisions is not None:
        sources = [(d.checkpoint, d.metric_source) for d in decisions]
    else:
        found_at = run.readings(run.checkpoints, r.metric)
        sources = [(c, x.source if x else None) for c, x in zip(run.checkpoints, found_at, strict=True)]
    found = [x for _, x in sources if x is not None]
    unread = [c for c in run.checkpoints if c.metric_problem]
    unread_note = f"; {len(unread)} could not be read: {unread[0].metric_problem}" if unread else ""
    if not found:
        return [_logged_for_none(run, r, unread_note)]
    out = []
    if len(set(found)) > 1:  # counted only then: one source is the rule
        by_source = Counter(found)
        counts = ", ".join(f"{s} ({n})" for s, n in sorted(by_source.items()))
        out.append(
            f"{run.path}: metric {r.metric!r} comes from more than one source: {counts}; a file name's "
            "value is rounded as the name was formatted"
        )
    missing = [c for c, x in sources if x is None and c.state is State.COMPLETE]
    if missing:
        out.append(_logged_for_some(run, r, missing, unread_note))
    elif unread:
        out.append(f"{run.path}: metric {r.metric!r}{unread_note.removeprefix(';')}")
    return out


def _logged_for_none(run: Run, r: Retention, unread_note: str) -> str:
    """`metric_warnings`'s line for a metric that none of the run's checkpoints carries."""
    assert r.metric
    if r.keep_total is not None:
        then = "only the other rules and what is always kept count"
    elif r.keep_missing_metric:
        then = "keep_missing_metric keeps every checkpoint"
    else:
        then = "only the other rules keep checkpoints"
    key = trainer_metric(r.metric)
    trainer = run.trainer_state() is not None or any(c.trainer_state for c in run.checkpoints)
    mapped = ""
    if key != r.metric and trainer:
        mapped = f" ({key} in trainer_state.json, as the Trainer maps it)"
    none = f"is logged for none of its checkpoints{unread_note}"
    return f"{run.path}: metric {r.metric!r}{mapped} {none}: {then}"


def _logged_for_some(run: Run, r: Retention, missing: list[Checkpoint], unread_note: str) -> str:
    """`metric_warnings`'s line for complete checkpoints without the metric, when others have it."""
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    shown = ", ".join(c.name for c in missing[:3]) + more
    if r.keep_total is not None:
        then = "they are counted as not best"
    elif r.keep_missing_metric:
        then = "keep_missing_metric keeps them"
    else:
        then = "keep_best ranks them out"
    complete = sum(1 for c in run.checkpoints if c.state is State.COMPLETE)
    return (
        f"{run.path}: metric {r.metric!r} found for {complete - len(missing)} of {complete} complete "
        f"checkpoints; none for {shown}{unread_note}: {then}"
    )


def inferred_modes(root: Root) -> list[str]:
    """For `plan` and `check-config`: each metric whose direction was inferred (no `mode` set),
    and which way: the Trainer's rule, greater is better unless the name ends in "loss"."""
    rules = [("retention", root.retention)]
    for i, rule in enumerate(root.runs):
        update = {k: getattr(rule, k) for k in rule.model_fields_set if k in Retention.model_fields}
        rules.append((f"runs[{i}]", root.retention.model_copy(update=update)))
    out = []
    for key, r in rules:
        if r.metric and r.mode is None and (r.keep_best or r.keep_total is not None):
            d = r.direction
            why = "lower is better: " if d == "min" else "higher is better: "
            why += "its name ends in 'loss'" if r.metric.lower().endswith("loss") else (
                "a lower-is-better name" if d == "min" else "its name does not end in 'loss'"
            )
            out.append(
                f"{root.path}: {key}.metric {r.metric!r}: mode not set, {d!r} inferred ({why}, as the "
                "Trainer infers greater_is_better); set mode to say otherwise"
            )
    return out


def _no_metric_warnings(run: Run) -> list[str]:
    """keep_best without a metric keeps the Trainer's best_model_checkpoint; a best that another
    framework records (Lightning's monitor in its names, Orbax's metrics for best_fn) is known
    only by a metric: say which names the run's checkpoints carry."""
    ts = run.trainer_state()
    if ts is not None and ts.best_model_checkpoint:
        return []
    carried = sorted({n for c in run.checkpoints for n, _ in c.metrics if n not in _ORDER_FIELDS})
    if not carried:
        return []
    kinds = "/".join(sorted({c.layout for c in run.checkpoints}))
    names = ", ".join(repr(n) for n in carried[:5])
    return [
        f"{run.path}: keep_best has no metric to rank these {kinds} checkpoints by (the trainer's "
        f"best_model_checkpoint is the HF Trainer's alone); they carry {names}: set retention.metric and mode"
    ]


def _slims(
    ckpts: list[Checkpoint], *, full_anchors: set[int], keep: dict[int, list[str]], r: Retention
) -> dict[int, str]:
    """The kept checkpoints to slim, with their reason; notes in `keep` why others are not.

    Pinned checkpoints, those holding a mount point and the run's newest full ones (by step
    and by time) are kept as they are. A slimmed checkpoint that still holds optimizer files
    was interrupted while they were being removed (its marker says "removing"): it is
    finished. One whose marker says "done" had them put back since: it is kept as it is.
    """
    full = [c for c in ckpts if c.state is State.COMPLETE and not c.slimmed]
    newest_full = {id(c) for c in full[-r.keep_full_last :]} if r.keep_full_last else set()
    newest_full |= full_anchors
    out: dict[int, str] = {}
    for c in ckpts:
        reasons = keep[id(c)]
        if not reasons or c.state is not State.COMPLETE or c.pinned or c.mounts or c.holds:
            continue
        if c.slimmed:
            if c.slim.restored:
                reasons.append("slimmed, its optimizer state put back since: kept as it is")
            elif c.slim.removable and c.slim.blocker is None:
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


def freed(decisions: Iterable[Decision]) -> int:
    """What carrying out all of `decisions` frees: each inode once, when its last link goes."""
    ledger = Ledger.disk()
    out = 0
    for d in decisions:
        if d.action is Action.DELETE:
            out += ledger.add(d.checkpoint)
        elif d.action is Action.SLIM:
            out += d.checkpoint.slim.removable_bytes
    return out


def enforce_max_size(decisions: list[Decision], max_size: int) -> tuple[list[Decision], list[str]]:
    """Delete the run's oldest unprotected checkpoints until it fits in `max_size`, if that can.

    The run's size is what `du` of its kept checkpoints counts (each inode once, space.py); a
    checkpoint planned for slimming counts with what slimming leaves of it.
    """
    kept = [d.checkpoint for d in decisions if d.action is not Action.DELETE]
    ledger = Ledger.within(kept)
    total = _du(kept) - sum(d.checkpoint.slim.removable_bytes for d in decisions if d.action is Action.SLIM)
    if total <= max_size or not decisions:
        return decisions, []
    c = decisions[0].checkpoint
    where = f"{c.root / c.run}"
    reason = f"max_size={format_size(max_size)} exceeded (run holds {format_size(total)})"
    budget = f"max_size={format_size(max_size)}"
    return _take_oldest(decisions, total - max_size, reason, where, budget, ledger)


def _du(ckpts: Sequence[Checkpoint]) -> int:
    """What `du` counts for these checkpoints together: each inode once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for c in ckpts:
        total += own_bytes(c)
        for sh in c.shared:
            if (sh.dev, sh.ino) not in seen:
                seen.add((sh.dev, sh.ino))
                total += sh.bytes
    return total


def enforce_min_free(
    decisions: Sequence[Decision],
    *,
    free: int,
    total: int,
    floor: FreeSpace,
    where: str,
    held: Callable[[Checkpoint], int] | None = None,
) -> tuple[list[Decision], list[str]]:
    """Delete the oldest unprotected checkpoints on one filesystem until `floor` is free, if that can.

    `decisions` are every decision on that filesystem, across runs and roots;
    space already freed by planned deletions and slims counts. `held(c)`: what deleting `c`
    leaves allocated on a filesystem that shares extents (extents.py), counted as not freed.
    """
    required = floor.required(total)
    if free >= required:  # met already: nothing to weigh (nor to ask the filesystem, `held`)
        return list(decisions), []
    # What the planned deletions free, each inode once, with its last link, shared extents not
    ledger = Ledger.disk(held)
    expected = free
    for d in decisions:
        if d.action is Action.DELETE:
            expected += ledger.add(d.checkpoint)
        elif d.action is Action.SLIM:
            expected += d.checkpoint.slim.removable_bytes
    if expected >= required:
        return list(decisions), []
    reason = f"{MIN_FREE}={floor} not met on {where} ({format_size(free)} free)"
    return _take_oldest(list(decisions), required - expected, reason, where, f"min_free={floor}", ledger)


MIN_FREE = "min_free"  # the first word of the reason a deletion min_free chose carries


def is_min_free(d: Decision) -> bool:
    """Whether `min_free` chose this deletion (it weighs a whole filesystem, not one run)."""
    return d.action is Action.DELETE and bool(d.reasons) and d.reasons[0].startswith(f"{MIN_FREE}=")


def _take_oldest(
    decisions: list[Decision], needed: int, reason: str, where: str, budget: str, ledger: Ledger
) -> tuple[list[Decision], list[str]]:
    """Delete the oldest (by when written) unprotected checkpoints until `needed` bytes are freed.

    Decided before deleting anything: if every checkpoint the budget may take together frees
    less than `needed`, it takes none and says so. Deleting them all would leave the budget
    missed anyway, with checkpoints lost for nothing; the operator has to act either way.
    What each frees is counted by `ledger` (space.py), after what it counted already: a file
    hard-linked from a checkpoint that stays frees nothing.
    """
    # (written_at, rel, index): the index keeps equal times and paths in the decisions' order.
    keep_, slim_, complete = Action.KEEP, Action.SLIM, State.COMPLETE
    keyed = sorted(
        (c.written_at, c.rel, i)
        for i, d in enumerate(decisions)
        # What a budget may take: kept or slimmed, unprotected, complete (asked of every decision)
        if d.action in (keep_, slim_) and not d.protected and (c := d.checkpoint).state is complete
    )
    order = [i for _, _, i in keyed]
    trial = copy.deepcopy(ledger)  # all of them: what the budget could free at most
    available = sum(trial.add(decisions[i].checkpoint) - _slimmed_already(decisions[i]) for i in order)
    if available < needed:
        return decisions, [
            f"{where}: {budget} cannot be met: it needs {format_size(needed)} more, and deleting every "
            f"checkpoint it may take ({len(order)}, {format_size(available)}) would not free it; deleting "
            "none of them (the rest is protected: newest, best, pinned, named by the framework's "
            "resume pointer, or not complete)"
        ]
    out = list(decisions)
    for i in order:
        if needed <= 0:
            break
        d = out[i]  # dataclasses.replace(d, action=DELETE, reasons=(reason,)), at a fifth of its cost
        out[i] = Decision(d.checkpoint, Action.DELETE, (reason,), d.protected, d.metric, d.metric_source)
        needed -= ledger.add(d.checkpoint) - _slimmed_already(d)
    return out, []


def _slimmed_already(d: Decision) -> int:
    """Of what deleting it frees, what its planned slim was counted as freeing already."""
    return d.checkpoint.slim.removable_bytes if d.action is Action.SLIM else 0


def summarise(decisions: Iterable[Decision]) -> dict[str, int]:
    decisions = list(decisions)
    out = {"keep": 0, "delete": 0, "slim": 0, "bytes_to_free": freed(decisions)}
    for d in decisions:
        out[str(d.action)] += 1
    return out
