"""DeepSpeed: `engine = ckptd.integrations.deepspeed.wrap(engine)`, after `deepspeed.initialize`.

`DeepSpeedEngine.save_checkpoint(save_dir, tag=None, ...)` (deepspeed/runtime/engine.py) runs on
every rank and writes into `save_dir/<tag>` (tag `global_step<N>` by default); rank 0 writes
`latest` before the final barrier, so `latest` says nothing of the other ranks. The wrapper
holds this rank's lease on the tag directory while it runs and writes its record when it
returns (none if it raised).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ckptd import attest

__all__ = ["wrap"]


def wrap(engine: Any, *, heartbeat: float = attest.HEARTBEAT, hash_files: bool = False) -> Any:
    """`engine`, its `save_checkpoint` writing this rank's commit record into the tag directory."""
    save_checkpoint = engine.save_checkpoint

    @functools.wraps(save_checkpoint)
    def attested(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        name = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        rank, world = engine.global_rank, engine.world_size
        with attest.saving(os.path.join(save_dir, name), rank, world, step=engine.global_steps,
                           heartbeat=heartbeat, hash_files=hash_files):  # fmt: skip
            return save_checkpoint(save_dir, tag, *args, **kwargs)

    engine.save_checkpoint = attested
    return engine
