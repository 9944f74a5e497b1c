"""accelerate with two prepared models (and two objects registered for checkpointing): a copy-in
that died before the second model's weights (or the second custom object's pickle) arrived.

Reproduces: a real accelerate job prepares two models with two optimizers (a GAN-style setup) and
registers two objects with accelerator.register_for_checkpointing; save_state writes run/step_10 and
run/step_20 (model.safetensors, model_1.safetensors, optimizer.bin, optimizer_1.bin,
custom_checkpoint_0.pkl, custom_checkpoint_1.pkl, random_states_0.pkl). The run is copied into a
volume with cp -rp (mtimes kept); in step_20 one file did not arrive (the copier died before it).
accelerate's own load_state fails on step_20 in both cases (FileNotFoundError for the model;
"Number of custom checkpoints ... does not match" for the pickle); step_10 loads. The promise:
step_20 is not complete, `ckptd latest` names step_10, keep_last=1 keeps step_10. (The same copy
missing optimizer_1.bin is caught by the file census: held.)
"""
import os, subprocess, sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, latest, plan, verify


@pytest.mark.parametrize("missing", ["model_1.safetensors", "custom_checkpoint_1.pkl"])
def test_an_accelerate_save_missing_a_second_objects_file_is_not_complete(tmp_path, missing):
    src = tmp_path / "src" / "gan"
    job("accelerate_multi.py", "save", src, "10,20")
    age(tmp_path / "src", 7200)
    run = tmp_path / "vol" / "gan"
    run.mkdir(parents=True)
    for s in ("step_10", "step_20"):
        subprocess.run(["cp", "-rp", str(src / s), str(run / s)], check=True)
    (run / "step_20" / missing).unlink()
    bad, _ = job("accelerate_multi.py", "load", run / "step_20")
    good, _ = job("accelerate_multi.py", "load", run / "step_10")
    assert good["load_state"] == "ok", good
    assert bad["load_state"] != "ok", bad                  # accelerate cannot restore step_20
    age(tmp_path / "vol", 600)                             # the copier died ten minutes ago
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "step_20")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["step_20"]["state"] != "complete", (rc, rows["step_20"])
    assert name == str(run / "step_10"), (name, err)
    assert rows["step_10"]["action"] != "delete", rows["step_10"]
