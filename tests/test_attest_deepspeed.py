"""`ckptd.integrations.deepspeed.wrap` on a real 2-rank ZeRO-2 DeepSpeed job (dsgen.py, bare layout:
`<out>/global_stepN/` is the checkpoint): each rank's record in the tag directory, and the engine
counting the save complete on them inside the quiet period."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptd.config import Root
from ckptd.model import ATTESTED, State
from ckptd.planner import Scanner

import dsgen

pytestmark = pytest.mark.deepspeed


def test_each_rank_records_its_deepspeed_save(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    env = {"DSGEN_ATTEST": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                                 os.environ.get("PYTHONPATH", "")])}
    dsgen.generate(out, world_size=2, stage=2, layout="bare", steps=(10, 20), env=env)
    tag = out / "global_step20"
    recs = {p.name: json.loads(p.read_text()) for p in (tag / ".ckptd").glob("*.json")}
    assert sorted(recs) == ["commit-rank0-of-2.json", "commit-rank1-of-2.json"]
    listed = {n: {f["path"] for f in r["files"]} for n, r in recs.items()}
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in listed["commit-rank1-of-2.json"]
    assert "mp_rank_00_model_states.pt" in listed["commit-rank0-of-2.json"]
    now = max(p.stat().st_mtime for p in tag.rglob("*")) + 1  # inside the quiet period
    [run] = Scanner(Root(path=tmp_path, world_size=2)).runs(now=now)
    c = next(c for c in run.checkpoints if c.name == "global_step20")
    assert c.state is State.COMPLETE, [str(k) for k in c.checks]
    assert any(k.name == ATTESTED for k in c.checks)
