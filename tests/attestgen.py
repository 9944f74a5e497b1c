"""Saves with ckptd's commit records, written by the frameworks' own code (fwgen's forked jobs).

    python tests/attestgen.py OUT [trainer-whole]    # OUT/trainer-whole, OUT/trainer-killed, OUT/accelerate

- trainer-whole: the HF Trainer, 2-process DDP (gloo), checkpoint-2 and -4, with
  `ckptd.integrations.hf.AttestCallback` (heartbeat 0.2 s).
- trainer-killed: the same, rank 1 killed (SIGKILL, the whole job) in checkpoint-4's save, just
  before it writes rng_state_1.pth: its record never appears, its lease stays.
- accelerate: `Accelerator.save_state` twice, one process, with `ckptd.integrations.accelerate.install`.
Prints one JSON line: {"trainer_killed_holds": [...]}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fwgen

HEARTBEAT = 0.2


def _trainer_job(rank: int, world: int, out: str, run: str, kill: bool) -> None:
    import torch

    from ckptd.integrations.hf import AttestCallback

    trainer = fwgen._trainer_parts(Path(out) / run, 4)
    trainer.add_callback(AttestCallback(heartbeat=HEARTBEAT))
    if kill:
        torch_save = torch.save

        def hook(obj, f, *a, **k):
            p = Path(str(f))
            if rank == 1 and p.parent.name == "checkpoint-4" and p.name == "rng_state_1.pth":
                fwgen.hold("rank1_before_rng_state", path=str(p))
            torch_save(obj, f, *a, **k)

        torch.save = hook
    trainer.train()
    if kill:
        threading.Event().wait()  # rank 0: waits here for the kill


def _accelerate_job(rank: int, world: int, out: str) -> None:
    import torch
    from accelerate import Accelerator

    from ckptd.integrations import accelerate as attest_accelerate

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    attest_accelerate.install(accelerator, heartbeat=HEARTBEAT)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for step in (1, 2):
        loss = model(torch.randn(3, 4)).sum()
        accelerator.backward(loss)
        opt.step()
        accelerator.save_state(os.path.join(out, "accelerate", f"step_{step}"))


def main(out: Path, only: str | None = None) -> int:
    for k, v in fwgen._CHILD_ENV.items():
        os.environ.setdefault(k, v)
    fwgen._preimport("transformers", "transformers.trainer", "transformers.models.gpt2.modeling_gpt2",
                     "torch._dynamo", "accelerate", "safetensors.torch")
    ctl = Path(tempfile.mkdtemp(prefix="attestgen-ctl-"))
    try:
        fwgen.Job(ctl, "trainer-whole", _trainer_job, 2, out=str(out), run="trainer-whole", kill=False).join()
        if only == "trainer-whole":
            return 0
        holds = fwgen.Job(ctl, "trainer-killed", _trainer_job, 2, out=str(out), run="trainer-killed",
                          kill=True).kill_at(1)
        fwgen.Job(ctl, "accelerate", _accelerate_job, 1, out=str(out)).join()
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
    print(json.dumps({"trainer_killed_holds": holds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), *sys.argv[2:3]))
