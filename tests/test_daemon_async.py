"""The daemon's async parts in-process, with pytest-asyncio: the thread-to-loop bridge, reload.

Waits are on asyncio events with timeouts. Settling timers are driven by a
controllable clock in test_tracker.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.demo import hf_deepspeed_checkpoint
from ckptd.watch import Watcher, choose_observer, filesystem_type

from daemonproc import write_config

pytestmark = pytest.mark.asyncio


async def test_watchdog_paths_reach_the_loop_from_its_thread(tmp_path):
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, int]] = []
    arrived = asyncio.Event()

    def on_path(path: str) -> None:
        seen.append((path, threading.get_ident()))
        arrived.set()

    watcher = Watcher(loop, on_path, lambda: None)
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), False)})
        (tmp_path / "checkpoint-1").mkdir()
        await asyncio.wait_for(arrived.wait(), 10)
    finally:
        await asyncio.to_thread(watcher.stop)
    assert (str(tmp_path / "checkpoint-1"), threading.get_ident()) in seen  # delivered on the loop's thread


async def test_a_queue_overflow_reaches_the_loop(tmp_path):
    """A real IN_Q_OVERFLOW cannot be produced deterministically here (it needs the kernel queue
    to fill faster than watchdog's reader drains it), so this calls watchdog's overflow callback
    on its group, from another thread, as watchdog's reader thread would."""
    loop = asyncio.get_running_loop()
    overflowed = asyncio.Event()
    watcher = Watcher(loop, lambda p: None, overflowed.set)
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), True)})
        [emitter] = watcher._observer.emitters
        await asyncio.to_thread(emitter._inotify.on_queue_overflow)
        await asyncio.wait_for(overflowed.wait(), 10)
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_watching_only_what_is_asked(tmp_path):
    loop = asyncio.get_running_loop()
    watcher = Watcher(loop, lambda p: None, lambda: None)
    watcher.start()
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path / "a"), False), (str(tmp_path / "b"), True)})
        assert watcher.count() == 2
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path / "b"), True), (str(tmp_path / "gone"), False)})
        assert watcher.count() == 1  # a unwatched; a missing path is skipped, not an error
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_auto_observer_reads_the_filesystem_type(tmp_path):
    fstype, mount = filesystem_type(tmp_path)
    assert fstype and mount and os.path.realpath(tmp_path).startswith(mount)
    kind, why = choose_observer(tmp_path, "auto")
    assert kind in ("inotify", "polling") and fstype in why
    assert choose_observer(tmp_path, "polling") == ("polling", "configured")


async def test_reload_validates_first_and_keeps_the_old_config(tmp_path):
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="world_size = 2",
                       retention="keep_last = 3")
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)
        cfg.write_text(cfg.read_text().replace("keep_last = 3", "keep_last = 'three'"))
        await daemon.reload()
        assert daemon.roots[0].root.retention.keep_last == 3
        cfg.write_text(cfg.read_text().replace("keep_last = 'three'", "keep_last = 1"))
        await daemon.reload()
        assert daemon.roots[0].root.retention.keep_last == 1
        assert daemon.roots[0].tracker.root.retention.keep_last == 1
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0
    assert not list(Path(tmp_path / "state").glob("daemon.*.json"))
