"""HELD (regression): DeepSpeed ZeRO-3, 2 ranks: a re-save of global_step10 in place whose rank 1
is killed after its model states and before its optimizer shard (rank 0 finished everything and
wrote `latest`).

How it was produced: ds_job.py (real DeepSpeed 0.19.8 on gloo, CPU), width 32 saves global_step5
and global_step10, aged 10 min; a width-64 job re-saves global_step10 with rank 1 held before
zero_pp_rank_1_mp_rank_00_optim_states.pt, then SIGKILLed once rank 0 wrote its two files.
Rank 1's optimizer shard is older than the model states the same process wrote before it.

ckptd: global_step10 incomplete (one save), global_step5 kept, `latest` names global_step5.
DeepSpeed's loader fails on global_step10 and resumes global_step5.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import atk
from atk import age, config, job, latest, plan, verify
from test_ds_resave_rank0_killed import _env


def test_zero3_resave_with_rank_1_killed_before_its_optimizer_shard_is_incomplete(tmp_path):
    vol = tmp_path / "vol"
    run = vol / "run"
    run.mkdir(parents=True)
    try:
        _env(DS_STAGE=3, DS_STEPS="5,10")
        job("ds_job.py", "save", run, 0, timeout=400)
        age(vol, 600)
        _env(DS_STAGE=3, DS_STEPS="10", DS_HIDDEN=64, DS_HOLD_RANK=1,
             DS_HOLD_PREFIX="zero_pp_rank_1_mp_rank_00_optim_states", DS_OTHER_FILES=2)
        r, _ = job("ds_job.py", "save", run, 10, timeout=400)
        assert r and r["killed"], r
        _env(DS_STAGE=3, DS_HIDDEN=64)
        res, _ = job("ds_job.py", "load", run, "global_step10", timeout=400)
    finally:
        _env()
    assert res != {"rank0": "ok", "rank1": "ok"}, res
    age(vol, 600)
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "global_step10")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["global_step10"]["state"] != "complete", rows["global_step10"]
    assert rows["global_step5"]["action"] != "delete", rows["global_step5"]
    assert name == str(run / "global_step5"), (name, err)
