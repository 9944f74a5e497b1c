"""Who deletes in a root: one leader per volume, however many hosts share it.

Two kinds of leadership, chosen by `[daemon] leadership`:

- `local` (`LocalLeadership`): the flock in `state_dir/locks/` (`locks.RootLock`). Enough when
  every ckptd that could delete in the root runs on this host with this state_dir.
- `volume` (`VolumeLease`): a lease recorded on the volume itself, in `<root>/.ckptd/` (hidden:
  discovery never descends into it or takes it for a checkpoint), so ckptd on any host that
  mounts the root sees it. `auto` (the default) means `volume` on network filesystems
  (`mounts.is_remote`) and `local` elsewhere. Every host must resolve to the same kind.

What is on the volume (`leader.lock`, the `epoch-<N>` claims, the record `leader.json` and its
`beat-<epoch>-<seq>` names), how it is written and read, and what the filesystem must give for
that to hold: leaserecord.py.

Rules:

- The leader renews every duration/3. A renewal reads the record first (still ours, at our
  epoch, no epoch-<N+1> claimed) and writes it with `seq` + 1 and expiry = now + duration.
  Its own deadline is the monotonic time (CLOCK_BOOTTIME, so a suspended host's deadline
  passes while it sleeps) taken *before* that renewal began, plus the duration. Past the
  deadline without a successful renewal it stops deleting at once, releases the lock and
  becomes a standby; it must win the lease again like anyone else.
- A standby takes over only when both hold: (1) by the wall clock, the record's expiry plus
  the margin has passed (the margin covers clock skew between hosts); (2) it has itself
  watched the record and the claims stay unchanged for the duration plus the margin, on its
  own monotonic clock. (2) alone is safe without synchronised clocks: a renewal the leader
  began at t0 is visible before any standby can see it, so a standby that saw no renewal for
  duration + margin acts after the leader's deadline t0 + duration has passed. (1) is what
  `status` shows. Each uses the larger of its own and the record's duration and margin, so
  hosts configured differently still wait long enough. (1) is set aside, and (2) decides alone,
  for a record whose expiry lies more than the duration plus the margin past this host's clock
  (no renewal writes that: one of the two clocks is wrong, and waiting would stop retention for
  the skew) and for a holder on this host whose process is gone (`_wall_rule_moot`).
- Before it claims, a standby makes and removes a name in `.ckptd/` (`RecordIO.probe`) and looks
  again; if anything it watched moved, it does not take over. A FUSE client that caches
  listings and contents (sshfs, rclone's VFS, s3fs, gcsfuse) drops its cache of a directory it
  changes itself: the look after the probe is the filesystem's, and shows a live leader's beats.
- The locks (`leader.lock`, `local.lock`) speed nothing up and decide nothing between lease
  holders: a holder frozen by SIGSTOP, a debugger, a cgroup freeze or a hung mount (D state)
  keeps them while it renews nothing, so a standby whose rules found the lease lapsed passes
  over the locks that holder keeps (`_take_locks`) and takes them at a later renewal, once free.
  A `local.lock` held by another process than the lease lock's (a ckptd with `leadership =
  "local"`, a prune) still stops it.
- A leader that reads a record of an older epoch than its own, with its own the highest claim,
  writes its record over it: a deposed leader's renewal, decided before a pause and landing
  after the takeover (that writer stands down at its next look: a later claim exists).
- A leader that stops cleanly writes the record `released`; a standby may take that at once.
- Fencing: every rename into the trash, and every rename of a slim, first asks `fence(epoch)`
  with the epoch the plan was made under. It refuses unless this process still holds that
  epoch, its deadline has not passed, and the record on the volume still names it at that
  epoch with no later claim. The deadline is looked at after the read, so a read that hung
  counts against it.
- What no lease can close: a process stopped between its last check and the rename itself
  (SIGSTOP, a VM paused for longer than the margin) can still rename once after its lease
  ran out. Only fencing by the storage could prevent that; none of these filesystems offers
  it. The margin is the allowance for it and for clock skew: choose it above both.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.leaserecord import RECORD, Holder, Record, RecordIO, Seen, engine_leader_seen, holder_gone
from ckptd.fleet.locks import LockHeld
from ckptd.volume.mounts import Mount, attribute_cache, coherence, is_remote, mount_of, read_mounts

log = logging.getLogger(__name__)

KEEP_CLAIMS = 4  # the leader removes older claim files than its epoch minus this


def boottime() -> float:
    """Monotonic seconds that also count time suspended (a deadline must pass during a suspend)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class VolumeLease:
    """The lease on one root's volume. Thread-safe: a renewal thread, the daemon's filesystem
    thread (fence, held) and the event loop (status) share it."""

    kind = "volume"

    def __init__(
        self,
        root: Path,
        *,
        duration: float,
        margin: float,
        why: str = "",
        problem: str | None = None,
        io: RecordIO | None = None,
        holder: Holder | None = None,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = boottime,
    ):
        self.root = root
        self.duration = duration
        self.margin = margin
        self.why = why  # why this kind of leadership (for status)
        self.problem = problem  # set: this host must never lead here (e.g. NFS nocto)
        self.io = io or RecordIO(root)
        self.me = holder or Holder.me()
        self.wall = wall
        self.mono = mono
        self.epoch: int | None = None  # the epoch held, or None
        self.deadline = float("-inf")  # `mono` time after which it is not held
        self.seq = 0
        self.seen: Seen | None = None  # the last look at the volume
        self._mine: Record | None = None  # the record this process wrote last, while it leads
        self._skew_said: tuple[int, int] | None = None  # the record the wall rule was last set aside for
        self._listing_cached = False  # said that a fresh look here showed more than a cached one
        self.error: str | None = None  # the last I/O error, while it lasts
        self.blocked: str | None = None  # why the last try did not take it
        self._key: tuple[bytes | None, int, tuple[int, int] | None] | None = None  # what it started on
        self._since = 0.0  # `mono` time of that
        self._mutex = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.want = True  # False: observe only (dry run)

    # --- questions ----------------------------------------------------------

    def held(self) -> bool:
        with self._mutex:
            return self.epoch is not None and self.mono() < self.deadline

    def current_epoch(self) -> int | None:
        with self._mutex:
            return self.epoch if self.held() else None

    def takeover_wait(self) -> float:
        """How long an entry another process put in the trash waits before a purge re-checks it:
        what a standby waits before taking over (the larger of ours and the record's), so a
        leader stopped before a rename has, once it runs again, that long to see it lost the
        lease and move the entry back (`Reaper.purge`)."""
        with self._mutex:
            rec = self.seen.record if self.seen else None
        return max(self.duration, rec.duration if rec else 0.0) + max(self.margin, rec.margin if rec else 0.0)

    def fencer(self) -> Callable[[], str | None]:
        """The fence for one pass of retention: bound to the epoch held now."""
        return functools.partial(self.fence, self.current_epoch())

    def fence(self, epoch: int | None) -> str | None:
        """Why this process may not rename now under `epoch`, or None if it may."""
        if epoch is None:
            return "this ckptd did not hold the volume lease when the plan was made"
        with self._mutex:
            if self.epoch != epoch:
                return f"the volume lease changed since the plan was made (epoch {epoch}, now {self.epoch})"
        try:
            seen = self.io.read()
            superseded = seen.max_claim > epoch
        except OSError as exc:
            return f"cannot read the lease record: {exc}"
        rec = seen.record
        if rec is None or rec.holder.id != self.me.id or rec.epoch != epoch or superseded:
            other = f"{rec.holder.describe()} epoch {rec.epoch}" if rec else "no readable record"
            return f"the lease record no longer names this ckptd at epoch {epoch} ({other})"
        if (mixed := engine_leader_seen(self.root, self.margin)) is not None:  # a host configured otherwise
            return mixed
        if self.mono() >= self.deadline:  # after the read: a read that hung counts against it
            return f"the volume lease (epoch {epoch}) ran out without a renewal"
        return None

    # --- one step ------------------------------------------------------------

    def step(self) -> None:
        """Renew if leading, else look and take over if the rules allow (one step; never blocks
        on anything but the filesystem)."""
        with self._mutex:
            if self.epoch is not None:
                if self.want:
                    self._renew()
                else:
                    self.release()
            else:
                self._try_take()

    def _renew(self) -> None:
        t0 = self.mono()
        epoch = self.epoch
        assert epoch is not None
        try:
            seen = self.io.read()
            self.seen = seen
            rec = seen.record
            if rec is not None and rec.epoch < epoch and seen.max_claim == epoch and self._mine is not None:
                # A write of an older epoch landed after this one was claimed: its writer decided it
                # before a pause (SIGSTOP, a paused VM, a hung mount) and lost that epoch meanwhile;
                # it stands down on its next look (a later claim exists). Ours is rewritten over it.
                log.warning("%s: a write of the volume lease's epoch %d (%s) landed after this ckptd claimed "
                            "epoch %d: written over", self.root, rec.epoch, rec.holder.describe(), epoch)
                rec = self._mine
            if seen.max_claim > epoch or rec is None or rec.holder.id != self.me.id or rec.epoch != epoch:
                who = f"{rec.holder.describe()} at epoch {rec.epoch}" if rec else "an unreadable record"
                self._lose(f"the lease was taken over ({who})")
                return
            now = self.wall()
            new = replace(rec, seq=rec.seq + 1, expires=now + self.duration, renewed=now,
                          duration=self.duration, margin=self.margin)
            self.io.write(new)
        except OSError as exc:
            if self.error != str(exc):
                self.error = str(exc)
                left = self.deadline - self.mono()
                log.warning("%s: cannot renew the volume lease (epoch %d): %s; %.1fs left before this "
                            "ckptd stops deleting", self.root, epoch, exc, max(0.0, left))
            if self.mono() >= self.deadline:
                self._lose(f"no renewal succeeded before its deadline ({exc})")
            return
        self.seen = Seen(new.to_bytes(), new, seen.max_claim)
        self.seq, self._mine = new.seq, new
        self.deadline = t0 + self.duration
        if not self.io.locked:
            self._relock()
        if self.error is not None:
            log.info("%s: the volume lease is renewed again", self.root)
            self.error = None

    def _relock(self) -> None:
        """A leader that took over from a frozen holder takes the locks once that holder lets go
        of them (it exits, or wakes and stands down): a ckptd with `leadership = "local"` or a
        prune is kept out by them again."""
        try:
            if self.io.lock() is None and self.io.lock_root() is None and self.io.locked:
                log.info("%s: this ckptd holds the volume lease's locks again", self.root)
        except OSError:
            pass

    def _lose(self, why: str) -> None:
        log.error("%s: volume lease lost: %s; this ckptd no longer deletes here", self.root, why)
        self.epoch = None
        self.deadline = float("-inf")
        self._key = None
        self.io.unlock()
        self.io.unlock_root()

    def _observe(self, seen: Seen, now: float) -> float:
        """Seconds the volume's lease state has been seen unchanged by this process: the record's
        bytes, the claims and the renewal the directory's names show."""
        key = (seen.raw, seen.max_claim, seen.beat)
        if key != self._key:
            self._key, self._since = key, now
        return now - self._since

    def _try_take(self) -> None:
        if self.problem is not None:
            self.blocked = self.problem
            return
        t0 = self.mono()
        try:
            seen = self.io.read()
            if seen.stale:  # read once more: the leader may have renewed between the two reads
                seen = self.io.read()
            self.seen = seen
            unchanged_for = self._observe(seen, t0)
            if not self.want:
                self.blocked = "observing only (dry run)"
                return
            if seen.stale:
                if not (self.blocked or "").startswith("reads of"):
                    log.warning("%s: reads of %s/%s here return an older renewal than the directory "
                                "shows: this mount caches file contents; not taking over on what it reads",
                                self.root, LEASE_DIR, RECORD)
                self.blocked = (f"reads of {LEASE_DIR}/{RECORD} are stale here (the directory shows renewal "
                                f"{seen.beat}): a caching mount; not taking over")
                return
            why = self._not_free(seen, unchanged_for) or engine_leader_seen(self.root, self.margin)
            if why is not None:
                self.blocked = why
                return
            # Every rule says take it: look once more, after changing the directory ourselves. A
            # client that caches listings as well as contents shows neither the record nor the
            # beats move while a live leader renews; it drops them for a directory it changes.
            self.io.probe(self.me)
            again = self.io.read()
            if (again.raw, again.max_claim, again.beat) != (seen.raw, seen.max_claim, seen.beat):
                if not self._listing_cached:  # once: it stays so while a live leader renews
                    self._listing_cached = True
                    log.warning("%s: the volume lease moved when %s/ was looked at afresh (a mount that "
                                "caches directory listings): not taking over on what it showed before",
                                self.root, LEASE_DIR)
                self.seen = again
                self._observe(again, self.mono())
                self.blocked = (f"the lease moved when {LEASE_DIR}/ was looked at afresh: this mount caches "
                                "listings; watching it again")
                return
            held_by = self._take_locks(seen)
            if held_by is not None:
                self.blocked = held_by
                return
            epoch = seen.epoch + 1
            if not self.io.claim(epoch, self.me):
                self.io.unlock()
                self.io.unlock_root()
                self.blocked = f"another host claimed epoch {epoch} first"
                self._key = None
                return
            now = self.wall()
            rec = Record(epoch, self.me, now + self.duration, now, 0, self.duration, self.margin, since=now)
            self.io.write(rec)
        except OSError as exc:
            self.io.unlock()
            self.io.unlock_root()
            if self.error != str(exc):
                log.warning("%s: cannot look at the volume lease: %s", self.root, exc)
            self.error = str(exc)
            self.blocked = f"cannot read or write {LEASE_DIR}/: {exc}"
            return
        self.epoch, self.seq, self.deadline = epoch, 0, t0 + self.duration
        self.seen, self._mine = Seen(rec.to_bytes(), rec, epoch), rec
        self.error = self.blocked = None
        try:
            self.io.forget_claims_before(epoch - KEEP_CLAIMS)
        except OSError:
            pass

    def _take_locks(self, seen: Seen) -> str | None:
        """Take the tenure's locks (`leader.lock`, `<root>/.ckptd/local.lock`): None if taken, or
        if they are held only by the holder whose lease the rules just found lapsed; else why not
        (and neither is kept).

        A process frozen by SIGSTOP, a debugger, a cgroup freeze or a hung mount (D state) keeps
        its locks for as long as it is frozen: the kernel drops them only when it exits. Waiting
        for them would stop retention on the whole volume until someone finds that process. It
        renews nothing, so the lease rules (unchanged for the duration plus the margin, expired
        by the wall clock) have already found its lease lapsed, and when it runs again its fence
        reads the later claim and it renames nothing. So such a holder's locks are passed over:
        `leader.lock` is only ever taken by a volume lease's holder or claimant, and the claim
        (O_EXCL) decides between claimants. `local.lock` is also what a ckptd with
        `leadership = "local"` or a prune holds while it deletes: it is passed over only where
        this host's lock table shows it held by the process holding `leader.lock` too, or, where
        neither shows here, when the lapsed holder is on another host (see docs/many-nodes.md
        for what that leaves to configuration)."""
        lead_busy = self.io.lock()
        root_busy = self.io.lock_root()
        if lead_busy is None and root_busy is None:
            return None
        if root_busy is not None and not self.io.root_busy:  # cannot be taken at all: refused
            self.io.unlock()
            return root_busy
        frozen = self._frozen_holder(seen, lead_busy is not None, root_busy is not None)
        if frozen is None:
            self.io.unlock()
            self.io.unlock_root()
            return root_busy or lead_busy
        log.warning("%s: %s, whose lease lapsed, still holds its lock%s (a frozen process: SIGSTOP, a "
                    "debugger, a hung mount): taking over on the lease; its fence refuses its renames when "
                    "it runs again", self.root, frozen, "s" if lead_busy and root_busy else "")
        return None

    def _frozen_holder(self, seen: Seen, lead_busy: bool, root_busy: bool) -> str | None:
        """Who the lapsed holder is, if the locks found held are its own (`_take_locks`), else None."""
        rec = seen.record
        if rec is None or rec.released or not lead_busy:
            return None  # only local.lock held: a local ckptd or a prune deletes here, not a lease holder
        if not root_busy:
            return rec.holder.describe()
        lead_pids, root_pids = self.io.lock_pids()
        if root_pids or lead_pids:
            return rec.holder.describe() if root_pids and root_pids <= lead_pids else None
        return rec.holder.describe() if rec.holder.host != self.me.host else None

    def _not_free(self, seen: Seen, unchanged_for: float) -> str | None:
        """Why the rules do not let a standby take the lease as `seen` (watched unchanged for
        `unchanged_for` seconds) shows it, or None: never held, handed back, or unrenewed for the
        duration plus the margin and expired by the wall clock (see the module doc)."""
        rec = seen.record
        if seen.raw is None and seen.max_claim == 0:
            return None  # never held: free
        if rec is not None and rec.released and rec.epoch >= seen.max_claim:
            return None  # handed back by a leader that stopped: free
        duration = max(self.duration, rec.duration if rec else 0.0)
        margin = max(self.margin, rec.margin if rec else 0.0)
        if unchanged_for < duration + margin:
            return (f"waiting for the lease to go unrenewed for {duration + margin:g}s "
                    f"(unchanged for {unchanged_for:.1f}s)")
        if rec is not None and rec.epoch == seen.epoch and self.wall() <= rec.expires + margin \
                and self._wall_rule_moot(rec, duration, margin) is None:
            return f"{rec.holder.describe()}'s lease has not expired (+{margin:g}s margin)"
        return None

    def _wall_rule_moot(self, rec: Record, duration: float, margin: float) -> str | None:
        """Why the wall-clock rule does not bind for `rec`, whose lease has been watched unchanged
        for the duration plus the margin already (rule 2, which alone is safe), or None.

        A record whose expiry lies further ahead than any renewal writes (more than the duration
        plus the margin past this host's wall clock) was written by a clock ahead of ours: waiting
        for ours to reach it would stop retention for as long as the skew. A holder on this host
        whose process is gone (its pid absent, or reused by a process started at another time)
        renews nothing again. Either way the monotonic rule decides alone."""
        ahead = rec.expires - self.wall()
        if ahead > duration + margin:
            why = f"its expiry is {ahead:.0f}s ahead of this host's clock"
        elif holder_gone(rec.holder):
            why = "its process is gone"
        else:
            return None
        if self._skew_said != (rec.epoch, rec.seq):
            self._skew_said = (rec.epoch, rec.seq)
            log.warning("%s: %s's lease (epoch %d) has gone unrenewed for the duration plus the margin "
                        "and %s: taking over on that rule alone, not waiting for the record's wall-clock "
                        "expiry",
                        self.root, rec.holder.describe(), rec.epoch, why)
        return why

    def release(self) -> None:
        """Stop leading; if held, say so in the record so a standby need not wait for it to expire."""
        with self._mutex:
            epoch = self.epoch
            if epoch is None:
                self.io.unlock()
                self.io.unlock_root()
                return
            still = self.held()
            self.epoch, self.deadline = None, float("-inf")  # first: nothing renames from here on
            try:
                seen = self.io.read()
                rec = seen.record
                if still and rec is not None and rec.holder.id == self.me.id and rec.epoch == epoch \
                        and seen.max_claim <= epoch:
                    self.io.write(replace(rec, released=True, expires=self.wall(), renewed=self.wall()))
            except OSError as exc:
                log.warning("%s: cannot mark the volume lease released (it will expire): %s", self.root, exc)
            finally:
                self.io.unlock()
                self.io.unlock_root()
                self._key = None

    # --- the renewal thread ----------------------------------------------------

    @property
    def interval(self) -> float:
        return max(0.05, self.duration / 3)

    def start(self, on_change: Callable[[], None] = lambda: None) -> None:
        """Renew (or look) every duration/3 on a thread of its own: a long scan or consolidation on
        the daemon's filesystem thread must not let the lease lapse."""
        if self._thread is not None:
            return
        self._thread = renewal_thread(self, "volume lease", f"ckptd-lease-{self.root.name}", on_change)

    def stop(self, release: bool = True, timeout: float = 5.0) -> bool:
        """End the renewal thread and hand the lease back. False if the thread is stuck in a call
        the volume does not answer: then nothing is released (the lease expires by itself)."""
        return stop_renewing(self, "the volume does not answer; the lease is left to expire", release, timeout)

    # --- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._mutex:
            seen = self.seen
            rec = seen.record if seen else None
            return lease_status(self, {
                "epoch": seen.epoch if seen else None,
                "holder": asdict(rec.holder) if rec else None,
                "expires": rec.expires if rec else None,
                "since": rec.since if rec else None,
                "released": rec.released if rec else None,
            }, error=self.error or self.problem)


class LocalLeadership:
    """The single-host case: the flock in `state_dir/locks/` (locks.RootLock). Not while a
    leader by an engine (etcd) says in `engine.json` that it leads the root: it holds the root's
    lock as well, but one that took over from a frozen leader has passed over that leader's lock
    and takes it only when that one lets go (`etcdlease.EtcdLeadership._lock_root`)."""

    kind = "local"

    def __init__(self, lock: Any, why: str = "", margin: float = 0.0):
        self.lock = lock
        self.why = why
        self.margin = margin  # for a live engine record (leaserecord.engine_record_live)
        self.blocked: str | None = None

    def held(self) -> bool:
        return self.lock.held

    def step(self) -> None:
        if (engine := engine_leader_seen(self.lock.root, self.margin)) is not None:
            if self.lock.held:
                log.error("%s: %s; this ckptd has leadership = \"local\": it lets go of the root's lock and "
                          "deletes nothing here", self.lock.root, engine)
                self.lock.release()
            self.blocked = f"{engine}, and this ckptd has leadership = \"local\""
            return
        if self.lock.held:
            return
        try:
            self.lock.acquire()
            self.blocked = None
        except LockHeld as exc:
            self.blocked = str(exc)

    def fencer(self) -> Callable[[], str | None]:
        return self.fence

    def takeover_wait(self) -> float:
        """0: the flock is the kernel's, held until its holder exits, so no other process on this
        host renamed without it (`VolumeLease.takeover_wait`)."""
        return 0.0

    def fence(self) -> str | None:
        if not self.lock.held:
            return f"this ckptd does not hold {self.lock.path}"
        return engine_leader_seen(self.lock.root, self.margin)

    def release(self) -> None:
        self.lock.release()

    def start(self, on_change: Callable[[], None] = lambda: None) -> None:
        pass

    def stop(self, release: bool = True, timeout: float = 5.0) -> bool:
        if release:
            self.release()
        return True

    def status(self) -> dict[str, Any]:
        held = self.held()
        return {"kind": self.kind, "why": self.why, "held": held, "lock": str(self.lock.path),
                "waiting": None if held else self.blocked}


Leadership = VolumeLease | LocalLeadership


def choose_leadership(
    root: Path, configured: str, mounts: list[Mount] | None = None, coherent: bool | None = None,
    etcd: bool = False,
) -> tuple[str, str, str | None]:
    """("local" | "volume" | "etcd" | "kubernetes", why, a problem that forbids leading here or None)
    for a root (`kubernetes` only where configured so).
    `coherent`: the root's key of that name (`mounts.coherence`); false forbids volume leadership.
    `etcd`: whether etcd endpoints are configured (`auto` then means etcd)."""
    mount = mount_of(root, read_mounts() if mounts is None else mounts)
    fstype = mount.fstype if mount else None
    where = f"{mount.point} is {fstype}" if mount else "filesystem type unknown"
    if configured == "auto" and etcd:
        kind, why = "etcd", "auto: etcd endpoints are configured"
    elif configured == "auto":
        kind = "volume" if fstype is None or is_remote(fstype) else "local"
        why = f"auto: {where}"
    else:
        kind, why = configured, f"configured ({where})"
    problem = None
    if kind == "volume" and mount is not None and not attribute_cache(mount).close_to_open:
        problem = (f"{mount.point} is mounted nocto: a read of the lease record may not see another "
                   "host's renewal, so this ckptd never leads there (remount without nocto)")
    elif kind == "volume" and coherent is False:
        problem = ("coherent = false: a read of the lease record may not see another host's renewal, "
                   "so this ckptd never leads there")
    return kind, why, problem


def coherence_note(root: Path, mounts: list[Mount], coherent: bool | None) -> str | None:
    """For volume leadership, where a mount's coherence is unknown: what the lease relies on
    there, for start-up and check-config; None where it is known or declared."""
    known, why = coherence(mount_of(root, mounts), coherent)
    if known is not None:
        return None
    return (f"{why}: the volume lease relies on renewals being seen there, by the record's contents or, "
            "where a client caches those, by directory listings (beat-<epoch>-<seq>); a client that also "
            "caches listings (sshfs, s3fs, gcsfuse) hides them: set coherent = true where reads are fresh, "
            "coherent = false to never lead there")

def volume_leader_seen(root: Path, now: float | None = None) -> str | None:
    """For a ckptd with `leadership = "local"`: who leads `root` under a live volume lease, as
    its record says, or None. Mixed settings: each excludes the other only through
    `<root>/.ckptd/local.lock`, which a flock reaches on this host (and across NFS), not across
    hosts on a FUSE filesystem."""
    try:
        rec = RecordIO(root).read().record
    except OSError:
        return None
    if rec is None or rec.released or (time.time() if now is None else now) > rec.expires + rec.margin:
        return None
    return (f"{rec.holder.describe()} leads {root} under a volume lease (epoch {rec.epoch}) and this "
            "ckptd has leadership = \"local\": every ckptd that deletes in a root must use the same "
            "leadership")


def lock_scope(mount: Mount | None) -> str:
    """Whether POSIX locks on this mount are seen by other hosts, for status and check-config."""
    if mount is None:
        return "unknown"
    fs = mount.fstype
    if fs in ("nfs", "nfs4"):
        local = mount.option("local_lock")
        if mount.option("nolock") is not None or local in ("posix", "all"):
            return f"this host only (nfs {'nolock' if local is None else 'local_lock=' + local})"
        return "cluster-wide (nfs lock manager)"
    if fs == "lustre":
        return "cluster-wide" if mount.option("flock") is not None else "none (lustre without flock)"
    if fs in ("gpfs", "ceph", "cephfs"):
        return "cluster-wide"
    return "this host only" if not is_remote(fs) else "unknown"


def lease_status(lead: Any, holding: dict[str, Any], error: str | None) -> dict[str, Any]:
    """A lease's status() (`VolumeLease`, `etcdlease.EtcdLeadership`, `kubelease.KubeLeadership`),
    called under its mutex: what every lease says (its kind, why it was chosen, whether this
    process holds it, its timings, what it waits for and its last error), with `holding`, the lease
    as last seen (epoch or token, holder, since, released, and where it is), between."""
    held = lead.held()
    return {"kind": lead.kind, "why": lead.why, "held": held, **holding, "duration": lead.duration,
            "margin": lead.margin, "waiting": None if held else lead.blocked, "error": error}


def stop_renewing(lead: Any, unanswered: str, release: bool, timeout: float) -> bool:
    """A lease's stop(): end its renewal thread (`renewal_thread`) and hand the lease back. False,
    releasing nothing, where the thread is stuck in a call its engine or volume does not answer:
    the lease then expires by itself (`unanswered` says so in the log)."""
    lead._stop.set()
    if lead._thread is not None:
        lead._thread.join(timeout)
        if lead._thread.is_alive():
            log.warning("%s: %s", lead.root, unanswered)
            return False
        lead._thread = None
    if release:
        lead.release()
    return True


def renewal_thread(lead: Any, what: str, name: str, on_change: Callable[[], None]) -> threading.Thread:
    """Started: `lead.step()` every `lead.interval` until `lead._stop` is set, for a lease that must
    not lapse while the daemon's filesystem thread is busy (`VolumeLease`, `etcdlease.EtcdLeadership`).
    A step that raises loses the lead (a bug must not leave a leader believing it leads); a change
    of `lead.held()` is told to `on_change`."""
    lead._stop.clear()

    def run() -> None:
        while True:
            before = lead.held()
            try:
                lead.step()
            except Exception:
                log.exception("%s: %s step failed", lead.root, what)
                with lead._mutex:
                    if lead.epoch is not None:
                        lead._lose("internal error")
            if lead.held() != before:
                try:
                    on_change()
                except Exception:
                    log.exception("%s: telling the daemon the %s changed hands failed", lead.root, what)
            if lead._stop.wait(lead.interval):  # a timer: stop() ends the wait at once
                return

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
