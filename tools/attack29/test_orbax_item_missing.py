"""Orbax: a step copied in without one of its items (the copier died before that item's directory).

Reproduces: a real Orbax CheckpointManager (CPU) saves steps 1 and 2, each with two items, "state"
(StandardSave, OCDBT) and "meta" (JsonSave); _CHECKPOINT_METADATA's item_handlers names both. The
run is copied into a volume with cp -rp (mtimes kept), and step 2's item directory did not arrive.
Orbax's own restore of step 2 fails (KeyError: Item "state" was not found in the checkpoint),
while all_steps() and latest_step() still list it; step 1 restores. The promise: step 2 is not
complete, `ckptd latest` names step 1, keep_last=1 keeps step 1.
"""
import shutil, subprocess, sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, latest, plan, verify


@pytest.mark.parametrize("missing", ["state", "meta"])
def test_an_orbax_step_missing_an_item_is_not_complete(tmp_path, missing):
    src = tmp_path / "src" / "run"
    job("orbax_job.py", "save", src, "1,2")
    age(tmp_path / "src", 7200)
    run = tmp_path / "vol" / "run"
    run.mkdir(parents=True)
    for s in ("1", "2"):
        subprocess.run(["cp", "-rp", str(src / s), str(run / s)], check=True)
    shutil.rmtree(run / "2" / missing)
    bad, _ = job("orbax_job.py", "restore", run, 2)
    good, _ = job("orbax_job.py", "restore", run, 1)
    assert good["restore"] == "ok", good
    assert bad["restore"] != "ok", bad                    # Orbax cannot restore step 2
    age(tmp_path / "vol", 600)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "2")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["2"]["state"] != "complete", (rc, rows["2"])
    assert name == str(run / "1"), (name, err)
    assert rows["1"]["action"] != "delete", rows["1"]
