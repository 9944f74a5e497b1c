"""Ray Train, on checkpoints Ray itself wrote on the CPU (tests/support/fwray.py: TorchTrainer, 2 workers on
gloo, num_to_keep=2 by "loss"), the fourth report's copy cut after its first file and the whole job
SIGKILLed. Complete is what Ray's run snapshot registered, exactly; the cut copy is incomplete; `ckptd latest`
names what Ray's restore resumes from; nothing the snapshot lists is ever deleted (Ray's restore refuses a
run whose snapshot names a missing checkpoint); the metrics are the ones reported with each checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import child_pythonpath, volcache
from tests.support.common import run_ckptd, shift_mtimes

pytestmark = pytest.mark.frameworks
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(),
       "RAY_USAGE_STATS_ENABLED": "0"}


# Ray's own servers (GCS, raylet, workers' gRPC) listen on every interface whatever ray.init is told, so the
# job runs in a network namespace of its own whose only interface is the loopback (`unshare -n`, as root).
ISOLATED = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']


def can_isolate() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run([*ISOLATED, "true"], capture_output=True, timeout=30).returncode == 0


def job(*args: str) -> subprocess.CompletedProcess[str]:
    """A Ray job in a process group of its own (the driver, Ray's processes, its workers), all of
    which are gone when this returns, in a network namespace with nothing but the loopback."""
    proc = subprocess.Popen([*ISOLATED, sys.executable, "-m", "tests.support.fwray", *args], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of Ray outlived its driver
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def ray_volume(tmp_path_factory) -> tuple[Path, dict]:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        pytest.skip("ray[train] is not installed: docs/frameworks/ray.md says how")
    if not can_isolate():
        pytest.skip("needs `unshare -n` (root) to keep Ray's servers off every interface but the loopback")
    out = tmp_path_factory.mktemp("ray")

    def make(out: Path) -> dict:
        proc = job(str(out), "run", "3")
        assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]  # killed in report 3's copy
        proc = job(str(out), "run", "check")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    truth = volcache.generated("ray", ["run", 3], ["fwray.py"], out, make)
    shift_mtimes(out, 3600)  # an hour old, order kept
    return out, truth


def rows(tmp_path: Path, root: Path, **retention) -> tuple[Path, dict]:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n[roots.retention]\n"
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in retention.items()))
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return cfg, {os.path.relpath(c["path"], root / "run"): c for c in json.loads(proc.stdout)["checkpoints"]}


def test_ray_registered_checkpoints_and_the_copy_cut_short(ray_volume, tmp_path):
    src, truth = ray_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    names = sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("checkpoint_") and p.is_dir())
    # Ray's own view: reports 1 and 2 registered (report 0 dropped as the worst and deleted), report 2 the
    # latest, what its restore resumes from; report 3's copy cut short, loaded by nothing
    assert truth["best"] == {names[0]: 0.5, names[1]: 0.7}, truth
    assert truth["latest"] == truth["restore"] == names[1], truth
    assert [truth["loads"][n] for n in names[:2]] == ["loads", "loads"] and truth["loads"][names[2]] != "loads"
    assert len(names) == 3, names

    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    assert {n: (seen[n]["layout"], seen[n]["state"]) for n in names} == {
        names[0]: ("ray", "complete"), names[1]: ("ray", "complete"), names[2]: ("ray", "incomplete")}, seen
    assert "not in checkpoint_manager_snapshot.json" in " ".join(seen[names[2]]["reasons"])
    proc = run_ckptd("latest", root / "run", env={"CKPTD_CONFIG": ""})
    assert proc.stdout == f"{root / 'run' / truth['restore']}\n", proc.stderr

    # keep_last=1 would delete report 1, but Ray's restore refuses a run whose snapshot lists a missing one
    assert seen[names[0]]["action"] == "keep", seen[names[0]]
    assert "checkpoint_manager_snapshot.json" in " ".join(seen[names[0]]["reasons"])
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("checkpoint_") and p.is_dir()) == names
    # and Ray's own restore still works on what ckptd left, from the same checkpoint
    proc = job(str(root), "run", "check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["restore"] == truth["restore"]


def test_a_users_pattern_over_ray_names_is_judged_by_rays_snapshot(ray_volume, tmp_path):
    """docs/frameworks/patterns.md offers `checkpoint_{time}` for Ray Train's names, and a user's pattern
    is asked before Ray's module. With `require = ["model.pt"]` the copy cut after model.pt was complete:
    `ckptd latest` named it, though it lacks optim.pt and Ray's restore resumes from the one before. A
    save any pattern names in a run directory that holds Ray's snapshot is judged by the snapshot too."""
    src, truth = ray_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    names = sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("checkpoint_") and p.is_dir())
    assert truth["loads"][names[2]] != "loads" and truth["restore"] == names[1], truth
    assert (root / "run" / names[2] / "model.pt").exists()  # what the pattern requires, there
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "patterns = [{name = 'checkpoint_{time}', require = ['model.pt']}]\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    seen = {os.path.basename(c["path"]): c for c in json.loads(proc.stdout)["checkpoints"]}
    assert {n: (seen[n]["layout"], seen[n]["state"]) for n in names} == {
        names[0]: ("pattern", "complete"), names[1]: ("pattern", "complete"), names[2]: ("pattern", "incomplete")}
    assert "not in checkpoint_manager_snapshot.json" in " ".join(seen[names[2]]["reasons"])
    proc = run_ckptd("latest", root / "run", "-c", cfg)
    assert proc.stdout == f"{root / 'run' / truth['restore']}\n", proc.stderr


def test_ray_metrics_are_the_reported_ones(ray_volume, tmp_path):
    src, truth = ray_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    _, seen = rows(tmp_path, root, keep_last=0, keep_best=1, metric="loss", mode="min")
    got = {n: c["metric"] for n, c in seen.items() if c["state"] == "complete"}
    assert got == truth["best"], (got, truth)


def test_a_snapshot_being_rewritten_deletes_nothing(ray_volume, tmp_path):
    """Ray rewrites its snapshot in place (open_output_stream): a reader may meet it half-written. Then no
    verdict, and every checkpoint may be one it lists. The snapshot cut by hand here (Ray's writes are
    too short to catch midway)."""
    src, _ = ray_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    snap = root / "run" / "checkpoint_manager_snapshot.json"
    snap.write_bytes(snap.read_bytes()[:100])
    shift_mtimes(root, 3600)
    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    assert all(c["action"] == "keep" and c["state"] != "complete" for c in seen.values()), seen
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert len([p for p in (root / "run").iterdir() if p.name.startswith("checkpoint_") and p.is_dir()]) == 3


def test_ray_names_recognised_and_not():
    from ckptd.discover import layouts

    cand = layouts.recognise("checkpoint_2026-12-07_17-45-32.517380", True, lambda: ["model.pt"])
    assert (cand.layout, cand.unit) == ("ray", "save time")
    later = layouts.recognise("checkpoint_2026-12-07_17-45-34.466084", True, lambda: ["model.pt"])
    assert later.step > cand.step
    for name in ("checkpoint_2026-13-07_17-45-32.517380", "checkpoint_2026-12-07_17-45-32"):
        c = layouts.recognise(name, True, lambda: ["model.pt"])
        assert c is None or c.layout != "ray", name
    # the older trainers' names are Ray's too, numbered by their index (test_ray_v1.py)
    assert layouts.recognise("checkpoint_000003", True, lambda: ["model.pt"]).unit == "checkpoint index"
