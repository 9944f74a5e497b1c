"""A filesystem that shares extents, for the tests of what deleting leaves allocated."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def reflink_xfs(tmp_path: Path, mount) -> Path:
    """A 300 MiB XFS with reflink=1 on a loop device, mounted with the `mount` fixture (cp in
    coreutils >= 9 reflinks there by default); skips where mkfs.xfs is missing."""
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs missing (apt-get install xfsprogs)")
    img = tmp_path / "xfs.img"
    with open(img, "wb") as f:
        f.truncate(300 * 2**20)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], check=True)
    point = tmp_path / "xfs"
    point.mkdir()
    mount("-o", "loop", img, point)
    return point
