"""ckptd on volumes the real frameworks wrote (fwgen.py), some saves really killed mid-way.

Ground truth is each framework's own verdict (Orbax's `all_steps()`/restore with the writer's
options, accelerate's `load_state`, the Trainer's resume, `dcp.load`, `torch.load`), recorded by
fwgen on every checkpoint. The promise is checked against it: ckptd never calls complete what
the framework refuses, and never deletes the last checkpoint the framework can load. Driven
through the real `ckptd` command line; the test process imports no framework.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import run_ckptd
from fwfixtures import copy_volume

pytestmark = pytest.mark.frameworks


def write_config(tmp_path: Path, root: Path, **retention: Any) -> Path:
    cfg = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'", f"[[roots]]\npath = '{root}'\nmax_depth = 8",
             "[roots.retention]", *(f"{k} = {json.dumps(v)}" for k, v in retention.items())]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def plan(cfg: Path) -> dict[str, Any]:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def rows(doc: dict[str, Any], root: Path) -> dict[str, dict[str, Any]]:
    """plan's rows by path relative to the root."""
    return {os.path.relpath(c["path"], root): c for c in doc["checkpoints"]}


VOLUMES = ["orbax_volume", "accelerate_volume", "trainer_volume", "dcp_volume", "lightning_volume"]


@pytest.mark.parametrize("volume_name", VOLUMES)
def test_ckptd_never_calls_complete_what_the_framework_refuses(request, tmp_path, volume_name):
    """Every checkpoint of every framework volume: where the framework's own loader refuses it (or
    restores it only in part), ckptd must not call it complete. Before issue 11, seven such states
    were 'complete' (Orbax's commit-file mode killed at four points, accelerate's, a Trainer rank's
    missing rng_state)."""
    volume = request.getfixturevalue(volume_name)
    root = copy_volume(volume, tmp_path / "vol")
    seen = rows(plan(write_config(tmp_path, root, keep_last=1, keep_best=0)), root)
    wrong = []
    for rec in volume["checkpoints"]:
        row = seen.get(rec["path"])
        if row is not None and row["state"] == "complete" and not rec["truth"]["complete"]:
            wrong.append(f"{rec['path']}: ckptd says complete; {volume_name} says {rec['truth']}")
    assert wrong == []


def surviving(root: Path, run: str) -> list[str]:
    return sorted(p.name for p in (root / run).iterdir() if not p.name.startswith("."))


def test_orbax_commit_file_mode_killed_midway_keeps_the_last_loadable_step(orbax_volume, tmp_path):
    """Issue 11, hole 1: step 3 written in place (CommitFileTemporaryPath) and killed before
    commit_success.txt was judged complete, became the newest, and with keep_last=1 steps 1 and 2
    (the last one Orbax can restore) were deleted. Each of the four kill points, end to end."""
    root = copy_volume(orbax_volume, tmp_path / "vol")
    cfg = write_config(tmp_path, root, keep_last=1, keep_best=0)
    before = rows(plan(cfg), root)
    for run in ("commit_file", "commit_file_late", "commit_file_midwrite"):
        assert before[f"{run}/3"]["state"] == "incomplete", before[f"{run}/3"]
        assert any("orbax commit failed: no commit_success.txt" in r for r in before[f"{run}/3"]["reasons"])
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for run in ("default", "commit_file", "commit_file_late", "commit_file_midwrite"):
        assert "2" in surviving(root, run), run  # Orbax's latest_step() = 2: kept
        assert "1" not in surviving(root, run), run
    assert "3" in surviving(root, "commit_file") and "3.orbax-checkpoint-tmp" in surviving(root, "default")


def test_accelerate_save_state_directories_are_found_and_counted(accelerate_volume, tmp_path):
    """Issue 11, hole 2: accelerate's save_state() directories had no layout (not even listed with
    no pattern configured; with one, complete on quiet alone). Now each is found by accelerate's
    own files and is complete only with every process's random_states_<r>.pkl, rank 0's included."""
    root = copy_volume(accelerate_volume, tmp_path / "vol")
    seen = rows(plan(write_config(tmp_path, root, keep_last=1, keep_best=0)), root)
    for rec in accelerate_volume["checkpoints"]:
        row = seen.get(rec["path"])
        if rec["killed"] is None:
            assert row is not None and row["layout"] == "accelerate" and row["state"] == "complete", rec["path"]
        elif row is not None:
            assert row["state"] == "incomplete", (rec["path"], row)
    killed = {rec["path"]: seen.get(rec["path"]) for rec in accelerate_volume["checkpoints"] if rec["killed"]}
    assert "rank census failed: 1 ranks' files, the run's last complete checkpoint step_30 has 2" in (
        killed["steps/step_40"]["reasons"][0])
    assert "random_states_0.pkl missing" in killed["auto/checkpoints/checkpoint_3"]["reasons"][0]


def test_a_trainer_rank_killed_before_its_rng_state_never_costs_the_last_whole_checkpoint(trainer_volume, tmp_path):
    """Issue 11, 9a: DDP with 2 ranks, rank 1 killed before rng_state_1.pth. 'rng_state_0 is
    contiguous' passed it, it became the newest complete, and keep_last=1 deleted checkpoint-8,
    the last whole one. The run's complete checkpoints have 2 ranks' files: 1 is short."""
    root = copy_volume(trainer_volume, tmp_path / "vol")
    cfg = write_config(tmp_path, root, keep_last=1, keep_best=0)
    row = rows(plan(cfg), root)["run-rng/checkpoint-10"]
    assert row["state"] == "incomplete"
    assert "1 ranks' files, the run's last complete checkpoint checkpoint-8 has 2" in row["reasons"][0]
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert surviving(root, "run-rng") == ["checkpoint-10", "checkpoint-8"]
    assert surviving(root, "run-state") == ["checkpoint-10", "checkpoint-8"]


def test_metric_loss_keeps_the_trainers_own_best_checkpoint(trainer_volume, tmp_path):
    """Issue 11, hole 6: metric_for_best_model='loss' is eval_loss to the Trainer (its best:
    checkpoint-6); ckptd ranked by the training loss (lowest at checkpoint-4) and deleted 6."""
    root = copy_volume(trainer_volume, tmp_path / "vol")
    recs = {r["path"]: r for r in trainer_volume["checkpoints"]}
    assert os.path.basename(recs["run-rng/checkpoint-8"]["best_model_checkpoint"]) == "checkpoint-6"
    cfg = write_config(tmp_path, root, keep_last=1, keep_best=1, metric="loss")
    seen = rows(plan(cfg), root)
    assert seen["run-rng/checkpoint-6"]["action"] == "keep"
    assert seen["run-rng/checkpoint-6"]["reasons"] == ["best loss=0.4 (min)"]
    assert seen["run-rng/checkpoint-4"]["action"] == "delete"


def test_an_accelerate_save_killed_before_any_random_states_is_incomplete(accelerate_volume, tmp_path):
    """Killed after the main process's model, optimizer and scheduler, before any process wrote its
    random_states_<r>.pkl (the files removed from a real save: what such a kill leaves)."""
    root = copy_volume(accelerate_volume, tmp_path / "vol")
    ck = root / "steps" / "step_30"
    for f in ck.glob("random_states_*.pkl"):
        f.unlink()
    copy_age = root.stat().st_mtime
    os.utime(ck, (copy_age, copy_age))
    row = rows(plan(write_config(tmp_path, root, keep_last=1, keep_best=0)), root)["steps/step_30"]
    assert row["state"] == "incomplete"
    assert "random_states_0.pkl missing" in row["reasons"][0]
