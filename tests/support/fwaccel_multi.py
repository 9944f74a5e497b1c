"""A real accelerate job with two prepared models and two objects registered for checkpointing, for
tests/completeness/test_accelerate_objects.py.

``python -m tests.support.fwaccel_multi save RUN STEPS``: a GAN-style setup on the CPU (two models,
two AdamW optimizers, `accelerator.register_for_checkpointing` of two small stateful objects), a
few steps, then `Accelerator.save_state(RUN/step_<N>)` for each N of the comma-separated STEPS:
model.safetensors, model_1.safetensors, optimizer.bin, optimizer_1.bin, custom_checkpoint_0.pkl,
custom_checkpoint_1.pkl, random_states_0.pkl (accelerate checkpointing.py save_accelerator_state,
save_custom_state). Prints "saved".

``python -m tests.support.fwaccel_multi load DIR``: the same objects, then `load_state(DIR)`; prints
"loaded", or "failed: <accelerate's error>" and exits 1.

``python -m tests.support.fwaccel_multi serve``: that load for each DIR read as a line from stdin, each in a
process forked from this one, which imported torch and accelerate once (most of a load's CPU time); each
answered with its output, then a line ``rc N``, N the exit code `load DIR` would have had.
"""

from __future__ import annotations

import os
import sys

from tests.support import refuse_in_light_test


class Counter:
    """A registered object: anything with state_dict/load_state_dict (accelerate checks for both)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def _parts():
    import torch
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    g = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    d = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    og, od = torch.optim.AdamW(g.parameters()), torch.optim.AdamW(d.parameters())
    g, d, og, od = acc.prepare(g, d, og, od)
    c1, c2 = Counter(), Counter()
    acc.register_for_checkpointing(c1, c2)
    return acc, g, d, og, od, c1, c2


def save(run: str, steps: list[int]) -> None:
    import torch

    acc, g, d, og, od, c1, c2 = _parts()
    for step in steps:
        for _ in range(2):
            loss = d(g(torch.randn(4, 8))).mean()
            acc.backward(loss)
            og.step()
            od.step()
            og.zero_grad()
            od.zero_grad()
            c1.n += 1
            c2.n += 2
        acc.save_state(f"{run}/step_{step}")
    print("saved")


def load(path: str) -> int:
    acc = _parts()[0]
    try:
        acc.load_state(path)
    except Exception as exc:  # FileNotFoundError, ValueError ("Number of custom checkpoints ..."): its verdict
        print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
        return 1
    print("loaded")
    return 0


def serve() -> int:
    import accelerate  # noqa: F401  imported before the forks: each child inherits it
    import torch  # noqa: F401

    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:  # the child: one load, as `load DIR` runs it; never back into this loop
            code = 1  # what an exception uncaught in `load DIR` exits with
            try:
                code = load(line.rstrip("\n"))
            except BaseException as exc:
                print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"rc {os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)}", flush=True)
    return 0


if __name__ == "__main__":
    refuse_in_light_test("an accelerate job (tests/support/fwaccel_multi.py)")
    if sys.argv[1] == "serve":
        sys.exit(serve())
    if sys.argv[1] == "save":
        save(sys.argv[2], [int(s) for s in sys.argv[3].split(",")])
        sys.exit(0)
    sys.exit(load(sys.argv[2]))
