"""accelerate's FSDP SHARDED_STATE_DICT save made with `save_state(output_dir="<a name of the user's>")`
(here `proj/final`, as `accelerator.save_state("final")` at the end of training writes it) anywhere
under a root: the save is not recognised as a checkpoint (its name is not checkpoint_N/step_N/epoch_N),
so its own DCP parts, pytorch_model_fsdp_0/ and optimizer_0/, are taken for two `dcp` checkpoints of a
run `proj/final`, and keep_last=1 deletes the model's weights out of it.

How it was produced: fsdp_like.py (Accelerator.save_state, then torch.distributed.checkpoint.save of
the model and optimizer state into pytorch_model_fsdp_0/ and optimizer_0/, as accelerate's
save_fsdp_model/save_fsdp_optimizer do) into vol/proj/final, aged 1 h with os.utime; a config with
the root vol/, keep_last = 1, keep_best = 0, quiet_period 60s; `ckptd prune -c CFG`.

ckptd plan: "proj/final  pytorch_model_fsdp_0  0  complete ... delete  outside keep_last=1" and
"optimizer_0 ... keep  newest complete"; prune trashes and purges pytorch_model_fsdp_0/. (With the
default keep_last = 2, a save of two models, four DCP parts, loses two of them.)

The framework's loader: dcp.load of the model part (what accelerate's load_state -> load_fsdp_model
calls) works before, fails after (CheckpointException: no .metadata).

The promise: a checkpoint's parts are not checkpoints; nothing of a complete save is deleted
piecemeal (in doubt: keep). `verify`/`plan` on the accelerate layout treat the same parts as parts of
step_1 (see test_root_spellings_held.py), so the name alone decides.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import shutil
from rootkit import cfg, ckptd, intact, loads, volume


def test_a_custom_named_accelerate_fsdp_save_keeps_its_parts(tmp_path):
    vol, ck = volume(tmp_path)
    final = vol / "proj" / "final"
    final.parent.mkdir()
    shutil.move(str(ck), str(final))      # the very same save, as save_state("final") names it (mtimes kept)
    shutil.rmtree(vol / "run")
    assert loads(final) == {"model": "ok", "optimizer": "ok"}
    c = cfg(tmp_path, vol)
    pl = ckptd(tmp_path, "plan", "-c", c)
    pr = ckptd(tmp_path, "prune", "-c", c)
    assert intact(final), (pl.stdout, pr.stdout, pr.stderr)
    assert loads(final) == {"model": "ok", "optimizer": "ok"}
