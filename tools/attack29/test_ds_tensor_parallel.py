"""DeepSpeed with model (tensor) parallelism and no ZeRO: a rank killed before its own
mp_rank_01_model_states.pt.

Reproduces: a real 2-rank DeepSpeed job (gloo, CPU) initialised with a Megatron-style mpu
(tensor-parallel 2, data-parallel 1, ZeRO stage 0, as Megatron-DeepSpeed runs it) saves
global_step10 whole, then at global_step20 rank 1 is held just before it writes its
mp_rank_01_model_states.pt while rank 0 writes mp_rank_00_model_states.pt and `latest`; the job is
SIGKILLed there. mp_rank_00_model_states.pt itself records mp_world_size=2. DeepSpeed's own
load_checkpoint of global_step20 fails on rank 1 (its model states file is missing); global_step10
loads on both ranks. The promise: global_step20 is not complete, `ckptd latest` names
global_step10, and keep_last=1 does not delete global_step10.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, latest, plan, verify


def test_a_tensor_parallel_rank_killed_before_its_model_states_is_not_complete(tmp_path):
    vol = tmp_path / "vol"
    run = vol / "megatron-ds" / "tp2"
    run.mkdir(parents=True)
    job("ds_tp.py", "save", run, 0, 20, timeout=400)
    assert (run / "global_step20" / "mp_rank_00_model_states.pt").exists()
    assert not (run / "global_step20" / "mp_rank_01_model_states.pt").exists()
    assert (run / "latest").read_text().strip() == "global_step20"
    good, _ = job("ds_tp.py", "load", run, 0, "global_step10", timeout=400)
    bad, _ = job("ds_tp.py", "load", run, 0, "global_step20", timeout=400)
    assert good == {"rank0": "ok", "rank1": "ok"}, good           # the framework restores step 10
    assert bad["rank1"] != "ok", bad                              # ... and cannot restore step 20
    age(vol)
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "global_step20")
    p = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, out, err = latest(cfg, run)
    assert rc != 0 and p["global_step20"]["state"] != "complete", (rc, ev, p["global_step20"])
    assert out == str(run / "global_step10"), (out, err)
    assert p["global_step10"]["action"] != "delete", p["global_step10"]
