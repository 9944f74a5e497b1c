"""What deleting a checkpoint leaves allocated on filesystems that share extents (extents.py),
on real filesystems: XFS with reflink=1 on a loop device, and tmpfs (where FIEMAP cannot answer).
The files are plain random bytes: what is measured is the filesystem's allocation, not a format."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckptd.decide import extents
from tests.support.reflinkfs import reflink_xfs


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_reflinked_extents_are_held_and_unshared_ones_are_not(tmp_path, mount):
    xfs = reflink_xfs(tmp_path, mount)
    ckpt = xfs / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / "shared.bin").write_bytes(os.urandom(4 * 2**20))
    (ckpt / "own.bin").write_bytes(os.urandom(2 * 2**20))
    os.sync()  # delayed allocation: FIEMAP reports extents once they are allocated
    assert extents.held(ckpt) == 0  # nothing shared yet: deleting it frees every block
    subprocess.run(["cp", "--reflink=always", str(ckpt / "shared.bin"), str(xfs / "copy.bin")], check=True)
    assert extents.held(ckpt) == _allocated(ckpt / "shared.bin")
    # A copy that rewrote part of itself shares only the rest.
    with open(xfs / "copy.bin", "r+b") as f:
        f.write(os.urandom(2**20))
    os.sync()
    assert extents.held(ckpt) == _allocated(ckpt / "shared.bin") - 2**20
    assert extents.held_by_checkpoints(xfs) is not None


def test_a_file_fiemap_cannot_answer_for_counts_as_freeing_nothing(tmp_path, mount):
    point = tmp_path / "tmpfs"
    point.mkdir()
    mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", point)
    (point / "ckpt").mkdir()
    (point / "ckpt" / "w.bin").write_bytes(os.urandom(2**20))
    with open(point / "ckpt" / "w.bin", "rb") as f, pytest.raises(OSError):
        extents.shared_bytes(f.fileno())  # tmpfs has no FIEMAP
    assert extents.held(point / "ckpt") == _allocated(point / "ckpt" / "w.bin")
    assert extents.held_by_checkpoints(point) is None  # tmpfs shares no extents: nothing is asked
