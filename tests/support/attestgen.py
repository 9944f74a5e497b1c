"""Saves with ckptd's commit records, written by the frameworks' own code (fwgen's forked jobs).

    python -m tests.support.attestgen OUT [trainer-whole]    # OUT/trainer-whole, -killed, -killed-late, accelerate
    python -m tests.support.attestgen OUT trainer-ds         # OUT/trainer-ds only

- trainer-whole: the HF Trainer, 2-process DDP (gloo), checkpoint-2 and -4, with
  `ckptd.integrations.hf.AttestCallback` (heartbeat 0.2 s).
- trainer-killed: the same, killed (SIGKILL, the whole job) in checkpoint-4's save once both ranks
  hold, each just before it writes its own rng_state_<rank>.pth: neither rng state, nor
  trainer_state.json (rank 0 writes it after its rng state), nor any record appears; both leases
  stay. Both ranks hold at a fixed point, so the files are the same on every run: with rank 1 alone
  held, rank 0 ran on and, on a loaded machine, had written rng_state_0.pth before the kill.
- trainer-killed-late: the same kill, rank 0 held just after it wrote rng_state_0.pth instead: a save
  killed after rank 0's rng state (rng_state_0.pth there, trainer_state.json not).
- accelerate: `Accelerator.save_state` twice, one process, with `ckptd.integrations.accelerate.install`.
- trainer-ds: the HF Trainer with DeepSpeed ZeRO-2 (`TrainingArguments(deepspeed=...)`, gloo, on the CPU),
  2 processes, `AttestCallback`, saves every 2 steps to 6, eval_loss best at checkpoint-2 (the oldest:
  `load_best_model_at_end` loads it back at the end); rank 1 slow in checkpoint-6's save (its
  `on_save` waits SLOW_S before the callback's record). Then `ckptd latest` names the checkpoint to
  resume from, and the same job resumes from it to step 8.
Prints one JSON line: {"trainer_killed_holds": {run: [...]}}, or for trainer-ds {"records": {rank:
mtime} of checkpoint-6, "latest": ..., "resumed": {what the resumed Trainer did}}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support import fwgen, refuse_in_light_test

HEARTBEAT = 0.2
SLOW_S = 5.0  # rank 1's delay in checkpoint-6's save: longer than the test's quiet period (2 s)
SLOW_STEP = 6
TRAINER_DS_LOSSES = {2: 0.3, 4: 0.6, 6: 0.5, 8: 0.7}  # eval_loss by step: the best is the oldest
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
}  # fmt: skip


def _trainer_job(rank: int, world: int, out: str, run: str, kill: str | None) -> None:
    """kill: None (a whole run), "before" (each rank holds just before its checkpoint-4 rng state),
    "after-rank0" (rank 0 holds just after writing its rng state, rank 1 just before its own)."""
    import torch

    from ckptd.integrations.hf import AttestCallback

    trainer = fwgen._trainer_parts(Path(out) / run, 4)
    trainer.add_callback(AttestCallback(heartbeat=HEARTBEAT))
    if kill is not None:
        torch_save = torch.save
        after = kill == "after-rank0" and rank == 0

        def hook(obj, f, *a, **k):
            p = Path(str(f))
            mine = p.parent.name == "checkpoint-4" and p.name == f"rng_state_{rank}.pth"
            if mine and not after:
                fwgen.hold(f"rank{rank}_before_rng_state", path=str(p))
            torch_save(obj, f, *a, **k)
            if mine and after:
                fwgen.hold(f"rank{rank}_after_rng_state", path=str(p))

        torch.save = hook
    trainer.train()


def _trainer_ds_job(rank: int, world: int, out: str, run: str, max_steps: int, resume: str | None) -> None:
    from transformers import TrainerCallback

    from ckptd.integrations.hf import AttestCallback
    from tests.support import dsgen

    dsgen._skip_shm_build()  # gloo collectives, no g++ build of DeepSpeed's shm op (dsgen.py)
    fwgen.EVAL_LOSSES = TRAINER_DS_LOSSES  # what fwgen's ChosenEvalLoss reports as eval_loss

    class SlowRank(TrainerCallback):
        """Rank 1's part of checkpoint-6's save ends SLOW_S late: added before AttestCallback, whose
        on_save (the record) then runs after this one (CallbackHandler calls them in order)."""

        def on_save(self, args, state, control, **kwargs):
            if args.process_index == 1 and state.global_step == SLOW_STEP:
                time.sleep(SLOW_S)  # the slow save itself, not synchronisation

    class Steps(TrainerCallback):
        ran = 0

        def on_step_end(self, args, state, control, **kwargs):
            Steps.ran += 1

    trainer = fwgen._trainer_parts(Path(out) / run, max_steps, deepspeed=DS_CONFIG)
    for cb in (SlowRank(), AttestCallback(heartbeat=HEARTBEAT), Steps()):
        trainer.add_callback(cb)
    trainer.train(resume_from_checkpoint=resume)
    fwgen.write_result("trainer", {"global_step": trainer.state.global_step, "steps_run": Steps.ran,
                                   "best": trainer.state.best_model_checkpoint})


def _trainer_ds(out: Path, ctl: Path) -> dict:
    run = out / "trainer-ds"
    fwgen.Job(ctl, "trainer-ds", _trainer_ds_job, 2, out=str(out), run=run.name, max_steps=6, resume=None).join()
    ck = run / f"checkpoint-{SLOW_STEP}"
    records = {p.name: p.stat().st_mtime for p in sorted((ck / ".ckptd").glob("commit-*"))}
    latest = subprocess.run([sys.executable, "-m", "ckptd", "latest", str(run)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    if latest.returncode != 0:
        raise RuntimeError(f"ckptd latest: {latest.returncode} {latest.stderr}")
    resume = latest.stdout.strip()
    job = fwgen.Job(ctl, "trainer-ds-resumed", _trainer_ds_job, 2, out=str(out), run=run.name, max_steps=8,
                    resume=resume)  # fmt: skip
    job.join()
    return {"records": records, "latest": resume, "latest_said": latest.stderr,
            "resumed": job.results("trainer")[0]}


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
    if only == "trainer-ds":
        from tests.support import dsgen

        for k, v in dsgen._CHILD_ENV.items():  # DS_ACCELERATOR=cpu among them
            os.environ.setdefault(k, v)
        fwgen._preimport("deepspeed")
        try:
            print(json.dumps(_trainer_ds(out, ctl)))
        finally:
            shutil.rmtree(ctl, ignore_errors=True)
        return 0
    try:
        fwgen.Job(ctl, "trainer-whole", _trainer_job, 2, out=str(out), run="trainer-whole", kill=None).join()
        if only == "trainer-whole":
            return 0
        holds = {}
        for run, kill in (("trainer-killed", "before"), ("trainer-killed-late", "after-rank0")):
            holds[run] = fwgen.Job(ctl, run, _trainer_job, 2, out=str(out), run=run, kill=kill).kill_at(2)
        fwgen.Job(ctl, "accelerate", _accelerate_job, 1, out=str(out)).join()
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
    print(json.dumps({"trainer_killed_holds": holds}))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("a real Trainer run (tests/support/attestgen.py)")
    sys.exit(main(Path(sys.argv[1]).resolve(), *sys.argv[2:3]))
