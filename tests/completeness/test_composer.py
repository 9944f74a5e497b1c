"""MosaicML Composer's CheckpointSaver, on saves Composer itself wrote on the CPU (tests/support/fwcomposer.py),
the third killed inside its `torch.save` (SIGKILL once 8 KiB reached the file). Whole saves are complete at
their batch; the killed one is incomplete and named why; `ckptd latest` names what Composer's autoresume
loads (through `latest-rank0.pt`); keep_last=1 keeps it, and never deletes what the symlink names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import composerenv, volcache
from tests.support.common import run_ckptd, shift_mtimes

pytestmark = pytest.mark.frameworks
WHOLE, KILLED = ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt"], "ep3-ba12-rank0.pt"


@pytest.fixture(scope="session")
def composer_env() -> dict[str, str]:
    """The environment of a Composer child: Composer installed apart, once, into the tests' cache
    (tests/support/composerenv.py); skips only where the package index cannot be reached."""
    return composerenv.env()


@pytest.fixture(scope="session")
def composer_volume(tmp_path_factory, composer_env) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("composer")

    def make(out: Path) -> dict[str, str]:
        proc = subprocess.run([sys.executable, "-m", "tests.support.fwcomposer", str(out), "run", "3"], env=composer_env,
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-3000:]  # killed in the third save
        proc = subprocess.run([sys.executable, "-m", "tests.support.fwcomposer", str(out), "run", "check"],
                              env=composer_env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    truth = volcache.generated("composer", ["run", 3, composerenv.key()], ["fwcomposer.py"], out, make)
    shift_mtimes(out, 3600)  # an hour old, order kept
    return out, truth


def rows(tmp_path: Path, root: Path, **retention) -> tuple[Path, dict]:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n[roots.retention]\n"
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in retention.items()))
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return cfg, {os.path.relpath(c["path"], root): c for c in json.loads(proc.stdout)["checkpoints"]}


def volume(src: Path, tmp_path: Path) -> Path:
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run", symlinks=True)
    return root


def test_composer_saves_and_the_one_killed_mid_save(composer_volume, composer_env, tmp_path):
    src, truth = composer_volume
    root = volume(src, tmp_path)
    run = root / "run"
    assert sorted(p.name for p in run.iterdir()) == [*WHOLE, KILLED, "latest-rank0.pt"]
    # Composer's own verdicts: the whole ones load at their batch, the killed one does not, and autoresume
    # (through latest-rank0.pt, which still names the second save) resumes at batch 8
    assert [truth[n] for n in WHOLE] == ["loads at batch 4", "loads at batch 8"], truth
    assert not truth[KILLED].startswith("loads"), truth
    assert truth["autoresume"] == "resumes at batch 8", truth
    assert os.readlink(run / "latest-rank0.pt") == WHOLE[1]

    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    assert {n: (seen[f"run/{n}"]["layout"], seen[f"run/{n}"]["step"]) for n in WHOLE} == {
        WHOLE[0]: ("composer", 4), WHOLE[1]: ("composer", 8)}
    assert [seen[f"run/{n}"]["state"] for n in WHOLE] == ["complete", "complete"]
    assert seen[f"run/{KILLED}"]["state"] == "incomplete", seen[f"run/{KILLED}"]
    assert "not a whole zip archive" in " ".join(seen[f"run/{KILLED}"]["reasons"])
    assert "run/latest-rank0.pt" not in seen  # the pointer is not a checkpoint

    proc = run_ckptd("latest", run, env={"CKPTD_CONFIG": ""})
    assert proc.stdout == f"{run / WHOLE[1]}\n", proc.stderr  # what autoresume loads
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    left = sorted(p.name for p in run.iterdir() if not p.name.startswith("."))
    assert left == [WHOLE[1], KILLED, "latest-rank0.pt"]
    assert (run / "latest-rank0.pt").resolve() == run / WHOLE[1]  # the symlink still names a save
    # and Composer itself still loads what is left and autoresumes from it
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwcomposer", str(root), "run", "check"], env=composer_env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (after[WHOLE[1]], after["autoresume"]) == ("loads at batch 8", "resumes at batch 8"), after


def test_what_latest_rank0_names_is_never_deleted(composer_volume, tmp_path):
    """Composer's load_path and autoresume load whatever `latest-rank0.pt` names. Composer's own files;
    the link pointed back at the first save by hand (as a user rolling back does): keep_last=1 keeps it."""
    src, _ = composer_volume
    root = volume(src, tmp_path)
    run = root / "run"
    (run / KILLED).unlink()
    os.unlink(run / "latest-rank0.pt")
    os.symlink(WHOLE[0], run / "latest-rank0.pt")
    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    first = seen[f"run/{WHOLE[0]}"]
    assert first["action"] == "keep" and "latest-rank0.pt" in " ".join(first["reasons"]), first
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [*WHOLE, "latest-rank0.pt"]


def test_composer_names_recognised_and_not():
    """CheckpointSaver's default names are Composer's; another rank's file, the symlink and other `.pt`
    files are not (never touched)."""
    from ckptd.discover import layouts

    cand = layouts.recognise("ep3-ba120-rank0.pt", False, lambda: [])
    assert (cand.layout, cand.step, cand.is_dir) == ("composer", 120, False)
    for name in ("ep3-ba120-rank1.pt", "latest-rank0.pt", "model.pt", "ep3-ba120.pt"):
        cand = layouts.recognise(name, False, lambda: [])
        assert cand is None or cand.layout != "composer", name
    sharded = layouts.recognise("ep1-ba4", True, lambda: ["__0_0.distcp", "__1_0.distcp", ".metadata"])
    assert (sharded.layout, sharded.step) == ("composer", 4)
