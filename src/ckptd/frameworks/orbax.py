"""Orbax's CheckpointManager: `[<prefix>_]<step>/`, in progress as `<that>.orbax-checkpoint-tmp*`.

orbax/checkpoint/_src/path/atomicity.py: a step is saved into a tmp directory renamed into place
(AtomicRenameTemporaryPath) or in place with `commit_success.txt` written last
(CommitFileTemporaryPath); `_CHECKPOINT_METADATA` comes before the commit. Its metrics are in
`metrics/metrics` (`from_orbax`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd import volread
from ckptd.frameworks.base import MAX_POINTER_BYTES, Evidence, Framework, Metrics, Save
from ckptd.layouts import Candidate
from ckptd.model import ORBAX_METRICS, Check, Entry, Reading, Verdict, as_metric

PASSED, FAILED, UNKNOWN = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN

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
    are in tests/FWGEN_NOTES.md).

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
        return Evidence([_orbax(save.cand, save.path, save.files)])

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
