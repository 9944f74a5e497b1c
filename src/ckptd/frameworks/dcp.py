"""torch.distributed.checkpoint (DCP): a directory of `*.distcp` and the coordinator's `.metadata`.

FileSystemWriter (torch/distributed/checkpoint/filesystem.py): every rank writes its
`__<rank>_<i>.distcp`, then the coordinator gathers their results and writes `.metadata` (through
`.metadata.tmp`, renamed) in `finish`, last. Frameworks put DCP directories inside their own
checkpoints (FSDP under the Trainer and accelerate, NeMo 2's `weights/`, torchtitan's steps,
Lightning's FSDP `.ckpt/`): the engine asks `metadata_check` of every directory holding `*.distcp`.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptd import layouts
from ckptd.frameworks.base import Evidence, Framework, Save
from ckptd.model import Check, Entry, Verdict

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED

# Written last in their directory, after its *.distcp: DCP's coordinator writes `.metadata` after
# every rank's data (torch.distributed.checkpoint's finish), megatron-core `metadata.json` after
# common.pt and the shards (dist_checkpointing/serialization.py `save`).
_WRITTEN_LAST = (".metadata", "metadata.json")


def _dcp_metadata(files: dict[str, Entry], d: str) -> Check:
    rel = f"{d}/.metadata" if d else ".metadata"
    where = f"dcp .metadata ({d})" if d else "dcp .metadata"
    if rel in files:
        return Check(where, PASSED, "present (the coordinator writes it after every rank)")
    return Check(where, FAILED, "missing (the coordinator writes it last)")



def written_after_shards(rel: str) -> Callable[[str], bool]:
    """The files written before `rel` (a `.metadata` or megatron-core's `metadata.json`): the `*.distcp`
    and megatron-core's `common.pt` in its directory."""
    d = rel.rpartition("/")[0]
    here = f"{d}/" if d else ""
    return lambda other: (
        other.startswith(here)
        and "/" not in other[len(here) :]
        and (other.endswith(".distcp") or other.endswith("common.pt"))
    )


def save_file(rel: str) -> bool:
    return rel == ".metadata" or rel.endswith(".distcp") or rel == layouts.TORCHTITAN_HF_INDEX


class DCP(Framework):
    layout = layouts.DCP
    owns_top_dcp = True

    def evidence(self, save: Save) -> Evidence:
        return Evidence([_dcp_metadata(save.files, "")])

    def save_file(self, rel: str) -> bool:
        return save_file(rel)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return written_after_shards(rel) if rel.rpartition("/")[2] == ".metadata" else None


FRAMEWORK = DCP()
