"""Orbax's CheckpointManager: `[<prefix>_]<step>/`, in progress as `<that>.orbax-checkpoint-tmp*`.

orbax/checkpoint/_src/path/atomicity.py: a step is saved into a tmp directory renamed into place
(AtomicRenameTemporaryPath) or in place with `commit_success.txt` written last
(CommitFileTemporaryPath); `_CHECKPOINT_METADATA` comes before the commit. Its metrics are in
`metrics/metrics` (fwmetrics.from_orbax).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ckptd import fwmetrics, layouts, volread
from ckptd.frameworks.base import MAX_POINTER_BYTES, Evidence, Framework, Metrics, Save
from ckptd.layouts import Candidate
from ckptd.model import Check, Entry, Verdict

PASSED, FAILED, UNKNOWN = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN

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
    if layouts.ORBAX_COMMIT in files and files[layouts.ORBAX_COMMIT].kind == "f":
        return Check(name, PASSED, f"{layouts.ORBAX_COMMIT} present")
    meta = files.get(layouts.ORBAX_METADATA)
    if meta is None or meta.kind != "f":
        return Check(name, FAILED, f"neither {layouts.ORBAX_COMMIT} nor {layouts.ORBAX_METADATA}")
    try:
        with volread.open_file(path / layouts.ORBAX_METADATA) as f:
            doc = json.loads(f.read(MAX_POINTER_BYTES * 16))
    except (OSError, ValueError, RecursionError) as exc:
        return Check(name, UNKNOWN, f"{layouts.ORBAX_METADATA} unreadable: {type(exc).__name__}: {exc}")
    if not isinstance(doc, dict):
        return Check(name, UNKNOWN, f"{layouts.ORBAX_METADATA} is not a JSON object")
    if "commit_timestamp_nsecs" in doc:
        why = (
            f"no {layouts.ORBAX_COMMIT}: saved in place (Orbax's commit-file mode) and never committed, "
            "or killed while committing"
        )
        return Check(name, FAILED, why)
    return Check(name, PASSED, "finalized by rename from its tmp directory (an Orbax that records no commit)")



class Orbax(Framework):
    layout = layouts.ORBAX
    read_whole = frozenset({layouts.ORBAX_METADATA, fwmetrics.ORBAX_METRICS_FILE})
    items_like_steps = True  # in commit-file mode each item has its own commit_success.txt

    def evidence(self, save: Save) -> Evidence:
        return Evidence([_orbax(save.cand, save.path, save.files)])

    def save_file(self, rel: str) -> bool:
        return rel in (layouts.ORBAX_COMMIT, layouts.ORBAX_METADATA)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        if rel == layouts.ORBAX_COMMIT:
            return lambda other: other == layouts.ORBAX_METADATA  # orbax atomicity: metadata, then commit
        return None

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        if fwmetrics.ORBAX_METRICS_FILE in save.files:
            return fwmetrics.from_orbax(save.path)
        return (), None


FRAMEWORK = Orbax()
