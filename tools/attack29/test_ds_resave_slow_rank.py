"""DeepSpeed (bare layout, ZeRO-2, 2 ranks): a re-save of a tag in place whose rank 1 is killed
before its optimizer shard, within 30 minutes of the old save.

Reproduces: a real DeepSpeed job (hidden width 32) saves global_step5 and global_step10. Ten minutes
later a new job (width 64) into the same directory saves global_step10 in place; rank 1 is held
just before it writes zero_pp_rank_1_mp_rank_00_optim_states.pt, rank 0 writes its model states,
its shard and `latest`, and the job is SIGKILLed. global_step10 holds the new job's model states and
rank 0 shard beside the old job's rank 1 shard (ten minutes older: inside the 30 minutes the "one
save" check allows between ranks). DeepSpeed's own load_checkpoint + one step (a resume) fails on
global_step10 with either width; global_step5 resumes with width 32. The promise: global_step10 is
not complete, `ckptd latest` names global_step5, keep_last=1 keeps global_step5.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import atk
from atk import age, config, job, latest, plan, verify


def test_a_deepspeed_resave_with_a_rank_killed_before_its_shard_is_not_complete(tmp_path):
    run = tmp_path / "vol" / "run"
    run.mkdir(parents=True)
    atk.ENV.update({"DS_NO_MPU": "1", "DS_STEPS": "5,10"})
    try:
        job("ds_tp.py", "save", run, 2, 0, timeout=400)
        age(tmp_path / "vol", 600)
        atk.ENV.update({"DS_STEPS": "10", "DS_HIDDEN": "64", "DS_KILL_PREFIX": "zero_pp_rank_1"})
        job("ds_tp.py", "save", run, 2, 10, timeout=400)
        atk.ENV.pop("DS_KILL_PREFIX")
        res = {}
        for tag in ("global_step5", "global_step10"):
            for h in ("32", "64"):
                atk.ENV["DS_HIDDEN"] = h
                res[tag, h], _ = job("ds_tp.py", "load", run, 2, tag, timeout=400)
    finally:
        for k in ("DS_NO_MPU", "DS_STEPS", "DS_HIDDEN", "DS_KILL_PREFIX"):
            atk.ENV.pop(k, None)
    assert res["global_step5", "32"] == {"rank0": "ok", "rank1": "ok"}, res
    assert res["global_step10", "32"]["rank1"] != "ok", res        # DeepSpeed cannot resume from it,
    assert res["global_step10", "64"]["rank1"] != "ok", res        # with either model
    age(tmp_path / "vol", 600)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "global_step10")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["global_step10"]["state"] != "complete", (rc, rows["global_step10"])
    assert name == str(run / "global_step5"), (name, err)
    assert rows["global_step5"]["action"] != "delete", rows["global_step5"]
