"""kill -9 at seeded random points of a deletion, then restart: nothing kept is lost or damaged,
the trash is purged, and the journal agrees with the filesystem.

The kill lands right after the daemon's (or prune's) k-th journal record reaches the disk,
k drawn from a seeded generator: between the decision and the intent record, between the
intent and the rename, between the rename and its record, or in the middle of a purge.
The test waits on inotify events for the journal, never on a sleep.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from ckptd.cli.demo_volume import age, write_zip
from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import read_journal
from ckptd.judge.evidence import fingerprint, walk
from tests.support.daemonproc import DaemonProc, write_config

STEPS = 16
KEPT = [f"iter_{s:07d}" for s in (STEPS - 1, STEPS)]


def megatron_run(root: Path) -> Path:
    """A Megatron-LM run: no torch needed to judge it, so the process starts fast."""
    run = root / "gpt"
    for step in range(1, STEPS + 1):
        it = run / f"iter_{step:07d}"
        for r in range(20):
            write_zip(it / f"mp_rank_{r:02d}" / "model_optim_rng.pt", 256)
        age(it, 1_700_000_000 + step)
    (run / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    return run


def fingerprints(run: Path) -> dict[str, str]:
    return {name: fingerprint(walk(run / name)) for name in KEPT}


class JournalWatch(FileSystemEventHandler):
    """Wakes the test whenever something is written in the state directory (watchdog, real inotify).

    Only writes: the test's own reads of the journal raise open and close-without-write
    events, which would wake it forever (a busy loop that no silence timeout ends).
    """

    def __init__(self, state_dir: Path):
        self.changed = threading.Event()
        self.observer = Observer()
        state_dir.mkdir(parents=True, exist_ok=True)
        self.observer.schedule(self, str(state_dir), event_filter=[FileModifiedEvent, FileClosedEvent,
                                                                   FileCreatedEvent, FileMovedEvent])
        self.observer.start()

    def on_any_event(self, event):
        self.changed.set()

    def wait_until(self, cond, proc, timeout: float = 60, deadline: float = 180) -> None:
        """Return once `cond()` holds or the process has ended; fail after `timeout` of silence
        or `deadline` in all (a daemon's own state-file writes are activity too)."""
        end = time.monotonic() + deadline
        while not cond() and proc.poll() is None:
            self.changed.clear()
            if cond():
                break
            if not self.changed.wait(timeout):
                raise AssertionError(f"no activity in the state directory for {timeout}s")
            if time.monotonic() > end:
                raise AssertionError(f"not done after {deadline}s")

    def wait_records(self, state_dir: Path, k: int, proc, timeout: float = 60) -> None:
        self.wait_until(lambda: len(read_journal(state_dir)) >= k, proc, timeout)

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join()


def check_after_restart(run: Path, root: Path, state_dir: Path, before: dict[str, str]) -> None:
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == KEPT
    assert fingerprints(run) == before  # kept checkpoints are whole and untouched
    assert os.listdir(root / TRASH_DIR) == []
    records = read_journal(state_dir)
    purging = {r["trash"] for r in records if r["event"] == "purging"}
    purged = {r["trash"] for r in records if r["event"] == "purged"}
    for step in range(1, STEPS - 1):
        path = str(run / f"iter_{step:07d}")
        intents = [r for r in records if r["event"] == "trashing" and r["path"] == path]
        assert intents, f"{path} is gone without an intent in the journal"
        assert any(r["trash"] in purging for r in intents), f"{path}'s trash entry was never purged"
    # "purged" is missing only where the kill landed between a removal and its record: one entry.
    assert len(purging - purged) <= 1, sorted(purging - purged)


def all_purged(state_dir: Path, run: Path) -> bool:
    """Every checkpoint but the kept ones has an intent whose trash entry was being purged or is."""
    records = read_journal(state_dir)
    purging = {r["trash"] for r in records if r["event"] == "purging"}
    trashed = {r["path"] for r in records if r["event"] == "trashing" and r["trash"] in purging}
    return all(str(run / f"iter_{s:07d}") in trashed for s in range(1, STEPS - 1))


# 8 seeds by default; --run-slow adds 40 more.
PRUNE_SEEDS = [*range(8), *(pytest.param(s, marks=pytest.mark.slow) for s in range(8, 48))]
DAEMON_SEEDS = [*range(3), *(pytest.param(s, marks=pytest.mark.slow) for s in range(3, 23))]


@pytest.mark.parametrize("seed", PRUNE_SEEDS)
def test_kill_9_during_prune_then_prune_again(tmp_path, seed):
    root = tmp_path / "vol"
    run = megatron_run(root)
    state_dir = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state_dir, retention="keep_last = 2\nkeep_best = 0")
    before = fingerprints(run)
    total = (STEPS - 2) * 3  # trashing, trashed, purged for each deletion
    k = random.Random(seed).randint(0, total)
    watch = JournalWatch(state_dir)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        watch.wait_records(state_dir, k, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        watch.stop()
    again = subprocess.run([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg)], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    check_after_restart(run, root, state_dir, before)


@pytest.mark.parametrize("seed", DAEMON_SEEDS)
def test_kill_9_of_the_daemon_mid_deletion_then_restart(tmp_path, seed):
    root = tmp_path / "vol"
    run = megatron_run(root)
    state_dir = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state_dir, root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true",
                       retention="keep_last = 2\nkeep_best = 0")
    before = fingerprints(run)
    k = random.Random(1000 + seed).randint(1, (STEPS - 2) * 3)
    watch = JournalWatch(state_dir)
    try:
        daemon = DaemonProc("-c", cfg)
        watch.wait_records(state_dir, k, daemon.proc)
        daemon.signal(signal.SIGKILL)
        daemon.stop()
    finally:
        watch.stop()
    watch = JournalWatch(state_dir)
    try:
        with DaemonProc("-c", cfg) as daemon:
            daemon.wait_message("ready")
            watch.wait_until(lambda: all_purged(state_dir, run), daemon.proc)
    finally:
        watch.stop()
    check_after_restart(run, root, state_dir, before)
