"""A root that is a SYMLINK to a checkpoint directory (ROOT on the command line, or `[[roots]] path`
in the config; the link outside the volume or inside it) is not seen as a checkpoint: the
checkpoint's own DCP parts are taken for a run of two checkpoints and keep_last=1 trashes and
purges the model's weights (`pytorch_model_fsdp_0/`) out of the run's only checkpoint. `prune`,
`plan` and the daemon (`ckptd run --foreground`) alike; `check-config` says OK.

How it was produced: fsdp_like.py writes accelerate's FSDP SHARDED_STATE_DICT layout with the
frameworks' own writers (Accelerator.save_state, then torch.distributed.checkpoint.save of the model
and the optimizer into step_1/pytorch_model_fsdp_0 and step_1/optimizer_0, as accelerate's
save_fsdp_model/save_fsdp_optimizer do), aged 1 h with os.utime. `ln -s vol/run/step_1 link`, then
`ckptd prune --keep-last 1 link` (no config), or a config whose root is `link` (keep_last = 1).
The same checkpoint named as `step_1/.`, `step_1/`, `step_1/optimizer_0/..`, `.` from inside it, or a
directory inside it is refused (exit 64, "is a checkpoint: name its run or a directory above it"):
see test_root_spellings_held.py.

ckptd: "delete pytorch_model_fsdp_0 (36.0KiB): outside keep_last=1 -> trashed", exit 0, and
`.ckptd/` and `.ckptd-trash/` left inside the checkpoint.

The framework's own loader: dcp.load of the model part (what accelerate's load_fsdp_model calls)
works before and fails after ("... .metadata" not found).

The promise: nothing of the run's newest complete checkpoint is deleted (in doubt: refuse, as the
other spellings are refused).
"""
import os, sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent))
from rootkit import cfg, ckptd, daemon_until, intact, loads, volume


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_prune_of_a_symlink_to_a_checkpoint_deletes_nothing_of_it(tmp_path, where):
    vol, ck = volume(tmp_path)
    assert loads(ck) == {"model": "ok", "optimizer": "ok"}
    link = (tmp_path / "link") if where == "outside" else (vol / "link")
    link.symlink_to(ck)
    p = ckptd(tmp_path, "prune", "--keep-last", "1", link)
    assert intact(ck), (p.returncode, p.stdout, p.stderr)
    assert loads(ck) == {"model": "ok", "optimizer": "ok"}


def test_a_config_root_that_is_a_symlink_to_a_checkpoint_deletes_nothing_of_it(tmp_path):
    vol, ck = volume(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(ck)
    c = cfg(tmp_path, link)
    cc = ckptd(tmp_path, "check-config", "-c", c)
    pl = ckptd(tmp_path, "plan", "-c", c)
    pr = ckptd(tmp_path, "prune", "-c", c)
    assert intact(ck), (cc.returncode, cc.stdout[-500:], pl.stdout, pr.stdout, pr.stderr)
    assert " delete " not in pl.stdout, pl.stdout


def test_the_daemon_with_a_symlink_root_to_a_checkpoint_deletes_nothing_of_it(tmp_path):
    vol, ck = volume(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(ck)
    c = cfg(tmp_path, link, quiet="5s")
    rc, log = daemon_until(tmp_path, c)
    assert intact(ck), log
    assert loads(ck) == {"model": "ok", "optimizer": "ok"}
