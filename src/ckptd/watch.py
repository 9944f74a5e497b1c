"""Narrow inotify watches: one inotify descriptor for all of them, read by watchdog's reader thread.

What is watched (see `RootTracker.wanted_watches`): the directories on the way
to runs and the run directories, not recursively, and the checkpoints still in
flight, recursively (a watch on each of their directories; one created inside
is watched as soon as its creation is read). Only creations, deletions, moves
and close-after-write are asked for: a rank writing 64 MiB in 4 KiB chunks
would otherwise queue 16k modify events, and our own reads would queue
open/access events. Events are hints only; the daemon always looks at the disk.

The descriptor is ckptd's own instance of watchdog's `InotifyFD`
(watchdog/observers/inotify_c.py), not an `Observer`: one inotify descriptor for
any number of watches, each registered with ckptd's mask and one callback
(`add_callback`/`remove_callbacks`), and one reader thread that calls
`on_event`, `on_watch_deleted` and `on_queue_overflow`. The callbacks queue
paths and hand them to the event loop with `loop.call_soon_threadsafe`, one
hand-over per batch, never one thread per watch. watchdog's `Observer`, used
before, runs an emitter thread per watch behind that reader: in a save storm
(100 checkpoints of 29 files written at once by another process,
`bench/storm.py`) it handed over the last event of a checkpoint p50 146-376 ms
and p99 0.37-0.9 s after the write, with 104 threads.

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
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.utils import UnsupportedLibcError

from ckptd.mounts import filesystem_type, is_remote

try:  # binds libc's inotify calls at import; raises where the C library has none
    from watchdog.observers.inotify_c import InotifyConstants as IN
    from watchdog.observers.inotify_c import InotifyEvent, InotifyFD
except (ImportError, UnsupportedLibcError, OSError) as exc:  # not Linux, or a libc without inotify
    IN = InotifyEvent = InotifyFD = None  # type: ignore[assignment,misc]
    _UNAVAILABLE = str(exc)

log = logging.getLogger(__name__)

# Logical watches (a directory, or an in-flight checkpoint's tree); beyond this many the rest is
# polled. A watch costs no thread, only the kernel's own: fs.inotify.max_user_watches.
MAX_WATCHES = 4096

# <sys/inotify.h>, as watchdog names them
MASK = 0 if IN is None else (
    IN.IN_CREATE | IN.IN_DELETE | IN.IN_MOVED_FROM | IN.IN_MOVED_TO | IN.IN_CLOSE_WRITE | IN.IN_DELETE_SELF
    | IN.IN_MOVE_SELF | IN.IN_ONLYDIR | IN.IN_DONT_FOLLOW | IN.IN_EXCL_UNLINK
)  # fmt: skip
THREAD_NAME = "ckptd-inotify"


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


Key = tuple[str, bool]  # (path, recursive)


class _Dir:
    __slots__ = ("cid", "owners", "path")

    def __init__(self, path: str, cid: int):
        self.path = path
        self.cid = cid  # the id of ckptd's one callback on this kernel watch, in watchdog's Watch
        self.owners: set[Key] = set()


class Watcher:
    """The inotify watches of every root: one descriptor, read by one thread (watchdog's).

    `on_path(path)` and `on_overflow()` are called on the loop's thread. `reconcile` may
    block (adding a recursive watch walks the tree): call it off the loop (it locks).
    `on_event`, `on_watch_deleted` and `on_queue_overflow` are watchdog's `WatchCallback`:
    called on its reader thread.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_path: Callable[[str], None], on_overflow: Callable[[], None]
    ):
        self._loop = loop
        self._on_path = on_path
        self._on_overflow = on_overflow
        self._inotify: InotifyFD | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)  # callback ids: unique, so watchdog never finds one twice on a watch
        self._watches: dict[Key, set[int]] = {}  # logical watch -> its kernel watch descriptors
        self._dirs: dict[int, _Dir] = {}  # kernel watch descriptor -> the directory
        self._pending: list[str] = []  # read, not yet handed to the loop
        self._rewalk = False  # after an overflow: walk every recursive watch again
        self.failed: set[str] = set()
        self.capped = False

    # --- life ------------------------------------------------------------------

    def start(self) -> None:
        """Create the descriptor and start its reader thread."""
        if InotifyFD is None:
            log.warning("inotify unavailable (%s): polling only", _UNAVAILABLE)
            return
        try:
            ifd = InotifyFD()
        except OSError as exc:  # no inotify here, or fs.inotify.max_user_instances
            log.warning("inotify unavailable (%s): polling only", exc)
            return
        # InotifyFD._create_inotify_fd calls inotify_init(), without IN_CLOEXEC: a program
        # exec'd by the daemon would hold the descriptor (and every watch) open.
        os.set_inheritable(ifd._inotify_fd, False)
        ifd.name = THREAD_NAME
        self._inotify = ifd
        ifd.start()

    def stop(self) -> None:
        """Close the descriptor and join its reader thread; from any thread but that one."""
        with self._lock:
            ifd, self._inotify = self._inotify, None
            self._watches.clear()
            self._dirs.clear()
            self._pending.clear()
        if ifd is None:
            return
        ifd.stop()  # InotifyFD.close: removes every watch, wakes the reader through its pipe
        ifd.join(10)

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
        if self._inotify is None:
            return
        with self._lock:
            rewalk, self._rewalk = self._rewalk, False
            for key in set(self._watches) - wanted:
                self._unwatch(key)
            new = [k for k in sorted(wanted) if k not in self._watches or (rewalk and k[1])]
        for key in new:
            dirs = _tree(key[0]) if key[1] else [key[0]]  # walked outside the lock: events go on
            with self._lock:
                if self._inotify is not None:
                    self._watch(key, dirs)

    def _watch(self, key: Key, dirs: list[str]) -> None:
        """Add the kernel watches of `key` on `dirs` (under the lock). A path that is gone is skipped."""
        wds = self._watches.get(key, set())
        for d in dirs:
            wd = self._add(d)
            if wd is not None:
                wds.add(wd)
                self._dirs[wd].owners.add(key)
            elif d == key[0] and not wds:
                return  # the watched directory itself could not be watched: polling covers it
        self._watches[key] = wds

    def _add(self, path: str) -> int | None:
        """The kernel watch on `path`, with ckptd's callback on it (under the lock); None: polled."""
        ifd = self._inotify
        assert ifd is not None
        cid = next(self._ids)
        try:
            wd = ifd.add_callback(os.fsencode(path), MASK, self, cid)
        except OSError as exc:
            err = exc.errno or 0
        else:
            if wd < 0:  # InotifyFD._raise_error lets EACCES through and keeps a Watch for wd -1
                ifd.remove_callbacks([(wd, cid)])
                err = errno.EACCES
            else:
                self.failed.discard(path)
                if wd in self._dirs:  # already watched for another key: one callback per kernel watch
                    ifd.remove_callbacks([(wd, cid)])
                else:
                    self._dirs[wd] = _Dir(path, cid)
                return wd
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
        ifd = self._inotify
        assert ifd is not None
        gone = []
        for wd in self._watches.pop(key, ()):
            d = self._dirs.get(wd)
            if d is None:
                continue
            d.owners.discard(key)
            if not d.owners:
                del self._dirs[wd]
                gone.append((wd, d.cid))
        if gone:
            # inotify_rm_watch: EINVAL where the kernel dropped the watch already (watchdog ignores it)
            ifd.remove_callbacks(gone)

    # --- events (watchdog's reader thread) ----------------------------------------

    def on_event(self, event: InotifyEvent) -> None:
        """Queue the event's path for the loop; watch a directory created inside a recursive watch."""
        with self._lock:
            d = self._dirs.get(event.wd)
            if d is None:
                return
            path = os.path.join(d.path, os.fsdecode(event.name)) if event.name else d.path
            if event.mask & IN.IN_ISDIR and event.mask & (IN.IN_CREATE | IN.IN_MOVED_TO):
                for key in [k for k in d.owners if k[1]]:
                    self._grow(key, path)
            self._pending.append(path)
            first = len(self._pending) == 1  # else a hand-over is on its way and takes this one too
        if first:
            self._hand(self._deliver)

    def on_watch_deleted(self, wd: int) -> None:
        """IN_IGNORED: the kernel dropped the watch (its directory was deleted, or unmounted)."""
        with self._lock:
            d = self._dirs.pop(wd, None)
            for key in d.owners if d is not None else ():
                self._watches.get(key, set()).discard(wd)

    def on_queue_overflow(self) -> None:
        """IN_Q_OVERFLOW (watchdog logs it as a warning): rescan, and walk recursive watches again."""
        with self._lock:
            self._rewalk = True
        self._hand(self._on_overflow)

    def _grow(self, key: Key, path: str) -> None:
        """A directory created (or moved) inside a recursive watch: watch it and what it holds."""
        if self._inotify is None:
            return
        for d in _tree(path):
            wd = self._add(d)
            if wd is not None:
                self._watches.setdefault(key, set()).add(wd)
                self._dirs[wd].owners.add(key)

    def _hand(self, fn: Callable[[], None]) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    def _deliver(self) -> None:
        """On the loop: every path read since the last hand-over, in the order read."""
        with self._lock:
            paths, self._pending = self._pending, []
        for path in paths:
            self._on_path(path)


def _tree(path: str) -> list[str]:
    """`path` and every directory below it, symlinks not followed."""
    dirs = [path]
    for top, subdirs, _ in os.walk(path):
        dirs += [os.path.join(top, d) for d in subdirs]
    return dirs
