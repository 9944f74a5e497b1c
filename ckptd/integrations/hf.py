"""The Hugging Face Trainer: `trainer.add_callback(ckptd.integrations.hf.AttestCallback())`.

The Trainer (transformers 5.x `Trainer._inner_training_loop`) calls `on_step_end` (or
`on_epoch_end`) after `DefaultFlowCallback` has decided `control.should_save`, then saves in
`_maybe_log_save_evaluate` (`_save_checkpoint`) and calls `on_save` on every process once that
process's part of the save has returned. So the lease is taken where the save is decided and the
record written at `on_save`: the files new or changed in `checkpoint-<global_step>` since then
(`ckptd.attest`). With `save_strategy="best"` the decision comes after evaluation: the save is
then taken as starting at the evaluation (`on_evaluate`).
"""

from __future__ import annotations

import os
from typing import Any

from ckptd import attest

__all__ = ["AttestCallback"]


def _base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


def _checkpoint_dir(args: Any, state: Any) -> str:
    # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR, as Trainer._save_checkpoint names it
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


class _Attest:
    def __init__(self, *, heartbeat: float = attest.HEARTBEAT, hash_files: bool = False):
        self.heartbeat = heartbeat
        self.hash_files = hash_files
        self._save: attest.Save | None = None  # the save in progress

    def _begin(self, args: Any, state: Any) -> None:
        if self._save is not None:
            return
        self._save = attest.begin(
            _checkpoint_dir(args, state), args.process_index, args.world_size, step=state.global_step,
            heartbeat=self.heartbeat, hash_files=self.hash_files,
        )  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._begin(args, state)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._begin(args, state)

    def on_evaluate(self, args, state, control, **kwargs):
        if str(getattr(args, "save_strategy", "")).endswith("best"):
            self._begin(args, state)

    def on_save(self, args, state, control, **kwargs):
        if self._save is not None and str(self._save.checkpoint) != _checkpoint_dir(args, state):
            self._save.stop(drop_lease=True)  # announced for another step: not this save
            self._save = None
        if self._save is None:  # a save no hook announced: only what it wrote since now is known
            self._begin(args, state)
        save, self._save = self._save, None
        save.commit()

    def on_train_end(self, args, state, control, **kwargs):
        if self._save is not None:  # announced, never saved (a best-only save that was not best)
            self._save.stop(drop_lease=True)
            self._save = None


def AttestCallback(*, heartbeat: float = attest.HEARTBEAT, hash_files: bool = False) -> Any:
    """A `transformers.TrainerCallback` writing each process's commit record after each save."""
    cls = type("AttestCallback", (_Attest, _base()), {})
    return cls(heartbeat=heartbeat, hash_files=hash_files)
