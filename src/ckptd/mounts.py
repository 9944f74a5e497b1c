"""The mount table, from `/proc/self/mountinfo`. Reads only.

Three things need it: choosing an observer (inotify cannot see other hosts' writes
on NFS, Lustre and friends), knowing how stale a network filesystem's attribute
cache can make a `stat` (its mount options), and never crossing into another
filesystem inside a checkpoint (a bind mount shares its `st_dev` with the
filesystem it came from, so only the mount table shows it).

Parsing is pure (`parse_mountinfo`); `read_mounts` reads the file.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(text: str) -> str:
    r"""The kernel writes space, tab, newline and backslash in paths as \040, \011, \012, \134."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), text)


def _options(text: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in text.split(","):
        if item:
            key, eq, value = item.partition("=")
            out[key] = value if eq else None
    return out


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo (proc(5))."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor"
    root: str  # the directory of the filesystem mounted here (not "/" for a bind mount)
    point: str  # where it is mounted
    fstype: str  # "ext4", "nfs4", "fuse.sshfs", ...
    source: str
    options: dict[str, str | None] = field(default_factory=dict)  # per mount: rw, noatime, ...
    super_options: dict[str, str | None] = field(default_factory=dict)  # per filesystem: vers, actimeo, ...

    def option(self, name: str) -> str | None:
        """A mount or filesystem option's value ("" for a flag that is set), or None if absent."""
        for opts in (self.super_options, self.options):
            if name in opts:
                value = opts[name]
                return "" if value is None else value
        return None


def parse_mountinfo(text: str) -> list[Mount]:
    """Every well-formed line of a mountinfo file, in the file's order (later mounts stack on top)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        try:
            mount_id, parent_id = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        mounts.append(
            Mount(
                mount_id=mount_id,
                parent_id=parent_id,
                device=fields[2],
                root=_unescape(fields[3]),
                point=_unescape(fields[4]),
                fstype=tail[0],
                source=_unescape(tail[1]),
                options=_options(fields[5]),
                super_options=_options(tail[2]) if len(tail) > 2 else {},
            )
        )
    return mounts


def read_mounts(path: str = MOUNTINFO) -> list[Mount]:
    """The mount table as this process sees it; empty if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def _under(path: str, point: str) -> bool:
    return path == point or point == "/" or path.startswith(point.rstrip("/") + "/")


def mount_of(path: str | os.PathLike[str], mounts: Sequence[Mount]) -> Mount | None:
    """The mount holding `path` (resolved): the longest mount point above it, the last one
    mounted where several share a point (it hides the others)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        if _under(real, m.point) and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def mounts_below(path: str | os.PathLike[str], mounts: Iterable[Mount]) -> list[str]:
    """Mount points strictly inside `path` (resolved), sorted."""
    real = os.path.realpath(path)
    return sorted({m.point for m in mounts if m.point != real and _under(m.point, real)})


def filesystem_type(path: Path, mounts: Sequence[Mount] | None = None) -> tuple[str | None, str | None]:
    """(filesystem type, mount point) of the mount holding `path`; (None, None) if unknown."""
    m = mount_of(path, read_mounts() if mounts is None else mounts)
    return (m.fstype, m.point) if m is not None else (None, None)


# --- is this directory the root of a mount? (statx) -------------------------

# A bind mount of a directory from the same filesystem keeps its st_dev: only the mount
# table, or statx's STATX_ATTR_MOUNT_ROOT (Linux 5.8), tells that one apart.
_STATX_ATTR_MOUNT_ROOT = 0x2000
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_NO_AUTOMOUNT = 0x800  # never trigger an automount by looking
_STATX_BASIC_STATS = 0x7FF
_STATX_SIZE = 256  # struct statx
_ATTRIBUTES, _ATTRIBUTES_MASK = 8, 56  # offsets of stx_attributes and stx_attributes_mask


@functools.cache
def _statx() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.statx  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def is_mount_root(name: str | os.PathLike[str], dir_fd: int | None = None) -> bool | None:
    """Whether `name` (relative to `dir_fd`, not followed if a symlink) is where a mount is
    attached, bind mounts included; None where the kernel or libc cannot say (no statx, or a
    kernel before 5.8) — callers then fall back to `st_dev` and the mount table."""
    fn = _statx()
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    flags = _AT_SYMLINK_NOFOLLOW | _AT_NO_AUTOMOUNT
    if fn(_AT_FDCWD if dir_fd is None else dir_fd, os.fsencode(name), flags, _STATX_BASIC_STATS, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(name))
    raw = buf.raw
    attributes, known = (int.from_bytes(raw[o : o + 8], "little") for o in (_ATTRIBUTES, _ATTRIBUTES_MASK))
    if not known & _STATX_ATTR_MOUNT_ROOT:
        return None
    return bool(attributes & _STATX_ATTR_MOUNT_ROOT)
