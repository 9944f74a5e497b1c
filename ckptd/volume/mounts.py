"""The mount table, from `/proc/self/mountinfo`. Reads only.

Four things need it: choosing an observer (inotify cannot see other hosts' writes
on NFS, Lustre and friends), choosing where the deleter's lease lives (`lease.py`:
on the volume when other hosts share it), knowing how stale a network filesystem's
attribute cache can make a `stat` (its mount options: `attribute_cache`), and never
crossing into another filesystem inside a checkpoint (a bind mount shares its
`st_dev` with the filesystem it came from, so only the mount table shows it).

Parsing is pure (`parse_mountinfo`, `attribute_cache`); `read_mounts` reads the file.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

MOUNTINFO = "/proc/self/mountinfo"
T = TypeVar("T")

# Filesystems other machines write to (or that inotify cannot see at all): the observer polls
# there, and `leadership = "auto"` keeps the deleter's lease on the volume.
REMOTE_FS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "cephfs", "9p", "afs", "beegfs",
    "glusterfs", "virtiofs", "vboxsf", "panfs", "wekafs", "orangefs", "pvfs2",
})  # fmt: skip


def is_remote(fstype: str) -> bool:
    """Whether other machines can write to a filesystem of this type (FUSE: assume so)."""
    return fstype in REMOTE_FS or fstype.startswith("fuse")

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


# --- network filesystems' attribute caches ------------------------------------

# Filesystems whose clients keep their caches coherent with the server: a change made on
# another node is seen at the next stat, not after a timeout. Lustre revokes a client's
# LDLM locks (and the attributes cached under them) before another client may change the
# file; GPFS does the same with its tokens, CephFS with its capabilities (caps).
COHERENT_FS = frozenset({"lustre", "gpfs", "ceph", "cephfs"})

# nfs(5), "Data and metadata coherence" / the ac* options: without them the Linux client caches
# a regular file's attributes for 3 to 60 seconds and a directory's for 30 to 60 (the timeout
# grows from the min to the max while nothing changes), and the kernel prints an ac* option in
# mountinfo only when it differs from that default (fs/nfs/super.c, nfs_show_mount_options).
NFS_DEFAULTS = {"acregmin": 3.0, "acregmax": 60.0, "acdirmin": 30.0, "acdirmax": 60.0}
# mount.cifs(8): actimeo, "the time (in seconds) that the CIFS client caches attributes of a
# file or directory before it requests attribute information from a server", default 1.
CIFS_DEFAULT_ACTIMEO = 1.0


@dataclass(frozen=True)
class AttributeCache:
    """How long another node's change can stay invisible to a `stat` on this mount."""

    fstype: str
    point: str
    max_staleness: float | None  # seconds; 0: coherent or uncached; None: cannot tell
    detail: str  # why, from which options
    close_to_open: bool = True  # NFS `nocto` turns it off: an open no longer revalidates


def _seconds(mount: Mount, name: str) -> float | None:
    value = mount.option(name)
    if value is None or value == "":
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def attribute_cache(mount: Mount) -> AttributeCache:
    """The worst-case staleness of attributes (size, mtime) and listings on `mount`, with why.

    NFS: `noac` (or `actimeo=0`) caches nothing; otherwise the largest of `acregmax` and
    `acdirmax` (`actimeo` sets all four ac* values; nfs(5) defaults where absent): a file a
    rank on another node is still writing can show an unchanged size and mtime that long,
    and a shard it created can be missing from a listing that long (a directory's cached
    attributes decide when its listing is read again; `lookupcache` changes how names are
    looked up, not how long a listing or a file's attributes are trusted).
    """
    fs, point = mount.fstype, mount.point
    if fs in ("nfs", "nfs4"):
        cto = mount.option("nocto") is None
        if mount.option("noac") is not None:
            return AttributeCache(fs, point, 0.0, f"{fs} mounted noac: no attribute cache", cto)
        actimeo = _seconds(mount, "actimeo")
        values, parts = {}, []
        for name, default in NFS_DEFAULTS.items():
            given = _seconds(mount, name)
            value = given if given is not None else actimeo if actimeo is not None else default
            values[name] = value
            if name.endswith("max"):
                source = "" if given is not None else " (actimeo)" if actimeo is not None else " (default)"
                parts.append(f"{name}={value:g}s{source}")
        staleness = max(values["acregmax"], values["acdirmax"])
        lookup = mount.option("lookupcache") or "all"
        vers = mount.option("vers")
        what = f"{fs}{' vers=' + vers if vers else ''}"
        detail = f"{what} caches attributes up to {staleness:g}s: {', '.join(parts)}, lookupcache={lookup}"
        return AttributeCache(fs, point, staleness, detail, cto)
    if fs in ("cifs", "smb3", "smbfs"):
        actimeo = _seconds(mount, "actimeo")
        base = actimeo if actimeo is not None else CIFS_DEFAULT_ACTIMEO
        more = [v for n in ("acregmax", "acdirmax") if (v := _seconds(mount, n)) is not None]
        staleness = max([base, *more])
        source = "actimeo" if actimeo is not None else "actimeo default"
        return AttributeCache(fs, point, staleness, f"{fs} caches attributes up to {staleness:g}s ({source})")
    if fs in COHERENT_FS:
        return AttributeCache(fs, point, 0.0, f"{fs} keeps client caches coherent (locks, tokens or caps)")
    if is_remote(fs):
        return AttributeCache(fs, point, None, f"{fs}: cannot tell how long its client caches attributes")
    return AttributeCache(fs, point, 0.0, f"{fs} is local")


def effective_quiet_period(quiet_period: float, cache: AttributeCache | None) -> float:
    """The quiet period to measure so that `quiet_period` of real quiet is seen through the cache.

    A change made elsewhere at time t may first show here at t + staleness, so a checkpoint
    that looks unchanged for `quiet_period` may have been written in the last `staleness`
    seconds of it: the quiet must be watched `staleness` longer. Keeping it longer never
    deletes anything earlier; unknown staleness is not added to (the config is trusted, and
    `check-config` says so).
    """
    if cache is None or not cache.max_staleness:
        return quiet_period
    return quiet_period + cache.max_staleness


def quiet_for(
    path: str | os.PathLike[str],
    quiet_period: float,
    mounts: Sequence[Mount],
    declared: float | None = None,
) -> tuple[float, AttributeCache | None, str | None]:
    """(the quiet period to use under `path`, its mount's attribute cache, a warning or None).

    `declared`: the root's `attribute_cache`, for what the mount table cannot show (FUSE, a
    filesystem not recognised); where the table shows a shorter one, the longer is used."""
    mount = mount_of(path, mounts)
    cache = attribute_cache(mount) if mount is not None else None
    known = cache.max_staleness if cache is not None else None
    if cache is not None and declared is not None and (known is None or declared > known):
        detail = f"{cache.fstype} caches attributes up to {declared:g}s (attribute_cache, as configured)"
        cache = replace(cache, max_staleness=declared, detail=detail)
    effective = effective_quiet_period(quiet_period, cache)
    if cache is None:
        return effective, None, None
    if cache.max_staleness is None:
        return effective, cache, f"{cache.detail}: quiet_period {quiet_period:g}s is used as configured"
    if effective != quiet_period:
        return effective, cache, (
            f"{cache.point}: {cache.detail}: another host's write can stay invisible that long, so "
            f"quiet_period {quiet_period:g}s is watched as {effective:g}s"
        )
    return effective, cache, None


def quiet_alone_problem(
    path: str | os.PathLike[str], mounts: Sequence[Mount], declared: float | None = None
) -> str | None:
    """Why a checkpoint judged on quiet alone (a pattern without `require` or `ranks`) cannot be
    complete under `path`, or None. Where the client's attribute cache is unknown (FUSE, a
    filesystem not recognised) and not declared, a checkpoint still being written elsewhere can
    look unchanged for as long as that cache lasts: quiet proves nothing there."""
    mount = mount_of(path, mounts)
    if mount is None or declared is not None:
        return None
    cache = attribute_cache(mount)
    if cache.max_staleness is not None:
        return None
    return (f"quiet alone proves nothing on {cache.point} ({cache.fstype}: ckptd cannot tell how long its "
            "client caches attributes): set attribute_cache for this root, or evidence (require, ranks) "
            "in its pattern")


# FUSE filesystems whose clients keep caches coherent: ceph-fuse holds CephFS capabilities, as the
# kernel client does. Others (sshfs, s3fs, gcsfuse, rclone, bindfs over a network filesystem)
# cache contents, attributes or listings for a time of their own.
COHERENT_FUSE = frozenset({"fuse.ceph-fuse"})


def coherence(mount: Mount | None, declared: bool | None = None) -> tuple[bool | None, str]:
    """(whether every read on `mount` sees another host's last write: True, False, None for
    unknown; why). `declared` is the root's `coherent`, which wins."""
    if declared is not None:
        return declared, f"coherent = {str(declared).lower()} (as configured)"
    if mount is None:
        return None, "filesystem type unknown"
    fs = mount.fstype
    if fs in ("nfs", "nfs4"):
        if mount.option("nocto") is not None:
            return False, f"{mount.point} is {fs} mounted nocto"
        return True, f"{mount.point} is {fs}: close-to-open"
    if fs in COHERENT_FS or fs in COHERENT_FUSE:
        return True, f"{mount.point} is {fs}: coherent client caches"
    if not is_remote(fs):
        return True, f"{mount.point} is {fs}: local"
    return None, f"{mount.point} is {fs}: ckptd cannot tell whether a read there sees another host's writes"


# --- where one path lies in another, by the kernel's measure ---------------------------------


def identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """A directory's (st_dev, st_ino), following links; None where it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _in_filesystem(real: str, mounts: Sequence[Mount]) -> tuple[str, str] | None:
    """(device, the path inside its filesystem) of a resolved path, from the mount table."""
    m = mount_of(real, mounts)
    if m is None:
        return None
    return m.device, os.path.normpath(os.path.join(m.root, os.path.relpath(real, m.point)))


def holder(
    path: str | os.PathLike[str],
    tops: Iterable[tuple[str | os.PathLike[str], T]],
    mounts: Sequence[Mount] | None = None,
) -> tuple[str, T] | None:
    """(where `path` lies in it, its item) for the first of `tops` (each a directory and an item:
    a configured root) that holds `path`, as `located_in` tells: by path, through symlinks and
    `..`, or by directory identity (a bind mount). The one answer to "which configured root holds
    this path" for the command line's ROOT, `verify`, `latest` and the Python API's `latest`."""
    for top, item in tops:
        rel = located_in(path, top, mounts)
        if rel is not None:
            return rel, item
    return None


def located_in(
    path: str | os.PathLike[str], top: str | os.PathLike[str], mounts: Sequence[Mount] | None = None
) -> str | None:
    """Where `path` lies inside `top`, relative to it ("." for `top` itself), or None where it
    does not (or where either cannot be seen).

    By the resolved paths first (symlinks, `..`); then by directory identity, walking up from
    `path`'s real path to a directory with `top`'s (st_dev, st_ino): `path` reached through a
    bind mount of `top` or of a directory above it; then by the mount table: the same filesystem,
    `path`'s directory in it under `top`'s (a bind mount of a directory inside `top`), confirmed
    by identity. (/mnt, a bind mount of the root /vol, was once taken for another root.)"""
    real, real_top = os.path.realpath(path), os.path.realpath(top)
    if _under(real, real_top):
        return os.path.relpath(real, real_top)
    top_id, own = identity(real_top), identity(real)
    if top_id is None or own is None:
        return None
    here = real
    while True:
        if identity(here) == top_id:
            return os.path.relpath(real, here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    table = read_mounts() if mounts is None else mounts
    a, b = _in_filesystem(real, table), _in_filesystem(real_top, table)
    if a is None or b is None or a[0] != b[0] or not _under(a[1], b[1]):
        return None
    rel = os.path.relpath(a[1], b[1])
    return rel if identity(os.path.join(real_top, rel)) == own else None
