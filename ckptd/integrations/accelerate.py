"""accelerate: `ckptd.integrations.accelerate.install(accelerator)`, once, after creating it.

`Accelerator.save_state` (accelerate 1.x, accelerator.py) calls every hook registered with
`register_save_state_pre_hook(hook)` as `hook(models, weights, output_dir)` on every process
before it writes, with the directory it resolved (`automatic_checkpoint_naming` included), and
has no hook after. So the pre-hook takes the lease, and `save_state` is wrapped on this
accelerator to write the process's record when it returns (none if it raised).
"""

from __future__ import annotations

import functools
from typing import Any

from ckptd import attest

__all__ = ["install"]


def install(accelerator: Any, *, heartbeat: float = attest.HEARTBEAT, hash_files: bool = False) -> Any:
    """Record each process's part of every `accelerator.save_state`; returns the hook's handle."""
    saves: list[attest.Save] = []

    def pre_hook(models: Any, weights: Any, output_dir: str) -> None:
        saves.append(attest.begin(
            output_dir, accelerator.process_index, accelerator.num_processes,
            step=getattr(accelerator, "step", None), heartbeat=heartbeat, hash_files=hash_files,
        ))  # fmt: skip

    save_state = accelerator.save_state

    @functools.wraps(save_state)
    def attested_save_state(*args: Any, **kwargs: Any) -> Any:
        try:
            out = save_state(*args, **kwargs)
        except BaseException:
            while saves:
                saves.pop().stop()  # no record; the lease's stopped heartbeat says where it ended
            raise
        while saves:
            saves.pop().commit()
        return out

    accelerator.save_state = attested_save_state
    return accelerator.register_save_state_pre_hook(pre_hook)
