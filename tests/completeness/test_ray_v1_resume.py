"""Ray Train V1 (RAY_TRAIN_V2_ENABLED=0) killed between Ray's own deletion of a dropped checkpoint and the
experiment state that would say so (tests/support/fwrayv1kill.py), and judged against `TorchTrainer.restore`.

`_CheckpointManager.register_checkpoint` (checkpoint_manager.py) drops the worst beyond num_to_keep, the
previous latest among them when it scores worst, and deletes its directory at once; the controller saves
the experiment state naming the new latest only afterwards. A job killed between the two leaves a state
whose latest is gone: Ray's restore fails ("Could not recover from checkpoint as it does not exist on
storage anymore"). ckptd must not call another checkpoint what the restore resumes from, and keeps every
checkpoint the state holds (a resume by hand picks among them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.completeness.test_ray import ISOLATED, can_isolate
from tests.completeness.test_ray_v1 import V1_ENV, ray_v1_volume, rows  # noqa: F401 (a fixture)
from tests.support import volcache
from tests.support.common import run_ckptd, shift_mtimes

pytestmark = pytest.mark.frameworks


def job(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A Ray job in a process group of its own, all of it gone when this returns (as test_ray_v1.job)."""
    proc = subprocess.Popen([*ISOLATED, sys.executable, "-m", module, *args], env=V1_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def latest_deleted_volume(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("ray.train", reason="ray[train] is not installed: docs/frameworks/ray.md says how")
    if not can_isolate():
        pytest.skip("needs `unshare -n` (root) to keep Ray's servers off every interface but the loopback")
    out = tmp_path_factory.mktemp("rayv1kill")

    def make(out: Path) -> dict:
        proc = job("tests.support.fwrayv1kill", str(out), "run", "after_delete", "checkpoint_000002")
        assert proc.returncode in (-9, 137), proc.stdout[-2000:] + proc.stderr[-3000:]
        proc = job("tests.support.fwrayv1kill", str(out), "run", "restore")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    truth = volcache.generated("rayv1kill", ["after_delete", "checkpoint_000002"], ["fwrayv1kill.py"], out, make)
    shift_mtimes(out, 3600)
    return out, truth


def test_a_state_whose_latest_ray_deleted_keeps_every_checkpoint_it_holds(latest_deleted_volume, tmp_path):
    src, truth = latest_deleted_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    (trial,) = [p for p in (root / "run").iterdir() if (p / "params.json").exists()]
    names = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    # Ray kept reports 0, 1 and 2 (the latest); registering report 3 deleted report 2 before the state
    # saying so: its restore refuses the run
    assert names == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000003"], names
    assert truth["restore"] is None and truth["checkpoint_gone"], truth

    cfg, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=0)
    assert {n: seen[n]["state"] for n in names} == {
        "checkpoint_000000": "complete", "checkpoint_000001": "complete", "checkpoint_000003": "incomplete"}
    reasons = " ".join(r for n in names for r in seen[n]["reasons"])
    assert "what Ray's restore resumes from" not in reasons, reasons  # it resumes from none of them
    assert "checkpoint_000002 as the trial's latest and it is gone" in reasons, reasons
    assert all(seen[n]["action"] == "keep" for n in names), seen
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_")) == names


def test_a_nested_metric_is_named_by_its_path_as_rays_score_attribute(latest_deleted_volume, tmp_path):
    """`report({"eval": {"loss": x}})`: Ray ranks by checkpoint_score_attribute="eval/loss" (flatten_dict);
    ckptd's `metric = "eval/loss"` reads the same value (else none: keep_best could not reproduce it)."""
    src, _ = latest_deleted_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    (trial,) = [p for p in (root / "run").iterdir() if (p / "params.json").exists()]
    _, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=1, metric="eval/loss", mode="min")
    assert {n: c["metric"] for n, c in seen.items() if c["state"] == "complete"} == {
        "checkpoint_000000": 0.5, "checkpoint_000001": 0.6}, seen


def test_ray_v1_restore_carries_on_after_ckptds_prune(ray_v1_volume, tmp_path):  # noqa: F811 (the fixture)
    """ckptd's keep_last=1 deletes checkpoints the experiment state still holds (Ray's num_to_keep=3 would
    keep them): Ray's restore resumes from the state's latest, the one ckptd kept; when Ray later drops one
    ckptd deleted, `_delete_fs_path` raises and `_process_trial_save` logs it, and the trial carries on. The
    resumed run numbers on from the state's latest (its first save goes into the cut copy's directory), in a
    state file of a new date, and ckptd follows that one."""
    src, truth = ray_v1_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    trial = root / "run" / truth["trial"]
    cfg, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=0)
    assert [n for n, c in seen.items() if c["action"] == "delete"] == ["checkpoint_000001", "checkpoint_000002"]
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    proc = job("tests.support.fwrayv1more", str(root / "run"), "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] is None and got["resumed_from"] == truth["restore"] == "checkpoint_000003", got
    assert "Error handling checkpoint" in proc.stderr  # checkpoint_000002, gone, dropped by Ray
    assert got["left"] == ["checkpoint_000004", "checkpoint_000005"], got
    assert len(list((root / "run").glob("experiment_state-*.json"))) == 2
    shift_mtimes(root, 3600)
    _, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=0)
    assert {n: seen[n]["state"] for n in got["left"]} == {n: "complete" for n in got["left"]}, seen
    assert "what Ray's restore resumes from" in " ".join(seen["checkpoint_000005"]["reasons"])


@pytest.fixture(scope="module")
def retried_volume(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("ray.train", reason="ray[train] is not installed: docs/frameworks/ray.md says how")
    if not can_isolate():
        pytest.skip("needs `unshare -n` (root) to keep Ray's servers off every interface but the loopback")
    out = tmp_path_factory.mktemp("rayv1retry")

    def make(out: Path) -> dict:
        proc = job("tests.support.fwrayv1retry", str(out))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    truth = volcache.generated("rayv1retry", [], ["fwrayv1retry.py"], out, make)
    shift_mtimes(out, 3600)
    return out, truth


def _retried(retried_volume, tmp_path, **retention) -> tuple[dict, dict]:
    src, truth = retried_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    (trial,) = [p for p in (root / "run").iterdir() if (p / "params.json").exists()]
    return truth, rows(tmp_path, root, trial, **retention)[1]


def test_a_worker_killed_mid_copy_and_retried_by_ray(retried_volume, tmp_path):
    """Ray retries the workers from checkpoint_000001 and writes report 2 again into the cut copy's
    directory: every checkpoint its manager holds is complete, the latest is its Result's."""
    truth, seen = _retried(retried_volume, tmp_path, keep_last=1, keep_best=0)
    assert truth["error"] == "None" and truth["checkpoint"] == "checkpoint_000003", truth
    assert {n for n, c in seen.items() if c["state"] == "complete"} == set(truth["losses"]), seen
    assert [n for n, c in seen.items() if c["action"] == "keep"] == [truth["checkpoint"]]

