"""A real Lightning fit from scratch with the default logger: EXP/lightning_logs/version_N/checkpoints/.

  python lightning_versions.py EXP MAX_STEPS EVERY_N   (ModelCheckpoint(save_top_k=-1, every_n_train_steps=EVERY_N))
"""
import json, os, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_job import M, data

if __name__ == "__main__":
    torch.manual_seed(0)
    exp, max_steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t = pl.Trainer(max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                   default_root_dir=exp, callbacks=[ModelCheckpoint(save_top_k=-1, every_n_train_steps=every)])
    t.fit(M(), data())
    print(json.dumps({"version_dir": t.logger.log_dir}))
