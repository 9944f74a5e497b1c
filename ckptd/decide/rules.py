"""Retention rules: each answers one question about a run, "which of these do I keep, and why".

A rule looks at one run's checkpoints as planning orders them (`OrderedRun`) and names those it
keeps (`Keep`), each with its reason and whether it is *protected*: a budget may not take it.
`policy.decide_run` takes their union: a checkpoint any rule keeps is kept, with the reasons of
every rule that keeps it, in the rules' order (`rules_for`). What no rule keeps is deleted.

The shape is orbax's preservation policies (orbax-checkpoint
`_src/checkpoint_managers/preservation_policy.py`: each policy's `should_preserve(checkpoints,
context)`, `AnyPreservationPolicy` their union), with the reason carried along as restic's
`KeepReason` does. Pure: no I/O, no clock; a rule is built from the retention and holds nothing
of a run.
"""

from __future__ import annotations

import datetime
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import NamedTuple, Protocol

from ckptd.config import Retention
from ckptd.discover.layouts import PIN_FILE
from ckptd.formatting import format_duration
from ckptd.judge.attestation import committed_summary
from ckptd.model import TRAINER_STATE, Checkpoint, Reading, Run, State, deciding_check, pointer_reason


class Keep(NamedTuple):
    """One rule keeping one checkpoint."""

    checkpoint: Checkpoint
    reason: str
    protect: bool = False  # no budget may take it
    reading: Reading | None = None  # where the rule found the checkpoint's metric (the Trainer's best_metric)


# Checkpoint.sort_key and the written-last order, in C: (step, written_at, name), (written_at, step, name).
_SORT_KEY = attrgetter("step", "written_at", "name")
_WRITTEN_KEY = attrgetter("written_at", "step", "name")


@dataclass(frozen=True, eq=False)
class OrderedRun:
    """One run as the rules see it: its checkpoints oldest first (by step, then time), the complete
    ones, and the metric's value of each where a rule ranks by it (by id)."""

    run: Run
    r: Retention
    ckpts: list[Checkpoint]
    complete: list[Checkpoint]
    readings: dict[int, Reading | None]
    values: dict[int, float | str | None]

    @classmethod
    def of(cls, run: Run, r: Retention) -> OrderedRun:
        ckpts = sorted(run.checkpoints, key=_SORT_KEY)
        complete_ = State.COMPLETE  # a local: an enum member is a slow attribute in Python 3.11
        readings: dict[int, Reading | None] = {}
        values: dict[int, float | str | None] = {}
        if r.metric and (r.keep_best or r.keep_total):
            for c, found in zip(ckpts, run.readings(ckpts, r.metric), strict=True):
                readings[id(c)] = found
                values[id(c)] = found.value if found is not None else None
        return cls(run, r, ckpts, [c for c in ckpts if c.state is complete_], readings, values)

    @cached_property
    def anchors(self) -> tuple[list[tuple[Checkpoint, str]], list[Checkpoint]]:
        """`_anchors` of the complete checkpoints: the anchors with their reasons, and the newest full."""
        return _anchors(self.complete)

    @cached_property
    def total(self) -> _Total:
        """What keep_total keeps (`KeepTotal`), asked by two rules."""
        return _keep_total(self)


class Rule(Protocol):
    """Names the checkpoints of `run` it keeps. `protected` holds the ids the rules before it
    protected; only a rule about what is always kept asks it."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]: ...


# --- the anchors: what every retention keeps


def anchors(ckpts: Iterator[Checkpoint] | Sequence[Checkpoint]) -> list[tuple[Checkpoint, str]]:
    """A run's anchors, each with the reason it is kept: its newest complete checkpoint by step
    and by time (written last), and its newest complete full (resumable) ones, likewise.

    Times are `written_at`: the newest mtime of the files its framework saves, so a pin, a touch
    of an old checkpoint's directory, or an evaluation's output written into it later does not
    make it the newest save. Which files a save wrote is known per framework (its `save_file`);
    in doubt, the checkpoint written last counting every file (`touched_at`) is kept as well:
    one more anchor, never one fewer.
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

    def add(pairs: Iterable[tuple[Checkpoint, str]]) -> None:
        """Each (checkpoint, why) not yet an anchor, with the first reason found for it."""
        for c, why in pairs:
            if all(c is not a for a, _ in found):
                found.append((c, why))

    pools = zip((newest_complete, newest_full), _ANCHOR_WHY, strict=True)
    for newest, (by_step_why, by_time_why, touched_why) in pools:
        if newest is not None:
            by_step, by_time, by_touch = newest
            by_step_why += ordered_by(by_step)
            add(((by_step, by_step_why), (by_time, by_time_why), (by_touch, touched_why)))
    # `ckptd latest` prefers a run's attested saves (`resume.choose`): where some full ones carry
    # commit records and a newer one does not, it names the newest attested one, by step or by time.
    # What a restart was just told to resume from is kept too.
    attested = [c for c in full if committed_summary(c.checks)]
    if attested and len(attested) < len(full):
        by_step, by_time, _ = _newest(attested)
        add(((by_step, _LATEST_WHY[0]), (by_time, _LATEST_WHY[1])))
    add(_launch_anchors(complete))
    return found, list(newest_full or ())


def _launch_anchors(complete: list[Checkpoint]) -> list[tuple[Checkpoint, str]]:
    """Of a run taken together from several directories (`planner.experiments`: the launches of
    one experiment whose steps carry on), each directory's newest complete checkpoint: a launch whose
    steps continue an earlier one's may have resumed from it, or started from scratch and saved at a
    coarser interval, and names cannot tell the two apart. [] for a run of one directory."""
    first = complete[0].run if complete else ""
    if all(c.run == first for c in complete):
        return []
    newest_in: dict[str, Checkpoint] = {}
    for c in complete:
        if c.run not in newest_in or _SORT_KEY(c) > _SORT_KEY(newest_in[c.run]):
            newest_in[c.run] = c
    return [(c, _LAUNCH_WHY.format(d)) for d, c in sorted(newest_in.items())]


_LAUNCH_WHY = (
    "newest complete in {}, a launch of its own: the next launch's steps continue its, but a fit "
    "from scratch cannot be told from a resume by names (kept in doubt)"
)
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
    """The pool's greatest by `Checkpoint.sort_key`, by time written and by time touched, the first
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
    if c.unit == "time":
        return " (by the time in its name: it has no step)"
    return f" (by {c.unit}, then time: its name has no step)"


@dataclass(frozen=True)
class Anchors:
    """The run's newest complete checkpoints by step and by time, and its newest full ones: protected."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        for c, why in run.anchors[0]:
            yield Keep(c, why, protect=True)


# --- counting: keep_last, keep_total


@dataclass(frozen=True)
class KeepLast:
    """The N newest complete checkpoints (the newest is an anchor already)."""

    n: int

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        n = self.n
        for i, c in enumerate(reversed(run.complete[-n:-1]), start=2):
            yield Keep(c, f"keep_last={n} (#{i} newest{ordered_by(c)})")


class _Total(NamedTuple):
    best: Keep | None  # the best, protected and counted inside the limit
    survivors: list[Checkpoint]  # oldest first

    @property
    def counted(self) -> set[int]:
        return {id(c) for c in self.survivors} | ({id(self.best.checkpoint)} if self.best else set())


def _keep_total(run: OrderedRun) -> _Total:
    """The Trainer's `save_total_limit` (transformers 5.x trainer_utils.py `rotate_checkpoints`): the
    newest and the best are protected, `max(limit, len(protected))` are kept, and the oldest others
    go first. So the best counts inside the limit: limit 2, best checkpoint-5 of 5..25 -> {5, 25};
    with the best the newest -> {20, 25}; limit 1 -> {best, newest} (the Trainer deletes the newest
    too at the very end of training, when the limit is 1: ckptd cannot tell training ended, and
    keeps the newest anyway). A best_model_checkpoint that names no complete checkpoint still
    counts as protected, as the Trainer counts the path it was given. Incomplete checkpoints are
    neither counted nor deleted (the Trainer counts every `checkpoint-*` directory)."""
    r, complete = run.r, run.complete
    n = r.keep_total
    assert n is not None
    order = trainer_order(complete)
    if not order:
        return _Total(None, [])
    best: Keep | None = None
    best_names: set[str] = set()
    if r.metric:
        ranked = _best(complete, run.values, r, 1)
        if ranked:
            c, value = ranked[0]
            best_names.add(c.name)
            best = Keep(c, f"best {r.metric}={_fmt(value)} ({r.direction}), counted in keep_total={n}", True)
    else:
        ts = run.run.trainer_state()
        if ts is not None and ts.best_model_checkpoint:
            best_names.add(ts.best_model_checkpoint)
            found = next((c for c in complete if c.name == ts.best_model_checkpoint), None)
            if found is not None:
                reading = Reading(ts.best_metric, TRAINER_STATE) if ts.best_metric is not None else None
                value = f" (best_metric={_fmt(ts.best_metric)})" if ts.best_metric is not None else ""
                why = f"trainer's best_model_checkpoint{value}, counted in keep_total={n}"
                best = Keep(found, why, True, reading)
    newest = order[-1]
    protected = {newest.name} | best_names
    to_keep = max(n, len(protected))
    survivors = list(order)
    for c in order:
        if len(survivors) <= to_keep:
            break
        if c.name not in protected:
            survivors.remove(c)
    return _Total(best, survivors)


@dataclass(frozen=True)
class KeepTotal:
    """At most N complete checkpoints, the newest and the best counted inside them (`_keep_total`)."""

    n: int

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        best, survivors = run.total
        if best is not None:
            yield best
        best_c = best.checkpoint if best is not None else None
        for i, c in enumerate(reversed(survivors), start=1):
            if c is not best_c:
                yield Keep(c, f"keep_total={self.n} ({'the newest' if i == 1 else f'#{i} newest'})")


@dataclass(frozen=True)
class OverKeepTotal:
    """What the Trainer's rotation would have deleted and ckptd keeps anyway: protected by another
    rule but not counted inside keep_total. Said, so that a run over its limit is explained."""

    n: int

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        counted = run.total.counted
        for c in run.complete:
            if id(c) in protected and id(c) not in counted:
                yield Keep(c, f"over keep_total={self.n}: always kept")


def trainer_order(complete: list[Checkpoint]) -> list[Checkpoint]:
    """Oldest first, as the Trainer orders its checkpoints to rotate them (transformers 5.x
    trainer_utils.py `sort_checkpoints(use_mtime=True)`): by when each was written, or by number
    when those times span less than a second (its test for a filesystem whose mtimes are unreliable).
    ckptd's times leave directories and its own files out (`Checkpoint.written_at`)."""
    by_time = sorted(complete, key=lambda c: (c.written_at, c.step, c.name))
    if len(by_time) > 1 and by_time[-1].written_at - by_time[0].written_at < 1.0:
        return sorted(complete, key=Checkpoint.sort_key)
    return by_time


# --- ranking by a metric


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


@dataclass(frozen=True)
class KeepBest:
    """The K best complete checkpoints by the configured metric: protected."""

    k: int
    metric: str
    direction: str

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        for c, value in _best(run.complete, run.values, run.r, self.k):
            yield Keep(c, f"best {self.metric}={_fmt(value)} ({self.direction})", protect=True)


@dataclass(frozen=True)
class TrainerBest:
    """With keep_best and no metric: the checkpoint the Trainer's trainer_state.json names as
    `best_model_checkpoint`, protected, its `best_metric` read from there."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        ts = run.run.trainer_state()
        if ts is None:
            return
        for c in run.complete:
            if c.name == ts.best_model_checkpoint:
                reading = Reading(ts.best_metric, TRAINER_STATE) if ts.best_metric is not None else None
                value = f" (best_metric={_fmt(ts.best_metric)})" if ts.best_metric is not None else ""
                yield Keep(c, f"trainer's best_model_checkpoint{value}", True, reading)


@dataclass(frozen=True)
class KeepMissingMetric:
    """`keep_missing_metric`: a complete checkpoint without a usable value of the metric is kept
    rather than ranked out."""

    metric: str

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        why = f"no usable {self.metric} logged (keep_missing_metric)"
        values = run.values
        for c in run.complete:
            value = values.get(id(c))
            if value is None or isinstance(value, str):
                yield Keep(c, why)


# --- by step and by time


@dataclass(frozen=True)
class KeepEverySteps:
    """Every complete checkpoint whose step is a multiple of N (steps only: an epoch or a save
    count is not one)."""

    n: int

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        n, why = self.n, f"keep_every_steps={self.n}"
        for c in run.complete:
            if c.unit == "step" and c.step % n == 0:
                yield Keep(c, why)


@dataclass(frozen=True)
class KeepWithin:
    """Every complete checkpoint written within a duration of the run's newest save. From when
    that save *began*: touching one file of an old checkpoint (or pinning it) cannot move the
    window and drop what it kept a moment before."""

    seconds: float

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        complete = run.complete
        if not complete:
            return
        start = max(c.saved_at for c in complete)
        window, why = self.seconds, f"within keep_within={format_duration(self.seconds)} of the run's newest"
        for c in complete:
            if start - c.written_at <= window:
                yield Keep(c, why)


# Each time bucket: its key, the calendar unit it is the newest of, and how that unit is written.
_BUCKETS: tuple[tuple[str, str, Callable[[datetime.datetime], str]], ...] = (
    ("keep_hourly", "hour", lambda t: t.strftime("%Y-%m-%d %H:00")),
    ("keep_daily", "day", lambda t: t.strftime("%Y-%m-%d")),
    ("keep_weekly", "week", lambda t: "{:04d}-W{:02d}".format(*t.isocalendar()[:2])),
    ("keep_monthly", "month", lambda t: t.strftime("%Y-%m")),
)


def thins(r: Retention) -> bool:
    """Whether any time bucket is on."""
    return bool(r.keep_hourly or r.keep_daily or r.keep_weekly or r.keep_monthly)


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


@dataclass(frozen=True)
class TimeBuckets:
    """keep_hourly/daily/weekly/monthly (`time_buckets`)."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        complete = run.complete
        if not complete:
            return
        thinned = time_buckets(complete, run.r)
        for c in complete:  # oldest first, as the others name theirs
            for why in thinned.get(id(c), ()):
                yield Keep(c, why)


# --- what is always kept, whatever the retention says


@dataclass(frozen=True)
class Pinned:
    """A pinned checkpoint: protected."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        for c in run.ckpts:
            if c.pinned:
                yield Keep(c, "pinned", protect=True)


@dataclass(frozen=True)
class ResumePointer:
    """The checkpoint a framework's own resume pointer names (DeepSpeed's `latest`, Megatron's
    tracker): the framework resumes from it, so it is protected."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        resume = run.run.resume
        if not resume:
            return
        for c in run.ckpts:
            if c.name in resume:
                yield Keep(c, pointer_reason(resume[c.name]), protect=True)


@dataclass(frozen=True)
class HoldsMount:
    """A checkpoint holding a mount point: another filesystem is never deleted."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        for c in run.ckpts:
            if c.mounts:
                where = ", ".join(m or "itself" for m in c.mounts[:3])
                why = f"holds a mount point ({where}): another filesystem is never deleted"
                yield Keep(c, why, protect=True)


def held_reason(c: Checkpoint) -> str:
    """`holds a run of its own: checkpoint-100, checkpoint-200`, for a checkpoint that does
    (`Checkpoint.holds`)."""
    shown = [f"a pin ({h})" if h.endswith(PIN_FILE) else h for h in c.holds[:3]]
    more = f" and {len(c.holds) - 3} more" if len(c.holds) > 3 else ""
    return f"holds a run of its own: {', '.join(shown)}{more}"


@dataclass(frozen=True)
class HoldsRun:
    """A checkpoint that holds a run (or a pin) of its own: never deleted as one checkpoint."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        for c in run.ckpts:
            if c.holds:
                yield Keep(c, f"{held_reason(c)}: never deleted as one checkpoint", protect=True)


def first_problem(c: Checkpoint) -> str:
    """The check that keeps a checkpoint from complete (`model.deciding_check`), as its reasons say it."""
    check = deciding_check(c.checks)
    if check is not None:
        return f"{check.name} {check.verdict}: {check.detail}"
    return "state reported by the daemon"


@dataclass(frozen=True)
class NotComplete:
    """An incomplete or still-writing checkpoint: never deleted, protected."""

    def keeps(self, run: OrderedRun, protected: Collection[int]) -> Iterator[Keep]:
        complete_ = State.COMPLETE
        for c in run.ckpts:
            if c.state is not complete_:
                yield Keep(c, f"{c.state}, never deleted: {first_problem(c)}", protect=True)


# --- one retention's rules, in the order their reasons are said

_RULES: dict[int, tuple[Retention, tuple[Rule, ...]]] = {}  # by id: the retention (kept alive), its rules


def rules_for(r: Retention) -> tuple[Rule, ...]:
    """The rules a retention turns on, in the order each checkpoint's reasons are said: the
    anchors; keep_total or keep_last; the best; keep_missing_metric; keep_every_steps;
    keep_within; the time buckets; then what is always kept (pinned, a resume pointer's, a mount
    point's, a held run's, the incomplete), and last what keep_total keeps over its limit.

    Built once per retention (frozen) rather than once per run: a plan of 1,000 runs asks 1,000
    times."""
    hit = _RULES.get(id(r))
    if hit is None or hit[0] is not r:
        if len(_RULES) >= 64:  # run rules make a retention per run and plan
            _RULES.clear()
        hit = _RULES[id(r)] = (r, _build(r))
    return hit[1]


def _build(r: Retention) -> tuple[Rule, ...]:
    rules: list[Rule] = [Anchors()]
    if r.keep_total is not None:
        rules.append(KeepTotal(r.keep_total))
    else:
        if r.keep_last > 1:
            rules.append(KeepLast(r.keep_last))
        if r.keep_best and r.metric:
            rules.append(KeepBest(r.keep_best, r.metric, r.direction))
            if r.keep_missing_metric:
                rules.append(KeepMissingMetric(r.metric))
        elif r.keep_best:
            rules.append(TrainerBest())
    if r.keep_every_steps:
        rules.append(KeepEverySteps(r.keep_every_steps))
    if r.keep_within is not None:
        rules.append(KeepWithin(r.keep_within))
    if thins(r):
        rules.append(TimeBuckets())
    rules += [Pinned(), ResumePointer(), HoldsMount(), HoldsRun(), NotComplete()]
    if r.keep_total is not None:
        rules.append(OverKeepTotal(r.keep_total))
    return tuple(rules)


def _fmt(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value) if isinstance(value, str) else "none"
