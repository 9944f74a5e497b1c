"""`ckptd prune ROOT` with no config, ROOT being a checkpoint directory (a user who names the
checkpoint instead of the run): its own parts are taken for a run and deleted.

Reproduces: accelerate's FSDP SHARDED_STATE_DICT layout written by the frameworks' own writers
(fsdp_like.py: Accelerator.save_state, then dcp.save into pytorch_model_fsdp_0/ and optimizer_0/), the
run's only (newest complete) checkpoint, aged an hour. `ckptd prune --keep-last 1 run/step_1` with no
config file takes pytorch_model_fsdp_0/ and optimizer_0/ for two DCP checkpoints of a run and moves the
older, pytorch_model_fsdp_0/ (the model's weights), into a .ckptd-trash/ it creates inside the checkpoint, and purges it.
With a config holding the volume as a root, the same command is refused (exit 64: "is inside the
run ... name the run itself or a directory above it"). dcp.load of both (what accelerate's load_fsdp_model /
load_fsdp_optimizer call) works before; the model's fails after. The promise: the newest complete
checkpoint of a run is never deleted, in part or whole; in doubt, keep (or refuse, as with -c).
"""
import os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import atk
from atk import PY, age, job, sh


def test_prune_of_a_checkpoint_directory_without_a_config_deletes_nothing_of_it(tmp_path):
    ck = tmp_path / "vol" / "run" / "step_1"
    job("fsdp_like.py", "save", ck)
    before, _ = job("fsdp_like.py", "load", ck)
    assert before == {"model": "ok", "optimizer": "ok"}, (before, _.stderr[-3000:])
    age(tmp_path / "vol")
    env = {**atk.ENV, "HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "home" / "state")}
    env.pop("CKPTD_CONFIG", None)
    p = sh([PY, "-m", "ckptd", "prune", "--keep-last", "1", str(ck)], check=False, env=env)
    after, _ = job("fsdp_like.py", "load", ck)
    assert (ck / "optimizer_0").is_dir() and (ck / "pytorch_model_fsdp_0").is_dir(), (p.returncode, p.stdout, p.stderr)
    assert after == {"model": "ok", "optimizer": "ok"}, after
