"""Retention: which checkpoints to keep, and why. Pure functions.

Rules combine as a union: a checkpoint is kept if any rule keeps it, and
every rule that keeps it is named in its reasons. Whatever the config says:
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
import datetime
import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from ckptd.attestation import committed_summary
from ckptd.config import FreeSpace, Retention, Root, format_duration, format_size
from ckptd.layouts import PIN_FILE
from ckptd.model import (
    TRAINER_STATE,
    Action,
    Checkpoint,
    Reading,
    Run,
    State,
    Verdict,
    is_rankable,
    trainer_metric,
)
from ckptd.space import Ledger, own_bytes


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


def anchors(ckpts: Iterable[Checkpoint]) -> list[tuple[Checkpoint, str]]:
    """A run's anchors, each with the reason it is kept: its newest complete checkpoint by step
    and by time (written last), and its newest complete full (resumable) ones, likewise.

    Times are `written_at`: the newest mtime of the files its framework saves, so a pin, a touch
    of an old checkpoint's directory, or an evaluation's output written into it later does not
    make it the newest save. Which files a save wrote is known per layout
    (`evidence.save_files`); in doubt, the checkpoint written last counting every file
    (`touched_at`) is kept as well: one more anchor, never one fewer.
    """
    return _anchors([c for c in ckpts if c.state is State.COMPLETE])[0]


def _anchors(complete: list[Checkpoint]) -> tuple[list[tuple[Checkpoint, str]], list[Checkpoint]]:
    """`anchors` of a run's complete checkpoints, and its newest full ones alone (by step, by
    time, counting added files): what `anchors` of the run's full checkpoints would name. Planning
    asks for both, for every run: one look at each pool."""
    full = [c for c in complete if not c.slim.slimmed]
    newest_complete = _newest(complete) if complete else None
    # With nothing slimmed the full ones are the complete ones: the same newest.
    newest_full = newest_complete if len(full) == len(complete) else (_newest(full) if full else None)
    found: list[tuple[Checkpoint, str]] = []
    pools = zip((newest_complete, newest_full), _ANCHOR_WHY, strict=True)
    for newest, (by_step_why, by_time_why, touched_why) in pools:
        if newest is None:
            continue
        by_step, by_time, by_touch = newest
        by_step_why += ordered_by(by_step)
        candidates = ((by_step, by_step_why), (by_time, by_time_why), (by_touch, touched_why))
        for c, why in candidates:
            if all(c is not a for a, _ in found):
                found.append((c, why))
    # `ckptd latest` prefers a run's attested saves (`resume.choose`): where some full ones carry
    # commit records and a newer one does not, it names the newest attested one, by step or by time.
    # What a restart was just told to resume from is kept too.
    attested = [c for c in full if committed_summary(c.checks)]
    if attested and len(attested) < len(full):
        by_step, by_time, _ = _newest(attested)
        for c, why in ((by_step, _LATEST_WHY[0]), (by_time, _LATEST_WHY[1])):
            if all(c is not a for a, _ in found):
                found.append((c, why))
    return found, list(newest_full or ())


_LATEST_WHY = (
    "newest attested: what `ckptd latest` names (a newer save has no commit records)",
    "written last of the attested ones: what `ckptd latest --by time` names",
)


def _anchor_why(by_step_why: str, by_time_why: str) -> tuple[str, str, str]:
    touched_why = f"{by_time_why.partition(' (')[0]} counting files added after its save (kept in doubt)"
    return by_step_why, by_time_why, touched_why


# Why each anchor is kept (by step, by time, counting files added after the save): of the complete
# checkpoints, then of the full ones.
_ANCHOR_WHY = (
    _anchor_why("newest complete", "written last (newest complete by time)"),
    _anchor_why("newest full (resumable)", "written last of the full ones (resumable)"),
)


def _newest(pool: list[Checkpoint]) -> tuple[Checkpoint, Checkpoint, Checkpoint]:
    """The pool's greatest by `Checkpoint.sort_key`, `_written_key` and `_touched_key`, the first
    of equals as `max` takes it: the first two with keys in C, the third in one loop."""
    by_step, by_time = max(pool, key=_SORT_KEY), max(pool, key=_WRITTEN_KEY)
    by_touch = first = pool[0]
    touch_key = (max(first.touched_at, first.written_at), first.step, first.name)
    for c in pool:
        touched, written = c.touched_at, c.written_at
        if (k := (touched if touched > written else written, c.step, c.name)) > touch_key:
            by_touch, touch_key = c, k
    return by_step, by_time, by_touch


def ordered_by(c: Checkpoint) -> str:
    """How a checkpoint without a step in its name is ordered, for its reasons ("" for a step)."""
    if c.unit == "step":
        return ""
    if c.unit == "save":
        return " (by save count, then time: accelerate's checkpoint_N counts saves, not steps)"
    return f" (by {c.unit}, then time: its name has no step)"


def _written_key(c: Checkpoint) -> tuple[float, int, str]:
    return (c.written_at, c.step, c.name)


def _touched_key(c: Checkpoint) -> tuple[float, int, str]:
    return (max(c.touched_at, c.written_at), c.step, c.name)


def decide_run(run: Run, r: Retention) -> list[Decision]:
    """Keep, slim or delete each checkpoint of one run, oldest first, each with its reasons.

    Planning decides for every checkpoint of every run: the passes below are plain loops over
    lists, and what a reason says about the rules is formatted once per run, not per checkpoint.
    """
    ckpts = sorted(run.checkpoints, key=_SORT_KEY)
    complete_ = State.COMPLETE  # a local: an enum member is a slow attribute in Python 3.11
    complete = [c for c in ckpts if c.state is complete_]
    keep: dict[int, list[str]] = {id(c): [] for c in ckpts}
    protected: set[int] = set()
    readings: dict[int, Reading | None] = {}

    def kept(c: Checkpoint, reason: str, protect: bool = False) -> None:
        keep[id(c)].append(reason)
        if protect:
            protected.add(id(c))

    anchored, newest_full = _anchors(complete)
    for c, why in anchored:
        kept(c, why, protect=True)
    values: dict[int, float | str | None] = {}
    if r.metric and (r.keep_best or r.keep_total):
        for c, found in zip(ckpts, run.readings(ckpts, r.metric), strict=True):
            readings[id(c)] = found
            values[id(c)] = found.value if found is not None else None

    counted: set[int] = set()  # what keep_total keeps
    if r.keep_total is not None:
        counted = _keep_total(run, complete, r, values, readings, kept)
    elif r.keep_last > 1:
        for i, c in enumerate(reversed(complete[-r.keep_last : -1]), start=2):
            kept(c, f"keep_last={r.keep_last} (#{i} newest{ordered_by(c)})")

    missing = ""  # keep_missing_metric's reason, when it applies
    if r.keep_total is None and r.keep_best and r.metric:
        for c, value in _best(complete, values, r, r.keep_best):
            kept(c, f"best {r.metric}={_fmt(value)} ({r.direction})", protect=True)
        if r.keep_missing_metric:
            missing = f"no usable {r.metric} logged (keep_missing_metric)"
    elif r.keep_total is None and r.keep_best:
        ts = run.trainer_state()
        for c in complete:
            if ts is not None and c.name == ts.best_model_checkpoint:
                if ts.best_metric is not None:
                    readings[id(c)] = Reading(ts.best_metric, TRAINER_STATE)
                value = f" (best_metric={_fmt(ts.best_metric)})" if ts.best_metric is not None else ""
                kept(c, f"trainer's best_model_checkpoint{value}", protect=True)

    every_steps = r.keep_every_steps  # steps only: an epoch or a save count is not one
    every = f"keep_every_steps={every_steps}" if every_steps else ""
    # From when the run's newest save *began*: touching one file of an old checkpoint (or
    # pinning it) cannot move the window and drop what it kept a moment before.
    window = r.keep_within if complete else None
    if window is not None:
        start = max(c.saved_at for c in complete)
        within = f"within keep_within={format_duration(window)} of the run's newest"

    thinned = time_buckets(complete, r) if complete and _thins(r) else {}

    # The rules that look at one checkpoint at a time, in one pass, each checkpoint's reasons in
    # the rules' order: a missing metric, keep_every_steps, keep_within, the time buckets, then
    # what is always kept.
    resume = run.resume
    for c in ckpts:
        reasons = keep[id(c)]
        if c.state is complete_:
            if missing:
                value = values.get(id(c))
                if value is None or isinstance(value, str):
                    reasons.append(missing)
            if every_steps and c.unit == "step" and c.step % every_steps == 0:
                reasons.append(every)
            if window is not None and start - c.written_at <= window:
                reasons.append(within)
            if thinned and id(c) in thinned:
                reasons += thinned[id(c)]
        if c.pinned:
            kept(c, "pinned", protect=True)
        if resume and c.name in resume:
            kept(c, f"named by {resume[c.name]}: the framework resumes from it", protect=True)
        if c.mounts:
            where = ", ".join(m or "itself" for m in c.mounts[:3])
            kept(c, f"holds a mount point ({where}): another filesystem is never deleted", protect=True)
        if c.holds:
            kept(c, f"{held_reason(c)}: never deleted as one checkpoint", protect=True)
        if c.state is not complete_:
            kept(c, f"{c.state}, never deleted: {_first_problem(c)}", protect=True)

    if r.keep_total is not None:  # what the Trainer's rotation would have deleted, and ckptd keeps
        for c in complete:
            if id(c) in protected and id(c) not in counted:
                kept(c, f"over keep_total={r.keep_total}: always kept")

    full_anchors = {id(c) for c in newest_full}
    # What the framework's resume pointer names is resumed from with its optimizer state: never slimmed.
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


def _thins(r: Retention) -> bool:
    return bool(r.keep_hourly or r.keep_daily or r.keep_weekly or r.keep_monthly)


# Each time bucket: its key, the calendar unit it is the newest of, and how that unit is written.
_BUCKETS: tuple[tuple[str, str, Callable[[datetime.datetime], str]], ...] = (
    ("keep_hourly", "hour", lambda t: t.strftime("%Y-%m-%d %H:00")),
    ("keep_daily", "day", lambda t: t.strftime("%Y-%m-%d")),
    ("keep_weekly", "week", lambda t: "{:04d}-W{:02d}".format(*t.isocalendar()[:2])),
    ("keep_monthly", "month", lambda t: t.strftime("%Y-%m")),
)


def time_buckets(complete: Sequence[Checkpoint], r: Retention) -> dict[int, list[str]]:
    """Thinning by time, as restic's `forget --keep-hourly/daily/weekly/monthly` does it
    (restic internal/restic/snapshot_policy.go, `ApplyPolicy`): newest first, a checkpoint is
    kept by a rule when its calendar bucket (the hour, day, ISO week or month its save ended, in
    UTC) differs from that of the last one the rule kept, until the rule has kept N. So each rule
    keeps the newest checkpoint of each of the last N buckets *that hold one*, counted back from
    the run's newest save: a run idle for a month keeps its last days, never none. Returns the
    reasons by checkpoint id; the newest complete checkpoint is kept by every rule that is on.

    UTC, not local time: ckptd on hosts in other time zones sharing a volume decide alike, and a
    DST change makes no day 23 or 25 hours long.
    """
    newest_first = sorted(complete, key=_WRITTEN_KEY, reverse=True)
    out: dict[int, list[str]] = {}
    for key, unit, label in _BUCKETS:
        n = getattr(r, key)
        last: str | None = None
        for c in newest_first:
            if n <= 0:
                break
            bucket = label(datetime.datetime.fromtimestamp(c.written_at, datetime.UTC))
            if bucket != last:
                out.setdefault(id(c), []).append(f"{key}={getattr(r, key)} (newest of {unit} {bucket} UTC)")
                last, n = bucket, n - 1
    return out


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


# Checkpoint.sort_key and _written_key, in C: (step, written_at, name), (written_at, step, name).
_SORT_KEY = attrgetter("step", "written_at", "name")
_WRITTEN_KEY = attrgetter("written_at", "step", "name")


def held_reason(c: Checkpoint) -> str:
    """`holds a run of its own: checkpoint-100, checkpoint-200`, for a checkpoint that does
    (`Checkpoint.holds`)."""
    shown = [f"a pin ({h})" if h.endswith(PIN_FILE) else h for h in c.holds[:3]]
    more = f" and {len(c.holds) - 3} more" if len(c.holds) > 3 else ""
    return f"holds a run of its own: {', '.join(shown)}{more}"


def _best(
    complete: list[Checkpoint], values: dict[int, float | str | None], r: Retention, n: int
) -> list[tuple[Checkpoint, float]]:
    """The `n` best complete checkpoints with a comparable value (by id in `values`), best first;
    ties go to the newer checkpoint (it saw more training for the same score), then to the
    earlier in `complete` (as a stable sort of them all by (value, newer) would order them)."""
    sign = 1.0 if r.direction == "min" else -1.0
    rankable = [
        (sign * v, -c.step, i, c, v)
        for i, c in enumerate(complete)
        if isinstance(v := values.get(id(c)), float) and math.isfinite(v)  # is_rankable
    ]
    return [(c, v) for _, _, _, c, v in heapq.nsmallest(n, rankable)]  # sorted(rankable)[:n]


def trainer_order(complete: list[Checkpoint]) -> list[Checkpoint]:
    """Oldest first, as the Trainer orders its checkpoints to rotate them (transformers 5.x
    trainer_utils.py `sort_checkpoints(use_mtime=True)`): by when each was written, or by number
    when those times span less than a second (its test for a filesystem whose mtimes are unreliable).
    ckptd's times leave directories and its own files out (`Checkpoint.written_at`)."""
    by_time = sorted(complete, key=lambda c: (c.written_at, c.step, c.name))
    if len(by_time) > 1 and by_time[-1].written_at - by_time[0].written_at < 1.0:
        return sorted(complete, key=Checkpoint.sort_key)
    return by_time


def _keep_total(
    run: Run,
    complete: list[Checkpoint],
    r: Retention,
    values: dict[int, float | str | None],
    readings: dict[int, Reading | None],
    kept: Callable[..., None],
) -> set[int]:
    """The Trainer's `save_total_limit` (transformers 5.x trainer_utils.py `rotate_checkpoints`): the
    newest and the best are protected, `max(limit, len(protected))` are kept, and the oldest others
    go first. So the best counts inside the limit: limit 2, best checkpoint-5 of 5..25 -> {5, 25};
    with the best the newest -> {20, 25}; limit 1 -> {best, newest} (the Trainer deletes the newest
    too at the very end of training, when the limit is 1: ckptd cannot tell training ended, and
    keeps the newest anyway). A best_model_checkpoint that names no complete checkpoint still
    counts as protected, as the Trainer counts the path it was given. Incomplete checkpoints are
    neither counted nor deleted (the Trainer counts every `checkpoint-*` directory).
    Returns the checkpoints it keeps."""
    n = r.keep_total
    assert n is not None
    order = trainer_order(complete)
    if not order:
        return set()
    best: Checkpoint | None = None
    best_names: set[str] = set()
    if r.metric:
        ranked = _best(complete, values, r, 1)
        if ranked:
            best, value = ranked[0]
            best_names.add(best.name)
            why = f"best {r.metric}={_fmt(value)} ({r.direction}), counted in keep_total={n}"
            kept(best, why, protect=True)
    else:
        ts = run.trainer_state()
        if ts is not None and ts.best_model_checkpoint:
            best_names.add(ts.best_model_checkpoint)
            best = next((c for c in complete if c.name == ts.best_model_checkpoint), None)
            if best is not None:
                if ts.best_metric is not None:
                    readings[id(best)] = Reading(ts.best_metric, TRAINER_STATE)
                value = f" (best_metric={_fmt(ts.best_metric)})" if ts.best_metric is not None else ""
                kept(best, f"trainer's best_model_checkpoint{value}, counted in keep_total={n}", protect=True)
    newest = order[-1]
    protected = {newest.name} | best_names
    to_keep = max(n, len(protected))
    survivors = list(order)
    for c in order:
        if len(survivors) <= to_keep:
            break
        if c.name not in protected:
            survivors.remove(c)
    for i, c in enumerate(reversed(survivors), start=1):
        if c is not best:
            kept(c, f"keep_total={n} ({'the newest' if i == 1 else f'#{i} newest'})")
    return {id(c) for c in survivors} | ({id(best)} if best is not None else set())


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
    if r.keep_total is not None:
        then = "only the other rules and what is always kept count"
    elif r.keep_missing_metric:
        then = "keep_missing_metric keeps every checkpoint"
    else:
        then = "only the other rules keep checkpoints"
    if not found:
        key = trainer_metric(r.metric)
        trainer = run.trainer_state() is not None or any(c.trainer_state for c in run.checkpoints)
        mapped = ""
        if key != r.metric and trainer:
            mapped = f" ({key} in trainer_state.json, as the Trainer maps it)"
        none = f"is logged for none of its checkpoints{unread_note}"
        return [f"{run.path}: metric {r.metric!r}{mapped} {none}: {then}"]
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
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        shown = ", ".join(c.name for c in missing[:3]) + more
        if r.keep_total is not None:
            then = "they are counted as not best"
        elif r.keep_missing_metric:
            then = "keep_missing_metric keeps them"
        else:
            then = "keep_best ranks them out"
        complete = sum(1 for c in run.checkpoints if c.state is State.COMPLETE)
        out.append(
            f"{run.path}: metric {r.metric!r} found for {complete - len(missing)} of {complete} complete "
            f"checkpoints; none for {shown}{unread_note}: {then}"
        )
    elif unread:
        out.append(f"{run.path}: metric {r.metric!r}{unread_note.removeprefix(';')}")
    return out


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
    decisions = list(decisions)
    out = {"keep": 0, "delete": 0, "slim": 0, "bytes_to_free": freed(decisions)}
    for d in decisions:
        out[str(d.action)] += 1
    return out
