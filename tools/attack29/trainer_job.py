"""A real HF Trainer run (tiny GPT-2 built from a config, CPU, one process).

  python trainer_job.py train OUT N_EMBD SAVE_STEPS MAX_STEPS [KILL_STEP]
      trains from scratch into OUT; with KILL_STEP, the process SIGKILLs itself inside the save of
      checkpoint-KILL_STEP right after the weights (model.safetensors, config.json) were written and
      before training_args.bin (Trainer._save -> save_pretrained, then torch.save(args)).
      With HOLD=1 it prints "holding" there and blocks on stdin instead (a save in flight).
  python trainer_job.py resume OUT N_EMBD CKPT
      the Trainer's own resume: trainer.train(resume_from_checkpoint=CKPT) one step further;
      prints one JSON line {"resume": "ok" | error}.
"""
import json, os, signal, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class DS(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (8,), generator=g)
        return {"input_ids": ids, "labels": ids}


def make(out, n_embd, save_steps, max_steps):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps,
                             save_steps=save_steps, save_strategy="steps", logging_steps=1, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, save_total_limit=None, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=DS())


def main():
    mode, out, n_embd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "train":
        save_steps, max_steps = int(sys.argv[4]), int(sys.argv[5])
        kill = int(sys.argv[6]) if len(sys.argv) > 6 else None
        if kill is not None:
            orig = torch.save
            def save(obj, f, *a, **k):
                if str(f).endswith(os.path.join(f"checkpoint-{kill}", "training_args.bin")):
                    if os.environ.get("HOLD") == "1":      # a save that stalls here (slow storage), still in flight
                        print("holding", flush=True)
                        sys.stdin.read()
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(obj, f, *a, **k)
            torch.save = save
        make(out, n_embd, save_steps, max_steps).train()
        print(json.dumps({"trained": True}))
    else:
        ckpt = sys.argv[4]
        step = int(ckpt.rstrip("/").rsplit("-", 1)[1])
        try:
            make(out + "-resume", n_embd, 1000, step + 1).train(resume_from_checkpoint=ckpt)
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"resume": res}))


if __name__ == "__main__":
    main()
