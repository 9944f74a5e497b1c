"""The filesystem primitives every removal goes through: directories opened from the root one
component at a time without following a symlink, identities (dev, inode) to tell a swap, renames
that never replace, and removal of a tree from descriptors that never enters another filesystem.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path

from ckptd.discover import layouts
from ckptd.volume import mounts

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_nofollow(root: Path, rel: str) -> int:
    """A descriptor of `root/rel`, opened one component at a time, refusing symlinks below the root.

    The root itself may be a symlink (it is configured); nothing under it may be.
    Raises OSError (ELOOP, ENOTDIR, ENOENT) otherwise.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [] if rel == "." else rel.split("/"):
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_dir(
    root: Path,
    name: str,
    mode: int,
    *,
    create: bool = True,
    look_first: bool = False,
    same_filesystem: bool = False,
) -> int:
    """A descriptor of ckptd's own directory `root/name` (the trash, the lease's `.ckptd/`, the
    consolidation's work area), made with `mode` where it is missing and `create`, and opened
    without following a symlink: one planted under the name is refused (ELOOP), as is a file
    (ENOTDIR). The root itself may be a symlink (it is configured).

    Made first, then opened (what is there already is kept: EEXIST is no error); with
    `look_first`, opened first and made only where it is not there (FileNotFoundError without
    `create`). With `same_filesystem`, one on another filesystem than the root, or where a mount
    is attached (`_another_filesystem`), is refused: EXDEV, saying which. Raises OSError.
    """
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = None
        if look_first:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                if not create:
                    raise
        if fd is None:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=root_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        if same_filesystem:
            try:
                why = _another_filesystem(name, root_fd, fd, root / name)
            except BaseException:
                os.close(fd)
                raise
            if why is not None:
                os.close(fd)
                raise OSError(errno.EXDEV, f"{root / name} is {why}")
        return fd
    finally:
        os.close(root_fd)


def _still_at(root: Path, rel: str, fd: int) -> bool:
    """Whether the directory `fd` is still what `root/rel` names, reached without symlinks."""
    try:
        again = open_dir_nofollow(root, rel)
    except OSError:
        return False
    try:
        a, b = os.fstat(fd), os.fstat(again)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        os.close(again)


def _identity(path: str, dir_fd: int | None = None, *, contents: bool = False) -> tuple[int, ...] | None:
    """(dev, inode) of `path`, not following a symlink; None if it is not there.

    With `contents`, also its size and mtime: a file unlinked and written again often gets
    the same inode number back at once. (Not the ctime: a rename changes it.)
    """
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if contents else (st.st_dev, st.st_ino)


def _contents(dir_fd: int) -> dict[str, tuple[int, int, int, int]] | None:
    """(dev, inode, size, mtime_ns) of each entry of a directory; None if one is not a regular file."""
    out = {}
    for name in os.listdir(dir_fd):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return None
        out[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _pinned_at(name: str, parent_fd: int) -> str | None:
    """Why `name` (just renamed under `parent_fd`) must go back: a pin at its top, by a listing of
    it (a lookup of the pin's name alone could be answered from a negative cache), or a listing
    that cannot be had. None: neither, or a checkpoint that is a file (its pin, beside it, was
    re-checked before the rename)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except NotADirectoryError:
        return None
    except OSError as exc:
        return f"cannot look at it in the trash: {exc}"
    try:
        if layouts.PIN_FILE in os.listdir(fd):
            return "pinned (its pin seen only under its name in the trash: a mount that caches listings)"
        return None
    except OSError as exc:
        return f"cannot look at it in the trash: {exc}"
    finally:
        os.close(fd)


def _rename_noreplace(src: str, src_fd: int, dst: str, dst_fd: int) -> None:
    """rename(2) that never replaces what is at `dst` (renameat2 RENAME_NOREPLACE: EEXIST).
    Where the filesystem or libc lacks the flag (EINVAL: some FUSE and NFS), a look, then the
    rename: the name is taken by nobody but a person in that instant."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        renameat2 = None
    if renameat2 is not None:
        if renameat2(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), 1) == 0:  # RENAME_NOREPLACE
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), src)
    if _identity(dst, dst_fd) is not None:
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def _another_filesystem(name: str, parent_fd: int, fd: int, path: Path) -> str | None:
    """Why the directory `fd` (`name` under `parent_fd`, at `path`) is not on its parent's
    filesystem, or None: another device, or where a mount is attached (a bind mount keeps its
    device number; the mount table where statx cannot tell)."""
    if os.fstat(fd).st_dev != os.fstat(parent_fd).st_dev:
        return "on another filesystem than the root"
    is_root = mounts.is_mount_root(name, parent_fd)
    if is_root is None:
        real = os.path.realpath(path)
        is_root = any(m.point == real for m in mounts.read_mounts())
    return "a mount point" if is_root else None


def _unlink_at(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)  # never follows: removes a symlink itself
    except FileNotFoundError:
        pass


def _remove_at(name: str, dir_fd: int) -> None:
    """Remove `name` under `dir_fd` (a file, a link itself, or a whole tree), never following links."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_tree(name, dir_fd, os.fstat(dir_fd).st_dev)
    else:
        os.unlink(name, dir_fd=dir_fd)


_MAX_REMOVE_DEPTH = 512


def _remove_tree(name: str, parent_fd: int, dev: int, depth: int = 0) -> None:
    """Remove directory `name` under `parent_fd` and all it holds, from descriptors.

    Never follows a symlink (a link is unlinked, not entered) and never enters another
    filesystem: a directory on another device, or where a mount is attached (a bind mount
    keeps its device number: `mounts.is_mount_root`), raises EXDEV and stays, with the
    directories holding it. shutil.rmtree crossed into a bind mount inside a trashed
    checkpoint and emptied it.
    """
    if depth > _MAX_REMOVE_DEPTH:
        raise OSError(errno.ELOOP, f"deeper than {_MAX_REMOVE_DEPTH} levels", name)
    if mounts.is_mount_root(name, parent_fd):
        raise OSError(errno.EXDEV, "a mount point: another filesystem is never removed", name)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_dev != dev:
            raise OSError(errno.EXDEV, "on another filesystem: never removed", name)
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                _remove_tree(child, fd, dev, depth + 1)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
