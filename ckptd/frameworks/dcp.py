"""torch.distributed.checkpoint (DCP): a directory of `*.distcp` and the coordinator's `.metadata`.

FileSystemWriter (torch/distributed/checkpoint/filesystem.py): every rank writes its
`__<rank>_<i>.distcp`, then the coordinator gathers their results and writes `.metadata` (through
`.metadata.tmp`, renamed) in `finish`, last. Frameworks put DCP directories inside their own
checkpoints (FSDP under the Trainer and accelerate, NeMo 2's `weights/`, torchtitan's steps,
Lightning's FSDP `.ckpt/`): the engine asks `nested_metadata` of every directory holding `*.distcp`
or DCP's metadata (`is_metadata`).
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path

from ckptd.formatting import format_age
from ckptd.frameworks.base import (
    FAILED,
    MTIME_SLACK,
    PASSED,
    UNKNOWN,
    Evidence,
    Framework,
    OrderProblems,
    Remembered,
    Save,
    known_world,
    rank_files,
    read_now,
)
from ckptd.frameworks.hfweights import SAFETENSORS_INDEX
from ckptd.model import Candidate, Check, Entry
from ckptd.volume import volread

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
METADATA_SUFFIX = ".metadata"


def is_metadata(name: str, kind: str) -> bool:
    """Whether the entry `name` (a base name) of `kind` is DCP's metadata: the coordinator's
    `.metadata` or a rank's `__<rank>.metadata`, not a directory (an Eclipse workspace's `.metadata/`).
    Its directory is a DCP save even with every `*.distcp` gone: the metadata names them, and
    dcp.load reads them (FileSystemReader.read_data)."""
    return kind != "d" and (name == METADATA_SUFFIX or _RANK_METADATA.fullmatch(name) is not None)


def _rank_metadata(files: dict[str, Entry], d: str, world: int | None) -> tuple[Check, int | None]:
    prefix = f"{d}/" if d else ""
    regex = re.compile(re.escape(prefix) + _RANK_METADATA.pattern)
    where = f"dcp rank metadata ({d})" if d else "dcp rank metadata"
    check, ranks = rank_files(files, regex, world, name=where)
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
    read_whole = frozenset({".metadata"})  # storage_check reads what it names

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
            check, ranks = _rank_metadata(files, "", known_world(save.world_size, save.mp_world_size))
            return Evidence([check, *storage_checks(save.path, files, "", save.remembered_file)], ranks)
        storage = storage_checks(save.path, files, "", save.remembered_file)
        return Evidence([_dcp_metadata(files, ""), *storage])

    def save_file(self, rel: str) -> bool:
        return save_file(rel)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return written_after_shards(rel) if rel.rpartition("/")[2] == ".metadata" else None


FRAMEWORK = DCP()


def nested_metadata(
    path: Path,
    files: Mapping[str, Entry],
    dirs: Iterable[str],
    skip_top: bool,
    remembered: Remembered = read_now,
) -> Iterator[Check]:
    """Any directory inside a checkpoint holding *.distcp files or DCP's metadata (`dirs`, sorted:
    `is_metadata`, so that one with every data file gone is judged too) is judged as a DCP save at
    the top is, whichever framework's checkpoint holds it (accelerate's and the Trainer's
    FSDP SHARDED_STATE_DICT `pytorch_model_fsdp_0/`, `optimizer_0/`): its .metadata (or every rank's
    `__<rank>.metadata`) there, and every file its storage_data names a regular file reaching the
    furthest byte it names (`storage_checks`, read with the same restricted unpickler); dcp.load
    fails on a shard cut short or missing. The top one only when the checkpoint is not itself DCP's
    (`skip_top`: its own evidence judged it). `remembered`: `Save.remembered_file`."""
    for d in dirs:
        if d == "" and skip_top:
            continue
        yield _dcp_metadata(files, d)  # type: ignore[arg-type]
        yield from storage_checks(path, files, d, remembered)


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
# --- what `.metadata` names: every file of storage_data there, and long enough ----------------------
#
# DCP's `.metadata` (and a rank's `__<rank>.metadata`) is a pickle of
# torch/distributed/checkpoint/metadata.py `Metadata`, whose `storage_data` maps each MetadataIndex
# to a filesystem.py `_StorageInfo(relative_path, offset, length)`: the byte range of every item in
# the rank files (FileSystemWriter.finish pickles it; FileSystemReader.read_metadata unpickles it,
# read_data opens `relative_path` and reads `length` bytes at `offset`). A rank's `.distcp` missing,
# empty, cut short, or in a killed rsync's temporary name leaves `.metadata` naming what is not
# there, and dcp.load fails. ckptd reads the pickle with an Unpickler that never imports or calls
# anything: the classes it admits (DCP's metadata classes and the few torch and pathlib names their
# state holds) are stand-ins that only record their arguments and state, and any other global
# refuses the file. A pickle from a shared volume is never handed to `pickle.load`.

_ADMITTED = {
    "torch.distributed.checkpoint.metadata": None,  # Metadata, MetadataIndex, *StorageMetadata, ...
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": None,
    "torch": None,  # torch.Size, the dtypes (torch.float32 ...)
    "torch.serialization": {"_get_layout"},
    "torch._utils": None,
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}
MAX_METADATA_BYTES = 256 * 1024 * 1024  # a large model's .metadata is tens of MB


class _Stub:
    """A stand-in for a class the pickle names: it records what it is built from, and nothing else."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.state = args, None

    def __setstate__(self, state: object) -> None:
        self.state = state

    def __setitem__(self, key: object, value: object) -> None:  # an OrderedDict's items
        pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        names = _ADMITTED.get(module, ())
        if names is not None and name not in names:
            raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes")
        return type(name, (_Stub,), {})

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


def _stub_field(obj: object, name: str) -> object:
    state = obj.state if isinstance(obj, _Stub) else None
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
        state = {**(state[0] or {}), **state[1]}
    return state.get(name) if isinstance(state, dict) else None


def storage_extents(raw: bytes) -> dict[str, int]:
    """{relative_path: the furthest byte (offset + length) `storage_data` names in it}, from a
    `.metadata` pickle. Raises ValueError when it is not one (empty, cut short, another global)."""
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError,
            TypeError, ValueError, struct.error, RecursionError, MemoryError) as exc:
        raise ValueError(f"not a DCP metadata pickle: {type(exc).__name__}: {exc}") from None
    storage = _stub_field(meta, "storage_data")
    if not isinstance(storage, dict):
        raise ValueError("not a DCP metadata pickle: no storage_data")
    extents: dict[str, int] = {}
    for info in storage.values():
        rel, offset, length = (_stub_field(info, k) for k in ("relative_path", "offset", "length"))
        if not isinstance(rel, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise ValueError("not a DCP metadata pickle: a storage_data entry without a byte range")
        extents[rel] = max(extents.get(rel, 0), offset + length)
    return extents


def storage_check(
    path: Path, files: Mapping[str, Entry], meta_rel: str, remembered: Remembered = read_now
) -> Check:
    """Whether every file `meta_rel` (a `.metadata` or a rank's `__<rank>.metadata`, relative to the
    checkpoint `path`) names in its storage_data is there, a regular file, and reaches the furthest
    byte it names there."""
    d = meta_rel.rpartition("/")[0]
    here = f"{d}/" if d else ""
    name = f"dcp storage ({meta_rel})"
    e = files.get(meta_rel)
    if e is None or e.kind != "f":
        return Check(name, FAILED, f"{meta_rel} is not a regular file")
    if e.size > MAX_METADATA_BYTES:
        return Check(name, UNKNOWN, f"{meta_rel}: {e.size} bytes, too large to read")

    def read() -> dict[str, object]:
        try:
            return {"extents": storage_extents(volread.read_bytes(path / meta_rel, MAX_METADATA_BYTES + 1))}
        except ValueError as exc:
            return {"error": str(exc)}

    try:
        found = remembered(meta_rel, read)
    except OSError as exc:
        return Check(name, UNKNOWN, f"{meta_rel} unreadable: {type(exc).__name__}: {exc}")
    extents = found.get("extents") if isinstance(found, dict) else None
    if not isinstance(extents, dict):
        error = found.get("error") if isinstance(found, dict) else found
        why = "empty (a power loss after the rename?)" if e.size == 0 else str(error)
        return Check(name, FAILED, f"{meta_rel} {why}: dcp.load cannot read it")
    if not extents:
        return Check(name, PASSED, f"{meta_rel} names no data files")
    for rel, end in sorted(extents.items()):
        if rel.startswith("/") or ".." in rel.split("/"):
            return Check(name, UNKNOWN, f"{meta_rel} names {rel!r}, outside the checkpoint")
        data = files.get(here + rel)
        if data is None or data.kind != "f":
            return Check(name, FAILED, f"{here}{rel} missing ({meta_rel} names it; dcp.load fails)")
        if data.size < end:
            why = f"{here}{rel} is {data.size} bytes, {meta_rel} names bytes up to {end}: cut short"
            return Check(name, FAILED, why)
    return Check(name, PASSED, f"the {len(extents)} data files {meta_rel} names, whole")


def storage_checks(
    path: Path, files: Mapping[str, Entry], d: str = "", remembered: Remembered = read_now
) -> list[Check]:
    """`storage_check` of the directory's `.metadata`, or of every rank's `__<rank>.metadata`
    (use_collectives=False) when there is no global one; none when there is neither."""
    here = f"{d}/" if d else ""
    if here + ".metadata" in files:
        return [storage_check(path, files, here + ".metadata", remembered)]
    ranks = sorted(r for r in files if r.startswith(here) and _RANK_METADATA.fullmatch(r[len(here):]))
    return [storage_check(path, files, r, remembered) for r in ranks]
