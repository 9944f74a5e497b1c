"""Megatron-LM: `iter_<N:07d>/` and the tracker `latest_checkpointed_iteration.txt`.

megatron/training/checkpointing.py save_checkpoint: every rank writes its part (`mp_rank_<tp>[_<pp>]/
model_optim_rng.pt`, or in the torch_dist format megatron-core's distributed checkpoint: `common.pt`,
the ranks' `*.distcp` (DCP's writer), `metadata.json` last), then rank 0 writes the tracker after
a barrier: an iteration above the tracker's is not finished.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd.frameworks import dcp
from ckptd.frameworks.base import (
    FAILED,
    MAX_POINTER_BYTES,
    PASSED,
    UNKNOWN,
    Evidence,
    Framework,
    RunContext,
    Save,
    pointer_target,
    read_pointer,
    run_pointer,
)
from ckptd.model import Candidate, Check, Entry
from ckptd.volume import volread

LAYOUT = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"  # checkpointing.py get_checkpoint_tracker_filename
_NAME = re.compile(r"iter_(\d{7,})")  # checkpointing.py get_checkpoint_name: f"iter_{iteration:07d}"
# Megatron-LM's model-parallel rank directories, mp_rank_<tp:02d>[_<pp:03d>] (get_checkpoint_name)
_RANK_DIR = re.compile(r"mp_rank_\d+(?:_\d+)?")

_MEGATRON_FILE = re.compile(
    r"(?:.+/)?(?:model_optim_rng\.pt|[^/]+\.distcp|metadata\.json|common\.pt|\.metadata)"
)


def megatron_iteration(text: str) -> int | None:
    """The iteration Megatron's tracker names, parsed as Megatron parses it (`int(metastring)`
    in checkpointing.py's read_metadata: ' 100', '+100', '1_000' are 100, 100, 1000); None if
    Megatron would not take it for one."""
    try:
        return int(text)
    except ValueError:
        return None


def _megatron_tracker(run: RunContext, cand: Candidate, newest_ns: int | None = None) -> Check:
    """Megatron's rank 0 writes the tracker after every rank saved the iteration: one above it is still
    being saved, unless the tracker was written after it (`newest_ns`, its newest file): then a user
    rolled the tracker back to resume from an earlier iteration, and this one is what that resume
    will overwrite. Either way not complete (kept, never deleted), and said which."""
    name = "megatron tracker"
    if TRACKER not in run.names:
        return Check(name, FAILED, f"{TRACKER} missing (written after every rank saved)")
    try:
        text = read_pointer(run.path / TRACKER)
    except OSError as exc:
        return Check(name, UNKNOWN, f"cannot read {TRACKER}: {exc.strerror or exc}")
    if text == "release":
        return Check(name, PASSED, "tracker says 'release'")
    iteration = megatron_iteration(text)
    if iteration is None:
        return Check(name, UNKNOWN, f"{TRACKER} holds {text[:40]!r}, not an iteration")
    if iteration < cand.step:
        if newest_ns is not None and _written_after(run.path / TRACKER, newest_ns):
            why = (f"above the tracker the framework resumes from (rolled back?): tracker at iteration "
                   f"{iteration} < {cand.step}, written after this iteration's files")
            return Check(name, FAILED, why)
        return Check(name, FAILED, f"tracker at iteration {iteration} < {cand.step}: still being saved")
    return Check(name, PASSED, f"tracker at iteration {iteration} >= {cand.step}")


def _written_after(tracker: Path, newest_ns: int) -> bool:
    """Whether the tracker was written after a save whose newest file is `newest_ns` (by more than
    mtime granularity and node clocks: one_save's slack). Its save wrote it before, never after."""
    try:
        return os.stat(tracker).st_mtime_ns - newest_ns > MTIME_SLACK_NS
    except OSError:
        return False  # cannot tell: "still being saved", as before


MTIME_SLACK_NS = 10 * 10**9
MEGATRON_CORE_METADATA = "metadata.json"
_MEGATRON_CORE_FILES = ("common.pt", MEGATRON_CORE_METADATA, ".metadata")


def _is_megatron_core(files: dict[str, Entry], d: str) -> bool:
    """Whether directory `d` ("" for the top) holds a megatron-core distributed checkpoint."""
    prefix = f"{d}/" if d else ""
    return any(f"{prefix}{n}" in files for n in _MEGATRON_CORE_FILES) or any(
        rel.startswith(prefix) and "/" not in rel[len(prefix) :] and rel.endswith(".distcp") for rel in files
    )


def _megatron_core(path: Path, files: dict[str, Entry], d: str) -> Check:
    """megatron-core writes `metadata.json` last (dist_checkpointing/serialization.py `save`: rank 0,
    after common.pt and every rank's shards; with async save, in the finalize), and takes a directory
    for a checkpoint only when it parses (`check_is_distributed_checkpoint`)."""
    rel = f"{d}/{MEGATRON_CORE_METADATA}" if d else MEGATRON_CORE_METADATA
    name = f"megatron-core {rel}"
    entry = files.get(rel)
    if entry is None or entry.kind != "f":
        return Check(name, FAILED, "missing (megatron-core writes it last)")
    try:
        with volread.open_file(path / rel) as f:
            doc = json.loads(f.read(MAX_POINTER_BYTES * 16))
    except (OSError, ValueError, RecursionError) as exc:
        return Check(name, FAILED, f"unreadable: {type(exc).__name__}: {exc}")
    if not isinstance(doc, dict):
        return Check(name, FAILED, "not a JSON object")
    backend = doc.get("sharded_backend")
    return Check(name, PASSED, f"parsed (sharded_backend={backend!r})" if backend else "parsed")


class Megatron(Framework):
    layout = LAYOUT
    named_alone = True
    names_first = True
    run_files = (TRACKER,)  # rewritten in place by rank 0 after every save

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = _NAME.fullmatch(name) if is_dir else None
        return Candidate(name, int(m[1]), LAYOUT, True) if m else None

    def rank_dir(self, name: str) -> bool:
        return bool(_RANK_DIR.fullmatch(name))

    def evidence(self, save: Save) -> Evidence:
        newest = max((e.mtime_ns for e in save.files.values() if e.kind == "f"), default=None)
        checks = [_megatron_tracker(save.run, save.cand, newest)]
        if _is_megatron_core(save.files, ""):  # the torch_dist format: megatron-core's files in iter_N/
            checks.append(_megatron_core(save.path, save.files, ""))
        return Evidence(checks)

    def save_file(self, rel: str) -> bool:
        return bool(_MEGATRON_FILE.fullmatch(rel))

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return dcp.written_after_shards(rel) if rel.rpartition("/")[2] in dcp._WRITTEN_LAST else None

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return tracker_pointer(run_path, names)


FRAMEWORK = Megatron()


def tracker_pointer(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """What the tracker names: the iteration the next resume loads, `os.path.join(path,
    'iter_{:07d}')` or 'release' (checkpointing.py get_checkpoint_name), never deleted. A tracker
    Megatron refuses (and exits on) names nothing; one that is there but cannot be read may name
    any checkpoint of the run: every one is named by it, kept until it can be read."""
    found: dict[str, str] = {}
    tracker = TRACKER
    if tracker not in names:
        return found
    text = run_pointer(found, run_path, tracker, names, tracker)
    if text is None:
        return found
    iteration = megatron_iteration(text)
    if iteration is None and text != "release":
        return found  # Megatron refuses it (and exits): it resumes from nothing
    for name in pointer_target(run_path, "release" if iteration is None else f"iter_{iteration:07d}"):
        found.setdefault(name, tracker)
    return found
