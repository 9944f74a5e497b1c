"""The daemon's async parts in-process, with pytest-asyncio: the thread-to-loop bridge, reload.

Waits are on asyncio events with timeouts. Settling timers are driven by a
controllable clock in test_tracker.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.daemon.watch import Watcher, choose_observer
from ckptd.errors import RootMissingError
from ckptd.volume.mounts import filesystem_type
from tests.support.daemonproc import write_config
from tests.support.logwatch import logs as logs

pytestmark = pytest.mark.asyncio


async def test_inotify_paths_reach_the_loop_on_its_thread(tmp_path):
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


@pytest.mark.exclusive
async def test_a_queue_overflow_reaches_the_loop_and_recursive_watches_are_walked_again(tmp_path):
    """A real IN_Q_OVERFLOW: the observer's inotify instance is made with a queue of one event
    (fs.inotify.max_queued_events is read once, by inotify_init at the first schedule: lowered for
    that only, and restored), and watchdog's reader is held (its InotifyFD lock, which the reader
    takes after each read) while the checkpoint is written: the kernel drops what does not fit,
    among it the creation of a directory. watchdog walks its recursive watch again and sends
    EventsLostEvent, which reaches the loop as the daemon's overflow; the lost directory is
    watched from then on."""
    queued = Path("/proc/sys/fs/inotify/max_queued_events")
    try:
        old = queued.read_text()
        queued.write_text(old)
    except OSError as exc:
        pytest.skip(f"fs.inotify.max_queued_events cannot be written here ({exc}): no overflow to provoke")
    loop = asyncio.get_running_loop()
    overflowed = asyncio.Event()
    seen: list[str] = []
    watcher = Watcher(loop, seen.append, overflowed.set)
    watcher.start()
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    try:
        try:
            queued.write_text("1")
            await asyncio.to_thread(watcher.reconcile, {(str(ckpt), True)})
        finally:
            queued.write_text(old)
        lost = ckpt / "global_step1"
        with watcher._observer._inotify_fd._lock:  # nothing is read meanwhile: the events fill the queue of one
            for name in ("a", "b"):
                (ckpt / name).write_bytes(b"x")
            lost.mkdir()
        await asyncio.wait_for(overflowed.wait(), 10)
        assert watcher.kernel_watches() == 2  # global_step1 watched again by watchdog's walk
        await asyncio.to_thread((lost / "shard.pt").write_bytes, b"x")
        while str(lost / "shard.pt") not in seen:
            await asyncio.sleep(0.01)  # bounded by the test timeout: the event arrives on the loop
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_a_directory_created_inside_a_watched_root_is_watched_at_once(tmp_path):
    """And the threads are watchdog's, a fixed few: the observer, the inotify reader and its
    dispatcher, and one emitter per scheduled watch (one per root), however many directories."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    arrived = asyncio.Event()

    def on_path(path: str) -> None:
        seen.append(path)
        if path.endswith("shard.pt"):
            arrived.set()

    await asyncio.to_thread(lambda: None)  # the loop's executor thread, started before counting
    before = threading.active_count()
    watcher = Watcher(loop, on_path, lambda: None)
    watcher.start()
    try:
        ckpt = tmp_path / "checkpoint-1"
        ckpt.mkdir()
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), True)})
        (ckpt / "global_step1").mkdir()
        while str(ckpt / "global_step1") not in seen:  # its creation read: now it is watched
            await asyncio.sleep(0.01)
        threads = threading.active_count()  # counted once an event went through every one of them
        assert threads - before == 4  # observer, reader, dispatcher, one emitter
        (ckpt / "global_step1" / "shard.pt").write_bytes(b"x")
        await asyncio.wait_for(arrived.wait(), 10)
        assert watcher.kernel_watches() == 3 and threading.active_count() == threads  # no thread per directory
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
        assert watcher.kernel_watches() == 1 and not watcher.failed
    finally:
        await asyncio.to_thread(watcher.stop)


@pytest.mark.exclusive
async def test_an_exhausted_watch_limit_is_logged_once_and_leaves_the_path_to_polling(tmp_path, caplog):
    """ENOSPC from inotify_add_watch (fs.inotify.max_user_watches reached), provoked for real: the
    limit is lowered to 0 (no new watch for this user) for the two reconciles only, and restored.
    A refused watch is asked for again after RETRY_AFTER, not at every step (it walks its tree), and
    twice as long after each refusal in a row."""
    from ckptd.daemon.watch import RETRY_AFTER

    limit = Path("/proc/sys/fs/inotify/max_user_watches")
    try:
        old = limit.read_text()
        limit.write_text(old)
    except OSError as exc:
        pytest.skip(f"fs.inotify.max_user_watches cannot be written here ({exc}): ENOSPC cannot be provoked")
    watcher = Watcher(asyncio.get_running_loop(), lambda p: None, lambda: None)
    watcher.start()
    key = (str(tmp_path), True)
    (tmp_path / "run" / "checkpoint-1").mkdir(parents=True)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptd.daemon.watch"):
            try:
                limit.write_text("0")
                await asyncio.to_thread(watcher.reconcile, {key}, 0.0)
                await asyncio.to_thread(watcher.reconcile, {key}, RETRY_AFTER + 1)  # asked again while it lasts
            finally:
                limit.write_text(old)
        assert watcher.count() == 0 and watcher.failed == {str(tmp_path)}
        assert len([r for r in caplog.records if "watch limit reached" in r.getMessage()]) == 1
        await asyncio.to_thread(watcher.reconcile, {key}, RETRY_AFTER + 2)
        assert watcher.count() == 0  # not yet: the limit allows it, but the retry waits
        await asyncio.to_thread(watcher.reconcile, {key}, 2 * RETRY_AFTER + 2)
        assert watcher.count() == 0  # refused twice in a row: it waits twice as long
        await asyncio.to_thread(watcher.reconcile, {key}, 3 * RETRY_AFTER + 2)
        assert watcher.count() == 1 and not watcher.failed  # watched again once the limit allows it
        assert watcher.kernel_watches() == 3
    finally:
        await asyncio.to_thread(watcher.stop)


@pytest.mark.parametrize("refusals, wait", [(1, 60.0), (2, 120.0), (3, 240.0), (5, 960.0), (6, 1800.0),
                                            (1000, 1800.0)])
async def test_a_refused_watch_waits_twice_as_long_after_each_refusal_up_to_half_an_hour(refusals, wait):
    """Each try walks the root's tree until the kernel refuses (0.4-0.55 s of CPU on L's 12,872
    directories: 0.9 % of a core at one a minute; bench/watchscale.py measures it); a limit rarely changes by itself."""
    from ckptd.daemon.watch import RETRY_MAX, retry_wait

    assert RETRY_MAX == 1800.0
    assert retry_wait(refusals) == wait


@pytest.mark.exclusive
async def test_an_exhausted_instance_limit_is_logged_and_leaves_the_root_to_polling(tmp_path, caplog):
    """EMFILE from inotify_init (fs.inotify.max_user_instances reached), provoked for real: watchdog's
    observer makes its one instance at the first schedule, with the limit lowered to 0 meanwhile."""
    from ckptd.daemon.watch import RETRY_AFTER

    limit = Path("/proc/sys/fs/inotify/max_user_instances")
    try:
        old = limit.read_text()
        limit.write_text(old)
    except OSError as exc:
        pytest.skip(f"fs.inotify.max_user_instances cannot be written here ({exc}): EMFILE cannot be provoked")
    watcher = Watcher(asyncio.get_running_loop(), lambda p: None, lambda: None)
    watcher.start()
    key = (str(tmp_path), True)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptd.daemon.watch"):
            try:
                limit.write_text("0")
                await asyncio.to_thread(watcher.reconcile, {key}, 0.0)
            finally:
                limit.write_text(old)
        assert watcher.count() == 0 and watcher.failed == {str(tmp_path)} and watcher.inotify_fd() is None
        assert [r.getMessage() for r in caplog.records if "instance limit reached" in r.getMessage()] == [
            f"inotify instance limit reached (fs.inotify.max_user_instances) at {tmp_path}; polling it instead"]
        await asyncio.to_thread(watcher.reconcile, {key}, RETRY_AFTER + 1)
        assert watcher.count() == 1 and watcher.kernel_watches() == 1  # watched once the limit allows it
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_a_directory_watched_for_two_keys_gives_one_hint_per_event(tmp_path):
    """One watch, one hint per event: a directory also inside a recursive watch (a run directory
    that is also an in-flight checkpoint's top) is not scheduled twice."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    last = asyncio.Event()

    def on_path(path: str) -> None:
        seen.append(path)
        if path.endswith("last"):
            last.set()

    watcher = Watcher(loop, on_path, lambda: None)
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), False), (str(tmp_path), True)})
        assert watcher.count() == 1 and watcher.kernel_watches() == 1
        (tmp_path / "shard.pt").write_bytes(b"x")
        (tmp_path / "last").write_bytes(b"x")  # read after the shard's events: same watch, in order
        await asyncio.wait_for(last.wait(), 10)
        assert seen.count(str(tmp_path / "shard.pt")) == 2  # created, closed: once each
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_stopping_closes_the_descriptor_and_joins_the_threads(tmp_path):
    await asyncio.to_thread(lambda: None)  # the loop's executor thread, started before counting
    before = set(threading.enumerate())
    watcher = Watcher(asyncio.get_running_loop(), lambda p: None, lambda: None)
    watcher.start()
    await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), True)})
    fd = watcher.inotify_fd()
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    assert not os.get_inheritable(fd)  # watchdog's inotify_init() has no IN_CLOEXEC: set after
    watch = f" ino:{os.stat(tmp_path).st_ino:x} "  # this instance's watch, as /proc's fdinfo lists it
    assert watch in Path(f"/proc/self/fdinfo/{fd}").read_text()
    await asyncio.to_thread(watcher.stop)
    assert watcher.count() == 0 and watcher.inotify_fd() is None
    left = [t for t in threading.enumerate() if t not in before and not t.name.startswith("asyncio_")]
    assert left == []  # joined, not left behind (the loop's executor may have grown meanwhile)
    # Closed: the number may be another file's by now, even another inotify instance's (a thread
    # of an earlier test in this worker), so look for this instance's own watch on tmp_path.
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except FileNotFoundError:
        info = ""
    assert watch not in info, info
    await asyncio.to_thread(watcher.stop)  # twice: nothing to do


async def test_the_thread_leak_fixture_fails_a_test_that_leaves_an_observer_running(tmp_path):
    """What tests/conftest.py's no_thread_leaks asserts on, for a watcher started and not stopped:
    its observer, inotify reader and dispatcher, and emitter are named; once stopped, none is."""
    from tests.support.threads import leaked

    await asyncio.to_thread(lambda: None)  # the loop's executor thread, started before counting
    before = set(threading.enumerate())
    watcher = Watcher(asyncio.get_running_loop(), lambda p: None, lambda: None)
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), True)})
        (tmp_path / "x").write_bytes(b"x")  # a first event through every thread: all are up by then
        while not [t for t in threading.enumerate() if t.name == "InotifyFD-Dispatcher" and t not in before]:
            await asyncio.sleep(0.01)  # bounded by the test timeout
        left = await asyncio.to_thread(leaked, before, 0.05)
        names = sorted(t.name for t in left if not t.name.startswith("asyncio_"))
        # watchdog's dispatcher comes and goes with the events it hands on (InotifyFD starts it per
        # burst): named when there, but not always there at the count
        assert [n for n in names if n != "InotifyFD-Dispatcher"] == [
            "ckptd-watch", f"ckptd-watch {tmp_path}", "ckptd-watch inotify"]
    finally:
        await asyncio.to_thread(watcher.stop)
    left = await asyncio.to_thread(leaked, before, 5.0)
    assert [t for t in left if not t.name.startswith("asyncio_")] == []  # (the loop's executor may grow)


async def test_without_inotify_the_same_watcher_runs_on_a_polling_observer(tmp_path):
    """The stand-in for a platform without inotify (a laptop's FSEvents, kqueue): watchdog's
    PollingObserver behind the same Watcher, its snapshots read every 0.1 s."""
    from watchdog.observers.polling import PollingObserver

    loop = asyncio.get_running_loop()
    seen: list[str] = []
    arrived = asyncio.Event()

    ckpt = tmp_path / "checkpoint-1"
    wanted = {str(ckpt), str(ckpt / "global_step1"), str(ckpt / "global_step1" / "shard.pt")}

    def on_path(path: str) -> None:
        seen.append(path)
        if wanted <= set(seen):  # one snapshot's events, in no particular order
            arrived.set()

    watcher = Watcher(loop, on_path, lambda: None, make_observer=lambda: PollingObserver(timeout=0.1))
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, {(str(tmp_path), True)})
        (tmp_path / "checkpoint-1" / "global_step1").mkdir(parents=True)
        (tmp_path / "checkpoint-1" / "global_step1" / "shard.pt").write_bytes(b"x")
        await asyncio.wait_for(arrived.wait(), 10)
        assert watcher.kernel_watches() == 0
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_auto_observer_reads_the_filesystem_type(tmp_path):
    fstype, mount = filesystem_type(tmp_path)
    assert fstype and mount and os.path.realpath(tmp_path).startswith(mount)
    kind, why = choose_observer(tmp_path, "auto")
    assert kind in ("inotify", "polling") and fstype in why
    assert choose_observer(tmp_path, "polling") == ("polling", "configured")


async def test_auto_watches_with_watchdog_where_there_is_no_mount_table(tmp_path, monkeypatch):
    """A developer's laptop (macOS: no /proc/self/mountinfo) is watched by watchdog's platform
    observer (FSEvents there); a Linux box whose mount table cannot be read is polled."""
    from ckptd.daemon import watch

    monkeypatch.setattr(watch, "filesystem_type", lambda path: (None, None))
    assert choose_observer(tmp_path, "auto") == ("polling", "filesystem type unknown")
    monkeypatch.setattr(watch.sys, "platform", "darwin")
    kind, why = choose_observer(tmp_path, "auto")
    assert kind == "inotify" and why.startswith("darwin: watchdog's")


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


async def test_a_flaky_volume_is_logged_once_backed_off_and_nothing_is_deleted(tmp_path, monkeypatch, logs):
    """ESTALE (a stale NFS handle) injected at the evidence walk, the daemon's one deep read."""
    from ckptd.judge import evidence

    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="world_size = 2\nquiet_period = '0.3s'\nallow_short_quiet_period = true\npoll_interval = '0.05s'",
                       retention="keep_last = 1\nkeep_best = 0")
    loop = asyncio.get_running_loop()
    real_walk = evidence.walk
    failing = threading.Event()
    failing.set()
    calls = 0
    enough = asyncio.Event()

    def flaky_walk(path):
        nonlocal calls
        if failing.is_set():
            calls += 1
            if calls == 4:
                loop.call_soon_threadsafe(enough.set)
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
        return real_walk(path)

    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)
        monkeypatch.setattr(evidence, "walk", flaky_walk)
        await asyncio.wait_for(enough.wait(), 30)  # several failed looks, backing off
        assert len(logs.messages("cannot look at the volume")) == 1
        assert not task.done() and logs.messages("deleted ") == []
        assert sorted(os.listdir(root / "job")) == ["checkpoint-1", "checkpoint-2"]
        failing.clear()
        await logs.wait("the volume answers again")
        await logs.wait("deleted job/checkpoint-1")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)
    assert sorted(os.listdir(root / "job")) == ["checkpoint-2"]


async def test_watches_are_capped_and_recursive_ones_come_first(tmp_path, monkeypatch):
    from ckptd.daemon import watch

    monkeypatch.setattr(watch, "MAX_WATCHES", 3)
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
    wanted = {(str(tmp_path / n), False) for n in "abc"} | {(str(tmp_path / "d"), True)}
    watcher = Watcher(asyncio.get_running_loop(), lambda p: None, lambda: None)
    watcher.start()
    try:
        await asyncio.to_thread(watcher.reconcile, wanted)
        assert watcher.count() == 3 and watcher.capped
        assert (str(tmp_path / "d"), True) in watcher._watches  # the recursive one first
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_a_reload_can_switch_dry_run_on_and_drop_a_pattern(tmp_path, logs):
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    (root / "job" / "snap_7").mkdir()
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\npatterns = ['snap_{step}']", retention="keep_last = 5")
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)
        assert "snap_7" in daemon.roots[0].tracker.runs["job"].checkpoints
        await logs.wait("job/checkpoint-3: complete")
        cfg.write_text(  # dry_run on, keep_last down to 1, the snap_{step} pattern gone
            f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\ndry_run = true\n"
            f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\n[roots.retention]\nkeep_last = 1\n"
        )
        await daemon.reload()
        assert daemon.dry_run and daemon.roots[0].reaper.dry_run
        assert "snap_7" not in daemon.roots[0].tracker.runs["job"].checkpoints
        await logs.wait("decide delete job/checkpoint-1")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)
    assert sorted(os.listdir(root / "job")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "snap_7"]


def ticked_daemon(cfg: Path, clock) -> tuple[Daemon, object]:
    """A dry-run Daemon for one root, first scan done, not served: the test drives `tick.run`,
    `retention.run` and `state` itself, on its own clock."""
    daemon = Daemon(load_config(cfg), config_path=cfg, dry_run=True, clock=clock, install_signals=False)
    daemon.watcher = None
    rt = daemon.keeper.runtime(daemon.config.roots[0], daemon.config)
    daemon.roots.append(rt)
    daemon.tick.first_scan()
    while rt.tracker.unseen:  # the first looks, which the daemon's first ticks after READY take
        rt.tracker.step(clock())
    return daemon, rt


@pytest.mark.parametrize(
    "fault",
    [OSError(errno.ESTALE, os.strerror(errno.ESTALE)), RootMissingError("/vol: the root is gone (unmounted?)")],
    ids=["ESTALE", "root-missing"],
)
async def test_a_failing_look_backs_off_doubling_up_to_the_reconcile_interval(tmp_path, monkeypatch, fault, logs):
    """Driven tick by tick with a controllable clock: the delays, the single log line, the recovery.
    The fault is injected where the tracker looks at the volume (poll and full scan)."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="poll_interval = '1s'\nreconcile_interval = '60s'")
    now = [1000.0]
    daemon, rt = ticked_daemon(cfg, lambda: now[0])

    def fail(*args):
        raise fault

    monkeypatch.setattr(rt.tracker, "poll", fail)
    monkeypatch.setattr(rt.tracker, "full_scan", fail)
    delays = []
    for _ in range(8):
        now[0] = rt.next_poll
        daemon.tick.run()
        delays.append(rt.next_poll - now[0])
    monkeypatch.undo()
    now[0] = rt.next_poll
    daemon.tick.run()
    delays.append(rt.next_poll - now[0])
    assert delays == [2, 4, 8, 16, 32, 60, 60, 60, 1]
    said = [r.getMessage() for r in logs.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "cannot look at the volume" in said[0] and "retrying in 2.0s" in said[0]
    assert logs.messages("the volume answers again")


async def test_a_stop_does_not_wait_for_a_look_at_the_volume_that_hangs(tmp_path, monkeypatch):
    """A hung NFS mount: the look never returns. The stop goes ahead to shutdown (STOPPING=1) at once."""
    import ckptd.daemon.core

    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state")
    loop = asyncio.get_running_loop()
    entered, stopping, release = asyncio.Event(), asyncio.Event(), threading.Event()
    real_notify = ckptd.daemon.core.notify

    def notify(*fields):
        if "STOPPING=1" in fields:
            stopping.set()
        return real_notify(*fields)

    monkeypatch.setattr(ckptd.daemon.core, "notify", notify)
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)

        def hung_tick():
            loop.call_soon_threadsafe(entered.set)
            release.wait(60)

        monkeypatch.setattr(daemon.tick, "run", hung_tick)
        daemon._wake.set()
        await asyncio.wait_for(entered.wait(), 30)
        daemon.request_stop("test")
        await asyncio.wait_for(stopping.wait(), 5)  # not after the look: it would never come
        assert not release.is_set()
    finally:
        release.set()  # within shutdown's bounded wait for the thread, so the test process lives on
        await asyncio.wait_for(task, 30)


async def test_a_standby_decides_but_never_deletes(tmp_path, logs):
    """Another ckptd holds the root's lock (here: the test): this one observes only."""
    from ckptd.fleet.locks import RootLock

    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\npoll_interval = '0.05s'", retention="keep_last = 1")
    holder = RootLock(tmp_path / "state", root)
    holder.acquire()
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await logs.wait("standby, observing only")
        await logs.wait("decide delete job/checkpoint-2")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)  # the decision's pass has finished on the fs thread
        holder.release()
    assert sorted(os.listdir(root / "job")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert logs.messages("deleted ") == [] and not (root / ".ckptd-trash").exists()


async def test_the_state_file_shows_each_checkpoints_decision_and_encodes_unchanged_runs_once(tmp_path):
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="quiet_period = '1s'\nallow_short_quiet_period = true",
                       retention="keep_last = 1")
    now = [1000.0]
    daemon, rt = ticked_daemon(cfg, lambda: now[0])
    now[0] += 2
    rt.tracker.step(now[0])
    daemon.retention.run()

    def rows():
        return daemon.state()["roots"][0]["runs"][0]["checkpoints"]

    first = rows()
    assert [(r["name"], r["state"], r["action"]) for r in first] == [
        ("checkpoint-1", "complete", "delete"), ("checkpoint-2", "complete", "delete"),
        ("checkpoint-3", "complete", "keep")]
    encoded = daemon.state_file.runs_cache[rt.root.path][1]
    rt.tracker.poll()  # nothing changed: the runs are not encoded again
    assert rows() == first and daemon.state_file.runs_cache[rt.root.path][1] is encoded
    (root / "job" / "checkpoint-1" / "late.txt").write_text("x")
    rt.tracker.full_scan()  # a reconcile: a directory of checkpoint-1 changed, so it is looked at
    assert [r["state"] for r in rows()] == ["writing", "complete", "complete"]
    daemon.retention.run()  # checkpoint-1 is not deleted any more: the decision changed too
    assert [(r["name"], r["action"]) for r in rows()] == [
        ("checkpoint-1", "keep"), ("checkpoint-2", "delete"), ("checkpoint-3", "keep")]


async def test_a_refusal_sends_the_tracker_to_look_at_what_changed_in_place(tmp_path):
    """A reconcile does not walk an unchanged complete checkpoint (its directories, and the files
    whose contents a decision rests on, are stat'ed), so a shard overwritten in place with its size
    and mtime kept goes unseen until the reaper's re-check reads it and refuses; the refusal makes
    the tracker look again, and the plan follows the disk. (trainer_state.json rewritten in place
    is seen by the reconcile itself: its ctime is stamped.)"""
    import time

    from ckptd.judge.verdicts import RACY_NS

    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="quiet_period = '1s'\nallow_short_quiet_period = true",
                       retention="keep_last = 1\nkeep_best = 0")
    now = [1000.0]
    daemon, rt = ticked_daemon(cfg, lambda: now[0])
    rt.tracker.scanner.verdicts.clock_ns = lambda: time.time_ns() + 10 * RACY_NS  # the files count as old
    now[0] += 2
    rt.tracker.step(now[0])
    assert {c.name: str(c.state) for c in rt.tracker.checkpoints()} == {
        "checkpoint-1": "complete", "checkpoint-2": "complete"}
    shard = root / "job" / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    st = shard.stat()
    with open(shard, "r+b") as f:  # the anchor's shard, zeroed in place: same size, mtime kept
        f.write(b"\0" * st.st_size)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    rt.tracker.full_scan()
    assert str(rt.tracker.runs["job"].checkpoints["checkpoint-2"].state) == "complete"  # unseen
    daemon.retention.run()  # decides to delete checkpoint-1; the re-check finds the anchor broken
    # looked at again after the refusal: no longer complete, and checkpoint-1 is still there
    assert str(rt.tracker.runs["job"].checkpoints["checkpoint-2"].state) != "complete"
    assert (root / "job" / "checkpoint-1").is_dir()


async def test_a_missing_root_does_not_stop_retention_on_the_others(tmp_path):
    """Free space counted every root's pending trash by stat'ing each root, so
    one unmounted root made every pass fail ("retention skipped") for all of them."""
    a, b = tmp_path / "a", tmp_path / "b"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(a / "job", step, world=2)
    b.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
                   f"[[roots]]\npath = '{a}'\nquiet_period = '1s'\nallow_short_quiet_period = true\n[roots.retention]\nkeep_last = 1\n"
                   f"min_free = '1%'\n[[roots]]\npath = '{b}'\n")
    now = [1000.0]
    daemon = Daemon(load_config(cfg), config_path=cfg, dry_run=True, clock=lambda: now[0], install_signals=False)
    daemon.watcher = None
    for root in daemon.config.roots:
        daemon.roots.append(daemon.keeper.runtime(root, daemon.config))
    daemon.tick.first_scan()
    daemon.roots[0].tracker.step(now[0])  # the first looks, after READY
    now[0] += 2
    daemon.roots[0].tracker.step(now[0])
    b.rmdir()  # unmounted
    daemon.retention.run()
    actions = [r["action"] for r in daemon.state()["roots"][0]["runs"][0]["checkpoints"]]
    assert actions == ["delete", "delete", "keep"]


async def test_a_stop_saves_what_was_proven_for_the_next_start(tmp_path, monkeypatch, logs):
    """Reconciles save every 5 min; a stop saves what was proven since, so that the next start
    restores it (the racy-clean margin is set to 0 here: the test's files are a moment old)."""
    from ckptd.judge import verdicts

    monkeypatch.setattr(verdicts, "RACY_NS", 0)
    root = tmp_path / "vol"
    (root / "job").mkdir(parents=True)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="world_size = 2\nquiet_period = '0.2s'\nallow_short_quiet_period = true", retention="keep_last = 5")
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)
        await asyncio.to_thread(hf_deepspeed_checkpoint, root / "job", 1, world=2)  # after start-up
        await logs.wait("job/checkpoint-1: complete")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)
    saved = verdicts.Verdicts()
    saved.load(verdicts.cache_path(tmp_path / "state", root), root)
    assert saved.restorable(str(root / "job" / "checkpoint-1"), "") is None  # (another context: no)
    assert len(saved) == 1 and saved._records[str(root / "job" / "checkpoint-1")].checkpoint is not None
