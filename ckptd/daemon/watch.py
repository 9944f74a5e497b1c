"""How ckptd watches: watchdog's Observer, one recursive watch per root, its events handed to the loop.

Each root that ckptd watches (its observer is "inotify"; `choose_observer`) is scheduled once,
recursively, on one watchdog `Observer` (`Watcher.reconcile`): watchdog's platform observer, so the
same code watches with inotify on Linux and with FSEvents or kqueue on a developer's laptop. The
handler's only job is to hand each event's path to the event loop (`loop.call_soon_threadsafe`) and
return: watchdog calls it on its observer thread, and nothing ckptd does with a path belongs there.
Events are hints only; the daemon always looks at the disk, and polls what is in flight in every
mode, because events can be lost.

The event filter keeps the kernel's mask narrow (watchdog's
`InotifyEmitter.get_event_mask_from_filter` builds the mask from it): creations, deletions, moves
and close-after-write. Not IN_MODIFY: a rank writing a 10 GB shard in 4 KiB chunks would queue
millions of events; its close is the one that says the file is done. Not open or access: ckptd's own
reads would wake it.

What this costs on Linux (watchdog 7.x's `InotifyObserver`): one inotify instance for the whole
observer (`fs.inotify.max_user_instances`, 128 by default, is spent once), a reader and a
dispatcher thread behind it, the observer's own thread, and one emitter thread per scheduled watch,
that is per root; one kernel watch per directory below each root (`fs.inotify.max_user_watches`).

What watchdog cannot do stays ckptd's:
- roots where events cannot be trusted (NFS, Lustre, FUSE: other hosts' writes send no event) are
  not scheduled at all and are polled (`choose_observer`, observer = "polling" or "auto");
- lost events: on an inotify queue overflow watchdog walks its recursive watches again and then
  sends an `EventsLostEvent`, which becomes `on_overflow`, the daemon's rescan of what is in flight;
- a watch the kernel refuses (the watch or the instance limit, ENOSPC/EMFILE from
  inotify_add_watch/inotify_init) is logged once and its root is left to polling; it is tried again
  after RETRY_AFTER seconds, twice as long after each refusal up to RETRY_MAX (each try walks the
  tree until the kernel refuses: 0.4-0.55 s of CPU on a volume of 12,872 directories, 0.9 % of a
  core at one try a minute).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    EventsLostEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from ckptd.volume.mounts import filesystem_type, is_remote

log = logging.getLogger(__name__)

# Scheduled watches (normally one per root). Each costs watchdog an emitter thread; beyond this many
# the rest is polled.
MAX_WATCHES = 64
# A watch the kernel refused is asked for again no sooner than this (seconds, monotonic), doubled at
# each refusal in a row up to RETRY_MAX: a limit that refused it rarely changes by itself.
RETRY_AFTER = 60.0
RETRY_MAX = 1800.0

# What ckptd is told of; EventsLostEvent passes the filter too (it is how an overflow arrives).
EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent, FileMovedEvent, DirMovedEvent,
    FileClosedEvent, EventsLostEvent,
]  # fmt: skip

THREAD_NAME = "ckptd-watch"


def choose_observer(path: Path, configured: str) -> tuple[str, str]:
    """("inotify" | "polling", why) for a root. "inotify" means: watched by watchdog's observer."""
    if configured != "auto":
        return configured, "configured"
    fstype, mount = filesystem_type(path)
    if fstype is None and sys.platform != "linux":  # no mount table to read: a developer's laptop
        return "inotify", f"{sys.platform}: watchdog's {Observer.__name__}"
    if fstype is None:
        return "polling", "filesystem type unknown"
    if is_remote(fstype):
        return "polling", f"{mount} is {fstype}: inotify does not see other hosts' writes"
    return "inotify", f"{mount} is {fstype}"


Key = tuple[str, bool]  # (path, recursive)


class Handoff(FileSystemEventHandler):
    """Runs on watchdog's observer thread: hands the path to the loop and returns."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_path: Callable[[str], None], on_overflow: Callable[[], None]
    ):
        self._loop = loop
        self._on_path = on_path
        self._on_overflow = on_overflow

    def dispatch(self, event: FileSystemEvent) -> None:
        try:
            if isinstance(event, EventsLostEvent):
                self._loop.call_soon_threadsafe(self._on_overflow)
                return
            self._loop.call_soon_threadsafe(self._on_path, os.fsdecode(event.src_path))
            if event.dest_path:  # a move: both ends changed
                self._loop.call_soon_threadsafe(self._on_path, os.fsdecode(event.dest_path))
        except RuntimeError:  # the loop is closed: the daemon is gone, nothing to tell
            pass


class Watcher:
    """watchdog's observer for every watched root; `on_path(path)` and `on_overflow()` run on `loop`.

    `reconcile` may block (scheduling a recursive watch walks the tree): call it off the loop.
    `make_observer` is watchdog's platform `Observer` unless given (tests pass its
    `PollingObserver`, the stand-in for a platform without inotify).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_path: Callable[[str], None],
        on_overflow: Callable[[], None],
        make_observer: Callable[[], BaseObserver] | None = None,
    ):
        self._handler = Handoff(loop, on_path, on_overflow)
        self._make = make_observer or Observer
        self._observer: BaseObserver | None = None
        self._lock = threading.Lock()
        self._watches: dict[Key, ObservedWatch] = {}
        self._refused: dict[Key, float] = {}  # a refused watch -> when it may be asked for again
        self._refusals: dict[Key, int] = {}  # a refused watch -> refusals in a row
        self.failed: set[str] = set()
        self.capped = False

    # --- life ------------------------------------------------------------------

    def start(self) -> None:
        """Start the observer's thread (watches come with `reconcile`)."""
        observer = self._make()
        observer.name = THREAD_NAME
        observer.start()
        self._observer = observer

    def stop(self) -> None:
        """Stop the observer and join its threads; from any thread but watchdog's."""
        with self._lock:
            observer, self._observer = self._observer, None
            self._watches.clear()
        if observer is None:
            return
        observer.stop()  # unschedules every watch: emitters stopped and joined, inotify closed
        observer.join(10)

    def count(self) -> int:
        """Scheduled watches: normally one per watched root."""
        return len(self._watches)

    def kernel_watches(self) -> int:
        """The kernel's inotify watches of this observer (0 where it is not inotify's)."""
        fd = self.inotify_fd()
        if fd is None:
            return 0
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                return sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            return 0

    def inotify_fd(self) -> int | None:
        """The observer's inotify descriptor, once a watch is scheduled (watchdog's InotifyObserver
        allocates one InotifyFD for all of its emitters); None for another observer."""
        ifd = getattr(self._observer, "_inotify_fd", None)
        return getattr(ifd, "_inotify_fd", None)

    # --- what to watch (the filesystem thread) ------------------------------------

    def reconcile(self, wanted: set[Key], now: float | None = None) -> None:
        """Watch exactly `wanted`, up to MAX_WATCHES (recursive ones first); the rest is polled.

        A path inside a recursive watch is not scheduled again: it is watched already, and a
        second watch would hand each event over twice.
        """
        if self._observer is None:
            return
        now = time.monotonic() if now is None else now
        wanted = _uncovered(wanted)
        if len(wanted) > MAX_WATCHES:
            if not self.capped:
                log.warning(
                    "%d watches asked for; watching %d and polling the rest", len(wanted), MAX_WATCHES
                )
                self.capped = True
            wanted = set(sorted(wanted, key=lambda k: (not k[1], k[0].count("/"), k[0]))[:MAX_WATCHES])
        with self._lock:
            observer = self._observer
            if observer is None:
                return
            for key in set(self._watches) - wanted:
                observer.unschedule(self._watches.pop(key))
            new = [k for k in sorted(wanted) if k not in self._watches and self._refused.get(k, 0.0) <= now]
        for key in new:
            self._schedule(observer, key, now)

    def _schedule(self, observer: BaseObserver, key: Key, now: float) -> None:
        path, recursive = key
        try:  # outside the lock: a recursive watch walks its tree first
            watch = observer.schedule(self._handler, path, recursive=recursive, event_filter=EVENTS)
        except OSError as exc:
            self._refused_watch(key, exc, now)
            return
        with self._lock:
            if self._observer is not observer:  # stopped meanwhile: stop() unscheduled everything
                return
            self._watches[key] = watch
        fd = self.inotify_fd()
        if fd is not None:  # watchdog's inotify_init() has no IN_CLOEXEC: keep it from exec'd programs
            os.set_inheritable(fd, False)
        _name_threads(observer, watch)
        self._refused.pop(key, None)
        self._refusals.pop(key, None)
        self.failed.discard(path)

    def _refused_watch(self, key: Key, exc: OSError, now: float) -> None:
        path = key[0]
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return  # gone already; the next poll notices
        self._refusals[key] = refusals = self._refusals.get(key, 0) + 1
        self._refused[key] = now + retry_wait(refusals)
        if path in self.failed:
            return
        self.failed.add(path)
        if exc.errno == errno.ENOSPC:
            log.warning(
                "inotify watch limit reached (fs.inotify.max_user_watches) at %s; polling it instead", path
            )
        elif exc.errno == errno.EMFILE:
            log.warning(
                "inotify instance limit reached (fs.inotify.max_user_instances) at %s; polling it instead",
                path,
            )
        else:
            log.warning("cannot watch %s (%s); polling it instead", path, exc.strerror or exc)


def retry_wait(refusals: int) -> float:
    """Seconds before a watch refused `refusals` times in a row is asked for again."""
    return min(RETRY_AFTER * 2 ** min(refusals - 1, 32), RETRY_MAX)


def _name_threads(observer: BaseObserver, watch: ObservedWatch) -> None:
    """Names that say whose threads these are (in a thread dump, `py-spy dump`)."""
    for emitter in list(observer.emitters):
        if emitter.watch == watch:
            emitter.name = f"{THREAD_NAME} {watch.path}"
    reader = getattr(observer, "_inotify_fd", None)  # watchdog's InotifyObserver: its one reader
    if reader is not None:
        reader.name = f"{THREAD_NAME} inotify"


def _uncovered(wanted: set[Key]) -> set[Key]:
    """`wanted` less what a recursive watch in it covers already."""
    deep = sorted(p for p, recursive in wanted if recursive)
    return {
        (p, r) for p, r in wanted
        if not any(p == d and not r or p.startswith(d.rstrip(os.sep) + os.sep) for d in deep)
    }  # fmt: skip
