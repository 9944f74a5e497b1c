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

from tests.support.common import REPO, run_ckptd
from tests.support.fwfixtures import copy_volume

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
    restores it only in part), ckptd must not call it complete. Seven such states are easy to take
    for complete (Orbax's commit-file mode killed at four points, accelerate's, a Trainer rank's
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
    """Step 3 written in place (CommitFileTemporaryPath) and killed before
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
    """accelerate's save_state() directories had no layout (not even listed with
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
    """DDP with 2 ranks, rank 1 killed before rng_state_1.pth. 'rng_state_0 is
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
    """metric_for_best_model='loss' is eval_loss to the Trainer (its best:
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


# --- every framework's checkpoints as its users know them, and the resume side -------------------


def default_config(tmp_path: Path, root: Path, **retention: Any) -> Path:
    """No patterns and the default max_depth (4): what a user who just points ckptd at a volume has."""
    cfg = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'", f"[[roots]]\npath = '{root}'",
             "[roots.retention]", *(f"{k} = {json.dumps(v)}" for k, v in retention.items())]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_lightning_checkpoints_with_their_metric_and_its_source_under_the_default_depth(lightning_volume, tmp_path):
    """Lightning's default tree, team/run/lightning_logs/version_0/checkpoints, is 5 levels down:
    found with the default max_depth. val_loss is read from the name where the template put it,
    else from the ModelCheckpoint state inside the .ckpt (torch is installed here), and plan says
    which; a template without a step is ordered by epoch; last.ckpt is not a step and not listed.
    The best epoch (1) is kept in every run, and no checkpoint here goes unlisted."""
    root = copy_volume(lightning_volume, tmp_path / "vol")
    doc = plan(default_config(tmp_path, root, keep_last=1, keep_best=1, metric="val_loss"))
    seen = rows(doc, root)
    for rec in lightning_volume["checkpoints"]:
        row = seen.get(rec["path"])
        if rec["last"]:
            assert row is None, rec["path"]  # Lightning's copy of the newest: never counted, never deleted
            continue
        assert row is not None and row["layout"] == "lightning", rec["path"]
        if rec["killed"]:
            assert (row["state"], row["action"]) == ("incomplete", "keep"), row
            continue
        nostep = "run-nostep" in rec["path"]
        assert (row["step"], row["step_unit"]) == ((rec["epoch"], "epoch") if nostep else (rec["step"], "step"))
        assert row["metric"] == pytest.approx(rec["metric"], abs=0.005)  # a name's value is rounded
        named = "val_loss=" in os.path.basename(rec["path"])
        assert row["metric_source"] == ("file name" if named else ".ckpt ModelCheckpoint state"), row
        if rec["epoch"] == 1:
            assert row["action"] == "keep" and f"best val_loss={row['metric']:g} (min)" in row["reasons"], row
        if rec["epoch"] == 0:
            assert row["action"] == "delete", row
    nostep = [r for r in doc["checkpoints"] if "run-nostep" in r["path"] and r["step"] == 3]
    assert nostep[0]["reasons"] == ["newest complete (by epoch, then time: its name has no step)"]
    assert not [w for w in doc["warnings"] if "val_loss" in w]


def test_lightning_metric_inside_the_ckpt_without_torch_is_missing_and_plan_says_why(lightning_volume, tmp_path):
    root = copy_volume(lightning_volume, tmp_path / "vol")
    run = "team-a/run-default"
    cfg = default_config(tmp_path, root / run, keep_last=1, keep_best=1, metric="val_loss")
    notorch = str(REPO / "bench" / "notorch")
    proc = run_ckptd("plan", "-c", cfg, "--json", env={"PYTHONPATH": f"{notorch}:{os.environ['PYTHONPATH']}"})
    doc = json.loads(proc.stdout)
    assert {r["action"] for r in doc["checkpoints"]} == {"keep"}  # keep_missing_metric
    [warning] = doc["warnings"]
    assert "could not be read: val_loss is not in its name" in warning and "torch is not installed" in warning


def test_orbax_best_fn_metrics_and_step_prefixes(orbax_volume, tmp_path):
    """Orbax's metrics item (<step>/metrics/metrics) ranks its steps as best_fn does (best_step() = 2);
    step_prefix ('step_100') and fixed-length names ('step_000100') are steps 100 and 200. With no
    metric configured, the defaults cannot know best_fn's key: a warning names it."""
    root = copy_volume(orbax_volume, tmp_path / "vol")
    seen = rows(plan(default_config(tmp_path, root, keep_last=1, keep_best=1, metric="loss")), root)
    assert orbax_volume["runs"]["best_fn"]["truth"]["best_step"] == 2
    best = seen["best_fn/2"]
    assert (best["action"], best["metric"], best["metric_source"]) == ("keep", 0.3, "orbax metrics/")
    assert best["reasons"] == ["best loss=0.3 (min)"]
    assert [seen[f"best_fn/{s}"]["action"] for s in (1, 3, 4)] == ["delete", "delete", "keep"]
    for run in ("step_prefix", "prefix_fixed", "fixed_length"):
        for step, name in zip((100, 200), orbax_volume["runs"][run]["step_dirs"], strict=True):
            row = seen[f"{run}/{name}"]
            assert (row["layout"], row["step"], row["state"]) == ("orbax", step, "complete"), row
    doc = plan(default_config(tmp_path, root))
    [warning] = [w for w in doc["warnings"] if "best_fn" in w]
    assert "keep_best has no metric to rank these orbax checkpoints by" in warning and "'loss'" in warning



@pytest.mark.parametrize("item", ["default", "metrics"])
def test_an_orbax_step_copied_without_one_of_its_items_is_incomplete(orbax_volume, tmp_path, item):
    """A step whose copy never brought one item's directory (a copier that died before it): Orbax's
    restore raises `Item "<name>" was not found` though all_steps() lists the step. Its
    `_CHECKPOINT_METADATA` names the items (`item_handlers`): each must be there. The volume is
    Orbax's own (best_fn's steps hold `default/` and `metrics/`); the item removed by hand, as the
    dead copier leaves it, the step's mtime kept."""
    root = copy_volume(orbax_volume, tmp_path / "vol")
    step = root / "best_fn" / "4"
    assert set(json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]) == {"default", "metrics"}
    st = step.stat()
    for dirpath, _dirnames, filenames in os.walk(step / item, topdown=False):
        for n in filenames:
            os.unlink(os.path.join(dirpath, n))
        os.rmdir(dirpath)
    os.utime(step, ns=(st.st_atime_ns, st.st_mtime_ns))
    seen = rows(plan(write_config(tmp_path, root, keep_last=1, keep_best=0)), root)
    assert seen["best_fn/4"]["state"] == "incomplete", seen["best_fn/4"]
    said = f"orbax items failed: item {item} missing (_CHECKPOINT_METADATA names it; restore fails)"
    assert any(said in r for r in seen["best_fn/4"]["reasons"]), seen["best_fn/4"]["reasons"]
    assert (seen["best_fn/3"]["state"], seen["best_fn/3"]["action"]) == ("complete", "keep"), seen["best_fn/3"]

def test_accelerate_automatic_naming_counts_saves_and_torchtitan_is_named(accelerate_volume, dcp_volume, tmp_path):
    root = copy_volume(accelerate_volume, tmp_path / "acc")
    seen = rows(plan(default_config(tmp_path, root)), root)
    row = seen["auto/checkpoints/checkpoint_2"]
    assert (row["step"], row["step_unit"]) == (2, "save")
    assert row["reasons"] == [
        "newest complete (by save count, then time: accelerate's checkpoint_N counts saves, not steps)"]
    assert seen["epochs/epoch_1"]["step_unit"] == "epoch" and seen["steps/step_30"]["step_unit"] == "step"
    root = copy_volume(dcp_volume, tmp_path / "dcp")
    seen = rows(plan(default_config(tmp_path, root)), root)
    assert {(r["layout"], r["step"]) for r in seen.values()} == {("torchtitan", s) for s in (10, 20, 30)}
    assert seen["titan-b/checkpoint/step-20"]["state"] == "incomplete"


def test_keep_total_is_what_the_trainer_would_have_kept(trainer_volume, tmp_path):
    """save_total_limit=2 with load_best_model_at_end: the Trainer's best (checkpoint-6) counts inside
    the limit, so 6 and 8 stay; the killed checkpoint-10 is neither counted nor deleted."""
    root = copy_volume(trainer_volume, tmp_path / "vol")
    cfg = default_config(tmp_path, root, keep_total=2)
    seen = rows(plan(cfg), root)
    assert seen["run-state/checkpoint-6"]["reasons"] == [
        "trainer's best_model_checkpoint (best_metric=0.4), counted in keep_total=2"]
    assert seen["run-state/checkpoint-6"]["metric_source"] == "trainer_state"
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    for run in ("run-rng", "run-state"):
        assert surviving(root, run) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]


def test_lightning_last_copies_are_never_counted_or_deleted(lightning_volume, tmp_path):
    """last.ckpt is what Lightning's ckpt_path='last' resumes from: keep_last=1 deletes the older
    epochs and never it, whole or truncated (a kill mid-copy from another filesystem)."""
    root = copy_volume(lightning_volume, tmp_path / "vol")
    cfg = default_config(tmp_path, root, keep_last=1, keep_best=0)
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    for run, spec in lightning_volume["runs"].items():
        if "skipped" in spec:
            continue
        left = surviving(root, spec["ckpt_dir"])
        assert "last.ckpt" in left, (run, left)
        assert len(left) < len(spec["files"]), (run, left)  # something was deleted: retention ran


RESUMES = [
    # (volume, RUN_DIR, the checkpoint ckptd latest names, the killed newer save it passes over)
    ("trainer_volume", "run-rng", "run-rng/checkpoint-8", "run-rng/checkpoint-10"),
    ("trainer_volume", "run-state", "run-state/checkpoint-8", "run-state/checkpoint-10"),
    ("orbax_volume", "default", "default/2", "default/3.orbax-checkpoint-tmp"),
    ("orbax_volume", "commit_file", "commit_file/2", "commit_file/3"),
    ("orbax_volume", "commit_file_late", "commit_file_late/2", "commit_file_late/3"),
    ("orbax_volume", "commit_file_midwrite", "commit_file_midwrite/2", "commit_file_midwrite/3"),
    ("orbax_volume", "commit_file_early", "commit_file_early/2", "commit_file_early/3"),
    ("orbax_volume", "step_prefix", "step_prefix/step_200", None),
    ("orbax_volume", "best_fn", "best_fn/4", None),
    ("accelerate_volume", "auto", "auto/checkpoints/checkpoint_2", "auto/checkpoints/checkpoint_3"),
    ("accelerate_volume", "steps", "steps/step_30", "steps/step_40"),
    ("accelerate_volume", "epochs", "epochs/epoch_1", None),
    ("dcp_volume", "titan-a", "titan-a/checkpoint/step-20", "titan-a/checkpoint/step-30"),
    ("dcp_volume", "titan-b", "titan-b/checkpoint/step-10", "titan-b/checkpoint/step-20"),
    ("lightning_volume", "team-a/run-default", "team-a/run-default/lightning_logs/version_0/checkpoints/epoch=3-step=8.ckpt",
     None),
    ("lightning_volume", "team-b/run-nostep",
     "team-b/run-nostep/lightning_logs/version_0/checkpoints/epoch=3-val_loss=0.70.ckpt", None),
    ("lightning_volume", "team-b/run-killed", "team-b/run-killed/lightning_logs/version_0/checkpoints/epoch=1-step=4.ckpt",
     None),  # killed before the commit rename: nothing under the final name
    ("lightning_volume", "team-c/run-xdev-topk",
     "team-c/run-xdev-topk/lightning_logs/version_0/checkpoints/epoch=1-step=4.ckpt",
     "team-c/run-xdev-topk/lightning_logs/version_0/checkpoints/epoch=2-step=6.ckpt"),
    ("lightning_volume", "team-c/run-xdev-last",  # the truncated last.ckpt is not a step: never named
     "team-c/run-xdev-last/lightning_logs/version_0/checkpoints/epoch=2-step=6.ckpt", None),
]


@pytest.mark.parametrize(("volume_name", "run_dir", "expected", "killed"), RESUMES,
                         ids=[f"{v.split('_')[0]}:{r}" for v, r, _, _ in RESUMES])
def test_ckptd_latest_names_a_checkpoint_the_frameworks_own_loader_loads(
        request, tmp_path, volume_name, run_dir, expected, killed):
    """The checkpoint `ckptd latest RUN_DIR` names is one the framework's own loader restores whole
    (fwgen's truth: Orbax's restore with the writer's options, accelerate's load_state, the Trainer's
    resume, dcp.load, torch.load and Trainer.fit(ckpt_path=)); a newer save killed mid-way is passed
    over, saying why. The frameworks' own 'last' picks the killed one (get_last_checkpoint,
    accelerate's load_state(), Orbax read with default options)."""
    volume = request.getfixturevalue(volume_name)
    if run_dir in volume["runs"] and "skipped" in volume["runs"][run_dir]:
        pytest.skip(volume["runs"][run_dir]["skipped"])
    root = copy_volume(volume, tmp_path / "vol")
    recs = {r["path"]: r for r in volume["checkpoints"]}
    proc = run_ckptd("latest", root / run_dir, env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{root / expected}\n"
    truth = recs[expected]["truth"]
    assert truth["complete"] and truth["loads"] is not False, truth
    if killed is not None:
        assert not recs[killed]["truth"]["complete"]
        assert f"passed over {os.path.relpath(root / killed, root / run_dir)}: incomplete" in proc.stderr
    if volume_name == "trainer_volume":  # the Trainer's own get_last_checkpoint picked the killed one
        assert recs[killed]["truth"]["get_last_checkpoint_picks_it"]
