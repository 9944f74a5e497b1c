"""A configured world_size that the checkpoints contradict is said, in `plan`, `check-config` and
the daemon's log: a world_size of 8 on a 4-rank job held every checkpoint "incomplete (4/8
ranks)" forever, nothing was deleted, the disk filled, and nothing named world_size.

The checkpoints are the frameworks' own (fwgen.py: the HF Trainer's 2-process DDP, whose ranks
each write rng_state_<rank>.pth; dsgen.py: a 2-rank ZeRO-2 run whose model states record
dp_world_size=2), through the real `ckptd` command line and daemon.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.fwfixtures import copy_volume


def config(tmp_path: Path, root: Path, extra: str) -> Path:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n{extra}\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    return cfg


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "world_size" in line and line.startswith("warning: ")]


@pytest.mark.frameworks
def test_a_world_size_the_rank_files_contradict_is_warned_about(trainer_volume, tmp_path, state_env):
    root = copy_volume(trainer_volume, tmp_path / "vol")
    cfg = config(tmp_path, root, "world_size = 4")
    proc = run_ckptd("plan", "-c", cfg, env=state_env)
    assert proc.returncode == 0, proc.stderr
    [line] = [w for w in warnings(proc.stdout) if "run-rng" in w]
    assert f"warning: {root / 'run-rng'}: world_size = 4, but no checkpoint holds more than 2 ranks' files" in line
    assert "set world_size = 2 for this run, or remove it" in line
    assert "prune: 0 deleted" in run_ckptd("prune", "-c", cfg, env=state_env).stdout  # what the warning is about

    checked = run_ckptd("check-config", "-c", cfg, env=state_env)
    assert checked.returncode == 0 and any("run-rng: world_size = 4" in w for w in warnings(checked.stderr))

    # a run rule's world size is named by its key; the right number says nothing
    cfg = config(tmp_path, root, "[[roots.runs]]\nmatch = 'run-rng'\nworld_size = 3")
    assert "run-rng: runs[0].world_size = 3, but" in run_ckptd("plan", "-c", cfg, env=state_env).stdout
    for extra in ("world_size = 2", ""):
        proc = run_ckptd("plan", "-c", config(tmp_path, root, extra), env=state_env)
        assert proc.returncode == 0 and warnings(proc.stdout) == [], proc.stdout


@pytest.mark.frameworks
def test_the_daemon_logs_the_world_size_warning(trainer_volume, tmp_path, state_env):
    root = copy_volume(trainer_volume, tmp_path / "vol")
    cfg = config(tmp_path, root, "world_size = 4\nquiet_period = '5s'")  # the daemon decides 5 s after its first look
    with DaemonProc("-c", cfg, "--dry-run", env=state_env) as daemon:
        [rec] = daemon.wait_message(f"{root / 'run-rng'}: world_size = 4, but no checkpoint holds more than 2", timeout=60)
        assert rec["level"] == "warning"
        assert daemon.stop() == 0


@pytest.mark.deepspeed
def test_a_world_size_the_model_states_contradict_is_warned_about(zero2_hf, tmp_path, state_env):
    root = tmp_path / "vol"
    shutil.copytree(zero2_hf, root / "run", symlinks=True)
    age(root, time.time() - 3600)
    proc = run_ckptd("plan", "-c", config(tmp_path, root, "world_size = 4"), env=state_env)
    assert proc.returncode == 0, proc.stderr
    [line] = warnings(proc.stdout)
    assert f"{root / 'run'}: world_size = 4, but checkpoint-40's mp_rank_00_model_states.pt records dp_world_size=2" in line
    proc = run_ckptd("plan", "-c", config(tmp_path, root, "world_size = 2"), env=state_env)
    assert warnings(proc.stdout) == []
