"""Keras 3's `keras.callbacks.ModelCheckpoint`: `<template>.keras` files, or `<template>.weights.h5`.

keras/src/callbacks/model_checkpoint.py `_save_model` formats `filepath` with `epoch=epoch + 1` and
the logs (`model-{epoch:02d}-{val_loss:.2f}.keras`) and calls `model.save` (saving_lib.save_model:
a zip written in place, `open(filepath, "wb")`, not atomic: metadata.json, config.json, then
model.weights.h5, the central directory at close) or, with `save_weights_only`, `model.save_weights`
(one HDF5 file written in place by h5py). A save killed midway leaves the final name: a zip
without its central directory, an HDF5 file whose superblock does not end where the file does
(HDF5 writes the end-of-file address at close).

Its step is the epoch: `epoch=<N>` (or `step=`, `batch=`) in the name, the template naming its fields
as Lightning's do (`model-epoch={epoch:02d}-val_loss={val_loss:.3f}.keras`); its metrics are the other
`name=value` fields. Keras's own docs and examples name them otherwise
(`model.{epoch:02d}-{val_loss:.2f}.keras`, `epoch{epoch:02d}-val_loss{val_loss:.3f}.keras`,
`w-{epoch:02d}.weights.h5`): there the epoch is the whole number that varies between the saves of
one template (`recognise_among`: two saves or more, their names alike but for their numbers),
zero-padded or after the word `epoch`/`ep`, set apart by a separator before it and a separator or
the end after it, so that `resnet50.keras` beside `resnet101.keras`, `llama-7b.keras` beside
`llama-13b.keras` or `yolo-5.keras` beside `yolo-8.keras` is no run; a metric is a `{name:.Nf}`
field whose name shows before it (`val_loss0.312`). A name alone without such a field is never
taken for a checkpoint, so never touched: a bare number proves nothing (`resnet50.keras` is a
model, not epoch 50), nor does `best.keras` (rewritten in place by save_best_only).

A zero-padded epoch is the only sign that some templates' numbers are epochs (`w-{epoch:02d}`): from
epoch 10 on, `w-10`, `w-11` alone show none, and are no run. So the newest save of such a template
whose epoch shows its padding (`w-09.weights.h5`) is kept while later saves of the template depend on
it (`resume_pointers`, said as its own reason): deleting it would leave the run unrecognised, its
later saves never listed, never pruned, and `ckptd latest` naming nothing.

`BackupAndRestore(backup_dir)` (keras/src/callbacks/backup_and_restore.py) rewrites
`backup_dir/latest.weights.h5` and `training_metadata.json` every epoch and restores from them when
fit starts again: `latest.weights.h5` is a resume copy (`resume_copy`), never a step, never counted
or deleted, and a directory holding it is never deleted as one checkpoint (`layouts.held`).
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from ckptd import frameworks
from ckptd.frameworks.base import Evidence, Framework, Metrics, Save
from ckptd.model import EPOCH, FILE_NAME, KEPT_FOR, STEP, Candidate, Check, Reading, Verdict, as_metric
from ckptd.volume import volread

LAYOUT = "keras"
KERAS, WEIGHTS_H5 = ".keras", ".weights.h5"
_ARCHIVE_MEMBERS = ("metadata.json", "config.json")  # saving_lib._METADATA_FILENAME, _CONFIG_FILENAME
_WEIGHTS_MEMBERS = ("model.weights.h5", "model.weights.npz")  # saving_lib._VARS_FNAME + its formats
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
BACKUP_WEIGHTS = "latest.weights.h5"  # BackupAndRestore's (backup_and_restore.py `_weights_path`)
BACKUP_NOTE = ("BackupAndRestore's backup (keras/src/callbacks/backup_and_restore.py): rewritten every "
               "epoch, what fit restores from; never a step of its own, never counted or deleted")

# A template's numbers as Keras formats them (`{epoch:02d}`, `{val_loss:.2f}`, `{lr:.1e}`)
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_EPOCH_WORD = re.compile(r"(?:^|[^A-Za-z0-9])(?:epoch|epochs|ep|e)$", re.IGNORECASE)
# A metric whose name shows before its value: `val_loss0.312`, `acc_0.91` (a float: `{name:.Nf}`)
_NAMED_VALUE = re.compile(r"([A-Za-z][A-Za-z0-9_]*?)[_=:]?(-?\d+\.\d+(?:[eE][-+]?\d+)?)(?![\d.])")


Saved = tuple[str, list[str]]  # a save of a template: its name, the numbers in it


def _stem(name: str) -> str:
    return name.removesuffix(WEIGHTS_H5).removesuffix(KERAS)


def _suffix(name: str) -> str:
    return WEIGHTS_H5 if name.endswith(WEIGHTS_H5) else KERAS


def _epoch_position(literals: tuple[str, ...], numbers: list[list[str]]) -> int | None:
    """Which of a template's numbers is the epoch: the first whole number that varies between its
    saves, written as an epoch is (the word epoch before it, or zero-padded: `{epoch:02d}`), with a
    separator before it (or the word) and a separator or the end after it. `yolo-5.keras` beside
    `yolo-8.keras`, `model-2023.keras` beside `model-2024.keras` are no run."""
    for i in range(len(numbers[0])):
        column = [n[i] for n in numbers]
        if not all(v.isdigit() for v in column) or len({int(v) for v in column}) < 2:
            continue
        before, after = literals[i], literals[i + 1]
        worded = _EPOCH_WORD.search(before) is not None
        padded = any(len(v) > 1 and v.startswith("0") for v in column)
        apart_before = worded or before == "" or not before[-1].isalnum()
        apart_after = after == "" or not after[0].isalnum()
        if (worded or padded) and apart_before and apart_after:
            return i
    return None


def named_metrics(stem: str) -> dict[str, str]:
    """The `{name:.Nf}` fields of a name where the name shows before the value (`val_loss0.312`)."""
    return {m[1].rstrip("_"): m[2] for m in _NAMED_VALUE.finditer(stem)}


def archive_problem(path: str, size: int) -> str | None:
    """Why a `.keras` zip is not a whole save, or None: its central directory (written at close) and
    the members saving_lib writes."""
    try:
        with volread.open_file(path) as f, zipfile.ZipFile(f) as zf:
            names = set(zf.namelist())
    except zipfile.BadZipFile as exc:
        return f"not a whole zip archive ({exc}): a save killed midway?"
    missing = [m for m in _ARCHIVE_MEMBERS if m not in names]
    if not any(w in names for w in _WEIGHTS_MEMBERS):
        missing.append(_WEIGHTS_MEMBERS[0])
    return f"{', '.join(missing)} missing from the archive" if missing else None


def hdf5_problem(path: str, size: int) -> str | None:
    """Why a `.weights.h5` file is not whole, or None: HDF5's superblock records where the file ends
    (written at close, when h5py closes the file); a file cut short or never closed disagrees."""
    fd = volread.open_regular(path)
    try:
        head = os.pread(fd, 96, 0)
    finally:
        os.close(fd)
    if head[:8] != _HDF5_SIGNATURE:
        return "no HDF5 signature"
    version = head[8]
    try:
        if version in (0, 1):
            width = head[13]  # size of offsets
            at = (24 if version == 0 else 28) + 2 * width  # base, free-space; then the end-of-file address
            base = int.from_bytes(head[24 if version == 0 else 28:][:width], "little")
        elif version in (2, 3):
            width = head[9]
            at, base = 12 + 2 * width, int.from_bytes(head[12:12 + width], "little")
        else:
            return f"HDF5 superblock version {version}: not checked"
        eof = int.from_bytes(head[at:at + width], "little")
    except (IndexError, struct.error):
        return "HDF5 superblock cut short"
    if base + eof != size:
        return f"HDF5 says it ends at byte {base + eof}, the file has {size}: not closed (killed midway?)"
    return None


class Keras(Framework):
    layout = LAYOUT
    file_suffixes = (KERAS, WEIGHTS_H5)

    def recognise_file(self, name: str) -> Candidate | None:
        stem = _stem(name)
        fields = frameworks.name_fields(stem)
        for key, unit in (("epoch", EPOCH), ("step", STEP), ("batch", STEP)):
            if (value := fields.get(key)) is not None and value.isdigit():
                return Candidate(name, int(value), LAYOUT, False, unit=unit)
        return None  # no named epoch or step: not recognised, never touched

    def _templates(self, names: Collection[str]) -> Iterator[tuple[tuple[str, ...], int, list[Saved]]]:
        """Each `filepath` template among `names` whose saves show an epoch: its literals, which of
        its numbers is the epoch, and its saves (name, numbers)."""
        templates: dict[tuple[tuple[str, ...], str], list[Saved]] = defaultdict(list)
        for name in names:
            if not name.endswith(self.file_suffixes) or name == BACKUP_WEIGHTS:
                continue
            stem = name.removesuffix(_suffix(name))
            numbers = _NUMBER.findall(stem)
            if numbers:
                templates[(tuple(_NUMBER.split(stem)), _suffix(name))].append((name, numbers))
        for (literals, _), saves in templates.items():
            at = _epoch_position(literals, [n for _, n in saves]) if len(saves) > 1 else None
            if at is not None:
                yield literals, at, saves

    def recognise_among(self, names: Collection[str]) -> list[Candidate]:
        """Saves of one `filepath` template, as Keras's docs name them: their names alike but for
        their numbers, two or more, the epoch the whole number that varies (`_epoch_position`)."""
        return [Candidate(name, int(nums[at]), LAYOUT, False, unit=EPOCH)
                for _, at, saves in self._templates(names) for name, nums in saves]

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        """Not a resume: the newest save of a template whose epoch shows only by its zero padding
        (no word `epoch` before it), while later saves of it show none (`w-09` beside `w-10`):
        without it they are no run."""
        kept = {}
        for literals, at, saves in self._templates(names):
            if _EPOCH_WORD.search(literals[at]):
                continue  # `epoch12` shows its epoch alone
            padded = [(int(n[at]), name) for name, n in saves if len(n[at]) > 1 and n[at][0] == "0"]
            if not padded:
                continue
            epoch, name = max(padded)
            if later := sorted(n for n, nums in saves if int(nums[at]) > epoch and nums[at][0] != "0"):
                kept[name] = (f"{KEPT_FOR}the newest save whose zero-padded epoch shows that {later[0]} and "
                              "the other saves of its template are a run's epochs: without it they look like "
                              "model files, and are never listed, pruned or named by latest")
        return kept

    def resume_copy(self, name: str) -> str | None:
        return BACKUP_NOTE if name == BACKUP_WEIGHTS else None

    def evidence(self, save: Save) -> Evidence:
        entry = save.files.get("")
        kind = "keras archive" if save.cand.name.endswith(KERAS) else "keras weights"
        if entry is None or entry.kind != "f":
            return Evidence([Check(kind, Verdict.FAILED, "not a regular file")])
        read = archive_problem if save.cand.name.endswith(KERAS) else hdf5_problem
        try:
            problem = read(str(save.path), entry.size)
        except OSError as exc:
            return Evidence([Check(kind, Verdict.UNKNOWN, f"cannot be read: {exc.strerror or exc}")])
        if problem:
            return Evidence([Check(kind, Verdict.FAILED, problem)])
        return Evidence([Check(kind, Verdict.PASSED, "whole (written at close)")])

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        out = []
        stem = _stem(save.cand.name)
        for k, v in {**named_metrics(stem), **frameworks.name_fields(stem)}.items():
            try:
                out.append((k, Reading(as_metric(float(v)), FILE_NAME)))
            except ValueError:
                continue
        return tuple(out), None


FRAMEWORK = Keras()
