"""A real Lightning fit (CPU, one process) with ModelCheckpoint(save_top_k=-1, every_n_train_steps=2).

  python lightning_job.py fit DIR MAX_STEPS    -> DIR/epoch=0-step=N.ckpt
  python lightning_job.py load CKPT            -> {"load": "ok"|error}: Trainer.fit(ckpt_path=CKPT) one step on
"""
import json, os, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    def training_step(self, b, i):
        x, = b
        return self.net(x).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def trainer(d, max_steps):
    return pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", default_root_dir=d,
                      callbacks=[ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_train_steps=2, filename="{epoch}-{step}")])


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1] == "fit":
        trainer(sys.argv[2], int(sys.argv[3])).fit(M(), data())
        print(json.dumps({"fit": True}))
    else:
        ck = sys.argv[2]
        try:
            sd = torch.load(ck, map_location="cpu", weights_only=False)
            t = trainer(os.path.join(os.path.dirname(ck), "..", "resume-" + os.path.basename(ck)), sd["global_step"] + 1)
            t.fit(M(), data(), ckpt_path=ck)
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"load": res}))
