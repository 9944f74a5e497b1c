"""What is one checkpoint and what is a run: a run written inside a checkpoint directory (the Trainer's,
DCP's) is not deleted with it, an Orbax directory named like a pattern is a run, NeMo's model-parallel
ranks are one checkpoint."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from tests.support.fwfixtures import copy_volume
from tests.support.rtkit import config, dcp_save, names, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- A directory holding checkpoints taken for one checkpoint -----------------------------------


def test_a_run_written_inside_a_checkpoint_directory_is_not_deleted_with_it(tmp_path):
    """A fine-tuning job given `--output_dir out/checkpoint-500` (the checkpoint it starts from)
    writes its own checkpoint-100, -200 inside. A strictly named directory (checkpoint-N,
    global_stepN, iter_N) is never looked into for checkpoints, so out/checkpoint-500 is one
    old checkpoint of `out`, and keep_last deletes it: the nested run's newest complete
    checkpoint goes with it, even pinned with .ckptd-keep. `plan` never lists the nested run."""
    root = tmp_path / "vol"
    out = root / "out"
    for step in (500, 1000, 1500, 2000):
        hf_deepspeed_checkpoint(out, step, world=2, mtime=OLD + step)
    nested = out / "checkpoint-500"
    for step in (100, 200):
        hf_deepspeed_checkpoint(nested, step, world=2, mtime=OLD + 1000 + step)
    (nested / "checkpoint-200" / ".ckptd-keep").touch()
    age(nested, OLD + 1000)
    age(out / "checkpoint-2000", OLD + 5000)  # the outer job saved last
    cfg = config(tmp_path, root, keep_last=2, keep_best=0)
    prune(cfg)
    assert (nested / "checkpoint-200").is_dir(), "the nested run's newest (and pinned) checkpoint was deleted"


def test_a_pattern_named_directory_holding_orbax_steps_is_a_run(orbax_volume, tmp_path):
    """patterns = ['ckpt_{step}'] for one team's own checkpoints; another team's Orbax
    CheckpointManager directory is called ckpt_1 and ckpt_2. recognise() keeps a loosely named
    directory that holds checkpoints as a run, but only checks its children by *name*: Orbax
    steps (numbered directories recognised by their contents) do not count, so each Orbax run
    is one 'checkpoint' complete on quiet alone, and ckpt_1 is deleted with all its steps,
    its newest and its best included."""
    root = tmp_path / "vol"
    (root / "jax").mkdir(parents=True)
    copy_volume(orbax_volume, tmp_path / "orbax")
    for name in ("ckpt_1", "ckpt_2"):
        shutil.copytree(tmp_path / "orbax" / "best_fn", root / "jax" / name, symlinks=True)
    age(root, OLD)
    cfg = config(tmp_path, root, root_extra="patterns = ['ckpt_{step}']", keep_last=1, keep_best=0)
    prune(cfg)
    assert (root / "jax" / "ckpt_1").is_dir(), "an Orbax run (steps 1-4, its newest and best) was deleted whole"
    assert names(root / "jax" / "ckpt_1") == ["1", "2", "3", "4"]


# --- NeMo's model-parallel layout: one checkpoint in several directories -------------------------


def test_nemo_model_parallel_ranks_are_one_checkpoint(tmp_path):
    """NeMo 1 with tensor parallelism (no distributed checkpoint) saves each step as
    checkpoints/mp_rank_00/<name>.ckpt and checkpoints/mp_rank_01/<name>.ckpt
    (inject_model_parallel_rank), with ONE unfinished marker, checkpoints/<name>-unfinished
    (format_checkpoint_unfinished_marker_path uninjects the rank), NVIDIA/NeMo
    nemo/utils/callbacks/nemo_model_checkpoint.py. ckptd takes each mp_rank_XX as a run of its
    own and looks for the marker beside the file: rank 0's step=300 (whose save is unfinished,
    by NeMo's own marker) is its 'newest complete', and its step=200, the last step every
    rank has, is deleted. Nothing resumable is left. NeMo is not installed here: hand-made files
    in NeMo's names (zip archives, as torch.save writes), and the marker as NeMo places it."""
    ck = tmp_path / "vol" / "gpt" / "checkpoints"
    name = "megatron_gpt--val_loss=2.50-step={s}-consumed_samples={c}.0"
    for rank in (0, 1):
        for s in (100, 200, 300):
            if rank == 1 and s == 300:
                continue  # rank 1 has not written step 300 yet
            write_zip(ck / f"mp_rank_{rank:02d}" / (name.format(s=s, c=s * 8) + ".ckpt"), 64)
    (ck / (name.format(s=300, c=2400) + "-unfinished")).touch()
    age(ck.parent, OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    prune(cfg)
    step200 = name.format(s=200, c=1600) + ".ckpt"
    assert (ck / "mp_rank_00" / step200).is_file(), "rank 0's part of the last whole step was deleted"


@pytest.mark.frameworks
def test_a_dcp_run_written_inside_a_checkpoint_is_not_deleted_with_it(tmp_path):
    """The run inside a checkpoint directory above, again with torch.distributed.checkpoint: a
    fine-tuning script given `--output_dir out/checkpoint-500` (the checkpoint it starts from) saves
    its own steps there
    with dcp.save as step_10/, step_20/ (ckptd's `dcp` layout: 'the last number in the name').
    layouts.held counts DCP directories nowhere, as parts of the checkpoint (FSDP's
    pytorch_model_fsdp_0/), and the evidence's own DCP check passes them ('.metadata present').
    So checkpoint-500 is one complete old checkpoint of `out`: once the outer job saves again,
    keep_last deletes it, and the nested run's every save, its newest included, goes with it.
    (The same nested run at the top of a root is two checkpoints ckptd keeps the newest of.)
    Real DCP files (dcp.save in one process); the Trainer's checkpoints are ckptd.cli.demo_volume's."""
    root = tmp_path / "vol"
    out = root / "out"
    for step in (500, 1000, 1500):
        hf_deepspeed_checkpoint(out, step, world=2, mtime=OLD + step)
    nested = out / "checkpoint-500"
    for step in (10, 20):
        dcp_save(nested / f"step_{step}", step)
        age(nested / f"step_{step}", OLD + 3000 + step)
    os.utime(nested, (OLD + 3020, OLD + 3020))
    hf_deepspeed_checkpoint(out, 2000, world=2, mtime=OLD + 4000)  # the outer job saved again, later
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert (nested / "step_20").is_dir(), "the nested DCP run's newest save was deleted with checkpoint-500"
