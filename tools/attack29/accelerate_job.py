"""A real accelerate job (CPU, one process): Accelerator.save_state(DIR/step_N).

  python accelerate_job.py train RUN WIDTH STEPS_CSV [KILL_STEP]
      saves RUN/step_N for each N; with KILL_STEP the process SIGKILLs itself inside that save right
      after model.safetensors was written, before optimizer.bin (checkpointing.save_accelerator_state).
  python accelerate_job.py load DIR WIDTH   -> {"load_state": "ok" | error}: load_state(DIR), then one training step (a resume)
"""
import json, os, signal, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch
from accelerate import Accelerator
import accelerate.checkpointing as ck


def parts(width):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train(acc, model, opt, sched, n):
    for _ in range(n):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        acc.backward(loss); opt.step(); sched.step(); opt.zero_grad()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        run, width, steps = sys.argv[2], int(sys.argv[3]), [int(s) for s in sys.argv[4].split(",")]
        kill = int(sys.argv[5]) if len(sys.argv) > 5 else None
        orig = ck.save
        cur = {"step": None}
        def save(obj, f, *a, **k):
            if cur["step"] == kill and str(f).endswith("optimizer.bin"):
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(obj, f, *a, **k)
        ck.save = save
        p = parts(width)
        last = 0
        for s in steps:
            train(*p, s - last); last = s
            cur["step"] = s
            p[0].save_state(os.path.join(run, f"step_{s}"))
        print(json.dumps({"saved": steps}))
    else:
        d, width = sys.argv[2], int(sys.argv[3])
        p = parts(width)
        try:
            p[0].load_state(d)
            train(*p, 1)   # resume: one more step with what was restored
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"load_state": res}))
