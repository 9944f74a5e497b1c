"""An empty path (an unset variable in cron or a unit's ExecStart) is refused by every command and in the
config, never taken for the current directory."""

from __future__ import annotations

import os
import time

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from tests.support.common import run_ckptd
from tests.support.rtkit import names

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- An empty ROOT argument (an unset "$VAR") is the current directory --------------------------


def test_an_empty_root_argument_is_refused(tmp_path):
    """`ckptd prune "$CKPT_ROOT"` from cron or a unit's ExecStart, with the variable unset, passes
    an empty argument. Path("") is ".", so ckptd prunes its working directory (for a service,
    often /) with the built-in defaults, up to max_depth below it: checkpoints outside every root
    the operator meant, and none of the config's pins. rm, ls and cd refuse an empty path;
    ckptd must too (exit 64), deleting nothing."""
    work = tmp_path / "home"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(work / "someone" / "exp", step, world=2, mtime=OLD + step)
    proc = run_ckptd("prune", "", env={"XDG_STATE_HOME": str(tmp_path / "state")}, cwd=work)
    assert names(work / "someone" / "exp") == [f"checkpoint-{s}" for s in (1, 2, 3, 4)], proc.stdout
    assert proc.returncode == 64, proc.stdout + proc.stderr


# --- empty path arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["prune", ""], ["plan", ""], ["run", ""], ["verify", ""], ["latest", ""], ["demo", ""],
     ["plan", "{work}", ""], ["prune", "-c", ""], ["plan", "-c", ""], ["check-config", "-c", ""],
     ["latest", "-c", "", "{work}/someone/exp"]],
)
def test_an_empty_path_argument_is_refused_by_every_command(tmp_path, argv):
    work = tmp_path / "home"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(work / "someone" / "exp", step, world=2, mtime=OLD + step)
    args = [a.format(work=work) for a in argv]
    proc = run_ckptd(*args, env={"XDG_STATE_HOME": str(tmp_path / "state")}, cwd=work, timeout=60)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "empty" in proc.stderr
    assert sorted(os.listdir(work / "someone" / "exp")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    assert sorted(os.listdir(work)) == ["someone"]


def test_an_empty_root_path_in_the_config_is_refused(tmp_path):
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = ''\n")
    proc = run_ckptd("prune", "-c", cfg, cwd=tmp_path)
    assert proc.returncode == 78, proc.stderr
    assert "roots[0].path" in proc.stderr
