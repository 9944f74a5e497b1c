"""A real Lightning fit from scratch with the default logger (EXP/lightning_logs/version_N/checkpoints/),
ModelCheckpoint(save_top_k=-1, every_n_train_steps=EVERY_N), optionally SIGKILLed in the middle of writing
the save of step KILL_STEP: Lightning's own _atomic_save (torch.save into a buffer, then one write into
the final name, no rename) is wrapped so that, at that save, the first half of the bytes Lightning
produced reach the file and then the process SIGKILLs itself (what a kill during the write leaves).

  python lightning_kill.py EXP MAX_STEPS EVERY_N [KILL_STEP [CKPT_PATH]]
"""
import io, json, os, signal, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import lightning.fabric.plugins.io.torch_io as tio
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_job import M, data

if __name__ == "__main__":
    torch.manual_seed(0)
    exp, max_steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kill = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    ckpt_path = sys.argv[5] if len(sys.argv) > 5 else None
    orig = tio._atomic_save

    def save(checkpoint, filepath):
        if kill and checkpoint.get("global_step") == kill:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            b = buf.getvalue()
            with open(filepath, "wb") as f:
                f.write(b[: len(b) // 2])
                f.flush()
                os.fsync(f.fileno())
            print(json.dumps({"killed_in": str(filepath)}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(checkpoint, filepath)

    tio._atomic_save = save
    t = pl.Trainer(max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                   default_root_dir=exp, callbacks=[ModelCheckpoint(save_top_k=-1, every_n_train_steps=every)])
    t.fit(M(), data(), ckpt_path=ckpt_path)
    print(json.dumps({"version_dir": t.logger.log_dir}))
