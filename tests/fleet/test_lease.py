"""The volume lease (lease.py), on a real directory, with clocks the tests drive.

Several `VolumeLease` objects in one process stand for daemons on several hosts. The POSIX
lock cannot tell them apart (locks belong to a process), so here the lease rules alone decide;
the real lock between real processes is exercised in test_multinode.py. The root's own flock
(`RecordIO.lock_root`) would tell them apart, but a host these tests "kill" by no longer
stepping it would keep it forever: it is left out here (`OneProcessIO`) and exercised between
real processes in test_mixed_leadership.py.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.lease import VolumeLease
from ckptd.fleet.leaserecord import RECORD, Holder, Record, RecordIO, Seen


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class OneProcessIO(RecordIO):
    """The lease's I/O without the root's own flock (see the module doc)."""

    def lock_root(self) -> str | None:
        return None


class FaultyIO(OneProcessIO):
    """The lease's I/O seam with faults switched on and off by the test (EIO, ESTALE)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.fail_write: int | None = None
        self.fail_read: int | None = None

    def write(self, record: Record) -> None:
        if self.fail_write is not None:
            raise OSError(self.fail_write, "injected")
        super().write(record)

    def read(self):
        if self.fail_read is not None:
            raise OSError(self.fail_read, "injected")
        return super().read()


D, M = 30.0, 10.0


def host(name: str, wall: Clock, mono: Clock, root: Path, io: RecordIO | None = None) -> VolumeLease:
    return VolumeLease(root, duration=D, margin=M, io=io or OneProcessIO(root), holder=Holder(name, 1, 0.0, name),
                       wall=wall, mono=mono)


@pytest.fixture
def world(tmp_path):
    """Two hosts on one volume: wall clocks in step, monotonic clocks apart (they never agree)."""
    wall, mono_a, mono_b = Clock(1_000_000.0), Clock(50.0), Clock(9_000.0)
    a = host("a", wall, mono_a, tmp_path)
    b = host("b", wall, mono_b, tmp_path)

    def advance(seconds: float) -> None:
        for c in (wall, mono_a, mono_b):
            c.t += seconds

    yield a, b, advance, tmp_path
    a.release()
    b.release()


def record(root: Path) -> dict:
    return json.loads((root / LEASE_DIR / RECORD).read_text())


def test_the_first_takes_a_free_volume_and_the_second_stands_by(world):
    a, b, advance, root = world
    a.step()
    assert a.held() and a.epoch == 1
    assert record(root)["holder"]["host"] == "a" and record(root)["epoch"] == 1
    b.step()
    assert not b.held() and "waiting" in b.blocked
    for _ in range(20):  # a renews every 10s: b never sees it unrenewed for long enough
        advance(10)
        a.step()
        b.step()
        assert a.held() and not b.held()
    assert record(root)["seq"] == 20


def test_a_dead_leader_is_replaced_only_after_expiry_plus_margin(world):
    a, b, advance, root = world
    a.step()
    b.step()
    expires = record(root)["expires"]
    advance(D + M - 1)  # unrenewed for 39s: not yet
    b.step()
    assert not b.held()
    advance(1.5)
    b.step()
    assert b.held() and b.epoch == 2
    assert b.wall() > expires + M
    assert a.fence(1) is not None  # a's deadline passed long ago: it may not rename


def test_a_standby_that_started_late_watches_for_the_whole_duration(world, tmp_path):
    a, _b, advance, root = world
    a.step()
    advance(3600)  # a died an hour ago; its record says so by the wall clock
    late = host("c", a.wall, Clock(0.0), root)
    late.step()
    assert not late.held()  # but c has not itself seen it unrenewed yet
    late.mono.t += D + M
    late.step()
    assert late.held() and late.epoch == 2
    late.release()


def test_a_fast_wall_clock_cannot_take_a_live_lease(world):
    """Clock skew beyond the margin: b's wall clock is an hour ahead. The monotonic rule holds."""
    a, b, advance, _root = world
    a.step()
    b.wall = Clock(a.wall() + 3600)
    for _ in range(10):
        advance(10)
        b.wall.t += 10
        a.step()
        b.step()
        assert a.held() and not b.held()


def test_a_slow_wall_clock_waits_for_the_expiry_too(world):
    """The record's expiry is honoured: a standby whose wall clock is behind (by less than a renewal
    could explain) waits for it."""
    a, b, advance, _root = world
    a.step()
    b.wall = Clock(a.wall() - 5)
    b.step()
    advance(D + M + 1)
    b.step()
    assert not b.held() and "not expired" in b.blocked
    b.wall.t += D + M  # its own wall clock is apart from the world's: still short of expiry + margin
    b.step()
    assert not b.held() and "not expired" in b.blocked
    b.wall.t += 6
    b.step()
    assert b.held()


def test_a_dead_leader_whose_record_is_far_ahead_is_replaced_on_the_monotonic_rule(world, caplog):
    """A record expiring a day past this host's clock (the holder's clock ran ahead, or this one's
    behind): no renewal writes that, and waiting for this clock to reach it stops retention for the
    skew. The monotonic rule still holds: not before unchanged for the duration plus the margin."""
    a, b, advance, _root = world
    a.wall = Clock(b.wall() + 86400)
    a.step()
    b.step()
    advance(D + M - 1)
    b.step()
    assert not b.held() and "unrenewed" in b.blocked
    advance(1.5)
    with caplog.at_level(logging.WARNING, logger="ckptd.fleet.lease"):
        b.step()
    assert b.held() and b.epoch == 2
    assert "ahead of this host's clock" in caplog.text


def test_a_gone_holder_of_this_host_is_replaced_without_waiting_for_the_wall_clock(tmp_path):
    """Its process exited (here: a pid that has been reaped); the standby's wall clock a little behind."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    wall = Clock(1_000_000.0)
    a = VolumeLease(tmp_path, duration=D, margin=M, io=OneProcessIO(tmp_path),
                    holder=Holder(socket.gethostname(), dead.pid, 0.0, "a"), wall=wall, mono=Clock(0.0))
    a.step()
    b = host("b", Clock(wall() - 5), Clock(100.0), tmp_path)
    b.step()
    b.mono.t += D + M - 1
    b.wall.t += D + M - 1
    b.step()
    assert not b.held()
    b.mono.t += 1.5
    b.wall.t += 1.5
    b.step()
    assert b.held(), b.blocked


def test_a_leader_whose_renewals_fail_stops_at_its_deadline_before_anyone_may_take_over(tmp_path):
    wall, mono_a, mono_b = Clock(1e6), Clock(0.0), Clock(0.0)
    io = FaultyIO(tmp_path)
    a = host("a", wall, mono_a, tmp_path, io)
    b = host("b", wall, mono_b, tmp_path)
    a.step()
    b.step()
    fence = a.fencer()
    for _ in range(2):  # two good renewals: the last at t=20
        for c in (wall, mono_a, mono_b):
            c.t += 10
        a.step()
        b.step()
    assert fence() is None
    io.fail_write = errno.EIO
    stopped = took = None
    for tick in range(1, 200):
        for c in (wall, mono_a, mono_b):
            c.t += 0.5
        a.step()
        b.step()
        if stopped is None and fence() is not None:
            stopped = tick * 0.5
        if took is None and b.held():
            took = tick * 0.5
    assert stopped is not None and took is not None
    assert stopped <= D  # the last good renewal began at 0 (t=20): a stops deleting by 0 + D
    assert took >= D + M  # b waits the duration plus the margin after the last renewal it saw
    assert not a.held() and a.epoch is None and a.fence(1) is not None


def test_a_standby_waits_for_the_leaders_longer_lease_not_its_own_shorter_one(tmp_path):
    """Hosts configured differently: b's own lease is 5s, but a's record says 30s (+10s). b's wall
    clock is also 100s fast, so only the monotonic rule, with a's figures, keeps b waiting."""
    wall, mono_a, mono_b = Clock(1e6), Clock(0.0), Clock(0.0)
    wall_b = Clock(1e6 + 100)
    a = host("a", wall, mono_a, tmp_path)
    b = VolumeLease(tmp_path, duration=5, margin=1, holder=Holder("b", 1, 0.0, "b"), wall=wall_b, mono=mono_b)
    a.step()
    b.step()
    for c in (wall, wall_b, mono_a, mono_b):  # a dies; by b's own settings it could take over after 6s
        c.t += D + M - 1
    b.step()
    assert not b.held() and "unrenewed for 40s" in b.blocked
    for c in (wall_b, mono_b):
        c.t += 1.5
    b.step()
    assert b.held()
    b.release()


def test_a_failing_read_refuses_at_the_fence(tmp_path):
    wall, mono = Clock(1e6), Clock(0.0)
    io = FaultyIO(tmp_path)
    a = host("a", wall, mono, tmp_path, io)
    a.step()
    fence = a.fencer()
    io.fail_read = errno.ESTALE
    assert "cannot read the lease record" in fence()
    io.fail_read = None
    assert fence() is None
    a.release()


def test_the_fence_refuses_a_lease_taken_over_or_rewritten(world):
    a, _b, _advance, root = world
    a.step()
    fence = a.fencer()
    # Someone else's record at a's epoch (an operator, a misconfigured host): refused.
    rec = Record.parse((root / LEASE_DIR / RECORD).read_bytes())
    RecordIO(root).write(Record(1, Holder("x", 9, 0.0, "x"), rec.expires, rec.renewed, 0, D, M))
    assert "no longer names this ckptd" in fence()
    RecordIO(root).write(rec)
    assert fence() is None
    RecordIO(root).claim(2, Holder("y", 9, 0.0, "y"))  # a later epoch claimed: refused
    assert fence() is not None
    a.step()  # the renewal sees it too, and a stands down
    assert not a.held()


class StaleIO(RecordIO):
    """Reads what the volume held a moment ago: a standby that looked just before another claimed."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.frozen = None

    def read(self):
        return self.frozen if self.frozen is not None else super().read()


def test_only_one_of_two_simultaneous_standbys_claims_the_epoch(world):
    a, b, advance, root = world
    io = StaleIO(root)
    c = host("c", a.wall, Clock(b.mono()), root, io)
    a.step()  # a leads, then dies (never steps again)
    b.step()
    c.step()
    advance(D + M + 1)
    c.mono.t += D + M + 1
    io.frozen = io.read()  # c's look at the volume, before b's claim lands
    b.step()
    assert b.held() and b.epoch == 2
    c.step()  # c decides from what it saw: free to take epoch 2. The exclusive create says no.
    assert not c.held() and c.blocked == "another host claimed epoch 2 first"
    assert record(root)["holder"]["host"] == "b"
    c.release()


def test_a_released_lease_is_taken_at_once_and_the_old_epoch_fenced(world):
    a, b, _advance, root = world
    a.step()
    old = a.fencer()
    b.step()
    a.release()
    assert record(root)["released"] is True
    assert old() is not None
    b.step()
    assert b.held() and b.epoch == 2


def test_the_record_is_replaced_atomically_and_unreadable_ones_wait_the_full_duration(world):
    a, _b, advance, root = world
    (root / LEASE_DIR).mkdir()
    (root / LEASE_DIR / RECORD).write_text("{ torn")
    a.step()
    assert not a.held()  # garbage is not "free": it is watched like any record
    advance(D + M)
    a.step()
    assert a.held() and a.epoch == 1
    assert sorted(p.name for p in (root / LEASE_DIR).iterdir()) == ["beat-1-0", "epoch-1", "leader.json", "leader.lock"]


def test_observing_only_never_writes(tmp_path):
    lease = host("dry", Clock(1e6), Clock(0.0), tmp_path)
    lease.want = False
    lease.step()
    assert not lease.held() and not (tmp_path / LEASE_DIR).exists()


def test_the_renewal_thread_renews_and_stop_releases(tmp_path):
    lease = VolumeLease(tmp_path, duration=0.3, margin=0.1, holder=Holder("t", 1, 0.0, "t"))
    changed = []
    lease.start(on_change=lambda: changed.append(lease.held()))
    try:
        import time

        deadline = time.monotonic() + 10
        while record_seq(tmp_path) < 3:  # renewed three times by its own thread
            assert time.monotonic() < deadline, "no renewals"
            lease._stop.wait(0.05)
        assert lease.held() and changed == [True]
    finally:
        lease.stop()
    assert record(tmp_path)["released"] is True and not lease.held()


def record_seq(root: Path) -> int:
    try:
        return record(root)["seq"]
    except (OSError, ValueError):
        return -1


def test_the_fence_goes_by_the_deadline_even_when_no_renewal_runs_to_notice(world):
    """A renewal thread stuck in a hung NFS call never gets to say the lease is lost: the fence and
    `held` look at the clock themselves."""
    a, _, _, _ = world
    a.step()
    fence = a.fencer()
    assert fence() is None
    a.mono.t += D - 0.01
    assert fence() is None and a.held()
    a.mono.t += 0.02
    assert not a.held()
    assert fence() == "the volume lease (epoch 1) ran out without a renewal"


class CachingIO(OneProcessIO):
    """Reads of the record served from a cache, as a FUSE mount with kernel_cache and a long
    entry_timeout does (shown on a real bindfs mount in test_caching_mount.py): the bytes first
    read, whatever was written since. The directory's names are listed afresh."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.cached: bytes | None = None

    def read(self):
        seen = super().read()
        if self.cached is None:
            self.cached = seen.raw
        return Seen(self.cached, Record.parse(self.cached) if self.cached else None, seen.max_claim, seen.beat)


def test_a_standby_whose_reads_are_stale_never_takes_over_a_live_leader(tmp_path):
    wall, mono_a, mono_b = Clock(1_000_000.0), Clock(50.0), Clock(9_000.0)
    a = host("a", wall, mono_a, tmp_path)
    a.step()
    b = host("b", wall, mono_b, tmp_path, io=CachingIO(tmp_path))
    b.step()
    for _ in range(12):  # 4 lease durations, a renewing every D/3
        for c in (wall, mono_a, mono_b):
            c.t += D / 3
        a.step()
        b.step()
        assert a.held() and not b.held()
    assert b.blocked is not None and b.blocked.startswith("reads of .ckptd/leader.json are stale here")
    assert b.seen is not None and b.seen.beat == (1, 12)
    a.release()
    b.release()


def test_an_unreadable_record_beside_a_beat_is_still_taken_after_the_full_duration(world):
    """A beat says nothing about a record that does not parse (torn, or removed by hand): it is
    watched for the full duration as before, not taken for a stale read forever."""
    a, _b, advance, root = world
    (root / LEASE_DIR).mkdir()
    (root / LEASE_DIR / RECORD).write_text("{ torn")
    (root / LEASE_DIR / "beat-3-7").touch()
    a.step()
    assert not a.held()
    advance(D + M)
    a.step()
    assert a.held() and a.epoch == 1
    assert sorted(p.name for p in (root / LEASE_DIR).glob("beat-*")) == ["beat-1-0"]


class ListingCachingIO(OneProcessIO):
    """Reads of `.ckptd/` served whole from a cache, listing and record alike, as sshfs, rclone,
    s3fs and gcsfuse do (tests/support/cachefs.py shows it on a real FUSE mount in tests/fleet/test_hosts_behind_caches.py):
    the first look, whatever was written since, until this process changes the directory itself
    (which such a client drops its cache for)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.cached: Seen | None = None

    def read(self):
        if self.cached is None:
            self.cached = super().read()
        return self.cached

    def probe(self, holder: Holder) -> None:
        super().probe(holder)
        self.cached = None


def test_a_standby_behind_a_listing_cache_looks_afresh_before_it_takes_over(tmp_path):
    wall, mono_a, mono_b = Clock(1_000_000.0), Clock(50.0), Clock(9_000.0)
    a = host("a", wall, mono_a, tmp_path)
    a.step()
    b = host("b", wall, mono_b, tmp_path, io=ListingCachingIO(tmp_path))
    b.step()
    said = set()
    for _ in range(12):  # 4 lease durations, a renewing every D/3; b sees nothing move
        for c in (wall, mono_a, mono_b):
            c.t += D / 3
        a.step()
        b.step()
        assert a.held() and not b.held()
        said.add((b.blocked or "").split(":")[0])
    assert "the lease moved when .ckptd/ was looked at afresh" in said
    assert not (tmp_path / LEASE_DIR / "epoch-2").exists()
    assert not [p for p in (tmp_path / LEASE_DIR).iterdir() if p.name.startswith(".probe-")]  # removed again
    a.release()
    b.release()
    # A dead leader: the fresh look shows what the cache showed, and b takes over.
    c = host("c", wall, mono_b, tmp_path, io=ListingCachingIO(tmp_path))
    a2 = host("a", wall, mono_a, tmp_path)
    a2.step()
    assert a2.held()
    c.step()
    for c_ in (wall, mono_a, mono_b):
        c_.t += D + M + 1
    c.step()
    assert c.held() and c.epoch == 3


def test_a_late_write_of_an_older_epoch_is_written_over_not_obeyed(world):
    """a decided a renewal, was paused past its lease, and b took over; a's write lands after
    b's claim. b keeps the lease and rewrites its record; a stands down on its next look."""
    a, b, advance, root = world
    a.step()
    late = Record.parse((root / LEASE_DIR / RECORD).read_bytes())
    advance(D + M + 1)
    b.step()
    b.step()
    advance(D + M + 1)
    b.step()
    assert b.held() and b.epoch == 2
    a.io.write(late)  # a's write, decided before the pause, lands now
    b.step()
    assert b.held() and b.epoch == 2
    rec = Record.parse((root / LEASE_DIR / RECORD).read_bytes())
    assert (rec.holder.id, rec.epoch) == ("b", 2)
    assert b.fencer()() is None
    a.step()
    assert not a.held() and a.epoch is None
