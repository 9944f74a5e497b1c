"""One real DCP save, for the hand-made look-alikes of frameworks that cannot save here (NeMo,
Megatron-core, torchtitan's staged shards: tests/discovery/test_fwlayouts.py, test_one_save.py).

``python -m tests.support.fwdcp_one OUT``: `torch.distributed.checkpoint.save` in one process with no
process group (DCP's no-dist path: torch/distributed/checkpoint/state_dict_saver.py `save`) writes
OUT/.metadata and OUT/__0_0.distcp (FileSystemWriter, one thread), then `dcp.load` reads it back
and compares. Prints "loaded" when DCP reads it back whole.

The files are the ones megatron-core's torch_dist strategy writes beside its common.pt (its
TorchDistSaveShardedStrategy calls the same FileSystemWriter): `.metadata` names `__0_0.distcp`
by a relative path, so a copy into another directory is the same save there (`put_dcp`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.support import refuse_in_light_test

FILES = (".metadata", "__0_0.distcp")


def save(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    sd = {"decoder.weight": torch.randn(16, 16), "decoder.bias": torch.randn(16), "iteration": torch.tensor(100)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out), thread_count=1), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items()), "read back different"
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES), sorted(p.name for p in out.iterdir())
    print("loaded")


def put_dcp(volume: dict, d: Path) -> Path:
    """Copy the save in `volume` (the `dcp_one` fixture) into directory `d`: a whole DCP save there."""
    d.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(volume["out_dir"] / name, d / name)
    return d


if __name__ == "__main__":
    refuse_in_light_test("a torch.distributed.checkpoint save (tests/support/fwdcp_one.py)")
    save(Path(sys.argv[1]))
