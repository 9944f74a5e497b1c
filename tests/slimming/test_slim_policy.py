"""Slimming in the retention policy: checkpoints in, (step, action) out. Pure: no disk, no clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptd.config import FreeSpace, Retention
from ckptd.decide.policy import Action, decide_run, enforce_max_size, enforce_min_free, summarise
from ckptd.model import Check, Checkpoint, Run, Slimming, TrainerState, Verdict

ROOT = Path("/vol")
COMPLETE = (Check("quiet", Verdict.PASSED, "quiet"),)
INCOMPLETE = (Check("quiet", Verdict.PASSED, "quiet"), Check("deepspeed shards", Verdict.FAILED, "rank 1 missing"))
OPTIM = (("global_step/zero_pp_rank_0_mp_rank_00_optim_states.pt", 60),)
FULL = Slimming(removable=OPTIM, source="global_step")  # ZeRO-3: consolidate first
SLIMMED = Slimming(slimmed=True, weights="model.safetensors")


def ck(step, slim=FULL, checks=COMPLETE, *, size=100, pinned=False, losses=None):
    ts = None
    if losses is not None:
        ts = TrainerState(step, None, None, {s: {"eval_loss": v} for s, v in losses.items() if s <= step})
    return Checkpoint(ROOT, "run", f"checkpoint-{step}", step, "hf", checks, size_bytes=size,
                      newest_mtime=float(step), saved_at=float(step), written_at=float(step), pinned=pinned, trainer_state=ts, slim=slim)


def actions(decisions) -> list[tuple[int, str]]:
    return [(d.checkpoint.step, str(d.action)) for d in decisions]


def decide(*ckpts, **retention):
    return decide_run(Run(ROOT, "run", ckpts), Retention(keep_best=0, **retention))


@pytest.mark.parametrize(
    ("ckpts", "retention", "expected"),
    [
        # off by default: nothing is slimmed
        ([ck(1), ck(2), ck(3)], dict(keep_last=3), [(1, "keep"), (2, "keep"), (3, "keep")]),
        # the N newest complete full checkpoints keep their optimizer state
        ([ck(1), ck(2), ck(3)], dict(keep_last=3, keep_full_last=1), [(1, "slim"), (2, "slim"), (3, "keep")]),
        ([ck(1), ck(2), ck(3)], dict(keep_last=3, keep_full_last=2), [(1, "slim"), (2, "keep"), (3, "keep")]),
        # only what a rule keeps is slimmed; the rest is deleted as before
        ([ck(1), ck(2), ck(3)], dict(keep_last=2, keep_full_last=1), [(1, "delete"), (2, "slim"), (3, "keep")]),
        # slimmed checkpoints are kept as they are and do not count toward keep_full_last
        ([ck(1, SLIMMED), ck(2, SLIMMED), ck(3)], dict(keep_last=3, keep_full_last=2),
         [(1, "keep"), (2, "keep"), (3, "keep")]),
        ([ck(1), ck(2, SLIMMED), ck(3)], dict(keep_last=3, keep_full_last=2),
         [(1, "keep"), (2, "keep"), (3, "keep")]),
        ([ck(1), ck(2, SLIMMED), ck(3), ck(4)], dict(keep_last=4, keep_full_last=2),
         [(1, "slim"), (2, "keep"), (3, "keep"), (4, "keep")]),
        # a slimmed checkpoint is the newest complete: the newest full one is kept too
        ([ck(1), ck(2), ck(3, SLIMMED)], dict(keep_last=1), [(1, "delete"), (2, "keep"), (3, "keep")]),
        ([ck(1), ck(2), ck(3, SLIMMED)], dict(keep_last=1, keep_full_last=1),
         [(1, "delete"), (2, "keep"), (3, "keep")]),
        # incomplete: neither slimmed nor counted; pinned: kept as it is
        ([ck(1), ck(2), ck(3, checks=INCOMPLETE)], dict(keep_last=3, keep_full_last=1),
         [(1, "slim"), (2, "keep"), (3, "keep")]),
        ([ck(1, pinned=True), ck(2), ck(3)], dict(keep_last=1, keep_full_last=1),
         [(1, "keep"), (2, "delete"), (3, "keep")]),
        # nothing to remove (no optimizer files): kept, not "slimmed"
        ([ck(1, Slimming()), ck(2)], dict(keep_last=2, keep_full_last=1), [(1, "keep"), (2, "keep")]),
        # an interrupted slimming is finished, whatever keep_full_last says
        ([ck(1, Slimming(slimmed=True, removable=OPTIM, weights="model.safetensors")), ck(2)], dict(keep_last=2),
         [(1, "slim"), (2, "keep")]),
    ],
)
def test_slim_rules(ckpts, retention, expected):
    assert actions(decide(*ckpts, **retention)) == expected


def test_slim_reason_names_what_keeps_it_and_bytes_freed():
    losses = {1: 0.31, 2: 0.5, 3: 0.6}
    ds = decide_run(
        Run(ROOT, "run", (ck(1, losses=losses), ck(2, losses=losses), ck(3, losses=losses))),
        Retention(keep_last=1, keep_best=1, metric="eval_loss", keep_full_last=1),
    )
    assert ds[0].line() == (
        "slim run/checkpoint-1: slim: outside keep_full_last=1 (kept for: best eval_loss=0.31 (min))"
    )
    assert ds[0].protected  # still the best: budgets may not delete it
    assert [d.bytes_freed for d in ds] == [60, 100, 0]
    assert summarise(ds) == {"keep": 1, "delete": 1, "slim": 1, "bytes_to_free": 160}


def test_reasons_for_slimmed_unslimmable_and_newest_full():
    blocked = Slimming(removable=OPTIM, blocker="no weights file and 2 global_step directories to consolidate from")
    ds = decide(ck(1, blocked), ck(2), ck(3, SLIMMED), keep_last=3, keep_full_last=1)
    assert [d.reasons for d in ds] == [
        ("keep_last=3 (#3 newest)", "not slimmed: no weights file and 2 global_step directories to consolidate from"),
        ("newest full (resumable)", "keep_last=3 (#2 newest)"),
        ("newest complete", "slimmed"),
    ]
    assert ds[1].protected


@given(
    flags=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=8),
    keep_last=st.integers(0, 4),
    keep_full_last=st.one_of(st.none(), st.integers(1, 3)),
    max_size=st.one_of(st.none(), st.integers(0, 500)),
)
def test_the_newest_full_complete_checkpoint_is_never_slimmed_or_deleted(flags, keep_last, keep_full_last, max_size):
    ckpts = [
        ck(i, SLIMMED if slimmed else FULL, INCOMPLETE if incomplete else COMPLETE, pinned=pinned)
        for i, (slimmed, incomplete, pinned) in enumerate(flags)
    ]
    ds = decide(*ckpts, keep_last=keep_last, keep_full_last=keep_full_last)
    if max_size is not None:
        ds, _ = enforce_max_size(ds, max_size)
    full = [c for c in ckpts if not c.slimmed and c.state.value == "complete"]
    if full:
        newest = next(d for d in ds if d.checkpoint is full[-1])
        assert newest.action is Action.KEEP and newest.protected
    for d in ds:  # only complete, unpinned checkpoints are ever slimmed
        if d.action is Action.SLIM:
            assert d.checkpoint.state.value == "complete" and not d.checkpoint.pinned


def test_budgets_count_what_slimming_frees():
    ds = decide(ck(1), ck(2), ck(3), keep_last=3, keep_full_last=1)  # 40 + 40 + 100 left
    assert actions(enforce_max_size(ds, 180)[0]) == [(1, "slim"), (2, "slim"), (3, "keep")]
    out, _ = enforce_max_size(ds, 150)
    assert actions(out) == [(1, "delete"), (2, "slim"), (3, "keep")]
    assert out[0].reasons[0].startswith("max_size=150B exceeded (run holds 180B)")

    out, warnings = enforce_min_free(ds, free=0, total=10_000, floor=FreeSpace(bytes=120), where="/vol")
    assert actions(out) == [(1, "slim"), (2, "slim"), (3, "keep")] and warnings == []
    out, warnings = enforce_min_free(ds, free=0, total=10_000, floor=FreeSpace(bytes=130), where="/vol")
    assert actions(out) == [(1, "delete"), (2, "slim"), (3, "keep")] and warnings == []
    assert sum(d.bytes_freed for d in out) == 160
