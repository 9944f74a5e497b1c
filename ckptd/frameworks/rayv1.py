"""Ray Train V1 and Ray Tune (`RAY_TRAIN_V2_ENABLED=0`, the default up to Ray 2.50): a trial directory's
`checkpoint_00000N/` directories, its `result.json`, and the experiment state beside the trials.

The save contract, from Ray 2.60's own code (ray/train/_internal, ray/tune):

- A worker's `ray.train.report(metrics, checkpoint=...)` copies the checkpoint's files into
  `<storage_path>/<experiment>/<trial>/checkpoint_%06d` (storage.py
  `StorageContext._make_checkpoint_dir_name`, `persist_current_checkpoint`: `create_dir`, then
  `_pyarrow_fs_copy_files` file by file, in place; no marker, no rename), and only then reports the
  result, with `checkpoint_dir_name` added to its metrics (session.py `_TrainSession.report`). Nothing
  inside a checkpoint says it is finished.
- The driver appends the result to the trial's `result.json` in its staging directory (tune/logger/json.py
  `JsonLoggerCallback.log_trial_result`), then registers the checkpoint (tune_controller.py
  `_process_trial_save`, trial.py `Trial.on_checkpoint`, checkpoint_manager.py
  `_CheckpointManager.register_checkpoint`: it drops the worst beyond `num_to_keep` from its list, never the
  latest, and deletes their directories). The trial's checkpoint manager is saved, cloudpickled, in the
  experiment's `experiment_state-<date>.json` (tune_controller.py `TuneController.save_to_dir`), and the
  staging directory (that file, each trial's result.json) is copied over the storage's
  (experiment_state.py `_ExperimentCheckpointManager.sync_up_experiment_state`): throttled, rewritten in
  place.
- Ray's restore (`Trainer.restore(path)`, `Tuner.restore`) reads the newest experiment state
  (`_find_newest_experiment_checkpoint`: the greatest file name) and resumes each trial from its checkpoint
  manager's latest result (tune_controller.py `_schedule_trial_restore`). So a checkpoint is complete exactly
  when that state's checkpoint manager names it: one it does not name was never registered, or not yet saved
  there (a copy killed midway, one still being copied), and the restore does not know it; its latest (the
  greatest index: indexes only grow, and the latest is never dropped) is what the restore resumes from. A
  trial directory with no experiment state beside it (copied out alone) has only its result.json: a
  checkpoint named there was copied whole before it was reported.

The state's checkpoint manager is a pickle: ckptd never unpickles it, it reads its strings
(`pickletools.genops`, which runs nothing) for the checkpoint paths of this trial.
"""

from __future__ import annotations

import json
import os
import pickletools
import re
from collections.abc import Collection
from pathlib import Path

from ckptd.model import KEPT_FOR
from ckptd.volume import volread

NAME = re.compile(r"checkpoint_(\d{6,})")  # storage.py `_make_checkpoint_dir_name`: f"checkpoint_{index:06d}"
RESULT = "result.json"  # ray/tune/result.py EXPR_RESULT_FILE
STATE_PREFIX, STATE_SUFFIX = "experiment_state-", ".json"  # tune_controller.py CKPT_FILE_TMPL
MAX_RECORD_BYTES = 256 * 1024 * 1024  # result.json holds every result of a run: more than a trainer's JSON
INDEX = "checkpoint index"  # what a V1 checkpoint's number counts (its reports with a checkpoint, from 0)


class Unreadable(Exception):
    """A record is there but cannot be read or parsed (Ray copies both over the old ones in place)."""


def index(name: str) -> int | None:
    m = NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def _read(path: Path, what: str) -> bytes | None:
    try:
        raw = volread.read_bytes(path, MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(f"{what} cannot be read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_RECORD_BYTES:
        raise Unreadable(f"{what} is over {MAX_RECORD_BYTES} bytes")
    return raw


def result_records(trial: Path) -> dict[str, dict[str, object]] | None:
    """{checkpoint_dir_name: the metrics of the last result reported with it} from the trial's result.json
    (as `ray.train.Result.from_path` pairs them), None without one. A last line without its newline is
    being written and is left out. Raises Unreadable."""
    raw = _read(trial / RESULT, RESULT)
    if raw is None:
        return None
    found: dict[str, dict[str, object]] = {}
    lines = raw.split(b"\n")
    for n, line in enumerate(lines[:-1]):  # the last is empty, or a line not yet ended
        if not line.strip():
            continue
        try:
            result = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise Unreadable(f"{RESULT} line {n + 1} is not JSON ({exc}): being copied over?") from exc
        if isinstance(result, dict) and isinstance(name := result.get("checkpoint_dir_name"), str):
            found[name] = result
    return found


def newest_state(experiment: Path) -> str | None:
    """The experiment state Ray's restore reads (`_find_newest_experiment_checkpoint`: the greatest name)."""
    try:
        names = os.listdir(experiment)
    except OSError:
        return None
    states = [n for n in names if n.startswith(STATE_PREFIX) and n.endswith(STATE_SUFFIX)]
    return max(states) if states else None


def experiment_checkpoints(trial: Path) -> tuple[str, set[str]] | None:
    """(the state's file name, the checkpoint names its checkpoint manager holds for `trial`) from the
    newest experiment state in the trial's parent; None when there is none. Raises Unreadable."""
    experiment = trial.parent
    state = newest_state(experiment)
    if state is None:
        return None
    raw = _read(experiment / state, state)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{state} is not whole JSON ({exc}): being copied over?") from exc
    trials = doc.get("trial_data") if isinstance(doc, dict) else None
    if not isinstance(trials, list):
        raise Unreadable(f"{state} has no trial_data list")
    names: set[str] = set()
    for entry in trials:
        metadata = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        try:
            metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
            manager = metadata.get("checkpoint_manager") if isinstance(metadata, dict) else None
            pickled = bytes.fromhex(manager["value"]) if isinstance(manager, dict) else None
        except (ValueError, TypeError, KeyError) as exc:
            raise Unreadable(f"{state}: a trial's checkpoint_manager cannot be read ({exc})") from exc
        if pickled is not None:
            names |= _checkpoints_of(pickled, trial.name, state)
    return state, names


def _checkpoints_of(pickled: bytes, trial_name: str, state: str) -> set[str]:
    """The checkpoint directories of trial `trial_name` a pickled `_CheckpointManager` holds: each kept
    result's `Checkpoint.path` (absolute where Ray wrote it: matched by its last two names, so a volume
    mounted elsewhere reads the same). Its opcodes are read, nothing in it is run."""
    found: set[str] = set()
    try:
        for _op, arg, _pos in pickletools.genops(pickled):
            if isinstance(arg, str) and "/" in arg:
                parent, _, name = arg.rstrip("/").rpartition("/")
                if NAME.fullmatch(name) and os.path.basename(parent) == trial_name:
                    found.add(name)
    except (ValueError, EOFError) as exc:
        raise Unreadable(f"{state}: a trial's checkpoint_manager is not a whole pickle ({exc})") from exc
    return found


PARAMS = "params.json"  # tune/logger/json.py `JsonLoggerCallback.log_trial_start`: written as a trial starts


def is_trial(names: Collection[str]) -> bool:
    """Whether a directory holding `names` is a Ray Tune trial's: its params.json and result.json."""
    return RESULT in names and PARAMS in names


def registered(trial: Path) -> tuple[str, set[str] | None, dict[str, dict[str, object]] | None]:
    """(the record that decides, the names it registers or None, the result.json records).
    Raises Unreadable."""
    records = result_records(trial)
    state = experiment_checkpoints(trial)
    if state is not None:
        return state[0], state[1], records
    return RESULT, (set(records) if records is not None else None), records


def resume_targets(trial: Path, names: Collection[str]) -> dict[str, str]:
    """The checkpoint Ray's restore resumes the trial from: the greatest index its experiment state
    holds (storage.py numbers them in order; `register_checkpoint` never drops the latest). Only that
    one: V1's restore loads the latest alone, and when it later drops one that is gone,
    `_delete_fs_path` raises and tune_controller.py `_process_trial_save` logs it and carries on. A
    state that cannot be read may name any."""
    ours = [n for n in names if NAME.fullmatch(n)]
    if not ours or not is_trial(names):
        return {}
    try:
        state = experiment_checkpoints(trial)
    except Unreadable as exc:
        return {n: f"{exc}; it may name any of them" for n in ours}
    if state is None or not (held := state[1] & set(ours)):
        return {}
    latest = max(state[1], key=lambda n: index(n) or 0)
    if latest in held:
        return {latest: f"{state[0]} (the trial's latest: what Ray's restore resumes from)"}
    # The state's latest is gone: `register_checkpoint` deletes the dropped latest before the controller
    # saves the state naming the new one, so a job killed between them leaves a state whose restore fails
    # (trainable.py `Trainable.restore`: "Could not recover from checkpoint as it does not exist on
    # storage anymore"). Which one the user resumes from by hand is theirs to choose: all are kept.
    return {n: (f"{KEPT_FOR}{state[0]} names {latest} as the trial's latest and it is gone: Ray's restore "
                "fails; every checkpoint the state holds is kept for a resume by hand") for n in held}
