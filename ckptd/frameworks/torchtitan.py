"""torchtitan: `<dump>/checkpoint/step-<N>/`, a DCP save (dcp.py's contract), or its last save in HF format.

torchtitan/components/checkpoint.py: `_create_checkpoint_id` names the step directory, `dcp.save`
writes it; with `last_save_in_hf` the final save is safetensors shards and `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd.frameworks import dcp
from ckptd.frameworks.base import FAILED, MAX_TRAINER_STATE_BYTES, PASSED, UNKNOWN, Evidence, Framework, Save
from ckptd.frameworks.hfweights import SAFETENSORS_INDEX
from ckptd.model import Candidate, Check, Entry
from ckptd.volume import volread

LAYOUT = "torchtitan"
_NAME = re.compile(r"step-(\d+)")  # torchtitan/components/checkpoint.py _create_checkpoint_id
HF_INDEX = SAFETENSORS_INDEX  # its last save in HF format (last_save_in_hf)

def _torchtitan(path: Path, files: dict[str, Entry]) -> Check:
    """torchtitan's own rule (components/checkpoint.py `_find_load_step`): a `step-N` it loads holds
    DCP's `.metadata`, or `model.safetensors.index.json` when its last save was in HF format; then
    every shard the index names must be there too (their integrity is checked with the rest)."""
    name = "torchtitan step"
    if ".metadata" in files:
        return Check(name, PASSED, ".metadata present (the DCP coordinator writes it after every rank)")
    index = files.get(HF_INDEX)
    if index is None or index.kind != "f":
        return Check(name, FAILED, f"neither .metadata nor {HF_INDEX} (written last)")
    if index.size > MAX_TRAINER_STATE_BYTES:
        return Check(name, UNKNOWN, f"{HF_INDEX}: {index.size} bytes, too large to parse")
    try:
        with volread.open_file(path / HF_INDEX) as f:
            weight_map = json.loads(f.read(MAX_TRAINER_STATE_BYTES + 1)).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as exc:
        return Check(name, FAILED, f"{HF_INDEX} unreadable: {type(exc).__name__}: {exc}")
    if not isinstance(weight_map, dict) or not weight_map:
        return Check(name, FAILED, f"{HF_INDEX} has no weight_map")
    shards = sorted({str(v) for v in weight_map.values()})
    missing = [s for s in shards if s not in files]
    if missing:
        present = len(shards) - len(missing)
        return Check(name, FAILED, f"{missing[0]} missing ({present}/{len(shards)} shards in the HF index)")
    return Check(name, PASSED, f"{HF_INDEX} and its {len(shards)} shards (HF format)")


class Torchtitan(Framework):
    layout = LAYOUT
    read_whole = frozenset({".metadata"})  # dcp.storage_check reads what it names

    def makes_dir(self, name: str) -> bool:
        return name == "checkpoint"  # <dump_folder>/checkpoint/step-<N>/ (CheckpointManager's folder)

    def recognise_contents(self, name: str, children: Collection[str]) -> Candidate | None:
        """A `step-<N>` directory holding DCP's files, its HF index, or a `sharded` one."""
        titan = dcp.looks_like_dcp(children) or HF_INDEX in children or "sharded" in children
        if titan and (m := _NAME.fullmatch(name)):
            return Candidate(name, int(m[1]), LAYOUT, True)
        return None

    def evidence(self, save: Save) -> Evidence:
        storage = dcp.storage_checks(save.path, save.files, "", save.remembered_file)
        return Evidence([_torchtitan(save.path, save.files), *storage])

    def save_file(self, rel: str) -> bool:
        return dcp.save_file(rel)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return dcp.written_after_shards(rel) if rel.rpartition("/")[2] == ".metadata" else None


FRAMEWORK = Torchtitan()
