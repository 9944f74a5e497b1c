"""Opening a file on a managed volume to read it: a regular file, or nothing.

Every file ckptd reads from a volume (a resume pointer, trainer_state.json, a model-states
file, Orbax's metadata, a safetensors header, ...) is opened here. A plain open() of a FIFO
blocks until a writer comes, which may be never: plan, prune and the daemon's one filesystem
thread hung on a FIFO named like Megatron's tracker. So: O_NONBLOCK
(a FIFO's open returns at once; on a regular file the flag changes nothing on Linux), one
fstat, and anything but a regular file (FIFO, socket, device, directory) is refused with
`NotRegularFile`, an OSError: every caller already takes an unreadable file as "cannot
tell", which never makes anything more deletable. No syscall beyond the open and the fstat.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


class NotRegularFile(OSError):
    """Not a regular file: never opened for reading (a FIFO would block the open forever)."""


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = False) -> int:
    """A read-only descriptor of the regular file at `path`; raises OSError (NotRegularFile for a
    FIFO, a socket, a device or a directory; ELOOP for a symlink unless `follow_symlinks`)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file: never read", os.fspath(path))
    return fd


def open_file(path: str | os.PathLike[str], *, follow_symlinks: bool = False) -> BinaryIO:
    """`open_regular` as a binary file object (for `with`, json, zipfile)."""
    return os.fdopen(open_regular(path, follow_symlinks=follow_symlinks), "rb")


def read_bytes(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = False) -> bytes:
    """At most `limit` bytes from the start of the regular file at `path`."""
    with open_file(path, follow_symlinks=follow_symlinks) as f:
        return read_upto(f, limit)


def read_upto(f: BinaryIO, limit: int) -> bytes:
    """`f.read(limit)` (up to `limit` bytes, or to the end), from its current position, without
    allocating `limit` bytes first: `read(n)` makes an n-byte buffer before it reads, and a limit
    of 64 MiB for a 300-byte trainer_state.json cost ~180 us a file (an mmap and munmap each).
    One read of the size fstat gives, plus one byte, reaches the end; a file that grew since is
    read on, to `limit`, as `read(limit)` would."""
    want = min(limit, max(0, os.fstat(f.fileno()).st_size - f.tell()) + 1)
    data = f.read(want)
    if len(data) < want or want >= limit:
        return data  # the end, or the limit
    return data + f.read(limit - want)
