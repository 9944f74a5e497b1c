"""A volume lease's holder frozen (SIGSTOP: as a debugger, a cgroup freeze or a hung mount's D
state leave it) keeps its POSIX lock and its flock, but renews nothing: a standby takes over on
the lease within the duration plus the margin and a poll, and the frozen holder, when it runs
again, renames nothing (its fence reads the later claim). Real `ckptd run` processes on one
host, with their own state_dirs, as in test_multinode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.daemonproc import DaemonProc
from tests.support.fleet import stop_all
from tests.support.nodes import (
    D,
    M,
    ckpts,
    lease_record,
    listing,
    logged_at,
    node_config,
    trashed,
    wait_stopped,
)

# What the test allows between the stop and the takeover's log line: the duration and the
# margin the rules wait, a lease step (D/3) to see the last renewal and one to act, and slack
# for a loaded machine (the measured figures: bench/takeover.py, BENCHMARKS.md's 16. takeover).
TAKEOVER_BOUND = D + M + 2 * D / 3 + 3.0


def lock_holders(path: Path) -> set[int]:
    """The pids holding a lock on `path`, by the kernel's table (/proc/locks)."""
    st = os.stat(path)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] != "->" and fields[5] == key:
            pids.add(int(fields[4]))
    return pids


def test_a_frozen_leader_is_taken_over_on_its_lease_and_deletes_nothing_when_it_wakes(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        b = DaemonProc("-c", node_config(tmp_path, "b", root))
        b.wait_message("standby, observing only")
        a.signal(signal.SIGSTOP)
        stopped = time.time()
        wait_stopped(a.proc.pid)
        lease = root / ".ckptd"
        assert lock_holders(lease / "leader.lock") == {a.proc.pid}  # frozen, its locks held
        assert lock_holders(lease / "local.lock") == {a.proc.pid}
        [took] = b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=30)
        assert logged_at(took) - stopped <= TAKEOVER_BOUND, b.dump()
        b.wait_message(f"pid {a.proc.pid}, whose lease lapsed, still holds its locks")
        taken = lease_record(root)
        ckpts(root, 2)
        b.wait_message("deleted job/checkpoint-1")  # while a is frozen, its locks held
        ckpts(root, 3)  # a wakes to a checkpoint it would delete if it still led
        mark = a.mark()
        a.signal(signal.SIGCONT)
        a.wait_message("volume lease lost", start=mark)
        b.wait_message("deleted job/checkpoint-2")
        b.wait_message("this ckptd holds the volume lease's locks again")
        a.wait_message("state written", start=mark)
        assert lock_holders(lease / "leader.lock") == {b.proc.pid}
        assert lock_holders(lease / "local.lock") == {b.proc.pid}
    finally:
        stop_all(a, b)
    assert all(t < taken["since"] for _, t in trashed(tmp_path / "a")), a.dump()
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


# --- which locks a standby passes over: the rules, with clocks the test drives -------------------

HOLD = """
import fcntl, os, sys
fds = []
for name, how in zip(sys.argv[1::2], sys.argv[2::2]):
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
    (fcntl.lockf if how == "lockf" else fcntl.flock)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fds.append(fd)
print("locked", flush=True)
sys.stdin.read()
"""


class Holding:
    """A child process holding locks on files of `.ckptd/` (lockf or flock, as ckptd takes them)
    until the test ends: a real holder the kernel's lock table shows, frozen or not."""

    def __init__(self, lease_dir: Path, *locks: tuple[str, str]):
        args = [a for name, how in locks for a in (str(lease_dir / name), how)]
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "locked\n"

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)  # closes its pipes


class NoLocksIO:
    """The lapsed holder's I/O in this process: its locks are the child's (`Holding`)."""

    @staticmethod
    def make(root: Path):
        from ckptd.fleet.leaserecord import RecordIO

        class IO(RecordIO):
            def lock(self) -> str | None:
                return None

            def lock_root(self) -> str | None:
                return None

        return IO(root)


@pytest.mark.parametrize(
    ("locks", "taken"),
    [
        pytest.param([("leader.lock", "lockf"), ("local.lock", "flock")], True, id="both-by-the-lapsed-holder"),
        pytest.param([("leader.lock", "lockf")], True, id="leader-lock-alone"),
        pytest.param([("local.lock", "flock")], False, id="local-lock-alone-a-local-ckptd"),
    ],
)
def test_a_standby_passes_over_only_the_lapsed_holders_own_locks(tmp_path, locks, taken):
    from ckptd.fleet.lease import VolumeLease
    from ckptd.fleet.leaserecord import Holder

    wall, mono = [1_000_000.0], [50.0]
    a = VolumeLease(tmp_path, duration=3.0, margin=1.0, io=NoLocksIO.make(tmp_path),
                    holder=Holder("elsewhere", 1, 0.0, "a"), wall=lambda: wall[0], mono=lambda: mono[0])
    b = VolumeLease(tmp_path, duration=3.0, margin=1.0, wall=lambda: wall[0], mono=lambda: mono[0])
    a.step()
    assert a.held()
    holder = Holding(tmp_path / ".ckptd", *locks)
    try:
        b.step()
        wall[0] += 10
        mono[0] += 10
        b.step()
        assert b.held() is taken, b.blocked
        if not taken:
            assert "leadership = \"local\" deletes here" in (b.blocked or "")
    finally:
        holder.close()
        b.release()


def test_a_local_lock_held_by_another_process_than_the_lease_lock_is_not_passed_over(tmp_path):
    """The lapsed holder's lease lock, and a ckptd with `leadership = "local"` (another process)
    holding the root's own lock: it deletes here, so the standby does not take over."""
    from ckptd.fleet.lease import VolumeLease
    from ckptd.fleet.leaserecord import Holder

    wall, mono = [1_000_000.0], [50.0]
    a = VolumeLease(tmp_path, duration=3.0, margin=1.0, io=NoLocksIO.make(tmp_path),
                    holder=Holder("elsewhere", 1, 0.0, "a"), wall=lambda: wall[0], mono=lambda: mono[0])
    b = VolumeLease(tmp_path, duration=3.0, margin=1.0, wall=lambda: wall[0], mono=lambda: mono[0])
    a.step()
    frozen = Holding(tmp_path / ".ckptd", ("leader.lock", "lockf"))
    local = Holding(tmp_path / ".ckptd", ("local.lock", "flock"))
    try:
        b.step()
        wall[0] += 10
        mono[0] += 10
        b.step()
        assert not b.held()
        assert "leadership = \"local\" deletes here" in (b.blocked or ""), b.blocked
    finally:
        frozen.close()
        local.close()
        b.release()
