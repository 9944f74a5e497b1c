"""What a checkpoint's weights files say about themselves: their dtypes, and ckptd's own record.

Reads only the small parts: a safetensors file's JSON header (8 bytes of length, then
the header; never the tensors), and a sharded checkpoint's `*.index.json`. The
result is plain data that `slim.survey` (pure) decides from: whether the weights a
slim would keep are fp32, or 16-bit while the fp32 master weights live only in the
DeepSpeed optimizer shards that slimming removes.

A `pytorch_model.bin` is a pickle: its dtypes are not read, and "unknown" counts as
"not known to be fp32" (the safe side: consolidate from the shards if there are any,
else do not slim). The Trainer has written safetensors by default since
transformers 4.35; a .bin checkpoint is slimmed as saved with `slim_weights = "as-saved"`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd import frameworks
from ckptd.judge import slim
from ckptd.model import ConsolidatedWeights, Dtypes, WeightsSeen

if TYPE_CHECKING:
    from ckptd.model import Entry

MAX_HEADER = 100 * 1024 * 1024  # safetensors itself refuses headers over 100 MB
MAX_INDEX = 64 * 1024 * 1024



def read_header(path: Path | str, dir_fd: int | None = None) -> dict[str, Any]:
    """A safetensors file's header without `__metadata__`: name -> {"dtype", "shape", "data_offsets"}.

    Never follows a symlink. Raises OSError or ValueError.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"header length {n} is larger than this tool will parse")
        data = f.read(n)
        if len(data) < n:
            raise ValueError(f"header length {n} runs past the end of the file")
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def floating(header: Mapping[str, Any]) -> frozenset[str]:
    """The dtypes of a header's floating-point tensors: "F32", "BF16", "F8_E4M3", ..."""
    out = set()
    for info in header.values():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(dtype, str) and dtype.startswith(("F", "BF")):
            out.add(dtype)
    return frozenset(out)


def read_index(path: Path) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_INDEX + 1)
    if len(data) > MAX_INDEX:
        raise ValueError(f"larger than {MAX_INDEX} bytes")
    index = json.loads(data)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError("no weight_map")
    return index


def _shard_names(index: Mapping[str, Any]) -> list[str]:
    """The shard files an index names, each a plain file name beside it."""
    names = sorted({v for v in index["weight_map"].values() if isinstance(v, str)})
    bad = [n for n in names if not n or "/" in n or n in (".", "..")]
    if bad or len(names) != len(set(index["weight_map"].values())):
        raise ValueError(f"weight_map names {bad[0] if bad else 'a non-string'} as a shard")
    return names


class WeightsReader:
    """Reads `WeightsSeen` for checkpoints, remembering each file's answer while its size and
    mtime stay the same (a checkpoint is looked at every poll while it is in flight)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, int], Any] = {}

    def read(self, path: Path, files: Mapping[str, Entry]) -> WeightsSeen:
        """The weights of the checkpoint at `path`, whose entries (by relative path) are `files`."""
        dtypes: dict[str, Dtypes] = {}
        for name in frameworks.SLIM_WEIGHTS:
            e = files.get(name)
            if e is not None and e.kind == "f":
                dtypes[name] = self._dtypes(path, name, files)
        index = f"{slim.WEIGHTS_DIR}/{slim.INDEX}"
        consolidated = None
        if index in files:
            consolidated = self._cached(path, index, files, lambda: _consolidated(path, index))
        return WeightsSeen(dtypes, consolidated)

    def _cached(self, path: Path, rel: str, files: Mapping[str, Entry], read: Any) -> Any:
        e = files[rel]
        key = (str(path / rel), e.size, e.mtime_ns)
        if key not in self._cache:
            if len(self._cache) > 20_000:  # files rewritten leave stale keys behind
                self._cache.clear()
            self._cache[key] = read()
        return self._cache[key]

    def _dtypes(self, path: Path, name: str, files: Mapping[str, Entry]) -> Dtypes:
        if name.endswith(".bin") or name.endswith(".bin.index.json"):
            return f"{name} is a pickle: its dtypes are not read"
        if not name.endswith(".index.json"):
            return self._cached(path, name, files, lambda: _file_dtypes(path / name))
        try:
            shards = _shard_names(self._cached(path, name, files, lambda: read_index(path / name)))
        except (OSError, ValueError, RecursionError) as exc:
            return f"{name} unreadable: {exc}"
        out: set[str] = set()
        for shard in shards:
            if shard not in files or files[shard].kind != "f":
                return f"{shard}, named by {name}, is missing"
            got = self._cached(path, shard, files, lambda shard=shard: _file_dtypes(path / shard))
            if isinstance(got, str):
                return got
            out |= got
        return frozenset(out)


def _file_dtypes(path: Path) -> Dtypes:
    try:
        return floating(read_header(path))
    except (OSError, ValueError, RecursionError) as exc:
        return f"{path.name} unreadable: {exc}"


def _consolidated(path: Path, index_rel: str) -> ConsolidatedWeights | str:
    """ckptd's record in the index of the fp32 weights it consolidated, or why there is none."""
    try:
        index = read_index(path / index_rel)
        shards = _shard_names(index)
    except (OSError, ValueError, RecursionError) as exc:
        return f"{index_rel} unreadable: {exc}"
    meta = index.get("metadata")
    record = meta.get(slim.INDEX_RECORD) if isinstance(meta, dict) else None
    if not isinstance(record, dict):
        return f"{index_rel} was not written by ckptd"
    files = record.get("files")
    source, fp, tool = record.get("source"), record.get("source_fingerprint"), record.get("tool", "")
    if not (
        isinstance(source, str) and isinstance(fp, str) and isinstance(files, list) and isinstance(tool, str)
    ):
        return f"{index_rel}: ckptd's record is malformed"
    out = []
    for f in files:
        ok = isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str)
        if not ok or not _is_size(f.get("bytes")) or f["path"] not in shards:
            return f"{index_rel}: ckptd's record names {f!r}, not a shard of its weight_map"
        out.append((f"{slim.WEIGHTS_DIR}/{f['path']}", f["bytes"], f["sha256"]))
    if sorted(p.rpartition("/")[2] for p, _, _ in out) != shards:
        return f"{index_rel}: ckptd's record and its weight_map name different shards"
    return ConsolidatedWeights(index_rel, source, fp, tuple(out), tool)


def _is_size(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
