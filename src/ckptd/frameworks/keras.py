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
`name=value` fields. A name without such a field is never taken for a checkpoint, so never touched:
a bare number proves nothing (`resnet50.keras` is a model, not epoch 50), nor does `best.keras`
(rewritten in place by save_best_only).
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable

from ckptd import volread
from ckptd.frameworks.base import Evidence, Framework, Metrics, Save
from ckptd.layouts import EPOCH, STEP, Candidate, name_fields
from ckptd.model import FILE_NAME, Check, Reading, Verdict, as_metric

LAYOUT = "keras"
KERAS, WEIGHTS_H5 = ".keras", ".weights.h5"
_ARCHIVE_MEMBERS = ("metadata.json", "config.json")  # saving_lib._METADATA_FILENAME, _CONFIG_FILENAME
_WEIGHTS_MEMBERS = ("model.weights.h5", "model.weights.npz")  # saving_lib._VARS_FNAME + its formats
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _stem(name: str) -> str:
    return name.removesuffix(WEIGHTS_H5).removesuffix(KERAS)


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
        fields = name_fields(stem)
        for key, unit in (("epoch", EPOCH), ("step", STEP), ("batch", STEP)):
            if (value := fields.get(key)) is not None and value.isdigit():
                return Candidate(name, int(value), LAYOUT, False, unit=unit)
        return None  # no named epoch or step: not recognised, never touched

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
        for k, v in name_fields(_stem(save.cand.name)).items():
            try:
                out.append((k, Reading(as_metric(float(v)), FILE_NAME)))
            except ValueError:
                continue
        return tuple(out), None


FRAMEWORK = Keras()
