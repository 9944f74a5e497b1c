"""Several ckptd "hosts" on one volume, some through caching FUSE mounts, in adversarial cases.

Each case is set up from the docs alone (docs/many-nodes.md), as a user would: real `ckptd run
--foreground` processes, each with its own state_dir; a "host" that sees the volume through a
bindfs mount has its own POSIX locks and flocks (the kernel keeps a FUSE mount's apart from the
source's) and the caches its options set. Processes are paused with SIGSTOP, a mount hung by
stopping its bindfs daemon, and pins written on the volume itself meanwhile. Every wait is on a
log line, a file or a process state, with a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.discover.layouts import PIN_FILE
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.fleet import said, stop_all, wait_until
from tests.support.nodes import ckpts, lease_record, listing, logged_at, node_config, trashed, wait_stopped

# Everything a FUSE client can be told to cache: file contents across opens, attributes,
# name lookups (positive and negative).
CACHING = ("kernel_cache", "attr_timeout=30", "entry_timeout=30", "negative_timeout=30")


class Bindfs:
    """`bindfs -f` as a child of the test, so that its daemon can be stopped (a hung mount)."""

    def __init__(self, source: Path, point: Path, *options: str, command: list[str] | None = None):
        if command is None:
            if shutil.which("bindfs") is None:
                pytest.skip("bindfs is not installed (apt-get install bindfs fuse3)")
            command = ["bindfs", "-f", *(["-o", ",".join(options)] if options else []), str(source), str(point)]
        if not os.path.exists("/dev/fuse"):
            pytest.skip("no /dev/fuse: FUSE mounts are not possible here")
        point.mkdir(parents=True, exist_ok=True)
        self.point = point
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: os.path.ismount(point) or self.proc.poll() is not None, 20, "the FUSE mount")
        except AssertionError:
            self.close()
            raise
        if self.proc.poll() is not None:
            pytest.skip(f"cannot mount {command[0]} here ({self.proc.stderr.read().strip()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        for unmount in ("fusermount3", "fusermount"):
            subprocess.run([unmount, "-u", "-z", str(self.point)], capture_output=True)
        subprocess.run(["umount", "-l", str(self.point)], capture_output=True)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def fuse():
    made: list[Bindfs] = []

    def do(source: Path, point: Path, *options: str, command: list[str] | None = None) -> Bindfs:
        made.append(Bindfs(source, point, *options, command=command))
        return made[-1]

    yield do
    for m in reversed(made):
        m.close()


@pytest.fixture
def cachefs(fuse):
    """cachefs(source, point, ttl): tests/support/cachefs.py, a FUSE mount that caches attributes,
    listings and contents for `ttl` seconds (as sshfs, rclone, s3fs, gcsfuse do)."""
    try:
        import fuse as _fusepy  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"fusepy is not installed or finds no libfuse 2 ({e}): pip install fusepy")

    def do(source: Path, point: Path, ttl: float, *subtype: str) -> Bindfs:
        return fuse(source, point, command=[sys.executable, "-m", "tests.support.cachefs", str(source), str(point),
                                            str(ttl), *subtype])

    return do


def renewals(root: Path, n: int, timeout: float = 60) -> dict:
    """Wait, by the record on the volume itself, for `n` more renewals of the epoch it holds now,
    or for another epoch (a takeover: the caller's assertions say what that means); return the
    record then."""
    first = lease_record(root)

    def done() -> bool:
        now = lease_record(root)
        return now["epoch"] != first["epoch"] or now["seq"] >= first["seq"] + n

    wait_until(done, timeout, f"{n} renewals of epoch {first['epoch']}")
    return lease_record(root)


# --- 1. A leader on a caching mount, paused past its lease, resumed after a takeover ---------


def test_a_paused_leader_on_a_caching_mount_does_not_lead_again_after_a_takeover(tmp_path, fuse):
    """A leads through a mount that caches its own record (kernel_cache, 30 s entry and attribute
    caches). It is paused (SIGSTOP) past its lease; B, on the volume itself, takes over; A runs
    again while its mount still shows the record A wrote last. A must not delete, nor renew over
    B's record; B must stay leader."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    via_a = fuse(root, tmp_path / "vol-a", *CACHING).point
    a = DaemonProc("-c", node_config(tmp_path, "a", via_a))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        a.signal(signal.SIGSTOP)
        wait_stopped(a.proc.pid)
        b = DaemonProc("-c", node_config(tmp_path, "b", root))
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        taken = lease_record(root)
        mark = a.mark()
        a.signal(signal.SIGCONT)
        ckpts(root, 2, 3)
        b.wait_message("deleted job/checkpoint-2", timeout=30)
        renewals(root, 9)  # three lease durations of B's renewals, A running all along
        a.wait_message("state written", start=mark)
    finally:
        stop_all(a, b)
    assert not said(b, "volume lease lost"), b.dump()
    assert all(t < taken["since"] for _, t in trashed(tmp_path / "a")), a.dump()
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


# --- 2. A hung mount: the leader's renewal lands after a takeover -------------------------------


def test_a_renewal_held_by_a_hung_mount_does_not_depose_the_leader_that_took_over(tmp_path, fuse):
    """A leads through a FUSE mount whose daemon is then stopped (a hung mount: every request on
    it waits). Its lease runs out and B, on the volume itself, takes over. The mount comes back:
    whatever A had sent meanwhile (a renewal's write and rename) reaches the volume late. B must
    remain the only leader, and A must not delete."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    m = fuse(root, tmp_path / "vol-a")
    a = DaemonProc("-c", node_config(tmp_path, "a", m.point))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        m.proc.send_signal(signal.SIGSTOP)  # the mount hangs
        wait_stopped(m.proc.pid)
        b = DaemonProc("-c", node_config(tmp_path, "b", root))
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        taken = lease_record(root)
        m.proc.send_signal(signal.SIGCONT)  # the mount answers again
        ckpts(root, 2, 3)
        b.wait_message("deleted job/checkpoint-2", timeout=30)
        renewals(root, 9)
    finally:
        stop_all(a, b)
    assert not said(b, "volume lease lost"), b.dump()
    assert all(t < taken["since"] for _, t in trashed(tmp_path / "a")), a.dump()
    assert listing(root / "job") == ["checkpoint-3"]


# --- 3. A pin written on the volume while the leader's mount caches "no such file" ------------


def test_a_pin_written_meanwhile_is_seen_through_a_negative_entry_cache(tmp_path, fuse):
    """The leader's mount caches failed lookups for 30 s (negative_timeout): the leader looked for
    checkpoint-1's pin and found none. A user pins checkpoint-1 on the volume itself (another
    host); then checkpoint-3 completes and keep_last = 2 would delete checkpoint-1."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    via_a = fuse(root, tmp_path / "vol-a", *CACHING).point
    with DaemonProc("-c", node_config(tmp_path, "a", via_a, keep_last=2)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        (root / "job" / "checkpoint-1" / PIN_FILE).touch()
        ckpts(root, 3)
        a.wait_message("job/checkpoint-3: complete", timeout=30)
        a.wait_message("decide keep job/checkpoint-1: pinned")  # without the pin: deleted
        a.wait_message("state written", start=a.mark())
    assert (root / "job" / "checkpoint-1").is_dir(), a.dump()
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


# --- 4. A renewal decided before a pause and written after a takeover ------------------------


def seamed(tmp_path: Path, name: str, root: Path, **env: str) -> DaemonProc:
    return DaemonProc("-c", node_config(tmp_path, name, root), command=[sys.executable, "-m", "tests.support.leaseseam"],
                      env=env)


def test_a_renewal_written_after_a_takeover_does_not_depose_the_new_leader(tmp_path, fuse):
    """A decides a renewal, and is held before its write reaches the volume (a paused VM, a hung
    mount: tests/support/leaseseam.py) past its lease; B, another host (a FUSE mount), takes over. Then
    A's write lands. B must stay leader, A must not delete, and nobody else may claim."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    hold = tmp_path / "hold"
    a = seamed(tmp_path, "a", root, CKPTD_TEST_LEASE_HOLD=str(hold))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        os.mkfifo(hold)
        a.wait_message("holding a lease write (test)")
        b = DaemonProc("-c", node_config(tmp_path, "b", fuse(root, tmp_path / "vol-b").point))
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        taken = lease_record(root)
        with open(hold, "wb") as fifo:  # A's write goes on
            fifo.write(b"go\n")
        wait_until(lambda: not hold.exists(), 10, "the held write")
        ckpts(root, 2, 3)
        b.wait_message("deleted job/checkpoint-2", timeout=30)
        renewals(root, 9)
    finally:
        stop_all(a, b)
    assert not said(b, "volume lease lost"), b.dump()
    assert all(t < taken["since"] for _, t in trashed(tmp_path / "a")), a.dump()
    assert listing(root / "job") == ["checkpoint-3"]


# --- 5. A paused leader stopped (SIGTERM) as it resumes hands back a lease it no longer holds ---


def test_a_deposed_leader_that_stops_does_not_release_the_new_leaders_lease(tmp_path, fuse):
    """A is paused past its lease, B takes over; A is told to stop while paused (SIGTERM is
    pending when it resumes), so its first act on resuming is to stop and hand the lease back.
    It must not mark B's record released: a third host would take it at once."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        a.signal(signal.SIGSTOP)
        wait_stopped(a.proc.pid)
        b = DaemonProc("-c", node_config(tmp_path, "b", fuse(root, tmp_path / "vol-b", *CACHING).point))
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        a.signal(signal.SIGTERM)
        a.signal(signal.SIGCONT)
        assert a.proc.wait(30) == 0
        record = lease_record(root)
        assert record["epoch"] == 2 and not record["released"], (record, a.dump())
        renewals(root, 6)
    finally:
        stop_all(a, b)
    assert not said(b, "volume lease lost"), b.dump()


# --- 6. A claimant killed between claiming an epoch and writing its record --------------------


def test_a_claimant_killed_before_its_record_does_not_keep_the_volume_leaderless(tmp_path, fuse):
    """A creates `epoch-1` and is killed (-9) before it writes the record (tests/support/leaseseam.py).
    Another host must still come to lead, within a few lease durations."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = seamed(tmp_path, "a", root, CKPTD_TEST_LEASE_DIE="1")
    assert a.proc.wait(30) == -signal.SIGKILL
    a.stop()
    with DaemonProc("-c", node_config(tmp_path, "b", fuse(root, tmp_path / "vol-b").point)) as b:
        b.wait_message("this ckptd deletes here (volume lease, epoch", timeout=20)
        b.wait_message("deleted job/checkpoint-1")
    assert listing(root / "job") == ["checkpoint-2"]


# --- 7. Listing caches: a FUSE client that caches listings and contents too -------------------


def test_a_standby_behind_a_listing_cache_does_not_depose_a_live_leader(tmp_path, cachefs):
    """B sees the volume through a mount that caches attributes, listings and contents for 30 s
    (tests/support/cachefs.py, as sshfs or rclone do): neither the record nor the beats change there while
    A renews. Left at the defaults (coherent unset), B must not take the lease from A."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    with DaemonProc("-c", node_config(tmp_path, "a", root)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        via_b = cachefs(root, tmp_path / "vol-b", 30).point
        with DaemonProc("-c", node_config(tmp_path, "b", via_b)) as b:
            b.wait_message("standby, observing only")
            renewals(root, 12)  # four lease durations
        assert not said(b, "this ckptd deletes here (volume lease"), b.dump()
        assert not said(a, "volume lease lost"), a.dump()


def test_two_hosts_behind_listing_caches_never_delete_at_once(tmp_path, cachefs):
    """Each host sees the volume through its own caching mount (tests/support/cachefs.py, 4 s: longer than
    the lease and its margin). Whoever leads, the other's view of the record and the beats stands
    still. Count the takeovers, and check each trashing against who held the lease then."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    via_a = cachefs(root, tmp_path / "vol-a", 4).point
    via_b = cachefs(root, tmp_path / "vol-b", 4).point
    a = DaemonProc("-c", node_config(tmp_path, "a", via_a))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        b = DaemonProc("-c", node_config(tmp_path, "b", via_b))
        b.wait_message("standby, observing only")
        for step in range(2, 6):  # the leader sees each within the cache's 4 s
            ckpts(root, step)
            wait_until(lambda: len(listing(root / "job")) <= 1, 20, f"checkpoint-{step - 1} deleted")
    finally:
        stop_all(a, b)
    # Who held the lease when: each claim ("deletes here") ends the tenure before it, on the
    # volume. A trashing at a time the other host's claim was the latest is one without the lease.
    claims = sorted([(logged_at(m), "a") for m in said(a, "this ckptd deletes here (volume lease")] +
                    [(logged_at(m), "b") for m in said(b, "this ckptd deletes here (volume lease")])
    without = [(who, name, t) for who in ("a", "b") for name, t in trashed(tmp_path / who)
               if max((c for c in claims if c[0] <= t), default=(0, who))[1] != who]
    assert len(claims) == 1, f"{len(claims) - 1} takeovers from a live leader; without the lease: {without}"
    assert not without


# --- 8. Hosts configured with different lease durations ---------------------------------------


def test_a_standby_with_a_shorter_lease_does_not_take_a_longer_live_one(tmp_path, fuse):
    """A leads with lease_duration 6s (it renews every 2s); B, another host, was given 1.5s and a
    0.5s margin (its config left at another value, or a typo). B must not take A's lease between
    A's renewals."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    with DaemonProc("-c", node_config(tmp_path, "a", root, duration=6, margin=2)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        via_b = fuse(root, tmp_path / "vol-b").point
        with DaemonProc("-c", node_config(tmp_path, "b", via_b)) as b:
            b.wait_message("standby, observing only")
            renewals(root, 5)  # 10 s: five of A's renewals, twenty of B's looks
        assert not said(b, "this ckptd deletes here (volume lease"), b.dump()
        assert not said(a, "volume lease lost"), a.dump()


# --- 9. A prune on a host behind a listing cache while a daemon leads -------------------------


def test_a_prune_behind_a_listing_cache_does_not_delete_while_a_daemon_leads(tmp_path, cachefs):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    with DaemonProc("-c", node_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        via_b = cachefs(root, tmp_path / "vol-b", 30).point
        # Another job on B's host looked at the volume a moment ago: the cache holds the record
        # and the listings from then (each for 30 s).
        listing(via_b / "job")
        os.listdir(via_b / ".ckptd")
        (via_b / ".ckptd" / "leader.json").read_bytes()
        renewals(root, 6)  # 3 s later: what B's cache shows has expired by its own times
        proc = run_ckptd("prune", "-c", node_config(tmp_path, "cron", via_b, keep_last=1))
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"], proc.stderr
        assert not said(a, "volume lease lost"), a.dump()


# --- 10. A pin written on the volume while a listing cache holds the checkpoint's old listing --


def test_a_prune_behind_a_listing_cache_does_not_delete_a_checkpoint_pinned_meanwhile(tmp_path, cachefs):
    """One ckptd only (leadership = local: no lease in play), on a host whose mount caches
    listings for 30 s. The cache holds checkpoint-1's listing from before a user, on another
    host, pinned it; checkpoint-3 is saved meanwhile and seen (the run's listing is fetched after
    it). keep_last = 2 would delete checkpoint-1 but for the pin."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    via = cachefs(root, tmp_path / "vol-b", 30).point
    os.listdir(via / "job" / "checkpoint-1")  # a user's `ls` on this host, a moment ago
    (root / "job" / "checkpoint-1" / PIN_FILE).touch()  # pinned on another host
    ckpts(root, 3)
    cfg = node_config(tmp_path, "cron", via, keep_last=2)
    cfg.write_text(cfg.read_text().replace("leadership = 'volume'", "leadership = 'local'"))
    proc = run_ckptd("prune", "-c", cfg)
    assert (root / "job" / "checkpoint-1" / PIN_FILE).exists(), proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


# --- 11. A standby paused just after it looked at the record ----------------------------------


def test_a_standby_paused_after_its_look_does_not_act_on_that_look(tmp_path, fuse):
    """B, a standby, reads A's record and is paused (tests/support/leaseseam.py) for longer than the lease
    and its margin while A renews. When B runs again, what it read says the lease expired and
    has gone unrenewed for longer than D + M on B's clock; A is alive. B must not take over."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    hold = tmp_path / "hold"
    with DaemonProc("-c", node_config(tmp_path, "a", root)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        b = seamed(tmp_path, "b", fuse(root, tmp_path / "vol-b").point, CKPTD_TEST_LEASE_HOLD_READ=str(hold))
        with b:
            b.wait_message("standby, observing only")
            b.wait_message("state written")
            os.mkfifo(hold)
            b.wait_message("holding after a lease read (test)")
            renewals(root, 6)  # 3 s: past the expiry B read, + its margin
            with open(hold, "wb") as fifo:
                fifo.write(b"go\n")
            wait_until(lambda: not hold.exists(), 10, "the held read")
            renewals(root, 6)
        assert not said(b, "this ckptd deletes here (volume lease"), b.dump()
        assert not said(a, "volume lease lost"), a.dump()


# --- 12. The newest taken away on another host while a listing cache still shows it ----------


def test_the_newest_moved_away_meanwhile_is_not_taken_for_an_anchor_behind_a_listing_cache(tmp_path, cachefs):
    """One ckptd, behind a mount that caches listings, attributes and contents for 30 s. It has
    seen checkpoint-3 arrive and waits out its quiet period; meanwhile an operator on another
    host moves checkpoint-3 out of the run (a bad save, quarantined). The cache goes on showing
    it, complete and unchanged: keep_last = 1 would then delete checkpoint-1 and -2, leaving the
    run with no complete checkpoint. checkpoint-2, the newest complete one there is, must stay.
    (It holds: the evidence is read from checkpoint-3's files, which the cache never held.)"""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    via = cachefs(root, tmp_path / "vol-b", 30).point
    cfg = node_config(tmp_path, "a", via, keep_last=1)
    cfg.write_text(cfg.read_text().replace("quiet_period = '0.2s'", "quiet_period = '4s'")
                   .replace("leadership = 'volume'", "leadership = 'local'"))
    with DaemonProc("-c", cfg) as a:
        a.wait_message("deleted job/checkpoint-1", timeout=30)
        ckpts(root, 3)
        a.wait_message("job/checkpoint-3: new, settling", timeout=30)
        os.rename(root / "job" / "checkpoint-3", root / "quarantined-3")  # on another host
        # The verdict on checkpoint-3 as the cache shows it, and what follows from it.
        wait_until(lambda: said(a, "job/checkpoint-3: incomplete") or said(a, "job/checkpoint-3: complete"), 30,
              "a verdict on checkpoint-3")
        a.wait_message("state written", start=a.mark())
    assert listing(root / "job") == ["checkpoint-2"], a.dump()
