"""DeepSpeed's own checkpoints: `global_step<N>/` beside the `latest` tag pointer.

`engine.save_checkpoint(save_dir, tag)` writes every rank's optimizer shard
(`[bf16_]zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt`) and the model states (`mp_rank_<m>_model_states.pt`,
one per data-parallel rank under ZeRO-3) into `<save_dir>/<tag>/`, and rank 0 writes `latest`
before the other ranks finish: `latest` is a resume pointer, never completeness evidence. The
census (every rank's shard, the world sizes from the model states' own metadata) is the engine's
(`evidence.Inspector._deepspeed`, which remembers what it read); the frameworks that save through
DeepSpeed (the Trainer, accelerate, Lightning's DeepSpeedStrategy) ask for it on their tags.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckptd import layouts, slim
from ckptd.frameworks.base import Evidence, Framework, Save
from ckptd.model import Entry

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_DS_FILE = re.compile(r"(?:[^/]+/)?(?:bf16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt")
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


def _global_step_dirs(files: dict[str, Entry]) -> list[str]:
    return sorted(
        rel
        for rel, e in files.items()
        if e.kind == "d" and "/" not in rel and re.fullmatch(r"global_step\d+", rel)
    )


def _deepspeed_tag_dirs(files: dict[str, Entry]) -> list[str]:
    """Top-level directories holding DeepSpeed model states (accelerate names its tag `pytorch_model`)."""
    return sorted(
        {rel.partition("/")[0] for rel in files if rel.count("/") == 1 and rel.endswith("model_states.pt")}
    )


class DeepSpeed(Framework):
    layout = layouts.DEEPSPEED
    named_alone = True
    slim_weights = (slim.CONSOLIDATED,)  # only what ckptd consolidates from its shards
    checkpoint_is_tag = True

    def evidence(self, save: Save) -> Evidence:
        return Evidence([save.deepspeed("")[0]])

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return [""]

    def save_file(self, rel: str) -> bool:
        return bool(_DS_FILE.fullmatch(rel))


FRAMEWORK = DeepSpeed()
