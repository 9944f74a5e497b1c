"""`ckptd.integrations.lightning.AttestedModelCheckpoint` in a real Lightning fit (CPU, one device, in a
subprocess). Lightning's single-file `.ckpt` has no directory for records: saved exactly as
ModelCheckpoint saves it, with none, and judged as before.

Its directory saves (DeepSpeed, sharded FSDP) are not run here: neither strategy runs on the CPU.
Lightning 2.6: `DeepSpeedStrategy.setup_environment` (lightning/pytorch/strategies/deepspeed.py)
raises "only supported on CUDA GPUs" unless the accelerator is CUDA, and past that guard
`setup_distributed` refuses CPU devices (`_validate_device_index_selection`, fabric/strategies/
deepspeed.py: device index None); `FSDPStrategy` is refused for accelerator='cpu' by
`_AcceleratorConnector._check_strategy_and_fallback`, and past that torch's own
`FullyShardedDataParallel` (torch/distributed/fsdp/_init_utils.py, `_init_device_handle`) raises
"FSDP needs a non-CPU accelerator device". What Lightning's DeepSpeed strategy saves is
`DeepSpeedEngine.save_checkpoint`'s directory, whose records on a real 2-rank save are tested with
the DeepSpeed wrapper (test_attest_deepspeed.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.common import REPO
from tests.support.fwgen import LIGHTNING_TINY

pytestmark = pytest.mark.frameworks

FIT = LIGHTNING_TINY + textwrap.dedent('''
    from ckptd.integrations.lightning import AttestedModelCheckpoint
    ck = AttestedModelCheckpoint(dirpath=sys.argv[1], save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, callbacks=[ck], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
''')


def test_a_lightning_fit_with_the_callback_saves_as_modelcheckpoint_does(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", FIT, str(out)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # no .ckptd/


def test_a_two_process_ddp_fit_with_the_callback_saves_one_file_without_records(tmp_path):
    """What runs here of a multi-process Lightning save: DDP over gloo, 2 processes (Lightning's own
    subprocess launcher re-running the script). Its checkpoint is one `.ckpt` that rank 0 writes
    (DDPStrategy.save_checkpoint): no directory, so no rank writes a record, and no rank waits."""
    pytest.importorskip("lightning")
    script = tmp_path / "fit.py"
    script.write_text(FIT.replace('devices=1, callbacks', 'devices=2, strategy="ddp", callbacks')
                      .replace("logger=False,", "logger=False, num_sanity_val_steps=0,"))
    assert 'strategy="ddp"' in script.read_text()
    out = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "PL_TORCH_DISTRIBUTED_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"]  # 2 ranks: 4 of 8 samples each
