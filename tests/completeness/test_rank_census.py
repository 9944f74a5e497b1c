"""A rank census with no complete checkpoint before it: the real HF Trainer's run (fwgen.py, 2-process
DDP on gloo) whose rank 1 was killed before `rng_state_1.pth` in checkpoint-10, while the checkpoint
before it is being written to. The run's complete checkpoints used to be the only yardstick: with
none, checkpoint-10 (rank 0's files alone, contiguous) was called complete, and `latest` named it;
resuming from it silently resets rank 1's random state. Driven through the real `ckptd` CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli.demo_volume import age
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume

pytestmark = pytest.mark.frameworks

OLD = 3600.0


def only_checkpoints_8_and_10(trainer_volume: dict[str, Any], tmp_path: Path) -> tuple[Path, Path]:
    """The Trainer's run-rng with checkpoint-8 (whole) and checkpoint-10 (rank 1 killed before its
    rng state) alone, every file an hour old."""
    root = copy_volume(trainer_volume, tmp_path / "vol", age_seconds=OLD)
    run = root / "run-rng"
    for step in (2, 4, 6):
        shutil.rmtree(run / f"checkpoint-{step}")
    assert not (run / "checkpoint-10" / "rng_state_1.pth").exists()
    return root, run


def plan_rows(root: Path, tmp_path: Path) -> dict[str, dict[str, Any]]:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\nmax_depth = 8\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return {os.path.relpath(c["path"], root): c for c in json.loads(proc.stdout)["checkpoints"]}


def latest(run: Path, *options: str):
    return run_ckptd("latest", *options, run, env={"CKPTD_CONFIG": ""})


def test_an_eval_job_writing_into_the_checkpoint_before_leaves_its_rank_files_to_count_against(
        trainer_volume, tmp_path):
    root, run = only_checkpoints_8_and_10(trainer_volume, tmp_path)
    results = run / "checkpoint-8" / "eval_results.json"
    results.write_text(json.dumps({"eval_loss": 1.25}))  # an eval job writing into it now: checkpoint-8 in flight

    rows = plan_rows(root, tmp_path)
    assert rows["run-rng/checkpoint-8"]["state"] == "writing"
    ten = rows["run-rng/checkpoint-10"]
    assert ten["state"] == "incomplete", ten
    assert "1 ranks' files, the run's earlier checkpoint checkpoint-8 (writing) has 2" in ten["reasons"][0]

    # An observer choosing while training runs (a quiet period) vouches for neither yet.
    proc = latest(run, "--quiet-period", "60s")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "passed over checkpoint-10: incomplete: rank census failed: 1 ranks' files, the run's earlier checkpoint checkpoint-8" in proc.stderr

    # At a restart (no quiet period: the job that wrote the run is the one being restarted), or once
    # the eval job is done (its file as old as the rest): checkpoint-8 is the one latest vouches for.
    proc = latest(run)
    assert proc.returncode == 0 and proc.stdout == f"{run / 'checkpoint-8'}\n", proc.stderr
    assert "passed over checkpoint-10: incomplete: rank census failed: 1 ranks' files" in proc.stderr
    age(run / "checkpoint-8", os.stat(run / "checkpoint-8" / "trainer_state.json").st_mtime)
    proc = latest(run)
    assert proc.returncode == 0 and proc.stdout == f"{run / 'checkpoint-8'}\n", proc.stderr
    assert "passed over checkpoint-10: incomplete: rank census failed: 1 ranks' files" in proc.stderr


def test_with_nothing_to_count_against_the_rank_count_is_unknown_not_complete(trainer_volume, tmp_path):
    """checkpoint-8 written again and not yet at its rng states (Trainer._save_checkpoint writes them
    after the weights and optimizer, then trainer_state.json): made from the real one by removing
    those files, the state such a save is in until it reaches them."""
    root, run = only_checkpoints_8_and_10(trainer_volume, tmp_path)
    eight = run / "checkpoint-8"
    for name in ("rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"):
        (eight / name).unlink()
    os.utime(eight / "optimizer.pt")  # written just now

    rows = plan_rows(root, tmp_path)
    assert rows["run-rng/checkpoint-8"]["state"] == "writing"
    ten = rows["run-rng/checkpoint-10"]
    assert ten["state"] == "incomplete", ten
    assert ten["reasons"][0].startswith("incomplete, never deleted: rank census unknown: 1 ranks' files, and no "
                                        "complete checkpoint of the run to count them against (checkpoint-8 is "
                                        "writing"), ten
    assert "the rank count is unknown until it is complete" in ten["reasons"][0]
    # `latest` as an observer choosing while training runs, as plan judges: checkpoint-8 in flight. (At a
    # restart, with no quiet period, checkpoint-8 is a save killed before its rng states, and a killed
    # save's missing rank files say nothing of the world size: there checkpoint-10 is named.)
    proc = latest(run, "--quiet-period", "60s")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "passed over checkpoint-10: incomplete: rank census unknown: 1 ranks' files" in proc.stderr
