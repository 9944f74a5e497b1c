"""Real DCP saves with `use_collectives=False`, for tests/completeness/test_dcp_local_metadata.py.

``python -m tests.support.fwdcp_local OUT``: two gloo ranks on the CPU each `dcp.save(...,
use_collectives=False)` into OUT/run/step_10 and step_20: every rank writes its `__<rank>_0.distcp`
and its own `__<rank>.metadata` (torch/distributed/checkpoint/filesystem.py _FileSystemWriter.finish,
`_get_metadata_path(rank)`), and no global `.metadata`. Then each rank loads step_20 back with
`dcp.load` (which falls back to its rank-local metadata: state_dict_loader.py local_step) and checks
what it saved: the framework's own verdict that the save is whole. Prints "loaded" when it is.
"""

from __future__ import annotations

import os
import socket
import sys

from tests.support import refuse_in_light_test


def _job(rank: int, world: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    saved = {}
    for step in (10, 20):
        sd = {f"w{rank}": torch.randn(4, 4), "step": torch.tensor(step)}
        dcp.save(sd, checkpoint_id=os.path.join(out, "run", f"step_{step}"), use_collectives=False)
        saved = sd
    dist.barrier()
    back = {f"w{rank}": torch.zeros(4, 4), "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=os.path.join(out, "run", "step_20"))
    assert int(back["step"]) == 20 and torch.equal(back[f"w{rank}"], saved[f"w{rank}"])
    dist.destroy_process_group()


def main(out: str) -> int:
    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_job, args=(2, out, port), nprocs=2)
    print("loaded")
    return 0


if __name__ == "__main__":
    refuse_in_light_test("a torch.distributed.checkpoint save (tests/support/fwdcp_local.py)")
    sys.exit(main(sys.argv[1]))
