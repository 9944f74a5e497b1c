"""Lightning's ModelCheckpoint: `epoch=E-step=S[-val_loss=V].ckpt`, and `last.ckpt`.

lightning/pytorch/callbacks/model_checkpoint.py names the file from its template
(`_format_checkpoint_name`), so its metrics are in the name; a name without the monitored one has it
in the file's `callbacks` state (`CkptScores`). A `.ckpt` file is written atomically on one
filesystem (fabric/utilities/cloud_io.py _atomic_save). Its strategies write directories named like
the file: DeepSpeedStrategy's tag `checkpoint/` (DeepSpeed's census), FSDPStrategy's sharded one
(DCP's files, then `meta.pt`). Under NeMo, NeMo's `-unfinished` marker says a save is not finished.

Its run is the experiment, not one launch's directory (`run_key`): every `Trainer.fit` with a
logger writes into a new `<save_dir>/<name>/version_N/checkpoints/`, a fit resumed with `ckpt_path`
included.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd import frameworks
from ckptd.frameworks import dsmeta, nemo
from ckptd.frameworks.base import (
    FAILED,
    PASSED,
    Evidence,
    Framework,
    Metrics,
    Save,
    pointer_target,
    unreadable_names_all,
)
from ckptd.frameworks.megatron import MEGATRON_CORE_METADATA
from ckptd.model import (
    CKPT_STATE,
    CONSUMED_SAMPLES,
    EPOCH,
    FILE_NAME,
    STEP,
    Candidate,
    Check,
    Entry,
    Reading,
)

LAYOUT = "lightning"

LIGHTNING_FSDP_META = "meta.pt"

# ModelCheckpoint's directory without a dirpath (lightning/pytorch/callbacks/model_checkpoint.py
# __resolve_ckpt_dir): os.path.join(save_dir, str(name), f"version_{version}", "checkpoints") of
# the first logger, where `version` is the next free number when none is given
# (loggers/tensorboard.py and fabric/loggers/csv_logs.py _get_next_version: max(version_N) + 1);
# a string version is used as it is, and is not a launch of a run that ckptd can tell.
_LAUNCH = re.compile(r"version_\d+")
CKPT_SUBDIR = "checkpoints"
DEFAULT_NAME = "lightning_logs"  # the loggers' default `name` (TensorBoardLogger, CSVLogger)


def run_key(rel: str) -> str:
    """`<exp>/lightning_logs/version_N/checkpoints` -> `<exp>` (the Trainer's default_root_dir, as a
    user names the experiment), `<save_dir>/<name>/version_N/checkpoints` -> `<save_dir>/<name>`
    (a logger's own name), `<save_dir>/version_N/checkpoints` -> `<save_dir>` (name=""); any other
    directory is its own run."""
    parts = rel.split("/")
    if len(parts) < 2 or parts[-1] != CKPT_SUBDIR or not _LAUNCH.fullmatch(parts[-2]):
        return rel
    above = parts[:-2]
    if above and above[-1] == DEFAULT_NAME:
        above = above[:-1]
    return "/".join(above) or "."


def _is_lightning_fsdp(cand: Candidate, files: dict[str, Entry]) -> bool:
    """Whether a `.ckpt` directory is Lightning FSDPStrategy's sharded checkpoint: DCP's files, then
    rank 0's `meta.pt` (lightning/pytorch/strategies/fsdp.py save_checkpoint), and none of
    megatron-core's own files (common.pt, written first; metadata.json)."""
    return (
        cand.name.endswith(".ckpt")
        and LIGHTNING_FSDP_META in files
        and not any(n in files for n in ("common.pt", MEGATRON_CORE_METADATA))
    )


def _lightning_fsdp(files: dict[str, Entry]) -> Check:
    """Lightning's FSDP sharded checkpoint is whole once DCP's `.metadata` (the coordinator writes it
    after every rank's data) and `meta.pt` (rank 0 writes it after the DCP save returns) are there."""
    name = "lightning fsdp (dcp .metadata, meta.pt)"
    if ".metadata" not in files:
        return Check(name, FAILED, "dcp .metadata missing (the coordinator writes it after every rank)")
    if files[LIGHTNING_FSDP_META].kind != "f":
        return Check(name, FAILED, f"{LIGHTNING_FSDP_META} is not a file")
    return Check(name, PASSED, f".metadata and {LIGHTNING_FSDP_META} present (written after DCP's save)")


def metrics(save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
    """Its metrics from its name, else (a `.ckpt` file whose name lacks `metric`) from ModelCheckpoint's
    state inside it."""
    cand, files, path = save.cand, save.files, save.path
    found = from_name(cand.name)
    named = metric is None or any(n == metric for n, _ in found)
    if named or cand.is_dir or not cand.name.endswith(".ckpt") or not whole:
        return found, None  # a file cut short: nothing to read, and no reason to import torch for it
    entry = files[""]
    read = scores(path, entry.size, entry.mtime_ns, entry.ctime_ns)
    if isinstance(read, str):
        return found, (
            f"{metric} is not in its name, and Lightning's ModelCheckpoint state in it "
            f"cannot be read: {read}"
        )
    extra = tuple((k, Reading(v, CKPT_STATE)) for k, v in read.items() if k not in dict(found))
    return found + extra, None


class Lightning(Framework):
    layout = LAYOUT
    held_suffixes = (".ckpt",)
    # a `.ckpt` file is a torch.save zip (fabric/utilities/cloud_io.py _atomic_save)
    whole_file_formats = ((".ckpt", "zip"),)

    def evidence(self, save: Save) -> Evidence:
        cand, run = save.cand, save.run
        # NeMo's callback wrote a marker for it, here or (one for every rank) above its rank directory
        if nemo.unfinished_marker(cand.name) in run.names or frameworks.is_rank_dir(run.path.name):
            return Evidence([nemo._nemo_unfinished(run, cand)])
        return Evidence()

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        return metrics(save, metric, whole, scores)

    def run_key(self, rel: str) -> str:
        return run_key(rel)

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        """A `.ckpt` file named by ModelCheckpoint's template (no NeMo `<name>--`), not a last copy."""
        if is_dir or not name.endswith(".ckpt") or "--" in name or is_last_copy(name):
            return None
        order = field_order(name)
        return None if order is None else Candidate(name, order[0], LAYOUT, False, unit=order[1])

    def makes_dir(self, name: str) -> bool:
        return bool(_MADE_DIR.fullmatch(name))

    def resume_copy(self, name: str) -> str | None:
        return LAST_COPY_NOTE if is_last_copy(name) else None
    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return last_link_targets(run_path, names)


FRAMEWORK = Lightning()


# Recognition by name. ModelCheckpoint names a file from its template's fields, `name=value` joined
# by '-' (_format_checkpoint_name, auto_insert_metric_name; `frameworks.name_fields`); NeMo's default
# template is `{name}--{monitor:.4f}-{epoch}` (+ `-{step}` or `-{consumed_samples}`).
def field_order(name: str) -> tuple[int, str] | None:
    """What a Lightning/NeMo name orders by: its step, else NeMo's consumed samples, else its epoch
    (then time, within one epoch)."""
    fields = frameworks.name_fields(name)
    for key, unit in (("step", STEP), ("consumed_samples", CONSUMED_SAMPLES), ("epoch", EPOCH)):
        value = fields.get(key)
        if value is not None and re.fullmatch(r"\d+(?:\.0*)?", value):
            return int(value.partition(".")[0]), unit
    return None


# Lightning's `last.ckpt` (save_last; `last-v1.ckpt` on a clash; a CHECKPOINT_NAME_LAST template
# such as `{epoch}-last`) and NeMo's `<name>--...-last` copies: rewritten in place or renamed
# each save, never a step of their own. A resume takes them (Lightning's ckpt_path="last",
# NeMo's resume_if_exists): ckptd never counts them and never deletes them.
_LAST_COPY = re.compile(r"(?:.*-)?last(?:-v\d+)?")
LAST_COPY_NOTE = (
    "a last copy (Lightning's last.ckpt, NeMo's -last): rewritten or renamed at every save and what a "
    "resume from 'last' loads; not a step: ckptd never counts it and never deletes it"
)
# Directories Lightning makes on the way to its checkpoints: `lightning_logs/version_<N>/checkpoints/`
# (TensorBoardLogger/CSVLogger's version directory, ModelCheckpoint's dirpath under it).
_MADE_DIR = re.compile(r"lightning_logs|version_\d+|checkpoints")


def is_last_copy(name: str) -> bool:
    """Lightning's `last.ckpt` or a NeMo `-last` copy: not a step of its own (see _LAST_COPY)."""
    return bool(_LAST_COPY.fullmatch(name.removesuffix(".ckpt").removesuffix(".nemo")))


# Metrics. Lightning puts them in the file name when the template names them
# (`epoch=3-step=40-val_loss=0.52.ckpt`), rounded as the template formats them; and it keeps, inside
# every `.ckpt`, its ModelCheckpoint callback's state (`ckpt["callbacks"]["ModelCheckpoint{'monitor':
# 'val_loss', ...}"]`): `best_k_models` maps each file it saved (absolute paths, as written) to its
# score, a 0-d tensor, and is updated *before* the file is written
# (lightning/pytorch/callbacks/model_checkpoint.py `_update_best_and_save`), so the file is listed in
# its own state. `current_score` is not used: a second callback (one without a monitor) stores the
# first one's `current_score` from an earlier save in its own files.
#
# Reading a `.ckpt` needs torch (`torch.load(weights_only=True, mmap=True)`, lazily imported, as
# `dsmeta.load_safely` does): it is done only when the metric is not in the file name, only for a
# file whose zip is whole, once per (path, size, mtime), and never decides completeness. Without
# torch the value is missing and `plan` says why.
Readings = tuple[tuple[str, Reading], ...]


def from_name(name: str) -> Readings:
    """The numeric fields of a Lightning/NeMo checkpoint name (step and epoch included)."""
    return tuple((k, Reading(float(v), FILE_NAME)) for k, v in frameworks.name_fields(name).items())


class CkptScores:
    """Lightning's ModelCheckpoint scores inside `.ckpt` files, remembered per (path, size, mtime,
    ctime): a file rewritten in place with its mtime kept still changes its ctime."""

    MAX_CACHE = 4096

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, int, int], dict[str, float] | str] = {}

    def read(self, path: Path, size: int, mtime_ns: int, ctime_ns: int) -> dict[str, float] | str:
        """{monitor: this file's score} for each ModelCheckpoint that lists the file, or why not."""
        key = (str(path), size, mtime_ns, ctime_ns)
        if key not in self._cache:
            if len(self._cache) > self.MAX_CACHE:  # files rewritten leave stale keys behind
                self._cache.clear()
            self._cache[key] = ckpt_scores(path)
        return self._cache[key]


def ckpt_scores(path: Path) -> dict[str, float] | str:
    """The score each ModelCheckpoint callback recorded for this very file, by its monitor."""
    try:
        ckpt = dsmeta.load_safely(path)  # torch.load(weights_only=True, mmap=True); MetadataUnavailable
    except dsmeta.MetadataUnavailable as exc:
        return str(exc)
    callbacks = ckpt.get("callbacks")
    if not isinstance(callbacks, dict):
        return "it holds no callback state"
    scores: dict[str, float] = {}
    for state in callbacks.values():
        if not (isinstance(state, dict) and isinstance(state.get("monitor"), str)):
            continue
        best_k = state.get("best_k_models")
        for saved, score in best_k.items() if isinstance(best_k, dict) else ():
            # Paths are absolute as written: the volume may be mounted elsewhere now.
            if isinstance(saved, str) and os.path.basename(saved) == path.name:
                value = _number(score)
                if value is not None:
                    scores[state["monitor"]] = value
    if not scores:
        return "no ModelCheckpoint with a monitor lists this file in its state"
    return scores


def _number(score: object) -> float | None:
    """A 0-d tensor (or a plain number) as a float."""
    if isinstance(score, int | float) and not isinstance(score, bool):
        return float(score)
    numel = getattr(score, "numel", None)
    if callable(numel) and numel() == 1:
        try:
            value = float(score.item())  # type: ignore[attr-defined]
        except (TypeError, ValueError, RuntimeError):
            return None
        return value
    return None
def last_link_targets(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """The checkpoints a `*last*` symlink of the run names: ModelCheckpoint's `last.ckpt` with
    save_last="link" (a link to the file it saved last, what ckpt_path="last" loads), and NeMo's
    `-last` links (NeMo's callback is a ModelCheckpoint). Deleting the target leaves the link dangling
    and the resume with nothing to load, so it is kept like what a resume pointer names. The link is
    read with os.readlink and resolved as a pointer is (`pointer_target`): only entries of this run
    are named. A link whose target cannot be read may name any checkpoint here: every one is named by it."""
    found: dict[str, str] = {}
    for link in sorted(n for n in names if "last" in n.lower()):
        try:
            text = os.readlink(run_path / link)
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                continue  # not a symlink: a copy, not a pointer
            why = f"{link} (a symlink that cannot be read: {exc.strerror or exc}; it may name any of them)"
            unreadable_names_all(found, names, why)
            continue
        for name in pointer_target(run_path, text):
            if name != link:
                found.setdefault(name, f"{link} (a symlink to it)")
    return found
