"""Retention tables: checkpoints in, kept steps out. Pure: no disk, no clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ckptd.config import FreeSpace, Retention
from ckptd.decide.policy import Action, decide_run, enforce_max_size, enforce_min_free, metric_warnings
from ckptd.model import Check, Checkpoint, Run, TrainerState, Verdict
from tests.support.memruns import COMPLETE, INCOMPLETE, ROOT, ck, run_of

WRITING = (Check("quiet", Verdict.FAILED, "changed 1s ago"),)


def kept(decisions) -> list[int]:
    return [d.checkpoint.step for d in decisions if d.action is Action.KEEP]


def with_losses(steps, losses, best=None):
    return run_of(*(ck(s, losses=losses, best=best) for s in steps))


STEPS = [100, 200, 300, 400, 500]


@pytest.mark.parametrize(
    ("retention", "losses", "expected"),
    [
        # the seed's corner case: the best is the oldest; best and newest survive
        (
            Retention(keep_last=1, keep_best=1, metric="eval_loss"),
            {100: 0.1, 200: 0.5, 300: 0.6, 400: 0.7, 500: 0.8},
            [100, 500],
        ),
        (
            Retention(keep_last=2, keep_best=1, metric="eval_loss"),
            {100: 0.1, 200: 0.5, 300: 0.6, 400: 0.7, 500: 0.8},
            [100, 400, 500],
        ),
        # mode=max flips it
        (
            Retention(keep_last=1, keep_best=1, metric="eval_loss", mode="max"),
            {100: 0.1, 200: 0.5, 300: 0.9, 400: 0.7, 500: 0.8},
            [300, 500],
        ),
        # 'loss' finds 'eval_loss', as the Trainer's metric_for_best_model does
        (
            Retention(keep_last=1, keep_best=2, metric="loss"),
            {100: 0.3, 200: 0.1, 300: 0.2, 400: 0.7, 500: 0.8},
            [200, 300, 500],
        ),
        # no metric logged anywhere: kept by default...
        (Retention(keep_last=1, keep_best=1, metric="eval_loss"), {}, STEPS),
        # ...deleted when configured so
        (Retention(keep_last=1, keep_best=1, metric="eval_loss", keep_missing_metric=False), {}, [500]),
        # ties go to the newer checkpoint
        (
            Retention(keep_last=1, keep_best=1, metric="eval_loss"),
            {100: 0.2, 200: 0.2, 300: 0.9, 400: 0.9, 500: 0.9},
            [200, 500],
        ),
        # NaN and inf are never best, and are not "missing" either
        (
            Retention(keep_last=1, keep_best=1, metric="eval_loss"),
            {100: math.nan, 200: 0.4, 300: math.inf, 400: 0.3, 500: math.nan},
            [400, 500],
        ),
        # a string is not a usable metric: treated as missing (kept by default)
        (
            Retention(keep_last=1, keep_best=1, metric="eval_loss"),
            {100: "oops", 200: 0.4, 300: 0.5, 400: 0.6, 500: 0.7},
            [100, 200, 500],
        ),
        # keep_last=0 still keeps the newest complete
        (Retention(keep_last=0, keep_best=0), {}, [500]),
        (Retention(keep_last=3, keep_best=0), {}, [300, 400, 500]),
        (Retention(keep_last=1, keep_best=0, keep_every_steps=200), {}, [200, 400, 500]),
    ],
)
def test_keep_rules(retention, losses, expected):
    assert kept(decide_run(with_losses(STEPS, losses), retention)) == expected


def test_trainer_best_without_metric_uses_best_model_checkpoint():
    run = run_of(*(ck(s, losses={}, best=200) for s in STEPS))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=1))
    assert kept(decisions) == [200, 500]
    best = next(d for d in decisions if d.checkpoint.step == 200)
    assert best.protected and "trainer's best_model_checkpoint" in best.reasons[0]


def test_trainer_best_is_read_from_the_newest_state():
    # older checkpoints thought 100 was best; the newest knows it is 300
    ckpts = [ck(100, best=100), ck(200, best=100), ck(300, best=300), ck(400, best=300)]
    assert kept(decide_run(run_of(*ckpts), Retention(keep_last=1, keep_best=1))) == [300, 400]


def test_incomplete_and_writing_are_never_deleted_and_do_not_count_as_newest():
    run = run_of(ck(100), ck(200), ck(300, INCOMPLETE), ck(400, WRITING))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=0))
    assert kept(decisions) == [200, 300, 400]
    by_step = {d.checkpoint.step: d for d in decisions}
    assert by_step[200].reasons == ("newest complete",)
    assert by_step[300].reasons[0].startswith("incomplete, never deleted: deepspeed shards failed")
    assert by_step[400].reasons[0].startswith("writing, never deleted")
    assert by_step[100].reasons == ("outside keep_last=1",)


def test_only_incomplete_checkpoints_means_nothing_is_deleted():
    run = run_of(ck(100, INCOMPLETE), ck(200, WRITING))
    assert kept(decide_run(run, Retention(keep_last=0, keep_best=0))) == [100, 200]


def test_best_among_complete_only():
    # the incomplete one has the best loss but cannot be "best": it is kept anyway, as incomplete
    losses = {100: 0.5, 200: 0.1, 300: 0.9, 400: 0.9}
    run = run_of(
        ck(100, losses=losses),
        ck(200, INCOMPLETE, losses=losses),
        ck(300, losses=losses),
        ck(400, losses=losses),
    )
    decisions = decide_run(run, Retention(keep_last=1, keep_best=1, metric="eval_loss"))
    assert kept(decisions) == [100, 200, 400]


def test_pins_are_kept_and_protected():
    run = run_of(ck(100, pinned=True), ck(200), ck(300))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=0))
    assert kept(decisions) == [100, 300]
    assert decisions[0].protected and decisions[0].reasons == ("pinned",)


def test_keep_within_is_measured_from_the_runs_newest_checkpoint():
    # mtimes in hours; the run stalled long ago: 'now' plays no part
    run = run_of(*(ck(s, mtime=s * 3600.0) for s in (1, 2, 3, 10, 11)))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=0, keep_within=2 * 3600))
    assert kept(decisions) == [10, 11]


def test_reasons_name_every_rule_that_keeps():
    losses = {100: 0.1, 200: 0.2}
    run = run_of(ck(100, losses=losses), ck(200, losses=losses, pinned=True))
    decisions = decide_run(run, Retention(keep_last=2, keep_best=1, metric="eval_loss", keep_every_steps=100))
    assert decisions[0].reasons == (
        "keep_last=2 (#2 newest)",
        "best eval_loss=0.1 (min)",
        "keep_every_steps=100",
    )
    assert decisions[1].reasons == ("newest complete", "keep_every_steps=100", "pinned")


def test_delete_reason_describes_the_rules():
    run = with_losses([100, 200, 300], {100: 0.1, 200: 0.5, 300: 0.6})
    decisions = decide_run(run, Retention(keep_last=1, keep_best=1, metric="eval_loss"))
    assert decisions[1].line() == (
        "delete run/checkpoint-200: outside keep_last=1 and keep_best=1 (eval_loss, min)"
    )


# --- budgets -------------------------------------------------------------


def test_max_size_deletes_oldest_unprotected_first():
    losses = {100: 0.1, 200: 0.5, 300: 0.6, 400: 0.7, 500: 0.8}
    run = run_of(*(ck(s, size=10, losses=losses) for s in STEPS))
    decisions = decide_run(run, Retention(keep_last=4, keep_best=1, metric="eval_loss"))
    assert kept(decisions) == STEPS  # 100 best, 200-500 keep_last
    out, warnings = enforce_max_size(decisions, max_size=30)
    # 100 (best) and 500 (newest) are protected: 200 and 300 go, oldest first
    assert kept(out) == [100, 400, 500]
    assert warnings == []
    assert next(d for d in out if d.checkpoint.step == 200).reasons[0].startswith("max_size=30B exceeded")


def test_max_size_warns_and_stops_at_protected():
    run = run_of(ck(100, pinned=True, size=50), ck(200, INCOMPLETE, size=50), ck(300, size=50))
    out, warnings = enforce_max_size(decide_run(run, Retention(keep_last=3, keep_best=0)), max_size=10)
    assert kept(out) == [100, 200, 300]
    assert len(warnings) == 1 and "max_size=10B cannot be met" in warnings[0]


def test_min_free_counts_planned_deletions_and_takes_oldest_by_mtime():
    a = Run(
        ROOT,
        "a",
        tuple(
            Checkpoint(ROOT, "a", f"c-{s}", s, "hf", COMPLETE, size_bytes=100, newest_mtime=t, written_at=t)
            for s, t in ((1, 10.0), (2, 40.0), (3, 50.0))
        ),
    )
    b = Run(
        ROOT,
        "b",
        tuple(
            Checkpoint(ROOT, "b", f"c-{s}", s, "hf", COMPLETE, size_bytes=100, newest_mtime=t, written_at=t)
            for s, t in ((1, 20.0), (2, 30.0), (3, 60.0))
        ),
    )
    ds = decide_run(a, Retention(keep_last=3, keep_best=0)) + decide_run(
        b, Retention(keep_last=2, keep_best=0)
    )
    assert [d.checkpoint.rel for d in ds if d.action is Action.DELETE] == ["b/c-1"]  # 100 bytes planned
    out, warnings = enforce_min_free(ds, free=0, total=10_000, floor=FreeSpace(bytes=250), where="/vol")
    # b/c-1 (planned) frees 100; then the oldest by mtime across runs: a/c-1 (t=10), b/c-2 (t=30)
    assert sorted(d.checkpoint.rel for d in out if d.action is Action.DELETE) == ["a/c-1", "b/c-1", "b/c-2"]
    assert warnings == []


def test_min_free_percentage_and_warning_when_unreachable():
    run = run_of(ck(100, size=10), ck(200, size=10))
    out, warnings = enforce_min_free(
        decide_run(run, Retention(keep_last=1, keep_best=0)),
        free=0,
        total=1000,
        floor=FreeSpace(percent=50.0),
        where="/vol",
    )
    assert kept(out) == [200]
    assert len(warnings) == 1 and "min_free=50% cannot be met: it needs 490B more" in warnings[0]


def test_min_free_already_met_changes_nothing():
    run = run_of(ck(100), ck(200))
    ds = decide_run(run, Retention(keep_last=2, keep_best=0))
    out, warnings = enforce_min_free(ds, free=900, total=1000, floor=FreeSpace(percent=10), where="/vol")
    assert out == ds and warnings == []


def test_incomplete_and_writing_decisions_are_protected_from_budgets():
    """Two protections that mask each other (mutation audit): the flag, and the budget's own check."""
    run = run_of(ck(100, INCOMPLETE, size=50), ck(200, WRITING, size=50), ck(300))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=0))
    assert [d.protected for d in decisions[:2]] == [True, True]
    unflagged = [replace(d, protected=False) for d in decisions]  # the budget must still refuse them
    out, _ = enforce_max_size(unflagged, max_size=1)
    assert kept(out)[:2] == [100, 200]


# --- what a user needs is never deleted ------------------------------------------------------


def test_a_budget_that_cannot_be_met_deletes_nothing():
    """min_free wants more than every unprotected checkpoint holds: deleting them all would miss the
    floor anyway. Before: 100-400 were deleted, then a warning said the floor was still not met."""
    run = run_of(*(ck(s, size=10) for s in STEPS))
    ds = decide_run(run, Retention(keep_last=5, keep_best=0))
    out, warnings = enforce_min_free(ds, free=0, total=10_000, floor=FreeSpace(bytes=1000), where="/vol")
    assert kept(out) == STEPS
    assert len(warnings) == 1 and "min_free=1000 cannot be met: it needs 1000B more" in warnings[0]
    assert "deleting every checkpoint it may take (4, 40B) would not free it; deleting none" in warnings[0]
    # reachable: the oldest go, and only as many as needed
    out, warnings = enforce_min_free(ds, free=0, total=10_000, floor=FreeSpace(bytes=15), where="/vol")
    assert kept(out) == [300, 400, 500] and warnings == []
    out, warnings = enforce_max_size(ds, max_size=5)
    assert kept(out) == STEPS and "max_size=5B cannot be met" in warnings[0]


def test_steps_that_go_backwards_never_lose_the_checkpoint_written_last():
    """A new job writes checkpoint-100, -200, -300 into an output dir holding a day-old
    checkpoint-5000. Before: 'newest' meant the highest step, and each new checkpoint was
    deleted as old right after it completed."""
    day_old = ck(5000, mtime=1000.0)
    new = [ck(s, mtime=90_000.0 + s) for s in (100, 200, 300)]
    ds = decide_run(run_of(*new, day_old), Retention(keep_last=1, keep_best=0))
    by_step = {d.checkpoint.step: d for d in ds}
    assert kept(ds) == [300, 5000]
    assert by_step[300].reasons == ("written last (newest complete by time)",) and by_step[300].protected
    assert by_step[5000].reasons == ("newest complete",)
    # both anchors are protected from budgets too: the oldest unprotected goes
    ds = decide_run(run_of(*new, day_old), Retention(keep_last=4, keep_best=0))
    out, _ = enforce_max_size(ds, max_size=30)
    assert kept(out) == [200, 300, 5000]


def test_steps_that_go_backwards_do_not_slim_the_live_lineage():
    day_old = ck(5000, mtime=1000.0)
    new = [ck(s, mtime=90_000.0 + s) for s in (100, 200, 300)]
    for c in [*new, day_old]:
        object.__setattr__(c, "slim", replace(c.slim, removable=(("optimizer.pt", 8),), weights="model.safetensors"))
    ds = decide_run(run_of(*new, day_old), Retention(keep_last=4, keep_best=0, keep_full_last=1))
    actions = {d.checkpoint.step: str(d.action) for d in ds}
    assert actions == {100: "slim", 200: "slim", 300: "keep", 5000: "keep"}


def test_a_touch_of_an_old_checkpoint_does_not_move_the_keep_within_window():
    """keep_within counts from when the run's newest save began: touching one file of an old
    checkpoint (or pinning it) made it 'the newest', and the window dropped what it kept."""
    hour = 3600.0
    run = [ck(s, mtime=s * hour) for s in (1, 2, 3, 4, 5)]
    r = Retention(keep_last=1, keep_best=0, keep_within=2 * hour)
    before = kept(decide_run(run_of(*run), r))
    assert before == [3, 4, 5]
    touched = replace(run[0], written_at=100 * hour, newest_mtime=100 * hour)  # saved_at unchanged
    after = kept(decide_run(run_of(touched, *run[1:]), r))
    assert set(before) <= set(after)


def test_the_checkpoint_a_resume_pointer_names_and_one_holding_a_mount_are_never_deleted():
    run = run_of(ck(100), replace(ck(200), mounts=("data",)), ck(300), ck(400))
    run = replace(run, resume={"checkpoint-100": "DeepSpeed's latest"})
    ds = decide_run(run, Retention(keep_last=1, keep_best=0))
    assert kept(ds) == [100, 200, 400]
    by_step = {d.checkpoint.step: d for d in ds}
    assert by_step[100].reasons == ("named by DeepSpeed's latest: the framework resumes from it",)
    assert by_step[200].reasons == ("holds a mount point (data): another filesystem is never deleted",)
    assert by_step[100].protected and by_step[200].protected


def test_the_checkpoint_a_resume_pointer_names_is_never_slimmed():
    """DeepSpeed resumes from what `latest` names with its optimizer state (load_optimizer_states):
    slimming it would leave a resume that fails. The plan said `slim` and the reaper refused it
    every pass."""
    run = [ck(s) for s in (100, 200, 300)]
    for c in run:
        object.__setattr__(c, "slim", replace(c.slim, removable=(("optimizer.pt", 8),), weights="model.safetensors"))
    r = Retention(keep_last=3, keep_best=0, keep_full_last=1)
    assert {d.checkpoint.step: str(d.action) for d in decide_run(run_of(*run), r)} == {
        100: "slim", 200: "slim", 300: "keep"}
    rolled_back = replace(run_of(*run), resume={"checkpoint-100": "DeepSpeed's latest"})
    ds = {d.checkpoint.step: d for d in decide_run(rolled_back, r)}
    assert {s: str(d.action) for s, d in ds.items()} == {100: "keep", 200: "slim", 300: "keep"}
    assert "named by DeepSpeed's latest: the framework resumes from it" in ds[100].reasons


def test_metric_loss_means_eval_loss_as_the_trainer_maps_it_never_the_training_loss():
    """The Trainer logs the training loss as 'loss' and evaluations as 'eval_loss' at the same
    steps. metric_for_best_model='loss' means eval_loss to the Trainer; ckptd looked for 'loss'
    first, ranked by the training loss and deleted the Trainer's own best_model_checkpoint."""
    train = {100: 0.9, 200: 0.5, 300: 0.1, 400: 0.2, 500: 0.3}  # training loss keeps falling
    evals = {100: 0.4, 200: 0.2, 300: 0.6, 400: 0.7, 500: 0.8}  # best eval: 200
    history = {s: {"loss": train[s], "eval_loss": evals[s]} for s in STEPS}
    ts = TrainerState(500, "checkpoint-200", 0.2, history)
    run = run_of(*(replace(ck(s), trainer_state=ts if s == 500 else None) for s in STEPS))
    ds = decide_run(run, Retention(keep_last=1, keep_best=1, metric="loss"))
    assert kept(ds) == [200, 500]
    assert next(d for d in ds if d.checkpoint.step == 200).reasons == ("best loss=0.2 (min)",)
    assert metric_warnings(run, Retention(metric="loss")) == []


def test_a_metric_logged_nowhere_is_a_warning_not_a_silent_fallback():
    run = with_losses(STEPS, {s: 0.1 for s in STEPS})
    [w] = metric_warnings(run, Retention(metric="val_loss"))
    assert w == ("/vol/run: metric 'val_loss' (eval_val_loss in trainer_state.json, as the Trainer maps it) "
                 "is logged for none of its checkpoints: keep_missing_metric keeps every checkpoint")
    [w] = metric_warnings(run, Retention(metric="eval_bleu", keep_missing_metric=False))
    assert w.endswith("'eval_bleu' is logged for none of its checkpoints: only the other rules keep checkpoints")
    assert metric_warnings(run, Retention(metric="eval_bleu", keep_best=0)) == []
