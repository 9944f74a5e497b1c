"""Narrow inotify watches: one inotify instance for all of them, read on the event loop.

What is watched (see `RootTracker.wanted_watches`): the directories on the way
to runs and the run directories, not recursively, and the checkpoints still in
flight, recursively (a watch on each of their directories; one created inside
is watched as soon as its creation is read). Only creations, deletions, moves
and close-after-write are asked for: a rank writing 64 MiB in 4 KiB chunks
would otherwise queue 16k modify events, and our own reads would queue
open/access events. Events are hints only; the daemon always looks at the disk.

One inotify descriptor, registered with the event loop (`loop.add_reader`):
reading an event costs no thread and no hop between threads; the path goes
straight to the daemon's hint queue. watchdog's observer, used before, runs an
emitter thread per watch behind a shared reader thread: in a save storm (100
checkpoints of 29 files written at once by another process, `bench/storm.py`)
it handed over the last event of a checkpoint p50 146-376 ms and p99
0.37-0.9 s after the write, with 104 threads; this reader, p50 under 1 ms and
p99 42-119 ms, with none (same machine, same storm). watchdog 7.1's `InotifyFD`
(one descriptor, per-watch callbacks, one reader thread handing paths over with
`call_soon_threadsafe`) was tried in its place and measured worse: detection
latency p99 +18 to +72 ms in each of three alternated runs, the look at the end
of the quiet period twice as late, one thread more (BENCHMARKS.md).

inotify queue overflow (IN_Q_OVERFLOW: the kernel dropped events) is handed to
the daemon, which rescans what is in flight; the watches of new directories
inside in-flight checkpoints may have been missed too, so the next `reconcile`
walks every recursive watch again. An exhausted watch limit (ENOSPC from
inotify_add_watch) is logged once and that path is left to polling, which runs
in every mode. Where inotify is not available at all, nothing is watched and
polling does the work.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from ckptd.mounts import filesystem_type, is_remote

log = logging.getLogger(__name__)

# Logical watches (a directory, or an in-flight checkpoint's tree); beyond this many the rest is
# polled. A watch costs no thread now, only the kernel's own: fs.inotify.max_user_watches.
MAX_WATCHES = 4096

# <sys/inotify.h>
IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x8, 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x400, 0x800, 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
MASK = (
    IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF
    | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK
)  # fmt: skip
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name


def choose_observer(path: Path, configured: str) -> tuple[str, str]:
    """("inotify" | "polling", why) for a root."""
    if configured != "auto":
        return configured, "configured"
    fstype, mount = filesystem_type(path)
    if fstype is None:
        return "polling", "filesystem type unknown"
    if is_remote(fstype):
        return "polling", f"{mount} is {fstype}: inotify does not see other hosts' writes"
    return "inotify", f"{mount} is {fstype}"


class _Libc:
    """inotify_init1, inotify_add_watch, inotify_rm_watch from the C library (as watchdog binds them)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes, self.init1.restype = [ctypes.c_int], ctypes.c_int
        self.add = libc.inotify_add_watch
        self.add.argtypes, self.add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
        self.rm = libc.inotify_rm_watch
        self.rm.argtypes, self.rm.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int


Key = tuple[str, bool]  # (path, recursive)


class _Dir:
    __slots__ = ("owners", "path")

    def __init__(self, path: str):
        self.path = path
        self.owners: set[Key] = set()


class Watcher:
    """The inotify watches of every root: one descriptor, read on `loop`.

    `on_path(path)` and `on_overflow()` are called on the loop's thread. `reconcile` may
    block (adding a recursive watch walks the tree): call it off the loop (it locks).
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_path: Callable[[str], None], on_overflow: Callable[[], None]
    ):
        self._loop = loop
        self._on_path = on_path
        self._on_overflow = on_overflow
        self._fd: int | None = None
        self._libc: _Libc | None = None
        self._lock = threading.Lock()
        self._watches: dict[Key, set[int]] = {}  # logical watch -> its kernel watch descriptors
        self._dirs: dict[int, _Dir] = {}  # kernel watch descriptor -> the directory
        self._rewalk = False  # after an overflow: walk every recursive watch again
        self.failed: set[str] = set()
        self.capped = False

    # --- life ------------------------------------------------------------------

    def start(self) -> None:
        """Create the descriptor and read it on the loop (call on the loop's thread)."""
        try:
            self._libc = _Libc()
            fd = self._libc.init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        except (OSError, AttributeError) as exc:  # no inotify here, or fs.inotify.max_user_instances
            log.warning("inotify unavailable (%s): polling only", exc)
            return
        self._fd = fd
        self._loop.add_reader(fd, self._read)

    def stop(self) -> None:
        """Close the descriptor; from any thread."""
        if self._fd is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop or self._loop.is_closed():
            self._close()
            return
        done = threading.Event()

        def close() -> None:
            self._close()
            done.set()

        try:
            self._loop.call_soon_threadsafe(close)
        except RuntimeError:  # the loop is closing
            self._close()
            return
        done.wait(10)

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(fd)
        os.close(fd)  # drops every kernel watch with it
        with self._lock:
            self._watches.clear()
            self._dirs.clear()

    def count(self) -> int:
        """Logical watches: directories, and in-flight checkpoints' trees."""
        return len(self._watches)

    def kernel_watches(self) -> int:
        return len(self._dirs)

    # --- what to watch (the filesystem thread) ------------------------------------

    def reconcile(self, wanted: set[tuple[str, bool]]) -> None:
        """Watch exactly `wanted`, up to MAX_WATCHES (in-flight checkpoints first); the rest is polled."""
        if len(wanted) > MAX_WATCHES:
            if not self.capped:
                log.warning(
                    "%d directories to watch; watching %d and polling the rest", len(wanted), MAX_WATCHES
                )
                self.capped = True
            keep = {k for k in wanted if k[1]}  # in-flight checkpoints first
            keep |= set(
                sorted(wanted - keep, key=lambda k: k[0].count("/"))[: max(0, MAX_WATCHES - len(keep))]
            )
            wanted = set(sorted(keep)[:MAX_WATCHES])
        if self._fd is None:
            return
        with self._lock:
            rewalk, self._rewalk = self._rewalk, False
            for key in set(self._watches) - wanted:
                self._unwatch(key)
            new = [k for k in sorted(wanted) if k not in self._watches or (rewalk and k[1])]
        for key in new:
            dirs = _tree(key[0]) if key[1] else [key[0]]  # walked outside the lock: events go on
            with self._lock:
                if self._fd is not None:
                    self._watch(key, dirs)

    def _watch(self, key: Key, dirs: list[str]) -> None:
        """Add the kernel watches of `key` on `dirs` (under the lock). A path that is gone is skipped."""
        wds = self._watches.get(key, set())
        for d in dirs:
            wd = self._add(d)
            if wd is not None:
                wds.add(wd)
                self._dirs.setdefault(wd, _Dir(d)).owners.add(key)
            elif d == key[0] and not wds:
                return  # the watched directory itself could not be watched: polling covers it
        self._watches[key] = wds

    def _add(self, path: str) -> int | None:
        assert self._libc is not None and self._fd is not None
        wd = self._libc.add(self._fd, os.fsencode(path), MASK)
        if wd >= 0:
            self.failed.discard(path)
            return wd
        err = ctypes.get_errno()
        if err in (errno.ENOENT, errno.ENOTDIR):
            return None  # gone already; the next poll notices
        if path not in self.failed:
            self.failed.add(path)
            if err == errno.ENOSPC:
                log.warning(
                    "inotify watch limit reached (fs.inotify.max_user_watches) at %s; polling it instead",
                    path,
                )
            else:
                log.warning("cannot watch %s (%s); polling it instead", path, os.strerror(err))
        return None

    def _unwatch(self, key: Key) -> None:
        assert self._libc is not None and self._fd is not None
        for wd in self._watches.pop(key, ()):
            d = self._dirs.get(wd)
            if d is None:
                continue
            d.owners.discard(key)
            if not d.owners:
                del self._dirs[wd]
                self._libc.rm(self._fd, wd)  # EINVAL if the kernel dropped it already: fine

    # --- events (the loop's thread) --------------------------------------------------

    def _read(self) -> None:
        while self._fd is not None:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("reading inotify events failed: %s", exc)
                return
            self._dispatch(buf)

    def _dispatch(self, buf: bytes) -> None:
        """Hand each event's path to `on_path`; watch directories created inside recursive watches."""
        paths: list[str] = []
        overflowed = False
        off = 0
        with self._lock:
            while off + EVENT.size <= len(buf):
                wd, mask, _, n = EVENT.unpack_from(buf, off)
                name = buf[off + EVENT.size : off + EVENT.size + n].split(b"\0", 1)[0]
                off += EVENT.size + n
                if mask & IN_Q_OVERFLOW:
                    overflowed = True
                    continue
                d = self._dirs.get(wd)
                if d is None:
                    continue
                if mask & IN_IGNORED:  # its directory was deleted (or unmounted)
                    del self._dirs[wd]
                    for key in d.owners:
                        self._watches.get(key, set()).discard(wd)
                    continue
                path = os.path.join(d.path, os.fsdecode(name)) if name else d.path
                if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                    for key in [k for k in d.owners if k[1]]:
                        self._grow(key, path)
                paths.append(path)
        if overflowed:
            self._rewalk = True
            log.warning("inotify queue overflow: events were lost")
            self._on_overflow()
        for path in paths:
            self._on_path(path)

    def _grow(self, key: Key, path: str) -> None:
        """A directory created (or moved) inside a recursive watch: watch it and what it holds."""
        for d in _tree(path):
            wd = self._add(d)
            if wd is not None:
                self._watches.setdefault(key, set()).add(wd)
                self._dirs.setdefault(wd, _Dir(d)).owners.add(key)


def _tree(path: str) -> list[str]:
    """`path` and every directory below it, symlinks not followed."""
    dirs = [path]
    for top, subdirs, _ in os.walk(path):
        dirs += [os.path.join(top, d) for d in subdirs]
    return dirs
