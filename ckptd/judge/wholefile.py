"""Is this one file whole? The engine's file integrity check, by the file's suffix.

The engine (`evidence._integrity`) asks `file_problem` of every torch.save file (a zip archive),
every safetensors file, and a checkpoint that is itself one archive its framework writes in place
(`Framework.whole_file_formats`: NeMo's `.nemo` tar). The formats are read in
frameworks/formats.py (a few bytes at known offsets, never the whole file). An OSError is not a
verdict: it passes through, so that the verdict cache (verdicts.py) does not remember it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptd import frameworks
from ckptd.frameworks.formats import SAFETENSORS_SUFFIX, is_zip, safetensors_problem, tar_problem
from ckptd.model import Entry

# A checkpoint that is itself one file, by suffix: the archive format its framework writes
WHOLE_FILE_FORMATS = {suffix: fmt for fw in frameworks.REGISTRY for suffix, fmt in fw.whole_file_formats}
_TAR_SUFFIXES = tuple(suffix for suffix, fmt in WHOLE_FILE_FORMATS.items() if fmt == "tar")


def file_problem(path: str | Path, e: Entry) -> str | None:
    """Why one zip (torch.save's), safetensors or tar file is not whole (as a suffix to its name),
    or None: a tar by the suffix a framework names for it (`whole_file_formats`), else a zip."""
    name = os.fspath(path)  # `path` is the file itself
    if name.endswith(SAFETENSORS_SUFFIX):
        problem = safetensors_problem(path, e.size)
        return f": {problem}" if problem else None
    if name.endswith(_TAR_SUFFIXES):
        problem = tar_problem(path, e.size)
        return f": {problem}" if problem else None
    if e.size == 0:
        return " is empty"
    if not is_zip(path, e.size):
        return " is not a complete zip archive (truncated?)"
    return None
