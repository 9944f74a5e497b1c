"""keep_total: the HF Trainer's save_total_limit, by name. Pure, but for one
test that runs the Trainer's own rotation code on a real directory to hold ckptd to it."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from ckptd.config import ConfigError, Retention, Root, parse_config
from ckptd.decide.policy import Action, decide_run, metric_warnings
from ckptd.model import Checkpoint, Run, TrainerState
from tests.support.memruns import COMPLETE, INCOMPLETE, ROOT, ck


def run_with_best(steps, best: int | None, *, mtimes: dict[int, float] | None = None, checks=None) -> Run:
    """Trainer checkpoints at `steps`; the newest one's trainer_state names `best` as best."""
    ckpts = []
    for s in steps:
        c = ck(s, (checks or {}).get(s, COMPLETE), mtime=(mtimes or {}).get(s))
        ts = TrainerState(s, f"checkpoint-{best}" if best is not None else None, 0.1, {})
        ckpts.append(Checkpoint(**{**c.__dict__, "trainer_state": ts}))
    return Run(ROOT, "run", tuple(ckpts))


def kept_steps(decisions) -> list[int]:
    return sorted(d.checkpoint.step for d in decisions if d.action is Action.KEEP)


STEPS = [5, 10, 15, 20, 25]


@pytest.mark.parametrize(
    ("limit", "best", "expected"),
    [
        (2, 5, [5, 25]),  # the best counts inside the limit (the union keeps 5, 20, 25)
        (2, 25, [20, 25]),  # the best is the newest: the limit's N newest
        (1, 5, [5, 25]),  # limit 1: the Trainer keeps max(1, |{best, newest}|) = 2
        (1, 25, [25]),
        (3, 10, [10, 20, 25]),
        (2, None, [20, 25]),  # no best recorded: the N newest
        (5, 5, STEPS),
        (9, 5, STEPS),
        # best_model_checkpoint names a checkpoint that is not there: the Trainer still counts the
        # path it was given, max(1, |{newest, missing}|) = 2
        (1, 99, [20, 25]),
    ],
)
def test_keep_total_is_the_trainers_save_total_limit(limit, best, expected):
    decisions = decide_run(run_with_best(STEPS, best), Retention(keep_total=limit))
    assert kept_steps(decisions) == expected


def test_keep_total_with_a_metric_counts_the_best_by_it():
    losses = {5: 0.1, 10: 0.5, 15: 0.6, 20: 0.7, 25: 0.8}
    run = Run(ROOT, "run", tuple(ck(s, losses=losses) for s in STEPS))
    decisions = decide_run(run, Retention(keep_total=2, metric="eval_loss"))
    assert kept_steps(decisions) == [5, 25]
    reasons = {d.checkpoint.step: d.reasons for d in decisions}
    assert reasons[5] == ("best eval_loss=0.1 (min), counted in keep_total=2",)
    assert "keep_total=2 (the newest)" in reasons[25]
    deleted = [d for d in decisions if d.action is Action.DELETE]
    assert deleted[0].reasons == ("outside keep_total=2 (save_total_limit: best by eval_loss, min counted)",)


def test_keep_total_never_takes_what_is_always_kept():
    """The Trainer's order is by time: a checkpoint-30 written before checkpoint-5..25 (a new job in
    the directory) is its oldest, and its rotation deletes it; it is ckptd's newest by step, an
    anchor, and stays, saying why. Pinned ones stay too; incomplete ones are not counted."""
    mtimes = {30: 1.0, 5: 105.0, 10: 110.0, 15: 115.0, 20: 120.0, 25: 125.0}
    run = run_with_best([5, 10, 15, 20, 25, 30], None, mtimes=mtimes)
    ckpts = list(run.checkpoints)
    ckpts[0] = Checkpoint(**{**ckpts[0].__dict__, "pinned": True})  # checkpoint-5 pinned
    ckpts.append(ck(35, INCOMPLETE, mtime=130.0))
    decisions = decide_run(Run(ROOT, "run", tuple(ckpts)), Retention(keep_total=2))
    assert kept_steps(decisions) == [5, 20, 25, 30, 35]
    reasons = {d.checkpoint.step: d.reasons for d in decisions}
    assert reasons[30] == ("newest complete", "over keep_total=2: always kept")
    assert reasons[5] == ("pinned", "over keep_total=2: always kept")
    assert reasons[25][:2] == ("written last (newest complete by time)", "keep_total=2 (the newest)")
    assert reasons[35][0].startswith("incomplete, never deleted")


def test_keep_total_orders_by_step_when_the_times_span_less_than_a_second():
    """The Trainer falls back to numbers when its mtimes look fake (a copy that reset them)."""
    run = run_with_best(STEPS, None, mtimes={s: 100.0 + (25 - s) / 100 for s in STEPS})
    assert kept_steps(decide_run(run, Retention(keep_total=2))) == [5, 20, 25]  # 5: written last, an anchor


def test_keep_total_replaces_keep_last_and_keep_best_and_says_so():
    with pytest.raises(ConfigError, match="keep_total replaces keep_best and keep_last"):
        parse_config({"roots": [{"path": "/v", "retention": {"keep_total": 2, "keep_last": 3, "keep_best": 1}}]})
    root = Root.model_validate({"path": "/v", "retention": {"keep_total": 2},
                                "runs": [{"match": "old/*", "keep_last": 5}, {"match": "new/*", "keep_total": 3}]})
    assert (root.retention_for("old/a")[0].keep_total, root.retention_for("old/a")[0].keep_last) == (None, 5)
    assert root.retention_for("new/a")[0].keep_total == 3
    root = Root.model_validate({"path": "/v", "retention": {"keep_last": 4}, "runs": [{"match": "x", "keep_total": 1}]})
    decisions = decide_run(run_with_best(STEPS, 5), root.retention_for("x")[0])
    assert kept_steps(decisions) == [5, 25]  # the root's keep_last does not leak into the run's keep_total


def test_keep_total_warns_about_a_metric_it_cannot_find():
    run = run_with_best(STEPS, None)
    [w] = metric_warnings(run, Retention(keep_total=2, metric="bleu"))
    assert "is logged for none of its checkpoints: only the other rules and what is always kept count" in w


# --- the Trainer's own rotation, run on a real directory ------------------------------------

_TRAINER_UTILS = None


def trainer_rotation():
    """transformers' `rotate_checkpoints` and `sort_checkpoints`, exec'd from the installed
    trainer_utils.py on their own: importing transformers takes 6-17 s here, and the two functions
    need only os, re, shutil, Path and a logger. It is the Trainer's code, not a re-telling."""
    global _TRAINER_UTILS
    if _TRAINER_UTILS is None:
        spec = importlib.util.find_spec("transformers")
        if spec is None or spec.origin is None:
            pytest.skip("transformers is not installed (pip install -e '.[test]')")
        source = (Path(spec.origin).parent / "trainer_utils.py").read_text()
        tree = ast.parse(source)
        wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name in ("sort_checkpoints", "rotate_checkpoints")]
        module = ast.Module(body=wanted, type_ignores=[])
        scope = {"os": os, "re": re, "shutil": shutil, "Path": Path, "PREFIX_CHECKPOINT_DIR": "checkpoint",
                 "logger": logging.getLogger("transformers-under-test")}
        scope["logger"].warning_once = scope["logger"].warning  # type: ignore[attr-defined]
        exec(compile(module, str(spec.origin), "exec"), scope)
        _TRAINER_UTILS = scope
    return _TRAINER_UTILS


@pytest.mark.parametrize("limit", [1, 2, 3, 4])
@pytest.mark.parametrize("best", [None, 5, 15, 25, 99])
@pytest.mark.parametrize("shuffled", [False, True])
def test_keep_total_keeps_what_the_trainers_rotation_keeps(tmp_path, limit, best, shuffled):
    """The Trainer's rotate_checkpoints(use_mtime=True), as `_save_checkpoint` calls it, on
    directories with the same mtimes: ckptd keeps exactly what it keeps, plus its anchors."""
    utils = trainer_rotation()
    order = [15, 5, 25, 10, 20] if shuffled else STEPS  # the order they were written in
    mtimes = {s: 1000.0 + 10 * i for i, s in enumerate(order)}
    for s in STEPS:
        d = tmp_path / f"checkpoint-{s}"
        d.mkdir()
        os.utime(d, (mtimes[s], mtimes[s]))
    best_path = str(tmp_path / f"checkpoint-{best}") if best is not None else None
    if best == 99:
        best_path = str(tmp_path / "checkpoint-99")  # deleted by hand: the Trainer still counts it
    utils["rotate_checkpoints"](str(tmp_path), save_total_limit=limit, best_model_checkpoint=best_path,
                                use_mtime=True)
    trainers = sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir())
    assert len(trainers) == min(5, max(limit, 2 if best not in (None, order[-1]) else 1))  # it did rotate

    decisions = decide_run(run_with_best(STEPS, best, mtimes=mtimes), Retention(keep_total=limit))
    anchors = {25, order[-1]}  # newest by step, and written last
    assert kept_steps(decisions) == sorted(set(trainers) | anchors)
    for d in decisions:
        if d.checkpoint.step not in trainers and d.action is Action.KEEP:
            assert d.reasons[-1] == f"over keep_total={limit}: always kept", d.reasons
