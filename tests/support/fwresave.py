"""A real HF Trainer re-saving into an output_dir that already holds its checkpoints, SIGKILLed
inside the save right after the weights, for tests/completeness/test_resave.py.

``python -m tests.support.fwresave train OUT N_EMBD SAVE_STEPS MAX_STEPS [KILL_STEP]``: a tiny
GPT-2 built from a config (CPU, one process, offline) trained from scratch into OUT. With
KILL_STEP the process SIGKILLs itself inside the save of checkpoint-KILL_STEP when the Trainer goes
to write training_args.bin: transformers' Trainer._save_checkpoint writes the model first
(save_pretrained: config.json, model.safetensors), then training_args.bin, the optimizer and
scheduler, the rng state, and trainer_state.json last. Prints "trained" when not killed.

``python -m tests.support.fwresave resume OUT N_EMBD CKPT``: the Trainer's own resume,
``train(resume_from_checkpoint=CKPT)`` one step further; prints "resumed", or "failed: <error>"
and exits 1.

``python -m tests.support.fwresave serve``: each line read from stdin is one of the commands above (its
arguments as a JSON list), run in a process forked from this one, which imported torch and transformers
once (most of a short job's CPU time); each answered with its output, then a line ``rc N``: N the exit
code the command would have had as a process of its own (-9 when it SIGKILLed itself).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from tests.support import refuse_in_light_test


def _trainer(out: str, n_embd: int, save_steps: int, max_steps: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps,
                             save_steps=save_steps, save_strategy="steps", logging_steps=1, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Data())


def train(out: str, n_embd: int, save_steps: int, max_steps: int, kill: int | None) -> None:
    import torch

    if kill is not None:
        real_save = torch.save
        target = os.path.join(f"checkpoint-{kill}", "training_args.bin")

        def save(obj, f, *args, **kwargs):
            if str(f).endswith(target):  # the weights are on disk; nothing after them is
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    _trainer(out, n_embd, save_steps, max_steps).train()
    print("trained")


def resume(out: str, n_embd: int, ckpt: str) -> int:
    step = int(ckpt.rstrip("/").rsplit("-", 1)[1])
    try:
        _trainer(out + "-resume", n_embd, 1000, step + 1).train(resume_from_checkpoint=ckpt)
    except Exception as exc:  # the Trainer's own verdict: a size mismatch, a missing file
        print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
        return 1
    print("resumed")
    return 0


def command(argv: list[str]) -> int:
    if argv[0] == "train":
        kill = int(argv[5]) if len(argv) > 5 else None
        train(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), kill)
        return 0
    return resume(argv[1], int(argv[2]), argv[3])


def serve() -> int:
    import torch  # noqa: F401  imported before the forks: each child inherits them
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel, Trainer  # noqa: F401

    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:  # the child: one command, as its own process runs it; never back into this loop
            code = 1  # what an exception uncaught in the command's own process exits with
            try:
                code = command(json.loads(line))
            except BaseException as exc:
                print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"rc {os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)}", flush=True)
    return 0


if __name__ == "__main__":
    refuse_in_light_test("an HF Trainer job (tests/support/fwresave.py)")
    sys.exit(serve() if sys.argv[1] == "serve" else command(sys.argv[1:]))
