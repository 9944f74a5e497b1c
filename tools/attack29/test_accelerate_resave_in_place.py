"""accelerate: a save_state() re-save in place killed right after model.safetensors.

Reproduces: a real accelerate job (Linear width 32) saves run/step_10 and run/step_20. A later job
(width 64) saves run/step_20 in place and is SIGKILLed inside save_state right after
model.safetensors, before optimizer.bin (checkpointing.save_accelerator_state: model, optimizer,
scheduler, then random_states_<i>.pkl). step_20 holds the new weights beside the old optimizer,
scheduler and random states. accelerate's own load_state fails on it with either model; step_10
loads. The promise: step_20 is not complete, `ckptd latest` names step_10, keep_last=1 keeps it.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, latest, plan, verify


def test_an_accelerate_resave_killed_after_the_weights_is_not_complete(tmp_path):
    vol = tmp_path / "vol"
    run = vol / "acc"
    job("accelerate_job.py", "train", run, 32, "10,20")
    age(vol, 7200)
    r, p = job("accelerate_job.py", "train", run, 64, "20", 20, check=False)
    assert p.returncode == -9, p.stderr[-2000:]
    s20 = run / "step_20"
    for width in (32, 64):
        res, _ = job("accelerate_job.py", "load", s20, width)
        assert res["load_state"] != "ok", res
    res, _ = job("accelerate_job.py", "load", run / "step_10", 32)
    assert res["load_state"] == "ok", res
    age(vol, 3600)
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    rc, ev = verify(cfg, s20)
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["step_20"]["state"] != "complete", (rc, rows["step_20"])
    assert name == str(run / "step_10"), (name, err)
    assert rows["step_10"]["action"] != "delete", rows["step_10"]
