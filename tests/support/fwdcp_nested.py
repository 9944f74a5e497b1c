"""A real accelerate checkpoint holding a real DCP directory, for tests/completeness/test_dcp_nested.py.

``python -m tests.support.fwdcp_nested save OUT``: accelerate's `Accelerator.save_state` (one CPU process)
writes OUT/run/checkpoint_0, and `torch.distributed.checkpoint.save` writes the model's state dict
into its `pytorch_model_fsdp_0/` (two data files), where accelerate's FSDP SHARDED_STATE_DICT puts it
(accelerate/utils/fsdp_utils.py save_fsdp_model: `dist_cp.save(state_dict, storage_writer=
FileSystemWriter(ckpt_dir))`, ckpt_dir `pytorch_model_fsdp_0`). FSDP itself cannot run on the CPU
here, so DCP's own writer is called directly, as that function calls it. Prints "saved".

``python -m tests.support.fwdcp_nested load CKPT``: `dcp.load` of CKPT/pytorch_model_fsdp_0 into a fresh
model's state dict, compared with what was saved; prints "loaded" when DCP reads it back whole,
else exits 1 with DCP's error.

``python -m tests.support.fwdcp_nested serve``: the same load for each CKPT read as a line from stdin, in this one
process (importing torch is most of a load's CPU time), each answered with its output, then a line ``rc N``:
N the exit code `load CKPT` would have had.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support import refuse_in_light_test


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def save(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = model(torch.randn(2, 64)).sum()
    accelerator.backward(loss)
    optimizer.step()
    ckpt = out / "run" / "checkpoint_0"
    accelerator.save_state(str(ckpt))
    # Two writer threads: two data files (`__0_0.distcp`, `__0_1.distcp`), as a real multi-file save
    writer = dcp.FileSystemWriter(str(ckpt / "pytorch_model_fsdp_0"), thread_count=2)
    dcp.save({"model": accelerator.unwrap_model(model).state_dict()}, storage_writer=writer)
    torch.save(accelerator.unwrap_model(model).state_dict(), out / "truth.pt")
    print("saved")


def load(ckpt: Path) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    truth = torch.load(ckpt.parent.parent / "truth.pt", weights_only=True)
    back = {"model": {k: torch.zeros_like(v) for k, v in truth.items()}}
    try:
        dcp.load(back, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    except Exception as exc:  # CheckpointException, FileNotFoundError, ...: DCP's own verdict
        print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
        return 1
    if not all(torch.equal(back["model"][k], v) for k, v in truth.items()):
        print("failed: read back different")
        return 1
    print("loaded")
    return 0


def serve() -> int:
    import torch.distributed.checkpoint.api

    for line in sys.stdin:
        try:
            code = load(Path(line.rstrip("\n")))
        except (Exception, torch.distributed.checkpoint.api.CheckpointException) as exc:
            # uncaught in `load CKPT` (DCP's CheckpointException is a BaseException): Python's exit code 1
            print(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
            code = 1
        print(f"rc {code}", flush=True)
    return 0


if __name__ == "__main__":
    refuse_in_light_test("accelerate and a torch.distributed.checkpoint save (tests/support/fwdcp_nested.py)")
    if sys.argv[1] == "serve":
        sys.exit(serve())
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(load(Path(sys.argv[2])))
