"""HELD (regression): a root that IS the checkpoint, spelt `step_1/.`, `step_1/`, `step_1/optimizer_0/..`,
`run/../run/step_1`, `.` from inside it, or a directory inside it (`step_1/optimizer_0`), on the command
line (no config) and as a config root: refused with exit 64 ("is a checkpoint: name its run or a directory
above it"), nothing deleted. Layout: fsdp_like.py (accelerate FSDP SHARDED_STATE_DICT written by
Accelerator.save_state + dcp.save), aged 1 h.
"""
import sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent))
from rootkit import cfg, ckptd, intact, volume

SPELLINGS = ["{ck}/.", "{ck}/", "{ck}/optimizer_0/..", "{vol}/run/../run/step_1", "{ck}/optimizer_0"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_prune_refuses_a_checkpoint_however_spelt(tmp_path, spelling):
    vol, ck = volume(tmp_path)
    p = ckptd(tmp_path, "prune", "--keep-last", "1", spelling.format(ck=ck, vol=vol))
    assert p.returncode == 64 and intact(ck), (p.returncode, p.stdout, p.stderr)


def test_prune_refuses_dot_from_inside_the_checkpoint(tmp_path):
    vol, ck = volume(tmp_path)
    p = ckptd(tmp_path, "prune", "--keep-last", "1", ".", cwd=ck)
    assert p.returncode == 64 and intact(ck), (p.returncode, p.stdout, p.stderr)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_config_roots_that_are_a_checkpoint_are_refused(tmp_path, spelling):
    vol, ck = volume(tmp_path)
    c = cfg(tmp_path, spelling.format(ck=ck, vol=vol))
    for cmd in ("check-config", "plan", "prune"):
        p = ckptd(tmp_path, cmd, "-c", c)
        assert p.returncode != 0 and intact(ck), (cmd, p.returncode, p.stdout, p.stderr)
