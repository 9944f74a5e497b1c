"""Each retention rule alone: a run's checkpoints in, what the rule keeps (and protects) out. Pure.

`test_policy.py` tables the union (`decide_run`); these pin down each small object on its own, so a
rule that starts keeping what another should (or stops keeping what it says) is named.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.config import Retention
from ckptd.decide import rules
from ckptd.model import FILE_NAME, Check, Checkpoint, Reading, Run, TrainerState, Verdict

ROOT = Path("/vol")
COMPLETE = (Check("quiet", Verdict.PASSED, "quiet"),)
INCOMPLETE = (Check("quiet", Verdict.PASSED, "quiet"), Check("deepspeed shards", Verdict.FAILED, "rank 3 missing"))
HOUR = 3600.0


def ck(step: int, *, checks=COMPLETE, at: float | None = None, **kw) -> Checkpoint:
    t = float(step if at is None else at)
    return Checkpoint(ROOT, "run", f"checkpoint-{step}", step, "hf", checks, size_bytes=10,
                      newest_mtime=t, saved_at=t, written_at=t, **kw)


def keeps(rule, ckpts, r: Retention | None = None, protected=()) -> list[tuple[int, bool]]:
    r = r or Retention(keep_last=1, keep_best=0)
    run = rules.OrderedRun.of(Run(ROOT, "run", tuple(ckpts)), r)
    return [(k.checkpoint.step, k.protect) for k in rule.keeps(run, set(protected))]


STEPS = (100, 200, 300, 400, 500)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (rules.Anchors(), [(500, True)]),
        (rules.KeepLast(1), []),  # the newest is the anchor's
        (rules.KeepLast(3), [(400, False), (300, False)]),
        (rules.KeepEverySteps(200), [(200, False), (400, False)]),
        (rules.KeepWithin(150.0), [(400, False), (500, False)]),  # from the newest save's start
        (rules.Pinned(), []),
        (rules.NotComplete(), []),
    ],
    ids=repr,
)
def test_each_rule_alone(rule, expected):
    assert keeps(rule, [ck(s) for s in STEPS]) == expected


def test_keep_total_counts_the_newest_inside_its_limit():
    assert keeps(rules.KeepTotal(2), [ck(s) for s in STEPS], Retention(keep_total=2)) == [(500, False), (400, False)]


def test_always_kept_rules_protect_what_they_name():
    ckpts = [ck(100, pinned=True), ck(200, checks=INCOMPLETE), ck(300, mounts=("sub",)), ck(400, holds=("a/b",))]
    assert keeps(rules.Pinned(), ckpts) == [(100, True)]
    assert keeps(rules.NotComplete(), ckpts) == [(200, True)]
    assert keeps(rules.HoldsMount(), ckpts) == [(300, True)]
    assert keeps(rules.HoldsRun(), ckpts) == [(400, True)]


def test_resume_pointer_protects_the_named_checkpoint():
    run = Run(ROOT, "run", tuple(ck(s) for s in STEPS), resume={"checkpoint-200": "latest"})
    ordered = rules.OrderedRun.of(run, Retention(keep_last=1, keep_best=0))
    assert [(k.checkpoint.step, k.protect) for k in rules.ResumePointer().keeps(ordered, set())] == [(200, True)]


def test_keep_best_ranks_by_the_metric_and_protects():
    ckpts = [ck(s, metrics=(("eval_loss", Reading(float(v), FILE_NAME)),)) for s, v in zip(STEPS, (5, 1, 3, 2, 4), strict=True)]
    r = Retention(keep_last=1, keep_best=2, metric="eval_loss", mode="min")
    assert keeps(rules.KeepBest(2, "eval_loss", "min"), ckpts, r) == [(200, True), (400, True)]


def test_trainer_best_reads_best_model_checkpoint_with_its_metric():
    ts = TrainerState(500, "checkpoint-100", 0.25, {})
    ckpts = [ck(s, trainer_state=ts if s == 500 else None) for s in STEPS]
    run = rules.OrderedRun.of(Run(ROOT, "run", tuple(ckpts)), Retention(keep_last=1, keep_best=1))
    [k] = rules.TrainerBest().keeps(run, set())
    assert (k.checkpoint.step, k.protect, k.reading.value) == (100, True, 0.25)


def test_over_keep_total_names_what_another_rule_protects_beyond_the_limit():
    ckpts = [ck(s) for s in STEPS]
    run = rules.OrderedRun.of(Run(ROOT, "run", tuple(ckpts)), Retention(keep_total=1))
    assert [k.checkpoint.step for k in rules.OverKeepTotal(1).keeps(run, {id(ckpts[0])})] == [100]
    assert list(rules.OverKeepTotal(1).keeps(run, set())) == []


def test_time_buckets_keep_the_newest_of_each_hour():
    ckpts = [ck(s, at=t) for s, t in ((1, 0.0), (2, 10.0), (3, HOUR + 5), (4, 2 * HOUR + 5))]
    r = Retention(keep_last=1, keep_best=0, keep_hourly=2)
    assert keeps(rules.TimeBuckets(), ckpts, r) == [(3, False), (4, False)]


def test_rules_for_orders_and_chooses_by_the_retention():
    names = [type(x).__name__ for x in rules.rules_for(Retention(keep_last=3, keep_best=1, metric="loss",
                                                                 keep_missing_metric=True, keep_every_steps=10))]
    assert names == ["Anchors", "KeepLast", "KeepBest", "KeepMissingMetric", "KeepEverySteps",
                     "Pinned", "ResumePointer", "HoldsMount", "HoldsRun", "NotComplete"]
    total = [type(x).__name__ for x in rules.rules_for(Retention(keep_total=2))]
    assert total[:2] == ["Anchors", "KeepTotal"] and total[-1] == "OverKeepTotal"
    assert "TrainerBest" in [type(x).__name__ for x in rules.rules_for(Retention(keep_last=1, keep_best=1))]


def test_every_rule_keeps_only_checkpoints_of_the_run_it_was_given():
    ckpts = [replace(ck(s), pinned=True) for s in STEPS]
    run = rules.OrderedRun.of(Run(ROOT, "run", tuple(ckpts)), Retention(keep_total=2))
    ids = {id(c) for c in run.ckpts}
    for rule in rules.rules_for(run.r):
        assert all(id(k.checkpoint) in ids for k in rule.keeps(run, ids))
