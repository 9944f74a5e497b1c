"""`ckptd.integrations.lightning.AttestedModelCheckpoint` in a real Lightning fit (CPU, one device, in a
subprocess). Lightning's single-file `.ckpt` has no directory for records: saved exactly as
ModelCheckpoint saves it, with none, and judged as before. Its directory saves (DeepSpeed,
sharded FSDP) need a GPU in Lightning 2.x (FSDPStrategy refuses accelerator='cpu'): not run here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.frameworks

FIT = textwrap.dedent('''
    import sys, torch
    import lightning.pytorch as pl
    from ckptd.integrations.lightning import AttestedModelCheckpoint
    torch.set_num_threads(1)
    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__(); self.layer = torch.nn.Linear(16, 8)
        def training_step(self, batch, i):
            x, y = batch; return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 8))
    ck = AttestedModelCheckpoint(dirpath=sys.argv[1], save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, callbacks=[ck], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
''')


def test_a_lightning_fit_with_the_callback_saves_as_modelcheckpoint_does(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", FIT, str(out)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # no .ckptd/
