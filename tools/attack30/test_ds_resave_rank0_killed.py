"""DeepSpeed 0.19 (bare layout, 2 ranks, ZeRO-2 and ZeRO-3): a re-save of a tag in place whose
RANK 0 is killed before its model states, while rank 1 finishes its part, is called complete,
and the older, loadable tag is deleted.

How it was produced: ds_job.py, a real 2-rank DeepSpeed job on gloo (CPU), width 32, saves
global_step5 and global_step10; the files are aged 10 minutes with os.utime. A second job (width
64) saves global_step10 again into the same directory. DeepSpeed 0.19.8 has no barrier between
rank 0's model states and the other ranks' files (_create_zero_checkpoint_files has none), so
rank 1 writes its new files (ZeRO-2: zero_pp_rank_1_..._optim_states.pt; ZeRO-3 also its
zero_pp_rank_1_..._model_states.pt) while rank 0 is held just before its model states
(mp_rank_00_model_states.pt / zero_pp_rank_0_mp_rank_00_model_states.pt); then every process is
SIGKILLed. The tag now holds rank 0's files from the old save and rank 1's from the new one:
every rank's shard is there, and the only mixing is a shard NEWER than rank 0's model states,
which the documented "one save" check ignores ("only older counts").

ckptd (plan/verify, keep_last=1): global_step10 complete ("one save: its files are in the order
one save writes them"), global_step5 delete, `ckptd latest` names global_step10.

DeepSpeed's own loader (engine.load_checkpoint(tag=...) and one step, a resume): global_step10
fails with either width (ZeRO-2, width 32: "The size of tensor a (404) must match the size of
tensor b (804)" on rank 1; width 64: state_dict size mismatch on both ranks; ZeRO-3 alike);
global_step5 resumes with width 32.

The promise: global_step10 is not complete; global_step5, the newest complete checkpoint, is kept.
"""
import sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent))
import atk
from atk import age, config, job, latest, plan, verify

HOLD = {2: "mp_rank_00_model_states", 3: "zero_pp_rank_0_mp_rank_00_model_states"}
OTHER_FILES = {2: 1, 3: 2}


def _env(**kw):
    for k in [k for k in atk.ENV if k.startswith("DS_")]:
        del atk.ENV[k]
    atk.ENV.update({k: str(v) for k, v in kw.items()})


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resave_whose_rank_0_died_before_its_model_states_is_not_complete(tmp_path, stage):
    vol = tmp_path / "vol"
    run = vol / "run"
    run.mkdir(parents=True)
    try:
        _env(DS_STAGE=stage, DS_STEPS="5,10")
        job("ds_job.py", "save", run, 0, timeout=400)
        age(vol, 600)
        _env(DS_STAGE=stage, DS_STEPS="10", DS_HIDDEN=64, DS_HOLD_RANK=0, DS_HOLD_PREFIX=HOLD[stage],
             DS_OTHER_FILES=OTHER_FILES[stage])
        r, _ = job("ds_job.py", "save", run, 10, timeout=400)
        assert r and r["killed"], r
        res = {}
        for tag, h in (("global_step5", 32), ("global_step10", 32), ("global_step10", 64)):
            _env(DS_STAGE=stage, DS_HIDDEN=h)
            res[tag, h], _ = job("ds_job.py", "load", run, tag, timeout=400)
    finally:
        _env()
    assert res["global_step5", 32] == {"rank0": "ok", "rank1": "ok"}, res
    assert res["global_step10", 32] != {"rank0": "ok", "rank1": "ok"}, res   # DeepSpeed cannot resume it
    assert res["global_step10", 64] != {"rank0": "ok", "rank1": "ok"}, res   # with either model
    age(vol, 600)
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "global_step10")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rows["global_step5"]["action"] != "delete", rows["global_step5"]
    assert rc != 0 and rows["global_step10"]["state"] != "complete", (rc, rows["global_step10"])
    assert name == str(run / "global_step5"), (name, err)
