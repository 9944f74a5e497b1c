"""What the red team's reproductions share (test_redteam.py, test_redteam2.py): a config for one
root with no quiet period, a prune that must succeed, and the DeepSpeed skip."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.common import run_ckptd

no_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None,
    reason="needs ckptd[deepspeed] (torch==2.13.0, deepspeed)",
)


def config(tmp_path: Path, root: Path, *, root_extra: str = "", **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'",
             f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n{root_extra}", "[roots.retention]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in retention.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def prune(cfg: Path, *args: str | Path) -> str:
    proc = run_ckptd("prune", "-c", cfg, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
