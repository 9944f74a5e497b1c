"""torch.distributed.checkpoint (DCP): a directory of `*.distcp` and the coordinator's `.metadata`.

FileSystemWriter (torch/distributed/checkpoint/filesystem.py): every rank writes its
`__<rank>_<i>.distcp`, then the coordinator gathers their results and writes `.metadata` (through
`.metadata.tmp`, renamed) in `finish`, last. Frameworks put DCP directories inside their own
checkpoints (FSDP under the Trainer and accelerate, NeMo 2's `weights/`, torchtitan's steps,
Lightning's FSDP `.ckpt/`): the engine asks `metadata_check` of every directory holding `*.distcp`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from ckptd.config import format_age
from ckptd.frameworks.base import (
    MTIME_SLACK,
    Evidence,
    Framework,
    OrderProblems,
    Save,
    _known_world,
    _rank_files,
)
from ckptd.frameworks.hfweights import SAFETENSORS_INDEX
from ckptd.layouts import Candidate
from ckptd.model import Check, Entry, Verdict

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED

DATA_SUFFIX = ".distcp"  # each rank's data files, __<rank>_<i>.distcp (filesystem.py _FileSystemWriter)
LAYOUT = "dcp"
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")
# Numbered DCP directories frameworks put inside a checkpoint as its parts: FSDP's under the
# Trainer and accelerate (`pytorch_model_fsdp_<i>/`, `optimizer_<i>/`: one per model or optimizer,
# accelerate's save_fsdp_model, save_fsdp_optimizer). Unnumbered ones (NeMo 2's `weights/`) are parts.
_DCP_PART = re.compile(r"(?:pytorch_model|model|optimizer|optim|scheduler)(?:_fsdp)?(?:_\d+)?")
# A DCP directory named as a save of a run is one (`step_10/`, `step-10`, `iter_100`, `20`): a
# script given the checkpoint as its output directory saved there, and that run is kept whole.
_DCP_SAVE_NAME = re.compile(r"(?:.*[_-])?(?:steps?|iter|iteration|global_step|checkpoint|ckpt|epoch)[_=-]?\d+"
                            r"|\d+")


def looks_like_dcp(children: Collection[str]) -> bool:
    """Whether a directory holding `children` holds a DCP save: the coordinator's `.metadata` or a
    rank's `*.distcp`."""
    return ".metadata" in children or any(c.endswith(".distcp") for c in children)


def _dcp_is_a_run_save(name: str, sibling_dirs: Collection[str]) -> bool:
    """Whether a DCP directory inside a checkpoint is a save of a run held there, not its part:
    named as a save, or one of several directories numbered alike (`save_10/`, `save_20/`)."""
    if _DCP_PART.fullmatch(name):
        return False
    if _DCP_SAVE_NAME.fullmatch(name):
        return True

    def stem(n: str) -> str | None:
        m = _LAST_INT.search(n)
        return None if m is None else f"{n[: m.start()]}#{n[m.end() :]}"

    own = stem(name)
    return own is not None and any(s != name and stem(s) == own for s in sibling_dirs)

# Written last in their directory, after its *.distcp: DCP's coordinator writes `.metadata` after
# every rank's data (torch.distributed.checkpoint's finish), megatron-core `metadata.json` after
# common.pt and the shards (dist_checkpointing/serialization.py `save`).
_WRITTEN_LAST = (".metadata", "metadata.json")


def _dcp_metadata(files: dict[str, Entry], d: str) -> Check:
    rel = f"{d}/.metadata" if d else ".metadata"
    where = f"dcp .metadata ({d})" if d else "dcp .metadata"
    if rel in files:
        return Check(where, PASSED, "present (the coordinator writes it after every rank)")
    if any(_RANK_METADATA.fullmatch(r.rpartition("/")[2]) for r in files if r.rpartition("/")[0] == d):
        return _rank_metadata(files, d, None)[0]
    return Check(where, FAILED, "missing (the coordinator writes it last)")


# Saved with `use_collectives=False` (state_dict_saver.py _save_state_dict: no coordinator), each rank
# writes `__<rank>.metadata` after its own data (filesystem.py _FileSystemWriter.finish,
# `_get_metadata_path(rank)`) and no global `.metadata`; dcp.load reads the rank's own then
# (state_dict_loader.py local_step). Whole when every rank's is there: 0..world-1, or 0..n-1 with
# no gap (and no fewer than the run's last complete save: against_siblings) when no world size is known.
_RANK_METADATA = re.compile(r"__(\d+)\.metadata")


def _rank_metadata(files: dict[str, Entry], d: str, world: int | None) -> tuple[Check, int | None]:
    prefix = f"{d}/" if d else ""
    regex = re.compile(re.escape(prefix) + _RANK_METADATA.pattern)
    where = f"dcp rank metadata ({d})" if d else "dcp rank metadata"
    check, ranks = _rank_files(files, regex, world, name=where)
    if check.verdict is not PASSED:
        return check, ranks
    # A rank writes its data before its metadata: one whose data is here and metadata not is not done
    data = re.compile(re.escape(prefix) + r"__(\d+)_\d+\.distcp")
    writing = sorted({int(m[1]) for r in files if (m := data.fullmatch(r))} - {
        int(m[1]) for r in files if (m := regex.fullmatch(r))})
    if writing:
        r = writing[0]
        why = f"rank {r} wrote its {prefix}__{r}_*.distcp, not yet its __{r}.metadata"
        return Check(where, FAILED, why), None
    n = ranks if ranks is not None else world
    detail = f"{prefix}__0.metadata..{prefix}__{(n or 1) - 1}.metadata, one per rank (use_collectives=False)"
    return Check(where, PASSED, f"{detail}: {check.detail}"), ranks



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
    return rel == ".metadata" or rel.endswith(".distcp") or rel == SAFETENSORS_INDEX  # torchtitan's HF save


class DCP(Framework):
    layout = LAYOUT
    owns_top_dcp = True

    def recognise_contents(self, name: str, children: Collection[str]) -> Candidate | None:
        if looks_like_dcp(children) and (m := _LAST_INT.search(name)):
            return Candidate(name, int(m[1]), LAYOUT, True)
        return None

    def part_inside(self, name: str, sibling_dirs: Callable[[], Collection[str]]) -> bool:
        """A DCP directory inside a checkpoint is its part (FSDP's `pytorch_model_fsdp_0/`, NeMo's
        `weights/`: the evidence demands their `.metadata` as parts), unless named as a run's
        saves (`step_10/`, or several numbered alike)."""
        return not _dcp_is_a_run_save(name, sibling_dirs())

    def evidence(self, save: Save) -> Evidence:
        files = save.files
        if ".metadata" not in files and any(_RANK_METADATA.fullmatch(r) for r in files):
            check, ranks = _rank_metadata(files, "", _known_world(save.world_size, save.mp_world_size))
            return Evidence([check], ranks)
        return Evidence([_dcp_metadata(files, "")])

    def save_file(self, rel: str) -> bool:
        return save_file(rel)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return written_after_shards(rel) if rel.rpartition("/")[2] == ".metadata" else None


FRAMEWORK = DCP()


def nested_metadata(files: Mapping[str, Entry], dirs: Iterable[str], skip_top: bool) -> Iterator[Check]:
    """Any directory inside a checkpoint holding *.distcp files (`dirs`, sorted) needs its .metadata,
    whichever framework's checkpoint holds it; the top one only when the checkpoint is not itself DCP's
    (`skip_top`: its own evidence judged it)."""
    for d in dirs:
        if d == "" and skip_top:
            continue
        yield _dcp_metadata(files, d)  # type: ignore[arg-type]


def metadata_order(
    files: Mapping[str, Entry], distcp: Mapping[str, tuple[int, str]]
) -> tuple[bool, OrderProblems]:
    """For one save's order (`evidence.one_save`): each directory's last-written file (DCP's
    `.metadata`, megatron-core's `metadata.json`: `_WRITTEN_LAST`) not older than the newest *.distcp
    beside it (`distcp`: directory -> its newest one's (mtime, path)). Returns whether any was there
    to tell by, and the problems."""
    checked, problems = False, []
    for d, (newest_ns, newest) in distcp.items():
        for last in _WRITTEN_LAST:
            marker = files.get(f"{d}/{last}" if d else last)
            if marker is None or marker.kind != "f":
                continue
            checked = True
            gap = (newest_ns - marker.mtime_ns) / 1e9
            if gap > MTIME_SLACK:
                why = f"{f'{d}/' if d else ''}{last} is {format_age(gap)} older than {newest}"
                problems.append((gap, f"{why}, which is written before it"))
    return checked, problems
