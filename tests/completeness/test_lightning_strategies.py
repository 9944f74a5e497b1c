"""Lightning's strategies' checkpoint shapes: DeepSpeedStrategy's and FSDPStrategy's directories named
like files are complete only by their own evidence, and the target of `last.ckpt` as a link is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ckptd.cli.demo_volume import age
from tests.support.common import run_ckptd
from tests.support.rtkit import config, dcp_save, no_deepspeed, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- Lightning's DeepSpeed checkpoint directory: no census of its shards -------------------------


@pytest.mark.deepspeed
@no_deepspeed
def test_a_lightning_deepspeed_checkpoint_missing_a_shard_is_not_complete(zero3_bf16_bare, tmp_path):
    """Lightning's DeepSpeedStrategy saves each checkpoint as a *directory* named like the file
    (`epoch=1-step=20.ckpt/`): `deepspeed_engine.save_checkpoint(filepath, tag="checkpoint")`, so
    the shards are in `<name>.ckpt/checkpoint/` and `latest` says `checkpoint`
    (lightning/pytorch/strategies/deepspeed.py save_checkpoint). ckptd takes the directory for a
    Lightning checkpoint and checks only quiet, NeMo's marker and the files' integrity: the
    DeepSpeed census (every rank's optimizer shard, from the model states' world sizes) runs for
    `global_step*` tags in Trainer checkpoints, bare runs and accelerate's tag directories, never
    here. With rank 1's shard missing (rank 1 killed mid-save, or still on its way: nothing of
    it in the directory yet), step 20 is 'complete', the newest, and keep_last=1 deletes step 10,
    the only checkpoint that can be resumed. Real DeepSpeed files (ZeRO-3 bf16, 2 ranks, from
    dsgen) in the directory Lightning puts them in; Lightning's DeepSpeedStrategy needs CUDA, so
    the directory is laid out by hand as deepspeed.py lays it out."""
    root = tmp_path / "vol"
    ckpts = root / "team" / "run" / "lightning_logs" / "version_0" / "checkpoints"
    for epoch, step in enumerate((10, 20)):
        d = ckpts / f"epoch={epoch}-step={step}.ckpt"
        shutil.copytree(zero3_bf16_bare / f"global_step{step}", d / "checkpoint")
        (d / "latest").write_text("checkpoint")
    killed = ckpts / "epoch=1-step=20.ckpt" / "checkpoint"
    shards = sorted(killed.glob("*zero_pp_rank_1_*optim_states.pt"))
    assert shards, sorted(p.name for p in killed.iterdir())
    for p in shards:
        p.unlink()
    age(root, OLD)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    proc = run_ckptd("plan", "-c", cfg)
    row = next(line for line in proc.stdout.splitlines() if "step=20" in line)
    prune(cfg)
    assert (ckpts / "epoch=0-step=10.ckpt").is_dir(), f"the last whole checkpoint was deleted; step 20: {row}"


# --- near-miss: Lightning's FSDP sharded checkpoints are megatron-core ones missing metadata.json -


@pytest.mark.frameworks
def test_lightning_fsdp_sharded_checkpoints_can_be_complete(tmp_path):
    """Lightning's FSDPStrategy with state_dict_type="sharded" saves each checkpoint as a directory
    named like the file (`epoch=0-step=100.ckpt/`): torch.distributed.checkpoint's files, then
    rank 0's `meta.pt` (lightning/pytorch/strategies/fsdp.py save_checkpoint,
    _distributed_checkpoint_save, _METADATA_FILENAME). ckptd takes a Lightning-named directory of
    DCP files for a NeMo/megatron-core distributed checkpoint and demands megatron-core's
    `metadata.json`, which Lightning never writes: every such checkpoint is 'incomplete' for
    ever. Nothing is deleted (safe), but nothing is ever freed either, and `plan` blames a file
    of another framework. Real DCP files (dcp.save, one process) and a real torch.save meta.pt,
    laid out as fsdp.py lays them out; Lightning refuses FSDP on the CPU, so it cannot write them
    here itself."""
    root = tmp_path / "vol"
    ckpts = root / "team" / "run" / "lightning_logs" / "version_0" / "checkpoints"
    code = ("import sys, torch; torch.save({'epoch': int(sys.argv[2]), 'global_step': int(sys.argv[3])},"
            " sys.argv[1])")
    for epoch, step in enumerate((100, 200)):
        d = ckpts / f"epoch={epoch}-step={step}.ckpt"
        dcp_save(d, step)
        subprocess.run([sys.executable, "-c", code, str(d / "meta.pt"), str(epoch), str(step)], check=True,
                       timeout=120)
        age(d, OLD + step)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    proc = run_ckptd("plan", "-c", cfg)
    rows = [line for line in proc.stdout.splitlines() if ".ckpt" in line]
    assert len(rows) == 2 and all(" complete " in r for r in rows), proc.stdout


@pytest.mark.frameworks
def test_a_lightning_fsdp_sharded_checkpoint_without_dcp_metadata_is_not_complete(tmp_path):
    """The other side of the one above: Lightning's FSDP checkpoint directory is complete by DCP's
    evidence, so without `.metadata` (the coordinator's, written after every rank's data) it is
    not, `meta.pt` or not. Real DCP files and meta.pt; `.metadata` removed by hand (a state no
    save leaves, meta.pt being written after it: the check must not lean on meta.pt alone)."""
    root = tmp_path / "vol"
    ckpts = root / "run" / "checkpoints"
    d = ckpts / "epoch=0-step=100.ckpt"
    dcp_save(d, 100)
    code = "import sys, torch; torch.save({'epoch': 0, 'global_step': 100}, sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(d / "meta.pt")], check=True, timeout=120)
    (d / ".metadata").unlink()
    age(root, OLD)
    proc = run_ckptd("plan", "-c", config(tmp_path, root, keep_last=1, keep_best=0))
    row = next(line for line in proc.stdout.splitlines() if "step=100" in line)
    assert " complete " not in row and ".metadata missing" in proc.stdout, proc.stdout


# --- Lightning's last.ckpt as a link: its target is what ckpt_path="last" loads ------------------

_LIGHTNING_LINK_JOB = """
import sys, torch, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(4, 1)
    def training_step(self, b, i):
        self.log("m", float(self.global_step))  # worse at every step: the first save stays the best
        return self.l(b[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
d = sys.argv[1]
best = ModelCheckpoint(dirpath=d, filename="best-{epoch}-{step}", monitor="m", mode="min", save_top_k=1,
                       save_last="link", every_n_train_steps=2)
periodic = ModelCheckpoint(dirpath=d, filename="{epoch}-{step}", save_top_k=-1, every_n_train_steps=2)
t = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[best, periodic], logger=False,
              enable_progress_bar=False, enable_model_summary=False)
t.fit(M(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4))
"""


@pytest.mark.frameworks
def test_the_target_of_lightnings_last_link_is_kept(tmp_path):
    """Lightning's ModelCheckpoint(save_last="link") makes last.ckpt a symlink to the file it saved
    last, instead of a copy (lightning/pytorch/callbacks/model_checkpoint.py _save_last_checkpoint,
    _link_checkpoint). With a top-k callback on a metric beside a periodic one (the usual pair),
    the top-k callback saves nothing once the metric stops improving, and its last.ckpt keeps
    pointing at its best file, `best-epoch=0-step=2.ckpt`, while the periodic callback writes
    newer steps beside it. ckptd never deletes last.ckpt itself ('what ckpt_path="last" loads'),
    but the file the link names is an ordinary old step: keep_last (the defaults too) deletes it,
    last.ckpt dangles, and `Trainer.fit(ckpt_path="last")` has nothing to load. Real Lightning
    files: a 6-step CPU fit with the two callbacks."""
    ckpts = tmp_path / "vol" / "run" / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", _LIGHTNING_LINK_JOB, str(ckpts)], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"lightning cannot run here: {proc.stderr[-300:]}")
    target = os.readlink(ckpts / "last.ckpt")
    assert target == "best-epoch=0-step=2.ckpt", target
    assert any(p.name == "epoch=0-step=6.ckpt" for p in ckpts.iterdir())
    age(tmp_path / "vol", OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    prune(cfg)
    assert (ckpts / "last.ckpt").resolve().is_file(), f"last.ckpt -> {target}, which was deleted"
