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
from collections.abc import Collection, Mapping

from ckptd import slim
from ckptd.frameworks.base import Evidence, Framework, Save
from ckptd.layouts import Candidate
from ckptd.model import Entry

LAYOUT = "deepspeed"
_NAME = re.compile(r"global_step(\d+)")  # engine.save_checkpoint's default tag: f"global_step{global_steps}"

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_DS_FILE = re.compile(r"(?:[^/]+/)?(?:bf16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt")
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


# zero_to_fp32 (deepspeed/utils/zero_to_fp32.py) reads the model states and the optimizer shards of one
# tag, of mp_rank_00 only, and knows nothing of pipeline layer files.
_MODEL_STATES_0 = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_MODEL_PARALLEL = re.compile(r".*mp_rank_(?!00_)\d+_.*\.pt")
_PIPELINE_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def consolidation_problem(tag: str, names: Collection[str]) -> str | None:
    """Why zero_to_fp32 cannot consolidate the tag directory `tag` holding `names`, or None."""
    if not set(names) & set(_MODEL_STATES_0):
        return f"no model states in {tag} to consolidate from"
    if any(_MODEL_PARALLEL.fullmatch(n) for n in names):
        return "model-parallel shards (mp_rank_01...): zero_to_fp32 consolidates mp_rank_00 only"
    if any(_PIPELINE_LAYER.fullmatch(n) for n in names):
        return "pipeline-parallel layer files: zero_to_fp32 cannot consolidate them"
    return None


def model_states_file(files: Collection[str], inside: str) -> str:
    """The model-states file zero_to_fp32 is pointed at, in the tag directory `inside` ("" or "<tag>/")."""
    model = _MODEL_STATES_0[0]
    return model if f"{inside}{model}" in files else _MODEL_STATES_0[1]


def zero_to_fp32_reads(name: str) -> bool:
    return name.endswith(("model_states.pt", "optim_states.pt"))


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
    layout = LAYOUT
    named_alone = True
    names_first = True
    slim_weights = (slim.CONSOLIDATED,)  # only what ckptd consolidates from its shards
    checkpoint_is_tag = True

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = _NAME.fullmatch(name) if is_dir else None
        return Candidate(name, int(m[1]), LAYOUT, True) if m else None

    def evidence(self, save: Save) -> Evidence:
        return Evidence([save.deepspeed("")[0]])

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return [""]

    def slim_keeps(self, name: str) -> bool:
        return name.endswith("model_states.pt")  # what zero_to_fp32 and a resume need besides the shards

    def consolidation_source(self, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
        problem = consolidation_problem(name, {rel for rel in files if rel and "/" not in rel})
        return (None, problem) if problem else (name, None)

    def consolidation_paths(self, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
        return ".", name, f"{name}/{model_states_file(files, '')}"  # the tag's save_dir is the run directory

    def consolidation_reads(self, name: str) -> bool:
        return zero_to_fp32_reads(name)

    def save_file(self, rel: str) -> bool:
        return bool(_DS_FILE.fullmatch(rel))


FRAMEWORK = DeepSpeed()
