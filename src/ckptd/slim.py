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

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from ckptd import layouts
from ckptd.model import Slimming

if TYPE_CHECKING:
    from ckptd.evidence import Entry

MARKER = ".ckptd-slim.json"
MARKER_VERSION = 1
CONSOLIDATED = "model.safetensors"
# Not *.safetensors, so a leftover from a crash fails no integrity check; the next try overwrites it.
CONSOLIDATING = f"{CONSOLIDATED}.ckptd-tmp"
DEFAULT_SLIM_FILES = ("global_step*/*optim_states.pt", "optimizer.pt")

# Weights a checkpoint may hold already (Trainer, PEFT): then nothing needs consolidating.
WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
_SHARDED_WEIGHTS = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")
_GLOBAL_STEP = re.compile(r"global_step\d+")
# zero_to_fp32 reads mp_rank_00 only, and knows nothing of pipeline layer files.
_MODEL_PARALLEL = re.compile(r".*mp_rank_(?!00_)\d+_.*\.pt")
_PIPELINE_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def matches(path: str, glob: str) -> bool:
    """`glob` matches `path` segment by segment: `*` never crosses a `/`."""
    p, g = path.split("/"), glob.split("/")
    return len(p) == len(g) and all(fnmatchcase(a, b) for a, b in zip(p, g, strict=True))


def never_removed(path: str) -> bool:
    """Files slimming keeps whatever `slim_files` says: weights, model states, state, markers."""
    name = path.rpartition("/")[2]
    return (
        name in WEIGHTS_FILES
        or bool(_SHARDED_WEIGHTS.fullmatch(name))
        or name.endswith("model_states.pt")
        or name in ("trainer_state.json", layouts.PIN_FILE, MARKER, CONSOLIDATING)
    )


def ckptd_files(marker: Marker | None) -> frozenset[str]:
    """Paths inside a checkpoint that ckptd wrote, not the trainer (besides its work directory
    `CONSOLIDATING/`): the slim marker and its temp name, and the weights it consolidated.
    They say nothing about when the checkpoint was saved."""
    own = {MARKER, f"{MARKER}.tmp"}
    if marker is not None and marker.consolidated:
        own.add(marker.weights)
    return frozenset(own)


def in_work_dir(rel: str) -> bool:
    return rel == CONSOLIDATING or rel.startswith(f"{CONSOLIDATING}/")


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

    @property
    def bytes_freed(self) -> int:
        return sum(size for _, size in self.removed)

    def summary(self, format_size) -> str:
        how = (
            f"consolidated from {self.source} by zero_to_fp32, sha256 {(self.sha256 or '?')[:12]}"
            if self.consolidated
            else "already present"
        )
        return (
            f"optimizer state removed: {len(self.removed)} files, {format_size(self.bytes_freed)}; "
            f"weights in {self.weights} ({how})"
        )


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
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"malformed weights path {path!r}")
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
) -> Slimming:
    """What slimming would remove from one checkpoint and where its weights are or come from.

    `files` are the checkpoint's entries by path; `slim_files` globs are matched
    against paths relative to the DeepSpeed save_dir, which is the checkpoint
    itself except for a bare `global_step<N>/` (then its parent), so that
    `global_step*/*optim_states.pt` fits both. Only Trainer and DeepSpeed
    layouts are slimmed: for the others ckptd cannot tell weights from state.
    """
    if layout not in (layouts.HF, layouts.DEEPSPEED):
        return Slimming()
    prefix = f"{name}/" if layout == layouts.DEEPSPEED else ""
    removable = tuple(
        sorted(
            (rel, e.size)
            for rel, e in files.items()
            if e.kind == "f"
            and rel
            and not never_removed(rel)
            and any(matches(prefix + rel, g) for g in slim_files)
        )
    )
    slimmed = marker is not None
    weights = _weights(layout, files, marker)
    if not removable or weights is not None:
        return Slimming(slimmed, removable, weights)
    if marker is not None:
        return Slimming(
            slimmed, removable, None, None, f"{marker.weights}, named by its slim marker, is missing"
        )
    source, blocker = _source(layout, name, files)
    return Slimming(slimmed, removable, None, source, blocker)


def _weights(layout: str, files: Mapping[str, Entry], marker: Marker | None) -> str | None:
    def present(rel: str) -> bool:
        return rel in files and files[rel].kind == "f"

    if marker is not None:
        return marker.weights if present(marker.weights) else None
    candidates = WEIGHTS_FILES if layout == layouts.HF else (CONSOLIDATED,)
    return next((w for w in candidates if present(w)), None)


def _source(layout: str, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
    """The DeepSpeed tag directory zero_to_fp32 would consolidate, or why there is none."""
    if layout == layouts.DEEPSPEED:
        tag, names = name, {rel for rel in files if rel and "/" not in rel}
    else:
        tags = sorted(rel for rel, e in files.items() if e.kind == "d" and _GLOBAL_STEP.fullmatch(rel))
        if len(tags) != 1:
            why = "no weights file and no" if not tags else f"no weights file and {len(tags)}"
            return None, f"{why} global_step directories to consolidate from"
        tag = tags[0]
        names = {rel[len(tag) + 1 :] for rel in files if rel.startswith(f"{tag}/")}
    if not names & {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"}:
        return None, f"no model states in {tag} to consolidate from"
    if any(_MODEL_PARALLEL.fullmatch(n) for n in names):
        return None, "model-parallel shards (mp_rank_01...): zero_to_fp32 consolidates mp_rank_00 only"
    if any(_PIPELINE_LAYER.fullmatch(n) for n in names):
        return None, "pipeline-parallel layer files: zero_to_fp32 cannot consolidate them"
    return tag, None


def consolidation_paths(layout: str, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
    """(save_dir, tag, model-states file) for zero_to_fp32, relative to the checkpoint's run directory.

    zero_to_fp32 takes the directory holding `global_step<N>/` and the tag.
    """
    if layout == layouts.DEEPSPEED:
        save_dir, tag, inside = ".", name, ""
    else:
        save_dir, tag, inside = name, source, f"{source}/"
    model = "mp_rank_00_model_states.pt"
    if f"{inside}{model}" not in files:
        model = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return save_dir, tag, f"{name}/{inside}{model}"
