"""Ray Train's older trainers (RAY_TRAIN_V2_ENABLED=0: Train V1 on Tune), on checkpoints Ray itself wrote on
the CPU (tests/support/fwrayv1.py: TorchTrainer, 2 workers on gloo, num_to_keep=3 by "loss"), the fifth
report's copy cut after its first file and the whole job SIGKILLed. Complete is what the experiment state's
checkpoint manager holds; the cut copy is incomplete (`Result.from_path` names it as the trial's checkpoint,
and it does not load); `ckptd latest` names what `TorchTrainer.restore` resumes from; the metrics are the
result.json's; keep_best + keep_last keep what Ray's own `_CheckpointManager` keeps with num_to_keep.
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

from tests.completeness.test_ray import ENV, ISOLATED, can_isolate
from tests.support import volcache
from tests.support.common import run_ckptd, shift_mtimes

pytestmark = pytest.mark.frameworks
V1_ENV = {**ENV, "RAY_TRAIN_V2_ENABLED": "0"}


def job(*args: str) -> subprocess.CompletedProcess[str]:
    """A Ray job in a process group of its own, all of it gone when this returns (as test_ray.job)."""
    proc = subprocess.Popen([*ISOLATED, sys.executable, "-m", "tests.support.fwrayv1", *args], env=V1_ENV,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
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
def ray_v1_volume(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("ray.train", reason="ray[train] is not installed: docs/frameworks/ray.md says how")
    if not can_isolate():
        pytest.skip("needs `unshare -n` (root) to keep Ray's servers off every interface but the loopback")
    out = tmp_path_factory.mktemp("rayv1")

    def make(out: Path) -> dict:
        proc = job(str(out), "run", "4")
        assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]  # killed in report 4's copy
        proc = job(str(out), "run", "check")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    truth = volcache.generated("rayv1", ["run", 4], ["fwrayv1.py"], out, make)
    shift_mtimes(out, 3600)
    return out, truth


def trial_copy(src: Path, tmp_path: Path, truth: dict) -> tuple[Path, Path]:
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    return root, root / "run" / truth["trial"]


def rows(tmp_path: Path, root: Path, trial: Path, **retention) -> tuple[Path, dict]:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n[roots.retention]\n"
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in retention.items()))
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return cfg, {os.path.relpath(c["path"], trial): c for c in json.loads(proc.stdout)["checkpoints"]}


CKPTS = [f"checkpoint_{i:06d}" for i in range(1, 5)]  # report 0 deleted by Ray (the worst beyond 3)


def test_ray_v1_registered_checkpoints_the_cut_copy_and_the_restore(ray_v1_volume, tmp_path):
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    assert sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_")) == CKPTS
    # Ray's own view: reports 1-3 load, report 4's copy does not; Result.from_path calls the cut copy the
    # trial's checkpoint, Ray's restore resumes from report 3
    assert [truth["loads"][n] == "loads" for n in CKPTS] == [True, True, True, False], truth["loads"]
    assert truth["result_checkpoint"] == CKPTS[3] and truth["restore"] == CKPTS[2], truth

    _, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=0)
    assert {n: (seen[n]["layout"], seen[n]["state"], seen[n]["step"]) for n in CKPTS} == {
        CKPTS[0]: ("ray", "complete", 1), CKPTS[1]: ("ray", "complete", 2), CKPTS[2]: ("ray", "complete", 3),
        CKPTS[3]: ("ray", "incomplete", 4)}, seen
    assert "not in experiment_state-" in " ".join(seen[CKPTS[3]]["reasons"])
    proc = run_ckptd("latest", trial, env={"CKPTD_CONFIG": ""})
    assert proc.stdout == f"{trial / truth['restore']}\n", proc.stderr


def test_ray_v1_metrics_are_the_result_json_ones(ray_v1_volume, tmp_path):
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    _, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=1, metric="loss", mode="min")
    got = {n: c["metric"] for n, c in seen.items() if c["state"] == "complete"}
    # Result.from_path pairs the same result.json lines with each directory (the cut copy has none)
    assert got == {n: m for n, m in truth["metrics"].items() if m is not None}, (got, truth)
    assert got == {CKPTS[0]: 0.5, CKPTS[1]: 0.7, CKPTS[2]: 0.6} and truth["metrics"][CKPTS[3]] is None
    _, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=1, metric="training_iteration", mode="max")
    assert {n: c["metric"] for n, c in seen.items() if c["state"] == "complete"} == {
        CKPTS[0]: 2, CKPTS[1]: 3, CKPTS[2]: 4}


@pytest.mark.parametrize("ray_config, retention", [
    ("best1", dict(keep_best=1, keep_last=1, metric="loss", mode="min")),
    ("best2", dict(keep_best=2, keep_last=1, metric="loss", mode="min")),
    ("newest2", dict(keep_best=0, keep_last=2)),
])
def test_ray_v1_num_to_keep_reproduced_by_a_config(ray_v1_volume, tmp_path, ray_config, retention):
    """CheckpointConfig(num_to_keep=K, checkpoint_score_attribute=...) keeps the K best plus the latest;
    without a score, the K newest: what Ray's `_CheckpointManager` keeps of the loadable ones is what
    ckptd's prune leaves of them (and the cut copy stays, as every incomplete one)."""
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    cfg, _ = rows(tmp_path, root, trial, **retention)
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    left = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    assert left == sorted([*truth["ray_keeps"][ray_config], CKPTS[3]]), (left, truth["ray_keeps"])
    assert len(left) < len(CKPTS)


def test_a_users_checkpoint_step_pattern_over_a_v1_trial_is_judged_by_rays_records(ray_v1_volume, tmp_path):
    """Before ckptd knew these names, `checkpoint_{step}` was the way to list them, and a user's pattern is
    asked before Ray's module. With `require = ["model.pt"]` the copy cut after model.pt was complete and
    `ckptd latest` named it; the experiment state decides as for Ray's own names."""
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    assert (trial / CKPTS[3] / "model.pt").exists()  # what the pattern requires, there
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "patterns = [{name = 'checkpoint_{step}', require = ['model.pt']}]\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    seen = {os.path.basename(c["path"]): c for c in json.loads(proc.stdout)["checkpoints"]}
    assert {n: (seen[n]["layout"], seen[n]["state"]) for n in CKPTS} == {
        CKPTS[0]: ("pattern", "complete"), CKPTS[1]: ("pattern", "complete"), CKPTS[2]: ("pattern", "complete"),
        CKPTS[3]: ("pattern", "incomplete")}, seen
    proc = run_ckptd("latest", trial, "-c", cfg)
    assert proc.stdout == f"{trial / truth['restore']}\n", proc.stderr


def test_ray_v1_restore_target_is_never_deleted(ray_v1_volume, tmp_path):
    """Ray's restore resumes from the experiment state's latest: with a best-only config that would drop
    it, it stays (and the restore still finds it)."""
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    _, seen = rows(tmp_path, root, trial, keep_last=0, keep_best=1, metric="loss", mode="min")
    assert seen[truth["restore"]]["action"] == "keep"
    assert "what Ray's restore resumes from" in " ".join(seen[truth["restore"]]["reasons"])


def test_ray_v1_experiment_state_being_copied_over_deletes_nothing(ray_v1_volume, tmp_path):
    """Ray copies its experiment state over the old one in place (the syncer's upload): a reader may meet
    it cut short. No verdict, every checkpoint may be its latest. Cut by hand here (Ray's copy is too short
    to catch midway)."""
    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    state = next(trial.parent.glob("experiment_state-*.json"))
    state.write_bytes(state.read_bytes()[:200])
    shift_mtimes(root, 3600)
    cfg, seen = rows(tmp_path, root, trial, keep_last=1, keep_best=0)
    assert set(seen) == set(CKPTS), seen
    assert all(c["action"] == "keep" and c["state"] != "complete" for c in seen.values()), seen
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_")) == CKPTS


def test_ray_v1_names_recognised_and_not():
    from ckptd.discover import layouts

    cand = layouts.recognise("checkpoint_000003", True, lambda: ["model.pt"])
    assert (cand.layout, cand.step, cand.unit) == ("ray", 3, "checkpoint index")
    for name in ("checkpoint_3", "checkpoint_00003", "checkpoint_000003x"):
        c = layouts.recognise(name, True, lambda: ["model.pt"])
        assert c is None or c.layout != "ray", name
    assert layouts.recognise("checkpoint_000003", False, lambda: []) is None


def test_a_rewritten_experiment_state_is_read_again_not_taken_from_the_verdict_cache(ray_v1_volume, tmp_path):
    """The experiment state lies one level above the trial (its run directory): a verdict remembered while it
    held the checkpoints is not reused once it is rewritten (here cut short, as a copy over it in progress).
    In process, with the verdicts' racy-clean clock ahead (tests/support/tracking.py): the copied files count
    as written well before the look, so their verdicts are remembered."""
    import time

    from ckptd.config import Root
    from ckptd.decide.planner import Scanner
    from ckptd.discover.runs import find_runs
    from ckptd.judge.verdicts import RACY_NS

    src, truth = ray_v1_volume
    root, trial = trial_copy(src, tmp_path, truth)
    scanner = Scanner(Root(path=root, quiet_period=0))
    scanner.verdicts.clock_ns = lambda: time.time_ns() + 10 * RACY_NS

    def states() -> dict[str, str]:
        (run,) = find_runs(root, max_depth=4, patterns=scanner.patterns)
        return {c.path.name: str(c.state) for c in scanner.inspect_run(run, now=time.time()).checkpoints}

    assert states() == {CKPTS[0]: "complete", CKPTS[1]: "complete", CKPTS[2]: "complete", CKPTS[3]: "incomplete"}
    state = next(trial.parent.glob("experiment_state-*.json"))
    state.write_bytes(state.read_bytes()[:200])
    assert all(s != "complete" for s in states().values())
