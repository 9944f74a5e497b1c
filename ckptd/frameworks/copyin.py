"""What a copy into a volume leaves when the copier dies midway.

A checkpoint copied back in (restored from object storage, synced from another volume) arrives
file by file, small files first with parallel copiers, each with the source's mtime: its files
pass every "is it quiet, is everything I know of there" test while the big ones are still on
the way. A copier that writes each file under a temporary name and renames it when whole leaves
that name behind when it dies; none of them is a file a framework writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckptd.model import Check, Entry, Verdict

COPY_LEFTOVERS = "copy leftovers"

# The temporary names copiers write a file under before renaming it into place:
# rclone `<name>.<hash>.partial` (operations.go, --partial-suffix, default `.partial`), gsutil
# `<name>_.gstmp` (gslib/utils/copy_helper.py _GetDownloadTempFileName), the AWS CLI's s3transfer
# `<name>.<8 hex digits>` (s3transfer/utils.py random_file_extension), rsync `.<name>.<6 chars>`
# (receiver.c get_tmpname), huggingface_hub `<name>.incomplete`, and the usual `.part`/`.tmp`.
# And the copiers that write into the final name, chunks out of order, beside a control file they
# remove when the file is whole: aria2c's `<name>.aria2` (its --continue state,
# src/DefaultBtProgressInfoFile.cc).
_LEFTOVER = re.compile(
    r"(?:.+\.partial|.+_\.gstmp|.+\.incomplete|.+\.part|.+\.tmp|.+\.aria2"
    r"|.+\.(?:safetensors|bin|pt|pth|pkl|json)\.[0-9a-fA-F]{8}"
    r"|\..+\.(?:safetensors|bin|pt|pth|pkl|json)\.[A-Za-z0-9]{6})"
)


def copy_leftovers(files: Mapping[str, Entry]) -> Check:
    """Failed if a copier's temporary file lies in the checkpoint: the copy did not finish."""
    left = sorted(
        rel for rel, e in files.items()
        if rel and e.kind == "f" and ".ckptd" not in rel and _LEFTOVER.fullmatch(rel.rpartition("/")[2])
    )  # not ckptd's own (a slim marker's `.ckptd-slim.json.tmp`: slimming finishes or undoes it)
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        why = (f"{left[0]}{more}: a copier's temporary file (rclone, gsutil, s3, rsync, aria2c): "
               "a copy not finished")
        return Check(COPY_LEFTOVERS, Verdict.FAILED, why)
    return Check(COPY_LEFTOVERS, Verdict.PASSED, "no copier's temporary files")
