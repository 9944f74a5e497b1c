"""The framework volumes are what FWGEN_NOTES.md says they are (tests of the fixtures, not of ckptd).

Each volume was written by the framework's own saving code, some saves killed mid-way, and its ground
truth recorded by the framework's own loader in a subprocess (fwgen.py).  These tests check that
truth and the files on disk, so that the tests built on the volumes stand on facts: a killed save
really is on disk and really is refused (or silently half-restored) by its framework.  The test
process imports no framework.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import fwgen
from tests.support.fwfixtures import copy_volume

pytestmark = pytest.mark.frameworks


def records(volume: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rec["path"]: rec for rec in volume["checkpoints"]}


def names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


# --- Orbax --------------------------------------------------------------------------------


def test_orbax_killed_steps_are_left_out_by_all_steps(orbax_volume):
    runs = orbax_volume["runs"]
    for name in ("default", "commit_file", "commit_file_late", "commit_file_midwrite", "commit_file_early"):
        writer = runs[name]["truth"]["writer_options"]
        assert writer["all_steps"] == [1, 2], name
        assert writer["latest_step"] == 2, name
        assert writer["restore"]["1"] == writer["restore"]["2"] == "ok", name
        assert writer["restore"]["3"] != "ok", name
    recs = records(orbax_volume)
    assert [p for p, r in recs.items() if r["killed"]] == [
        "default/3.orbax-checkpoint-tmp", "commit_file/3", "commit_file_late/3", "commit_file_midwrite/3",
        "commit_file_early/3"]
    for rec in recs.values():
        assert rec["truth"]["complete"] is (rec["killed"] is None), rec["path"]


def test_orbax_default_mode_leaves_a_tmp_directory(orbax_volume):
    run = orbax_volume["out_dir"] / "default"
    assert names(run) == {"1", "2", "3.orbax-checkpoint-tmp"}
    assert "commit_success.txt" in names(run / "2")  # 0.12.8 writes it before the rename too
    assert "commit_success.txt" not in names(run / "3.orbax-checkpoint-tmp")


def test_orbax_commit_file_killed_step_has_the_final_name(orbax_volume):
    """What a commit-file save killed before its commit leaves: `3/` in place, no commit_success.txt,
    commit timestamp null."""
    runs, out = orbax_volume["runs"], orbax_volume["out_dir"]
    step3 = out / "commit_file" / "3"
    assert step3.is_dir() and not (step3 / "commit_success.txt").exists()
    assert "commit_success.txt" in names(out / "commit_file" / "2")
    meta = json.loads((step3 / "_CHECKPOINT_METADATA").read_text())
    assert meta["commit_timestamp_nsecs"] is None and meta["init_timestamp_nsecs"] > 0
    assert runs["commit_file"]["step3_metadata"] == meta
    # the data itself was all written before the kill: the item has its own commit file
    assert (step3 / "default" / "commit_success.txt").exists()
    # a reader that does not know the writer's mode (default options, local path) takes it
    default_view = runs["commit_file"]["truth"]["default_options"]
    assert default_view["all_steps"] == [1, 2, 3] and default_view["latest_step"] == 3


def test_orbax_commit_timestamp_is_not_completion(orbax_volume):
    """Killed between the commit timestamp and commit_success.txt: the timestamp is set, and Orbax
    (in the writer's mode) still leaves the step out."""
    step3 = orbax_volume["out_dir"] / "commit_file_late" / "3"
    meta = json.loads((step3 / "_CHECKPOINT_METADATA").read_text())
    assert isinstance(meta["commit_timestamp_nsecs"], int)
    assert not (step3 / "commit_success.txt").exists()
    assert 3 not in orbax_volume["runs"]["commit_file_late"]["truth"]["writer_options"]["all_steps"]


def test_orbax_item_and_early_kills(orbax_volume):
    out, runs = orbax_volume["out_dir"], orbax_volume["runs"]
    mid = out / "commit_file_midwrite" / "3"
    assert (mid / "default").is_dir() and not (mid / "default" / "commit_success.txt").exists()
    early = out / "commit_file_early" / "3"
    assert names(early) == {"_CHECKPOINT_METADATA"}
    assert json.loads((early / "_CHECKPOINT_METADATA").read_text())["item_handlers"] is None
    default_view = runs["commit_file_early"]["truth"]["default_options"]
    assert default_view["latest_step"] == 3  # listed by a default-options reader ...
    assert default_view["restore"]["3"].startswith("KeyError")  # ... which then cannot restore it


def test_orbax_step_names(orbax_volume):
    out, runs = orbax_volume["out_dir"], orbax_volume["runs"]
    assert names(out / "step_prefix") == {"step_100", "step_200"}
    assert names(out / "fixed_length") == {"00000100", "00000200"}
    assert names(out / "prefix_fixed") == {"step_000100", "step_000200"}
    for name in ("step_prefix", "fixed_length", "prefix_fixed"):
        assert runs[name]["truth"]["all_steps"] == [100, 200]
        assert set(runs[name]["truth"]["restore"].values()) == {"ok"}


def test_orbax_best_fn_metrics(orbax_volume):
    out, truth = orbax_volume["out_dir"], orbax_volume["runs"]["best_fn"]["truth"]
    assert truth["best_step"] == 2 and truth["latest_step"] == 4  # the best is neither oldest nor newest
    for step, loss in fwgen.ORBAX_LOSSES.items():
        assert json.loads((out / "best_fn" / str(step) / "metrics" / "metrics").read_text()) == {"loss": loss}
    meta = json.loads((out / "best_fn" / "2" / "_CHECKPOINT_METADATA").read_text())
    assert "metrics" in meta["item_handlers"] and meta["metrics"] == {}  # metrics live in metrics/, not here


def test_copy_volume_is_private_and_aged(orbax_volume, tmp_path):
    copy = copy_volume(orbax_volume, tmp_path / "vol")
    assert names(copy) == names(orbax_volume["out_dir"])
    assert max(p.stat().st_mtime for p in copy.rglob("*")) < time.time() - 3000


# --- DCP (torchtitan's layout) ----------------------------------------------------------------


def test_dcp_killed_saves_do_not_load(dcp_volume):
    out, recs = dcp_volume["out_dir"], records(dcp_volume)
    a = out / "titan-a" / "checkpoint"
    assert names(a) == {"step-10", "step-20", "step-30"}
    assert names(a / "step-20") == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert names(a / "step-30") == {"__0_0.distcp", "__1_0.distcp"}  # every rank's data, no .metadata
    assert names(out / "titan-b" / "checkpoint" / "step-20") == {".metadata.tmp", "__0_0.distcp", "__1_0.distcp"}
    for path, rec in recs.items():
        assert rec["truth"]["loads"] is (rec["killed"] is None), path
        if rec["killed"]:
            assert rec["truth"]["dcp_load"].startswith("CheckpointException"), path
    assert dcp_volume["runs"]["titan-a"]["torchtitan_find_load_step"] == 20
    assert dcp_volume["runs"]["titan-b"]["torchtitan_find_load_step"] == 10


# --- accelerate --------------------------------------------------------------------------------

ACC_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"}


def test_accelerate_complete_saves(accelerate_volume):
    out, recs = accelerate_volume["out_dir"], records(accelerate_volume)
    assert names(out / "auto" / "checkpoints") == {f"checkpoint_{i}" for i in range(4)}
    assert names(out / "steps") == {"step_10", "step_20", "step_30", "step_40"}
    assert names(out / "epochs") == {"epoch_0", "epoch_1"}
    whole = [r for r in recs.values() if r["killed"] is None]
    assert len(whole) == 8
    for rec in whole:
        assert names(rec["abs_path"]) == ACC_FILES, rec["path"]
        assert rec["truth"]["load_state"] == ["ok", "ok"] and rec["truth"]["rng"] == ["restored", "restored"]


def test_accelerate_killed_before_the_optimizer_fails_to_load(accelerate_volume):
    """Rank 1 had written random_states_1.pkl; rank 0 died between model.safetensors and optimizer.bin."""
    rec = records(accelerate_volume)["auto/checkpoints/checkpoint_3"]
    assert names(rec["abs_path"]) == {"model.safetensors", "random_states_1.pkl"}
    assert all(r.startswith("FileNotFoundError") and "optimizer.bin" in r for r in rec["truth"]["load_state"])
    # load_state() with automatic naming takes the highest checkpoint_N, this one
    for got in accelerate_volume["runs"]["auto"]["load_state_no_dir"]:
        assert got["picks"] == "auto/checkpoints/checkpoint_3" and got["load_state"].startswith("FileNotFoundError")


def test_accelerate_missing_rank_rng_state_loads_silently(accelerate_volume):
    """Rank 1 died before random_states_1.pkl: load_state raises nothing; rank 1's RNG is not restored."""
    rec = records(accelerate_volume)["steps/step_40"]
    assert names(rec["abs_path"]) == ACC_FILES - {"random_states_1.pkl"}
    assert rec["truth"]["load_state"] == ["ok", "ok"]
    assert rec["truth"]["rng"][0] == "restored" and rec["truth"]["rng"][1].startswith("not restored")
    assert rec["truth"]["complete"] is False and rec["truth"]["loads"] is True


# --- the HF Trainer ----------------------------------------------------------------------------

TRAINER_FILES = {"config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                 "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "training_args.bin"}


def test_trainer_complete_checkpoints_and_best(trainer_volume):
    out = trainer_volume["out_dir"]
    for run in ("run-rng", "run-state"):
        assert names(out / run) == {f"checkpoint-{s}" for s in (2, 4, 6, 8, 10)}
        for step in (2, 4, 6, 8):
            ckpt = out / run / f"checkpoint-{step}"
            assert names(ckpt) == TRAINER_FILES
            state = json.loads((ckpt / "trainer_state.json").read_text())
            evals = {h["step"]: h["eval_loss"] for h in state["log_history"] if "eval_loss" in h}
            assert evals == {s: fwgen.EVAL_LOSSES[s] for s in range(2, step + 1, 2)}
        # metric_for_best_model="loss" is eval_loss: the best is checkpoint-6 (neither oldest nor newest)
        state = json.loads((out / run / "checkpoint-8" / "trainer_state.json").read_text())
        assert Path(state["best_model_checkpoint"]).name == "checkpoint-6" and state["best_metric"] == 0.4
        # ... and the training loss, logged at the same steps, is lowest elsewhere: ranking by `loss`
        # instead of `eval_loss` keeps a different checkpoint
        train = {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}
        assert min(train, key=train.get) != 6
    resumed = records(trainer_volume)["run-rng/checkpoint-8"]["truth"]
    assert resumed["resume"] == ["ok", "ok"] and resumed["started_at"] == [8, 8] and resumed["complete"]


def test_trainer_killed_before_rank1_rng_state(trainer_volume):
    """trainer_state.json (rank 0's last file) is there, rng_state_1.pth is not: get_last_checkpoint
    picks it and resuming works, with the Trainer's own message that rank 1's RNG file is missing."""
    rec = records(trainer_volume)["run-rng/checkpoint-10"]
    assert names(rec["abs_path"]) == TRAINER_FILES - {"rng_state_1.pth"}
    truth = rec["truth"]
    assert truth["get_last_checkpoint_picks_it"] and truth["resume"] == ["ok", "ok"]
    assert truth["started_at"] == [10, 10]
    assert truth["rng_messages"][0] == [] and "RNG file for process 1" in truth["rng_messages"][1][0]


def test_trainer_killed_before_trainer_state(trainer_volume):
    rec = records(trainer_volume)["run-state/checkpoint-10"]
    assert names(rec["abs_path"]) == TRAINER_FILES - {"trainer_state.json"}
    truth = rec["truth"]
    assert truth["get_last_checkpoint_picks_it"] and not truth["loads"]
    assert all(r.startswith("FileNotFoundError") and "trainer_state.json" in r for r in truth["resume"])


# --- Lightning ---------------------------------------------------------------------------------

MC_KEY = "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, " \
         "'every_n_epochs': 1, 'train_time_interval': None}"


def ckpt_dir(volume, run: str) -> Path:
    return volume["out_dir"] / run / "lightning_logs" / "version_0" / "checkpoints"


def test_lightning_names_and_tree(lightning_volume):
    assert names(ckpt_dir(lightning_volume, "team-a/run-default")) == {
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"}
    assert names(ckpt_dir(lightning_volume, "team-a/run-metric")) == {
        "epoch=0-step=2-val_loss=0.90.ckpt", "epoch=1-step=4-val_loss=0.40.ckpt",
        "epoch=2-step=6-val_loss=0.60.ckpt", "epoch=3-step=8-val_loss=0.70.ckpt", "last.ckpt"}
    assert names(ckpt_dir(lightning_volume, "team-b/run-nostep")) == {
        "epoch=0-val_loss=0.90.ckpt", "epoch=1-val_loss=0.40.ckpt", "epoch=2-val_loss=0.60.ckpt",
        "epoch=3-val_loss=0.70.ckpt", "last.ckpt"}
    # the ModelCheckpoint dirpath default: five levels below the volume root
    assert len(Path(records(lightning_volume)[
        "team-a/run-default/lightning_logs/version_0/checkpoints/last.ckpt"]["path"]).parts) == 6


def test_lightning_model_checkpoint_state(lightning_volume):
    truth = records(lightning_volume)["team-a/run-default/lightning_logs/version_0/checkpoints/epoch=2-step=6.ckpt"][
        "truth"]
    assert truth["weights_only_mmap"] == "ok" and truth["callbacks_keys"] == [MC_KEY]
    mc, types = truth["model_checkpoint"], truth["model_checkpoint_types"]
    assert mc["monitor"] == "val_loss"
    assert mc["current_score"] == pytest.approx(0.6) and types["current_score"] == "Tensor(shape=(), dtype=float32)"
    assert mc["best_model_score"] == pytest.approx(0.4) and types["best_model_score"].startswith("Tensor(shape=()")
    assert Path(mc["best_model_path"]).name == "epoch=1-step=4.ckpt"
    assert Path(mc["last_model_path"]).name == "last.ckpt"
    assert set(truth["best_k_models"]) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"}
    assert truth["epoch"] == 2 and truth["global_step"] == 6


def test_lightning_same_filesystem_kill_leaves_no_file(lightning_volume):
    """Staged in TMPDIR and renamed: killed before the rename, nothing has the final name."""
    d = ckpt_dir(lightning_volume, "team-b/run-killed")
    assert names(d) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"}
    last = records(lightning_volume)[f"{d.relative_to(lightning_volume['out_dir'])}/last.ckpt"]["truth"]
    assert last["epoch"] == 1 and last["resume"] == "ok"


def test_lightning_cross_filesystem_kills_leave_truncated_files(lightning_volume):
    if lightning_volume["other_filesystem"] is None:
        pytest.skip("no writable directory on another filesystem than the volume")
    recs = records(lightning_volume)
    topk = ckpt_dir(lightning_volume, "team-c/run-xdev-topk")
    broken = recs[f"{topk.relative_to(lightning_volume['out_dir'])}/epoch=2-step=6.ckpt"]
    assert broken["killed"] == "mid_copy_topk"
    assert 0 < (topk / "epoch=2-step=6.ckpt").stat().st_size < (topk / "epoch=1-step=4.ckpt").stat().st_size
    for key in ("weights_only_mmap", "resume"):
        assert "central directory" in broken["truth"][key]
    assert recs[f"{topk.relative_to(lightning_volume['out_dir'])}/last.ckpt"]["truth"]["epoch"] == 1
    last_dir = ckpt_dir(lightning_volume, "team-c/run-xdev-last")
    last = recs[f"{last_dir.relative_to(lightning_volume['out_dir'])}/last.ckpt"]
    assert last["killed"] == "mid_copy_last" and not last["truth"]["loads"]  # the previous last.ckpt is gone too
    assert recs[f"{last_dir.relative_to(lightning_volume['out_dir'])}/epoch=2-step=6.ckpt"]["truth"]["loads"]
