"""What deleting a checkpoint cannot free because its extents are shared (reflinks, snapshots).

On filesystems that share extents between files (XFS with reflink=1, btrfs, OCFS2, bcachefs,
ZFS with block cloning), `cp --reflink` (coreutils >= 9 reflinks by default: `cp -a` of a run to
a backup) and snapshots leave one set of blocks owned by several files. `st_blocks` counts them
for each file, but deleting one of the files frees none of them while another holds them. The
filesystem says which extents are shared: FIEMAP (linux/fiemap.h, `FS_IOC_FIEMAP`) flags them
`FIEMAP_EXTENT_SHARED`. What FIEMAP cannot answer for counts as freeing nothing: `min_free`
would rather delete too little than delete checkpoints for nothing.

Asked only where `min_free` weighs a checkpoint on such a filesystem (planner.decide).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

from ckptd.judge import evidence
from ckptd.model import Checkpoint
from ckptd.volume import mounts
from ckptd.volume.space import BLOCK

log = logging.getLogger(__name__)

# Filesystems whose files can share extents (mountinfo's type names).
SHARING = frozenset({"xfs", "btrfs", "ocfs2", "bcachefs", "zfs"})

# linux/fiemap.h, linux/fs.h
FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
FIEMAP_EXTENT_LAST = 0x0001
FIEMAP_EXTENT_SHARED = 0x2000
_HEAD = struct.Struct("=QQLLLL")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, -
_EXTENT = struct.Struct("=QQQ2QL3L")  # fe_logical, fe_physical, fe_length, -, fe_flags, -
_BATCH = 256  # extents asked for per ioctl
_ALL = 2**64 - 1  # FIEMAP_MAX_OFFSET


def shared_bytes(fd: int) -> int:
    """Bytes of the open file's extents that FIEMAP flags shared. Raises OSError where it cannot say."""
    start = 0
    total = 0
    while True:
        buf = bytearray(_HEAD.size + _EXTENT.size * _BATCH)
        _HEAD.pack_into(buf, 0, start, _ALL - start, 0, 0, _BATCH, 0)
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        mapped = _HEAD.unpack_from(buf, 0)[3]
        if mapped == 0:
            return total
        for i in range(mapped):
            logical, _, length, _, _, flags, *_ = _EXTENT.unpack_from(buf, _HEAD.size + i * _EXTENT.size)
            if flags & FIEMAP_EXTENT_SHARED:
                total += length
            if flags & FIEMAP_EXTENT_LAST:
                return total
            start = logical + length


def held(path: Path, unanswered: Callable[[OSError], None] | None = None) -> int:
    """Of the blocks the files under `path` hold (each inode once), those deleting them leaves
    allocated: extents shared with another file, and all of a file FIEMAP cannot answer for
    (`unanswered` is told why)."""
    out = 0
    seen: set[tuple[int, int]] = set()
    try:
        entries = evidence.walk(path)
    except evidence.TooDeep as exc:
        entries = exc.entries
    except OSError:
        return _UNKNOWN
    for e in entries:
        if e.kind != "f" or (e.dev, e.ino) in seen:
            continue
        seen.add((e.dev, e.ino))
        allocated = e.blocks * BLOCK
        name = path / e.rel if e.rel else path
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError:
            out += allocated
            continue
        try:
            out += min(allocated, shared_bytes(fd))
        except OSError as exc:
            log.debug("FIEMAP on %s: %s: counted as freeing nothing", name, exc)
            out += allocated
            if unanswered is not None:
                unanswered(exc)
        finally:
            os.close(fd)
    return out


_UNKNOWN = 2**62  # more than any checkpoint holds: it frees nothing


def held_by_checkpoints(root: Path) -> Callable[[Checkpoint], int] | None:
    """For a root on a filesystem that shares extents, what each checkpoint's deletion leaves
    allocated (`held`, asked once per checkpoint); None elsewhere (ext4, tmpfs, NFS: st_blocks is
    what deleting frees)."""
    fstype, _ = mounts.filesystem_type(root)
    if fstype not in SHARING:
        return None
    cache: dict[Path, int] = {}
    said: list[OSError] = []

    def unanswered(exc: OSError) -> None:
        # OpenZFS has no FIEMAP (ENOTTY): what deleting frees cannot be told there at all.
        if not said:
            said.append(exc)
            log.warning("%s: %s does not say which blocks its files share with others (FIEMAP: %s): "
                        "min_free counts such files as freeing nothing", root, fstype, exc.strerror or exc)

    def of(c: Checkpoint) -> int:
        where = c.path
        if where not in cache:
            cache[where] = held(where, unanswered)
        return cache[where]

    return of
