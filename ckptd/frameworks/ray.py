"""Ray Train (2.x, the default "v2" trainers): `checkpoint_<date>_<time>/` directories and the run's snapshot.

The save contract, from Ray 2.60's own code:

- A worker's `ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))` copies the checkpoint's
  files into the run directory `<storage_path>/<name>/checkpoint_%Y-%m-%d_%H-%M-%S.%f/`
  (ray/train/v2/_internal/execution/storage.py `make_default_checkpoint_dir_name`, `persist_current_checkpoint`:
  `create_dir`, then `_pyarrow_fs_copy_files` file by file, in place; no marker, no rename). The files are
  the user's own: Ray writes none of its own into the checkpoint, so nothing inside it says it is finished.
- Afterwards the controller registers it (checkpoint_manager.py `CheckpointManager.register_checkpoint`) and
  writes the run's `checkpoint_manager_snapshot.json` beside the checkpoints (`_write_state_to_storage`,
  rewritten in place): `checkpoint_results` (each `checkpoint_dir_name` with the metrics reported with it),
  `latest_checkpoint_result`. That record is the commit: a checkpoint it does not name was never
  registered (a copy killed midway, or one still being copied or not yet registered), and Ray's restore does
  not know it. So: complete exactly when the snapshot names it.
- Ray's restore (the same `RunConfig(storage_path, name)` launched again) loads the snapshot
  (`_maybe_load_state_from_storage`), hands `latest_checkpoint_result` to `ray.train.get_checkpoint()`, and
  refuses the whole run (`_assert_checkpoints_exist`: CheckpointManagerInitializationError, "a reference to a
  checkpoint that does not exist anymore") when any checkpoint the snapshot lists is gone. So every
  checkpoint the snapshot lists is a resume pointer's target (`resume_pointers`): ckptd never deletes one.
- `CheckpointConfig(num_to_keep=K, checkpoint_score_attribute=...)` (`_save_state_and_delete_old_checkpoints`)
  drops the worst beyond K (by the score, else the oldest), never the latest, from the snapshot *before* it
  deletes their directories. So what Ray keeps is what its snapshot lists, and ckptd keeps all of that:
  retention of a Ray run is Ray's own; `keep_*` cannot reproduce it any other way without breaking the
  restore. A directory Ray dropped from the snapshot but did not finish deleting is not registered: it is
  incomplete, and kept as every incomplete checkpoint is.

Its order is the time in its name (`unit` "save time": the digits of the name, as microseconds); its metrics
are those reported with it, read from the snapshot. The older trainers' `checkpoint_00000N` names (Ray Train
V1 and Ray Tune, `RAY_TRAIN_V2_ENABLED=0`) are Ray's too: their contract is in rayv1.py, the same layout.
"""

from __future__ import annotations

import calendar
import json
import re
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd.frameworks import rayv1
from ckptd.frameworks.base import (
    MAX_TRAINER_STATE_BYTES,
    Evidence,
    Framework,
    Metrics,
    Save,
    unreadable_names_all,
)
from ckptd.model import Candidate, Check, Reading, Verdict, as_metric
from ckptd.volume import volread

LAYOUT = "ray"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # ray/train/v2/_internal/constants.py
SAVE_TIME = "save time"  # what a Ray checkpoint's number counts: the microseconds its name's time stands for
SNAPSHOT_METRICS = "ray checkpoint_manager_snapshot.json"  # where its metrics are read
V1_METRICS = "ray result.json"
_NAME = re.compile(r"checkpoint_(\d{4})-(\d\d)-(\d\d)_(\d\d)-(\d\d)-(\d\d)\.(\d{6})")


def name_time(name: str) -> int | None:
    """The microseconds a `checkpoint_%Y-%m-%d_%H-%M-%S.%f` name stands for (its local time read as UTC:
    only their order matters), or None."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    y, mo, d, h, mi, s, us = (int(g) for g in m.groups())
    if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 62):
        return None
    return calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) * 1_000_000 + us


class Unreadable(Exception):
    """The snapshot is there but cannot be read or parsed (Ray rewrites it in place: a reader may meet
    it half-written)."""


Listed = tuple[str | None, dict[str, dict[str, object]]]


def read_snapshot(run: Path) -> Listed | None:
    """(the latest's checkpoint_dir_name, {checkpoint_dir_name: its reported metrics} of every
    checkpoint the run's snapshot lists); None when there is no snapshot. Raises Unreadable."""
    try:
        raw = volread.read_bytes(run / SNAPSHOT, MAX_TRAINER_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(f"{SNAPSHOT} cannot be read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_TRAINER_STATE_BYTES:
        raise Unreadable(f"{SNAPSHOT} is over {MAX_TRAINER_STATE_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{SNAPSHOT} is not whole JSON ({exc}): being rewritten?") from exc
    results = doc.get("checkpoint_results") if isinstance(doc, dict) else None
    if not isinstance(results, list):
        raise Unreadable(f"{SNAPSHOT} has no checkpoint_results list")
    latest = doc.get("latest_checkpoint_result")
    listed: dict[str, dict[str, object]] = {}
    for r in [latest, *results, *(doc.get("pending_training_results") or [])]:
        if isinstance(r, dict) and isinstance(name := r.get("checkpoint_dir_name"), str):
            metrics = r.get("metrics")
            listed.setdefault(name, metrics if isinstance(metrics, dict) else {})
    latest_name = latest.get("checkpoint_dir_name") if isinstance(latest, dict) else None
    return (latest_name if isinstance(latest_name, str) else None), listed


class Ray(Framework):
    layout = LAYOUT
    # `checkpoint_2026-12-07_17-45-32.517380` is Ray's unless the user's own pattern says otherwise: a
    # pattern such as `checkpoint_{time}` is asked first (layouts.recognise_by_name), so it keeps its meaning
    names_first = False
    named_alone = True  # its contents are the user's: the snapshot, not a file inside, says what it is
    # rewritten in place after every registration (V1: copied over from the driver's staging directory):
    # the plan notices a rewrite
    run_files = (SNAPSHOT, rayv1.RESULT)

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        if not is_dir:
            return None
        if (t := name_time(name)) is not None:
            return Candidate(name, t, LAYOUT, True, unit=SAVE_TIME)
        if (i := rayv1.index(name)) is not None:
            return Candidate(name, i, LAYOUT, True, unit=rayv1.INDEX)
        return None

    def outside_run_files(self, run_path: Path, names: Collection[str]) -> tuple[Path, ...]:
        """A V1 trial's experiment state, in the directory above it."""
        if not rayv1.is_trial(names) or (state := rayv1.newest_state(run_path.parent)) is None:
            return ()
        return (run_path.parent / state,)

    def evidence(self, save: Save) -> Evidence:
        if rayv1.index(save.cand.name) is not None:
            return Evidence([v1_registration(save)])
        kind = "ray registration"
        name = save.cand.name
        try:
            listed = read_snapshot(save.run.path)
        except Unreadable as exc:
            return Evidence([Check(kind, Verdict.UNKNOWN, str(exc))])
        if listed is None:
            return Evidence([Check(kind, Verdict.FAILED, (
                f"no {SNAPSHOT} beside it: Ray registers a checkpoint there after every worker's files are "
                "copied; its restore knows none"))])
        if name not in listed[1]:
            return Evidence([Check(kind, Verdict.FAILED, (
                f"not in {SNAPSHOT}: never registered (its copy killed midway, or not finished yet); Ray's "
                "restore does not know it"))])
        return Evidence([Check(kind, Verdict.PASSED, f"registered in {SNAPSHOT} (written after its files)")])

    def run_evidence(self, save: Save) -> Check | None:
        """A save a user's pattern names in a run directory that holds Ray's snapshot (`checkpoint_{time}`
        over Ray's own names, or a pattern for `report(checkpoint_dir_name=...)`'s): Ray owns that
        directory, and its registration decides as for its own saves. A copy cut short beside
        whatever files the pattern requires is not registered, and Ray's restore does not know it."""
        if save.cand.layout == LAYOUT:
            return None
        if SNAPSHOT in save.run.names:
            return self.evidence(save).checks[0]
        if rayv1.is_trial(save.run.names) and rayv1.index(save.cand.name) is not None:
            return v1_registration(save)  # `checkpoint_{step}` over a V1 trial's own names
        return None

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        if rayv1.index(save.cand.name) is not None:
            return v1_metrics(save)
        try:
            listed = read_snapshot(save.run.path)
        except Unreadable as exc:
            return (), str(exc)
        if listed is None or save.cand.name not in listed[1]:
            return (), f"not in {SNAPSHOT}: Ray keeps the metrics reported with a checkpoint there"
        out = []
        for k, v in listed[1][save.cand.name].items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                out.append((str(k), Reading(as_metric(v), SNAPSHOT_METRICS)))
        return tuple(out), None

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return {**rayv1.resume_targets(run_path, names), **snapshot_targets(run_path, names)}


def v1_registration(save: Save) -> Check:
    """A V1 checkpoint is complete when the newest experiment state's checkpoint manager holds it (what
    Ray's restore knows); without an experiment state, when the trial's result.json names it (reported,
    so copied whole)."""
    kind = "ray registration"
    try:
        record, held, _ = rayv1.registered(save.run.path)
    except rayv1.Unreadable as exc:
        return Check(kind, Verdict.UNKNOWN, str(exc))
    if held is None:
        return Check(kind, Verdict.FAILED, (
            f"no {rayv1.RESULT} and no experiment state: Ray reports a checkpoint there once its files are "
            "copied, and its restore knows none"))
    if save.cand.name not in held:
        return Check(kind, Verdict.FAILED, (
            f"not in {record}: never registered, or not yet saved there (its copy killed midway, or not "
            "finished yet); Ray's restore does not know it"))
    return Check(kind, Verdict.PASSED, f"registered in {record} (written after its files)")


def v1_metrics(save: Save) -> Metrics:
    """The result reported with a V1 checkpoint, from the trial's result.json (Ray keeps no metrics in
    the checkpoint; `Result.from_path` pairs them the same way): `training_iteration` among them."""
    try:
        records = rayv1.result_records(save.run.path)
    except rayv1.Unreadable as exc:
        return (), str(exc)
    if records is None or save.cand.name not in records:
        return (), f"not in {rayv1.RESULT}: Ray keeps the metrics reported with a checkpoint there"
    out = []
    for k, v in _flat(records[save.cand.name]):
        if isinstance(v, int | float) and not isinstance(v, bool):
            out.append((k, Reading(as_metric(v), V1_METRICS)))
    return tuple(out), None


def _flat(metrics: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, object]]:
    """A result's metrics with nested ones named by their path joined with "/": Ray ranks by
    `checkpoint_score_attribute="eval/loss"` for `report({"eval": {"loss": ...}})` so (checkpoint_manager.py
    `_get_checkpoint_score`: ray/_private/dict.py `flatten_dict`)."""
    out: list[tuple[str, object]] = []
    for k, v in metrics.items():
        if isinstance(v, dict) and depth < 8:
            out += _flat(v, f"{prefix}{k}/", depth + 1)
        else:
            out.append((f"{prefix}{k}", v))
    return out


def snapshot_targets(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """Every checkpoint the run's snapshot lists: Ray's restore resumes from its latest and refuses the
    run when any listed one is missing. A snapshot that cannot be read or parsed may list any of them."""
    found: dict[str, str] = {}
    if SNAPSHOT not in names:
        return found
    try:
        listed = read_snapshot(run_path)
    except Unreadable as exc:
        unreadable_names_all(found, [n for n in names if _NAME.fullmatch(n)], f"{exc}; it may list any of them")
        return found
    latest, listed_names = listed if listed is not None else (None, {})
    for name in listed_names:
        if name in names:
            found[name] = (f"{SNAPSHOT} (the latest: what Ray's restore resumes from)" if name == latest else
                           f"{SNAPSHOT} (listed: Ray's restore refuses the run if it is gone)")
    return found


FRAMEWORK = Ray()
