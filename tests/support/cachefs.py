"""A passthrough FUSE filesystem that caches what it reads, as sshfs, rclone's VFS, s3fs and
gcsfuse do: `python -m tests.support.cachefs SOURCE MOUNTPOINT TTL [SUBTYPE]`, in the foreground.

Each path's attributes (getattr), directory listing (readdir) and file contents (read) are kept
for TTL seconds from when they were fetched, whatever the source does meanwhile; what this
mount itself changes (a write, create, rename, unlink, mkdir, rmdir, utimens) drops the cached
entries for that path and its parent, so the mount's own writes are read back at once (sshfs
does the same). The kernel's own caches are turned off (attr_timeout, entry_timeout and
negative_timeout 0, no kernel_cache), so only these caches are in play. POSIX locks and flocks
are the kernel's, local to this mount, as with bindfs: another "host".

Needs fusepy (ctypes bindings to libfuse 2): the tests that use it skip without it.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations


class CacheFS(Operations):
    def __init__(self, source: str, ttl: float):
        self.source, self.ttl = os.path.realpath(source), ttl
        self.attrs: dict[str, tuple[float, dict | None]] = {}
        self.dirs: dict[str, tuple[float, list[str]]] = {}
        self.data: dict[str, tuple[float, bytes]] = {}
        self._mu = threading.Lock()

    def _full(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def _fresh(self, table: dict, path: str):
        with self._mu:
            hit = table.get(path)
            if hit is not None and time.monotonic() - hit[0] < self.ttl:
                return hit
        return None

    def _drop(self, *paths: str) -> None:
        with self._mu:
            for path in paths:
                for p in (path, os.path.dirname(path) or "/"):
                    for table in (self.attrs, self.dirs, self.data):
                        table.pop(p, None)

    # --- reads: cached ---------------------------------------------------------------------

    def getattr(self, path, fh=None):
        hit = self._fresh(self.attrs, path)
        if hit is None:
            try:
                st = os.lstat(self._full(path))
                got = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                                                   "st_atime", "st_mtime", "st_ctime")}
            except FileNotFoundError:
                got = None
            with self._mu:
                self.attrs[path] = hit = (time.monotonic(), got)
        if hit[1] is None:
            raise FuseOSError(errno.ENOENT)
        return dict(hit[1])

    def readdir(self, path, fh):
        hit = self._fresh(self.dirs, path)
        if hit is None:
            names = os.listdir(self._full(path))
            with self._mu:
                self.dirs[path] = hit = (time.monotonic(), names)
        return [".", "..", *hit[1]]

    def read(self, path, size, offset, fi):
        hit = self._fresh(self.data, path)
        if hit is None:
            with open(self._full(path), "rb") as f:
                content = f.read()
            with self._mu:
                self.data[path] = hit = (time.monotonic(), content)
        return hit[1][offset:offset + size]

    def readlink(self, path):
        return os.readlink(self._full(path))

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

    def access(self, path, amode):
        if not os.access(self._full(path), amode):
            raise FuseOSError(errno.EACCES)

    # --- opens and writes: through, dropping what they change ------------------------------

    def open(self, path, fi):
        fi.fh = os.open(self._full(path), fi.flags & ~os.O_CREAT)
        if fi.flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            self._drop(path)
        return 0

    def create(self, path, mode, fi):
        fi.fh = os.open(self._full(path), fi.flags | os.O_CREAT, mode)
        self._drop(path)
        return 0

    def write(self, path, data, offset, fi):
        n = os.pwrite(fi.fh, data, offset)
        self._drop(path)
        return n

    def truncate(self, path, length, fh=None):
        os.truncate(self._full(path), length)
        self._drop(path)

    def flush(self, path, fi):
        return 0

    def fsync(self, path, datasync, fi):
        os.fsync(fi.fh)
        return 0

    def release(self, path, fi):
        os.close(fi.fh)
        return 0

    def unlink(self, path):
        os.unlink(self._full(path))
        self._drop(path)

    def rmdir(self, path):
        os.rmdir(self._full(path))
        self._drop(path)

    def mkdir(self, path, mode):
        os.mkdir(self._full(path), mode)
        self._drop(path)

    def rename(self, old, new):
        os.rename(self._full(old), self._full(new))
        self._drop(old, new)
        with self._mu:  # what was under the old name is gone from there
            for table in (self.attrs, self.dirs, self.data):
                for p in [p for p in table if p.startswith(old + "/") or p.startswith(new + "/")]:
                    table.pop(p, None)

    def chmod(self, path, mode):
        os.chmod(self._full(path), mode)
        self._drop(path)

    def chown(self, path, uid, gid):
        os.chown(self._full(path), uid, gid)
        self._drop(path)

    def utimens(self, path, times=None):
        os.utime(self._full(path), times)
        self._drop(path)

    def symlink(self, target, source):
        os.symlink(source, self._full(target))
        self._drop(target)

    def link(self, target, source):
        os.link(self._full(source), self._full(target))
        self._drop(target)


def main() -> None:
    source, point, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    extra = {"subtype": sys.argv[4]} if len(sys.argv) > 4 else {}
    FUSE(CacheFS(source, ttl), point, foreground=True, raw_fi=True, nothreads=False, allow_other=True,
         attr_timeout=0, entry_timeout=0, negative_timeout=0, fsname="cachefs", **extra)


if __name__ == "__main__":
    main()
