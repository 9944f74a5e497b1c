"""Narrow inotify watches through watchdog, and where inotify cannot see.

watchdog's handlers run on its observer thread, under its lock, so ours does
one thing: hand the path to the event loop with `call_soon_threadsafe` and
return. The events are hints only; the daemon always looks at the disk.

What is watched (see `RootTracker.wanted_watches`): the directories on the
way to runs and the run directories, not recursively, and only the
checkpoints still in flight (written lately), recursively. Only creations, deletions, moves and
close-after-write are asked for: a rank writing 64 MiB in 4 KiB chunks would
otherwise queue 16k modify events, and our own scans would generate
open/access events.

inotify queue overflow: watchdog logs a warning and carries on, telling no
handler. We hook its overflow callback and let the daemon rescan what is in
flight. Watch-limit exhaustion (ENOSPC from inotify_add_watch) is logged and
that path is left to polling, which runs in every mode.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import ObservedWatch
from watchdog.observers.inotify import InotifyEmitter, InotifyObserver

from ckptd.mounts import filesystem_type, is_remote

log = logging.getLogger(__name__)

# watchdog runs one emitter thread per watch: beyond this many, the rest is left to polling.
MAX_WATCHES = 512

EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent, FileDeletedEvent, FileMovedEvent, FileClosedEvent,
    DirCreatedEvent, DirDeletedEvent, DirMovedEvent,
]  # fmt: skip


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


class _Emitter(InotifyEmitter):
    """watchdog's inotify emitter, telling us when the kernel queue overflowed."""

    def __init__(self, *args, on_overflow: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._on_overflow = on_overflow

    def on_thread_start(self) -> None:
        super().on_thread_start()
        group = self._inotify
        if group is None:
            return
        reconcile = group.on_queue_overflow

        def overflowed() -> None:  # on watchdog's inotify reader thread
            reconcile()
            self._on_overflow()

        group.on_queue_overflow = overflowed  # type: ignore[method-assign]


class _Observer(InotifyObserver):
    def __init__(self, on_overflow: Callable[[], None]):
        super().__init__()
        self._emitter_class = _Emitter
        self._emitter_kwargs["on_overflow"] = on_overflow


class _Bridge(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, on_path: Callable[[str], None]):
        self._loop = loop
        self._on_path = on_path

    def dispatch(self, event: FileSystemEvent) -> None:
        # On watchdog's thread: hand over and return.
        for p in (event.src_path, getattr(event, "dest_path", "")):
            if p:
                self._loop.call_soon_threadsafe(self._on_path, os.fsdecode(p))


class Watcher:
    """The inotify watches of every root.

    `reconcile` may block (adding a recursive watch walks the tree): call it off the event loop.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_path: Callable[[str], None], on_overflow: Callable[[], None]
    ):
        self._observer = _Observer(lambda: loop.call_soon_threadsafe(on_overflow))
        self._handler = _Bridge(loop, on_path)
        self._watches: dict[tuple[str, bool], ObservedWatch] = {}
        self.failed: set[str] = set()
        self.capped = False

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=10)

    def count(self) -> int:
        return len(self._watches)

    def reconcile(self, wanted: set[tuple[str, bool]]) -> None:
        """Watch exactly `wanted`, up to MAX_WATCHES (each is a watchdog thread); the rest is polled."""
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
        self._reconcile(wanted)

    def _reconcile(self, wanted: set[tuple[str, bool]]) -> None:
        for key in set(self._watches) - wanted:
            try:
                self._observer.unschedule(self._watches.pop(key))
            except (KeyError, OSError):
                pass
        for key in sorted(wanted - set(self._watches)):
            path, recursive = key
            try:
                self._watches[key] = self._observer.schedule(
                    self._handler, path, recursive=recursive, event_filter=EVENTS
                )
                self.failed.discard(path)
            except FileNotFoundError:
                continue  # gone already; the next poll notices
            except RuntimeError as exc:  # no thread to be had: polling covers it
                if path not in self.failed:
                    self.failed.add(path)
                    log.warning("cannot watch %s (%s); polling it instead", path, exc)
            except OSError as exc:
                if path not in self.failed:
                    self.failed.add(path)
                    if exc.errno == errno.ENOSPC:
                        log.warning(
                            "inotify watch limit reached (fs.inotify.max_user_watches) at %s; "
                            "polling it instead",
                            path,
                        )
                    else:
                        log.warning("cannot watch %s (%s); polling it instead", path, exc)
