"""Slimming: keep a checkpoint's weights, drop its optimizer state. The pure part.

Which files slimming may remove (`slim_files` globs, never weights, model states
or the trainer state), where the checkpoint's weights are or would come from
(`survey`), and the marker a slimmed checkpoint carries (`.ckptd-slim.json`).
Nothing here touches the disk: evidence reads the marker, `consolidate` writes
the consolidated weights, and the reaper, the only module that removes
anything, carries slimming out.

With Adam under ZeRO, the `*_optim_states.pt` shards hold the fp32 master
weights plus two moments (12 bytes a parameter), the weights in fp32 4: most
of a checkpoint is optimizer state that only resuming needs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import frameworks
from ckptd.discover import layouts
from ckptd.frameworks.base import CONSOLIDATED, matches_any
from ckptd.model import ConsolidatedWeights, Slimming

if TYPE_CHECKING:
    from ckptd.config import Config
    from ckptd.model import Dtypes, Entry, WeightsSeen

MARKER = ".ckptd-slim.json"
MARKER_VERSION = 1
# fp32 weights ckptd consolidates go into this directory of the checkpoint, written as the HF
# ecosystem reads sharded weights (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`;
# transformers' `load_sharded_checkpoint(model, "checkpoint-N/fp32")`). A directory of their own:
# beside 16-bit weights the Trainer saved, no loader that reads a checkpoint's top level
# (from_pretrained, vLLM's `*.safetensors` glob) sees two sets of weights; and a directory comes
# into place with one rename, so a crash never leaves half a set of shards under final names.
WEIGHTS_DIR = "fp32"
INDEX = "model.safetensors.index.json"
INDEX_RECORD = "ckptd"  # the key of ckptd's record (source, shard hashes) in the index's "metadata"
SLIM_WEIGHTS = ("fp32", "as-saved")
# Where ckptd before fp32/ consolidated weights (`CONSOLIDATED`, a single file; markers that name
# it still verify), and the work directory it used inside the checkpoint: a crash's leftover there
# is ckptd's own temp file, removed with the optimizer state when the checkpoint is slimmed.
LEGACY_WORK_DIR = f"{CONSOLIDATED}.ckptd-tmp"
_DTYPE_NAMES = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def shard_name(i: int, n: int) -> str:
    """The i-th of n consolidated shards (from 1), named as transformers names them."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def dtype_name(dtypes: frozenset[str]) -> str:
    """`{"BF16"}` -> "bf16"; several -> "bf16+fp32"."""
    return "+".join(sorted(_DTYPE_NAMES.get(d, d.lower()) for d in dtypes)) or "no floating-point tensors"


def is_fp32(dtypes: frozenset[str]) -> bool:
    """Every floating-point tensor at least fp32 (and there is one)."""
    return bool(dtypes) and dtypes <= {"F32", "F64"}


def never_removed(path: str) -> bool:
    """Files slimming keeps whatever `slim_files` says: ckptd's own (fp32/, pins, markers), and what
    a framework says a slim keeps (`Framework.slim_keeps`: weights, model states, trainer state)."""
    name = path.rpartition("/")[2]
    return (
        path == WEIGHTS_DIR
        or path.startswith(f"{WEIGHTS_DIR}/")
        or name in (layouts.PIN_FILE, MARKER)
        or any(f.slim_keeps(name) for f in frameworks.REGISTRY)
    )


def ckptd_files(marker: Marker | None) -> frozenset[str]:
    """Paths inside a checkpoint that ckptd wrote, not the trainer (besides its work directory
    `LEGACY_WORK_DIR/`): the slim marker and its temp name, and the weights it consolidated
    (the index and each shard in `fp32/`, or an older ckptd's single file).
    They say nothing about when the checkpoint was saved."""
    own = {MARKER, f"{MARKER}.tmp"}
    if marker is not None and marker.consolidated:
        own.add(marker.weights)
        own.update(path for path, _ in marker.files)
    return frozenset(own)


def in_work_dir(rel: str) -> bool:
    return rel == LEGACY_WORK_DIR or rel.startswith(f"{LEGACY_WORK_DIR}/")


def source_fingerprint(files: Mapping[str, Entry], tag_prefix: str) -> str:
    """What zero_to_fp32 reads in a tag directory (model-states and optimizer files: names, sizes,
    mtimes), as a digest: fp32 weights consolidated from them are theirs while it is the same.

    `tag_prefix` is "global_step10/" inside a Trainer checkpoint, "" for a bare `global_step10/`.
    """
    h = hashlib.sha256()
    reads = frameworks.REGISTRY
    for rel in sorted(files):
        rest = rel[len(tag_prefix) :]
        read = any(f.consolidation_reads(rest) for f in reads)
        if rel.startswith(tag_prefix) and "/" not in rest and read:
            e = files[rel]
            h.update(f"{rest}\0{e.kind}\0{e.size}\0{e.mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class Marker:
    """A `.ckptd-slim.json`: what slimming removed (or is removing) and where the weights are."""

    done: bool  # False: slimming was interrupted while removing; the next prune finishes it
    removed: tuple[tuple[str, int], ...]  # (path relative to the checkpoint, bytes)
    weights: str  # relative to the checkpoint
    weights_bytes: int | None
    consolidated: bool
    source: str | None
    sha256: str | None
    time: float | None
    document: dict = field(compare=False, repr=False)  # as read, for rewriting it
    files: tuple[tuple[str, int], ...] = ()  # the shards `weights` (an index) names, with their bytes
    dtype: str | None = None  # of the weights kept, when recorded: "fp32", "bf16"

    @property
    def bytes_freed(self) -> int:
        return sum(size for _, size in self.removed)

    def summary(self, format_size) -> str:
        how = (
            f"consolidated from {self.source} by zero_to_fp32, sha256 {(self.sha256 or '?')[:12]}"
            if self.consolidated
            else "already present"
        )
        if self.files:
            how += f", {len(self.files)} shard{'s' if len(self.files) > 1 else ''}"
        if self.dtype:
            how = f"{self.dtype}, {how}"
        return (
            f"optimizer state removed: {len(self.removed)} files, {format_size(self.bytes_freed)}; "
            f"weights in {self.weights} ({how})"
        )


def _relative(path: object) -> bool:
    return isinstance(path, str) and bool(path) and not path.startswith("/") and ".." not in path.split("/")


def parse_marker(data: Any) -> Marker:
    """A marker from its JSON document. Raises ValueError if it is not one."""
    if not isinstance(data, dict) or data.get("ckptd_slim") != MARKER_VERSION:
        raise ValueError(f"not a version {MARKER_VERSION} slim marker")
    removed = data.get("removed")
    weights = data.get("weights")
    if not isinstance(removed, list) or not isinstance(weights, dict):
        raise ValueError("no 'removed' list or 'weights' object")
    files = []
    for item in removed:
        if not (isinstance(item, dict) and isinstance(item.get("path"), str) and _is_int(item.get("bytes"))):
            raise ValueError(f"malformed 'removed' entry {item!r}")
        files.append((item["path"], item["bytes"]))
    path = weights.get("path")
    if not _relative(path):
        raise ValueError(f"malformed weights path {path!r}")
    shards = []
    for item in weights.get("files") or ():  # optional: markers before sharded weights have none
        if not (isinstance(item, dict) and _relative(item.get("path")) and _is_int(item.get("bytes"))):
            raise ValueError(f"malformed weights file {item!r}")
        shards.append((item["path"], item["bytes"]))
    state = data.get("state")
    if state not in ("removing", "done"):
        raise ValueError(f"unknown state {state!r}")
    return Marker(
        done=state == "done",
        removed=tuple(files),
        weights=path,
        weights_bytes=weights["bytes"] if _is_int(weights.get("bytes")) else None,
        consolidated=weights.get("consolidated") is True,
        source=weights.get("source") if isinstance(weights.get("source"), str) else None,
        sha256=weights.get("sha256") if isinstance(weights.get("sha256"), str) else None,
        time=data["time"] if isinstance(data.get("time"), int | float) else None,
        document=data,
        files=tuple(shards),
        dtype=weights.get("dtype") if isinstance(weights.get("dtype"), str) else None,
    )


def marker_document(
    *, state: str, time: float, removed: Collection[tuple[str, int]], weights: dict, reasons: Collection[str]
) -> dict:
    """The JSON document of a marker (the inverse of `parse_marker`)."""
    return {
        "ckptd_slim": MARKER_VERSION,
        "state": state,
        "time": time,
        "removed": [{"path": p, "bytes": b} for p, b in removed],
        "bytes_freed": sum(b for _, b in removed),
        "weights": weights,
        "reasons": list(reasons),
    }


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def survey(
    layout: str,
    name: str,
    files: Mapping[str, Entry],
    slim_files: Collection[str],
    marker: Marker | None,
    weights: WeightsSeen | None = None,
    slim_weights: str = "fp32",
    removable: tuple[tuple[str, int], ...] | None = None,
) -> Slimming:
    """What slimming would remove from one checkpoint and which weights it would keep.

    `files` are the checkpoint's entries by path; `slim_files` globs are matched
    against paths relative to the DeepSpeed save_dir, which is the checkpoint
    itself except for a bare `global_step<N>/` (then its parent), so that
    `global_step*/*optim_states.pt` fits both. Only Trainer and DeepSpeed
    layouts are slimmed: for the others ckptd cannot tell weights from state.

    The weights a slim keeps, best first: fp32 weights ckptd consolidated from these
    very shards (`fp32/`); the checkpoint's own weights file, if it is fp32 (or with
    `slim_weights = "as-saved"`, whatever its dtype); else fp32 weights still to be
    consolidated from the DeepSpeed tag directory (`source`). Weights that are 16-bit
    or of unknown dtype are not enough for "fp32": the fp32 master weights would go
    with the optimizer shards. `weights` holds what their headers say (`weights.py`).
    """
    fw = frameworks.get(layout)
    if not fw.slim_weights:
        return Slimming()
    if removable is None:  # else the caller's pass over the entries asked `removable_file` of each
        test = removable_file(fw.checkpoint_is_tag, name, slim_files)
        removable = tuple(sorted((rel, e.size) for rel, e in files.items() if e.kind == "f" and test(rel)))
    if marker is not None:
        return _slimmed(marker, files, removable)
    saved = next((w for w in fw.slim_weights if _present(files, w)), None)
    seen = weights.dtypes.get(saved) if weights is not None and saved is not None else None
    dtype = dtype_name(seen) if isinstance(seen, frozenset) else None
    if not removable:
        return Slimming(False, (), saved, dtype=dtype)

    source, blocker = _source(layout, name, files)
    record = weights.consolidated if weights is not None else None
    consolidated, occupied = _consolidated(layout, files, record, source)
    if consolidated is not None:
        keeps = f"fp32 weights consolidated from {consolidated.source} into {WEIGHTS_DIR}/"
        return Slimming(False, removable, consolidated.index, None, None, keeps, consolidated, "fp32")
    return _unconsolidated(saved, seen, dtype, slim_weights, removable, source, blocker or occupied)


def _present(files: Mapping[str, Entry], rel: str) -> bool:
    return rel in files and files[rel].kind == "f"


def _slimmed(marker: Marker, files: Mapping[str, Entry], removable: tuple[tuple[str, int], ...]) -> Slimming:
    """A checkpoint with a slim marker (`survey`): what is left to remove, the weights it names."""
    named = f"{marker.weights}, named by its slim marker"
    # A slim writes "done" only once every file it listed has gone (removal.slimming); optimizer
    # files here after that were put back by someone, to resume from it: theirs to keep.
    if marker.done and any(not in_work_dir(rel) for rel, _ in removable):
        return Slimming(True, (), marker.weights if _present(files, marker.weights) else None, keeps=named,
                        restored=True)
    if _present(files, marker.weights):
        return Slimming(True, removable, marker.weights, keeps=named)
    return Slimming(True, removable, None, None, f"{named}, is missing")


def _unconsolidated(
    saved: str | None,
    seen: Dtypes | None,
    dtype: str | None,
    slim_weights: str,
    removable: tuple[tuple[str, int], ...],
    source: str | None,
    blocker: str | None,
) -> Slimming:
    """A checkpoint without ckptd's fp32/ weights (`survey`): its own weights file `saved` as saved
    (fp32, or whatever `dtype` with "as-saved"), else fp32 weights to consolidate from `source`
    first, unless `blocker` says why none can be."""
    if saved is not None:
        fp32 = isinstance(seen, frozenset) and is_fp32(seen)
        if fp32 or slim_weights == "as-saved":
            keeps = f"{saved} as saved ({dtype or 'dtype not known'})"
            return Slimming(False, removable, saved, keeps=keeps, dtype=dtype)
        why = f"{saved} is {dtype}" if dtype else str(seen or f"{saved}: dtype not known")
        opt_out = f'; slim_weights = "as-saved" would keep {saved} alone'
    else:
        why, opt_out = "no weights file", ""
    if blocker is not None:
        return Slimming(False, removable, None, None, f"{why} and {blocker}{opt_out}")
    keeps = f"fp32 weights consolidated from {source} into {WEIGHTS_DIR}/ first ({why})"
    return Slimming(False, removable, None, source, None, keeps=keeps, dtype="fp32")


def removes_load_need(glob: str) -> str | None:
    """A file loading the weights needs (`Framework.load_needs`) that a slim with `glob` among the
    `slim_files` would remove, or None: such a glob cannot be meant (`["*"]` takes config.json and
    the tokenizer, and `from_pretrained` fails on what is left)."""
    for fw in frameworks.REGISTRY:
        if not fw.slim_weights:
            continue
        test = removable_file(fw.checkpoint_is_tag, "", (glob,))
        found = next((rel for rel in fw.load_needs if test(rel)), None)
        if found is not None:
            return found
    return None


def config_refusals(config: Config) -> list[tuple[str, str]]:
    """(key, why) for each retention table (a root's, a run rule's) whose `slim_files` holds a glob
    that would remove what loading the weights needs (`removes_load_need`): its first such glob.
    The config knows no framework; whoever reads it passes this check (`effective_config`'s
    `checks`), so that check-config, plan, prune and run refuse such a config (exit 78)."""
    out = []
    for i, root in enumerate(config.roots):
        tables = [("retention", root.retention), *((f"runs[{j}]", rule) for j, rule in enumerate(root.runs))]
        for key, retention in tables:
            for glob in retention.slim_files:
                needed = removes_load_need(glob)
                if needed is not None:
                    out.append((f"roots[{i}].{key}.slim_files", (
                        f"{glob!r} would remove {needed}, which loading the weights needs: name only "
                        "the optimizer state to drop (default: global_step*/*optim_states.pt, optimizer.pt)"
                    )))
                    break
    return out


def removable_file(checkpoint_is_tag: bool, name: str, slim_files: Collection[str]) -> Callable[[str], bool]:
    """Whether a slim removes the regular file at `rel` (not "", the checkpoint itself) of the
    checkpoint `name` (`survey`): a leftover of ckptd's work directory, or a file `slim_files`
    matches, relative to the DeepSpeed save_dir, that slimming does not always keep (`never_removed`)."""
    prefix = f"{name}/" if checkpoint_is_tag else ""
    leftover = f"{LEGACY_WORK_DIR}/"
    globs = tuple(slim_files)

    def test(rel: str) -> bool:
        return bool(rel) and (
            rel.startswith(leftover) or (matches_any(prefix + rel, globs) and not never_removed(rel))
        )

    return test


def _consolidated(
    layout: str, files: Mapping[str, Entry], record: ConsolidatedWeights | str | None, source: str | None
) -> tuple[ConsolidatedWeights | None, str | None]:
    """ckptd's fp32/ weights if they are whole and were consolidated from these very shards; else
    None and, when something occupies fp32/, why no new consolidation may go there."""
    if WEIGHTS_DIR not in files:
        return None, None
    if record is None or isinstance(record, str):
        why = record or f"{WEIGHTS_DIR}/{INDEX} missing"
        return None, f"{WEIGHTS_DIR}/ holds no fp32 weights ckptd consolidated ({why})"
    for path, size, _ in record.files:
        if path not in files or files[path].kind != "f" or files[path].size != size:
            return None, f"{path} is missing or not the size ckptd recorded when it consolidated it"
    if source is None or record.source != source:
        return None, f"{WEIGHTS_DIR}/ was consolidated from {record.source}, not from {source}"
    tag_prefix = "" if frameworks.get(layout).checkpoint_is_tag else f"{source}/"
    if source_fingerprint(files, tag_prefix) != record.source_fingerprint:
        return None, f"{WEIGHTS_DIR}/ was consolidated from {source} as it was then: its shards changed since"
    return record, None


def _source(layout: str, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
    """The DeepSpeed tag directory zero_to_fp32 would consolidate, or why there is none (its framework's
    `consolidation_source`)."""
    return frameworks.get(layout).consolidation_source(name, files)


def consolidation_paths(layout: str, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
    """(save_dir, tag, model-states file) for zero_to_fp32, relative to the checkpoint's run directory.

    zero_to_fp32 takes the directory holding the tag and the tag (its framework's `consolidation_paths`).
    """
    return frameworks.get(layout).consolidation_paths(name, source, files)
