"""Lightning: `ModelCheckpoint` replaced by `ckptd.integrations.lightning.AttestedModelCheckpoint(...)`
(the same arguments), for strategies whose checkpoint is a directory (DeepSpeed, FSDP's sharded
state dict).

Lightning's `Callback` hooks see a save only before it is written (`on_save_checkpoint` gets the
dict, not the path); `ModelCheckpoint._save_checkpoint(trainer, filepath)` (lightning 2.x,
callbacks/model_checkpoint.py) is where each save runs, on every rank (`trainer.save_checkpoint`
gathers and writes), so the subclass wraps it. A single-file `.ckpt` has no directory for records:
it is saved as before, without one, and ckptd judges it as before.
"""

from __future__ import annotations

from typing import Any

from ckptd import attest

__all__ = ["AttestedModelCheckpoint"]


def _base() -> type:
    try:
        from lightning.pytorch.callbacks import ModelCheckpoint
    except ImportError:  # the older package name
        from pytorch_lightning.callbacks import ModelCheckpoint
    return ModelCheckpoint


class _Attested:
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if not _is_sharded(trainer):  # one .ckpt file: no directory to hold records
            return super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        with attest.saving(filepath, trainer.global_rank, trainer.world_size, step=trainer.global_step):
            super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]


def _is_sharded(trainer: Any) -> bool:
    name = type(trainer.strategy).__name__
    sharded_fsdp = name.startswith("FSDP") and getattr(trainer.strategy, "_state_dict_type", "") == "sharded"
    return name.startswith("DeepSpeed") or sharded_fsdp


def AttestedModelCheckpoint(*args: Any, **kwargs: Any) -> Any:
    """A Lightning `ModelCheckpoint` writing each rank's commit record after each directory save."""
    cls = type("AttestedModelCheckpoint", (_Attested, _base()), {})
    return cls(*args, **kwargs)
