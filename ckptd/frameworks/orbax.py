"""Orbax's CheckpointManager: `[<prefix>_]<step>/`, in progress as `<that>.orbax-checkpoint-tmp*`.

orbax/checkpoint/_src/path/atomicity.py: a step is saved into a tmp directory renamed into place
(AtomicRenameTemporaryPath) or in place with `commit_success.txt` written last
(CommitFileTemporaryPath); `_CHECKPOINT_METADATA` comes before the commit. Its metrics are in
`metrics/metrics` (`from_orbax`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from ckptd.frameworks.base import (
    FAILED,
    MAX_POINTER_BYTES,
    MAX_TRAINER_STATE_BYTES,
    PASSED,
    UNKNOWN,
    Evidence,
    Framework,
    Metrics,
    Remembered,
    Save,
    read_now,
)
from ckptd.model import ORBAX_METRICS, Candidate, Check, Entry, Reading, as_metric
from ckptd.volume import volread

LAYOUT = "orbax"
# Orbax's step names (orbax/checkpoint/_src/path/step.py: `<step_prefix>_<step>`, the step
# zero-padded to step_format_fixed_length if set) and its tmp directories (`TMP_DIR_STEP_PATTERN`).
_NAME = re.compile(r"(?:.+_)?(\d+)")
_TMP = re.compile(r"(?:.+_)?(\d+)\.orbax-checkpoint-tmp.*")
# Files Orbax writes into a finalized step directory.
METADATA = "_CHECKPOINT_METADATA"
COMMIT = "commit_success.txt"
_MARKERS = frozenset({METADATA, COMMIT})
# The metrics given to `CheckpointManager.save(step, metrics=...)`, as JSON in `<step>/metrics/metrics`
# (checkpoint_manager.py `METRIC_ITEM_NAME`): what its `best_fn` ranks.
METRICS_FILE = "metrics/metrics"
MAX_METRICS_BYTES = 1024 * 1024

def _orbax(cand: Candidate, path: Path, files: dict[str, Entry]) -> Check:
    """Orbax's own verdict on a step directory (orbax/checkpoint/_src/path/atomicity.py; the facts
    are in tests/support/FWGEN_NOTES.md).

    Saved through a tmp directory renamed into place (AtomicRenameTemporaryPath, the default
    on local filesystems), the final name is Orbax's proof. Saved in place (CommitFileTemporaryPath,
    the default on object stores and filesystems without atomic rename), only the step's own
    `commit_success.txt`, written last, is: a save killed midway leaves the final name, and may
    even hold a commit time already (the items' own commit files and the timestamp come first).
    ckptd cannot know which mode wrote a directory, and an Orbax reader that guesses wrong lists
    a broken step. Orbax 0.12 writes `commit_success.txt` in both modes, so it is what counts.
    A step whose `_CHECKPOINT_METADATA` has no commit record at all is from an Orbax that wrote
    neither: renamed into place, its name is the proof.
    """
    name = "orbax commit"
    if cand.in_progress:
        return Check(name, FAILED, "still a tmp directory (Orbax renames it when finished)")
    if COMMIT in files and files[COMMIT].kind == "f":
        return Check(name, PASSED, f"{COMMIT} present")
    meta = files.get(METADATA)
    if meta is None or meta.kind != "f":
        return Check(name, FAILED, f"neither {COMMIT} nor {METADATA}")
    try:
        with volread.open_file(path / METADATA) as f:
            doc = json.loads(f.read(MAX_POINTER_BYTES * 16))
    except (OSError, ValueError, RecursionError) as exc:
        return Check(name, UNKNOWN, f"{METADATA} unreadable: {type(exc).__name__}: {exc}")
    if not isinstance(doc, dict):
        return Check(name, UNKNOWN, f"{METADATA} is not a JSON object")
    if "commit_timestamp_nsecs" in doc:
        why = (
            f"no {COMMIT}: saved in place (Orbax's commit-file mode) and never committed, "
            "or killed while committing"
        )
        return Check(name, FAILED, why)
    return Check(name, PASSED, "finalized by rename from its tmp directory (an Orbax that records no commit)")


class Orbax(Framework):
    layout = LAYOUT
    names_first = True  # its tmp directories, by name alone
    read_whole = frozenset({METADATA, METRICS_FILE})
    items_like_steps = True  # in commit-file mode each item has its own commit_success.txt

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = _TMP.fullmatch(name) if is_dir else None
        return Candidate(name, int(m[1]), LAYOUT, True, in_progress=True) if m else None

    def recognise_contents(self, name: str, children: Collection[str]) -> Candidate | None:
        """A numeric directory is an Orbax step only with Orbax's own files in it: a run or team
        directory that happens to be called `42` is never mistaken for a checkpoint."""
        if (m := _NAME.fullmatch(name)) and _MARKERS & set(children):
            return Candidate(name, int(m[1]), LAYOUT, True)
        return None

    def evidence(self, save: Save) -> Evidence:
        items = items_check(save.path, save.files, save.remembered_file)
        return Evidence([_orbax(save.cand, save.path, save.files), items])

    def save_file(self, rel: str) -> bool:
        return rel in (COMMIT, METADATA)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        if rel == COMMIT:
            return lambda other: other == METADATA  # orbax atomicity: metadata, then commit
        return None

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        if METRICS_FILE in save.files:
            return from_orbax(save.path)
        return (), None


FRAMEWORK = Orbax()


def from_orbax(path: Path) -> Metrics:
    """Orbax's metrics item (`<step>/metrics/metrics`), or why it cannot be read."""
    try:
        with volread.open_file(path / METRICS_FILE) as f:
            doc = json.loads(f.read(MAX_METRICS_BYTES + 1))
    except (OSError, ValueError, RecursionError) as exc:
        return (), f"{METRICS_FILE} unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(doc, dict):
        return (), f"{METRICS_FILE} is not a JSON object"
    return tuple((str(k), Reading(as_metric(v), ORBAX_METRICS)) for k, v in doc.items()), None
# --- each item's own files: commit_success.txt is not proof its data arrived -------------------------
#
# A PyTree/Standard item saved with OCDBT (the default, `use_ocdbt: true` in its `_METADATA`) is a
# tensorstore OCDBT database: `<item>/manifest.ocdbt` (format_utils.is_ocdbt_checkpoint: without it
# Orbax reads the item as not OCDBT and restore fails) and its `d/` data files, merged from each
# process's own database `<item>/ocdbt.process_<i>/{manifest.ocdbt, d/}`, which the merged one keeps
# referencing (serialization/ocdbt_utils.py merge_ocdbt_per_process_files); a process's database
# is how ckptd knows an item is OCDBT when the merged manifest is gone. A copier that sends small
# files first brings both commit_success.txt files long before the data: the step's own commit says
# the save finished, never that this copy of it is whole. ckptd cannot read the manifest's references
# (a binary b-tree), so it asks that each database be there with at least one data file, none empty.

_OCDBT_MANIFEST = "manifest.ocdbt"
_OCDBT_PROCESS = "ocdbt.process_"


def _item_metadata_says_ocdbt(
    path: Path, files: Mapping[str, Entry], item: str, remembered: Remembered = read_now
) -> bool:
    """Whether `<item>/_METADATA` (PyTree handler's JSON) records `use_ocdbt: true`; False when it
    is absent or unreadable (then only the item's own OCDBT files say it)."""
    e = files.get(f"{item}/_METADATA")
    if e is None or e.kind != "f" or e.size > MAX_TRAINER_STATE_BYTES:
        return False

    def read() -> bool:
        try:
            with volread.open_file(path / item / "_METADATA") as f:
                doc = json.loads(f.read(MAX_TRAINER_STATE_BYTES + 1))
        except (ValueError, RecursionError):
            return False
        return isinstance(doc, dict) and doc.get("use_ocdbt") is True

    try:
        return remembered(f"{item}/_METADATA", read) is True
    except OSError:
        return False


def _ocdbt_database(files: Mapping[str, Entry], db: str) -> str | None:
    """Why the OCDBT database at `db` (relative to the step) is not there whole, or None."""
    manifest = files.get(f"{db}/{_OCDBT_MANIFEST}")
    if manifest is None or manifest.kind != "f":
        return f"{db}/{_OCDBT_MANIFEST} missing"
    if manifest.size == 0:
        return f"{db}/{_OCDBT_MANIFEST} is empty"
    data = [(rel, e) for rel, e in files.items() if rel.startswith(f"{db}/d/") and e.kind == "f"]
    if not data:
        return f"{db}/d/ has no data files"
    empty = sorted(rel for rel, e in data if e.size == 0)
    if empty:
        return f"{empty[0]} is empty"
    return None


def _named_items(path: Path, files: Mapping[str, Entry], remembered: Remembered = read_now) -> list[str]:
    """The item names `_CHECKPOINT_METADATA` records in `item_handlers` (none when it is absent,
    unreadable or names no items: then the directories alone say what the step holds)."""
    e = files.get(METADATA)
    if e is None or e.kind != "f" or e.size > MAX_TRAINER_STATE_BYTES:
        return []

    def read() -> list[str]:
        try:
            with volread.open_file(path / METADATA) as f:
                doc = json.loads(f.read(MAX_TRAINER_STATE_BYTES + 1))
        except (ValueError, RecursionError):
            return []
        handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
        if not isinstance(handlers, dict):
            return []
        return sorted(k for k in handlers if isinstance(k, str) and "/" not in k and k not in {"", ".", ".."})

    try:
        found = remembered(METADATA, read)  # the one framework read of this file: its item names
    except OSError:
        return []
    return found if isinstance(found, list) else []


def items_check(path: Path, files: Mapping[str, Entry], remembered: Remembered = read_now) -> Check:
    """Every item directory of the step that is an OCDBT database (by its own files, or by its
    `_METADATA`) holds its merged manifest and data."""
    name = "orbax items"
    items = sorted(rel for rel, e in files.items() if e.kind == "d" and "/" not in rel)
    # The items the step was saved with: `_CHECKPOINT_METADATA`'s `item_handlers`, a name for each
    # (checkpoint_manager.py `_save_checkpoint_metadata`; a bare string for an unnamed single item).
    # One not there is an item a copy never brought: restore raises `Item "<name>" was not found`.
    missing = sorted(set(_named_items(path, files, remembered)) - set(items))
    if missing:
        return Check(name, FAILED, f"item {missing[0]} missing ({METADATA} names it; restore fails)")
    counted = 0
    for item in items:
        here = {rel[len(item) + 1:] for rel in files if rel.startswith(f"{item}/")}
        processes = sorted({r.split("/", 1)[0] for r in here if r.startswith(_OCDBT_PROCESS)})
        ocdbt = bool(processes) or _OCDBT_MANIFEST in here or "d" in here
        if not ocdbt and not _item_metadata_says_ocdbt(path, files, item, remembered):
            continue
        counted += 1
        # Only the merged database: Orbax restores from it with a process's database gone
        # (measured, tests/completeness/test_damaged_saves.py: drop-ocdbt-process-dir restores in full).
        if (why := _ocdbt_database(files, item)) is not None:
            return Check(name, FAILED, f"{why}: the item's OCDBT data is not all there (restore fails)")
    if not counted:
        return Check(name, PASSED, "no OCDBT items")
    return Check(name, PASSED, f"{counted} OCDBT item(s): manifest.ocdbt and data files")
