"""A real accelerate job with two prepared models and optimizers (a GAN-style setup) and two objects
registered for checkpointing (accelerator.register_for_checkpointing): save_state writes
model.safetensors, model_1.safetensors, optimizer.bin, optimizer_1.bin, custom_checkpoint_0.pkl,
custom_checkpoint_1.pkl, random_states_0.pkl.

  python accelerate_multi.py save RUN STEPS_CSV     -> RUN/step_N
  python accelerate_multi.py load DIR               -> {"load_state": "ok"|error}
"""
import json, os, sys
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import torch
from accelerate import Accelerator


class Counter:
    def __init__(self): self.n = 0
    def state_dict(self): return {"n": self.n}
    def load_state_dict(self, sd): self.n = sd["n"]


def parts():
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    g = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    d = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    og, od = torch.optim.AdamW(g.parameters()), torch.optim.AdamW(d.parameters())
    g, d, og, od = acc.prepare(g, d, og, od)
    c1, c2 = Counter(), Counter()
    acc.register_for_checkpointing(c1, c2)
    return acc, g, d, og, od, c1, c2


if __name__ == "__main__":
    if sys.argv[1] == "save":
        acc, g, d, og, od, c1, c2 = parts()
        for s in [int(x) for x in sys.argv[3].split(",")]:
            for _ in range(2):
                loss = d(g(torch.randn(4, 8))).mean()
                acc.backward(loss); og.step(); od.step(); og.zero_grad(); od.zero_grad()
                c1.n += 1; c2.n += 2
            acc.save_state(os.path.join(sys.argv[2], f"step_{s}"))
        print(json.dumps({"saved": True}))
    else:
        p = parts()
        try:
            p[0].load_state(sys.argv[2])
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"load_state": res}))
