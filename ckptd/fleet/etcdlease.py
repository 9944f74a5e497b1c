"""Leadership by etcd (`leadership = "etcd"`): the engine elects, the volume fences.

- The key: `<prefix><volume id>/leader`. The volume id is a random name kept on the volume, in
  `<root>/.ckptd/volume-id` (made once with link(2), so the first host to make it wins), so every
  host names the same key whatever path it mounts the volume at.
- Taking it: an etcd lease with `lease_duration` (rounded up to whole seconds) as its TTL, then a
  transaction: if the key's `create_revision` is 0 (it does not exist), put it, the holder as its
  value, under that lease. The key's `create_revision` (the transaction's revision) is the token:
  etcd's revisions only grow, so a later leader's token is larger.
- The token on the volume: `<root>/.ckptd/engine.json` names the backend, the key, the token and
  the holder. A new leader writes it (temp file, fsync, rename, directory fsync) before it deletes
  anything; one that finds a larger token there stands down.
- Renewing: a keepalive every third of the TTL. The holder's own deadline is its monotonic clock
  (CLOCK_BOOTTIME) taken before the keepalive was sent, plus the TTL: etcd expires the lease no
  sooner. A keepalive answered with TTL 0 (the lease is gone: expired while this process was
  frozen, or revoked) stands it down at once. Every endpoint is tried in turn; where none answers
  (a partition, quorum lost) the deadline passes and it stops deleting, by its own clock.
- The fence, before every rename: this process still holds that token and its deadline has not
  passed; a linearizable read of the key (bounded by the time left and the request timeout) finds
  it with that `create_revision` under this process's lease; and the volume's record names that
  token. The deadline is looked at again after the reads. No engine can fence a write to a POSIX
  filesystem: a process paused between its fence and its rename still renames once, which is why
  the record on the volume is checked too and another process's trash waits `takeover_wait`
  before a purge re-checks it (as with the volume lease).

The client is `etcd3gw` (the `etcd` extra): etcd's HTTP/JSON gateway (`/v3/`), plain requests,
no gRPC or protobuf to pin against torch's.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.lease import boottime, lease_status, renewal_thread, stop_renewing
from ckptd.fleet.leaserecord import (
    ENGINE_RECORD,
    Holder,
    engine_leadership_ended,
    engine_record_live,
    passed_over_doc,
    passed_over_pids,
    read_engine_record,
    volume_lease_live,
    write_engine_record,
)
from ckptd.fleet.locks import (
    LapsedLeader,
    LockHeld,
    PassedOver,
    RootLock,
    RootLockHeld,
    root_lock_holders,
    take_root_lock,
)

log = logging.getLogger(__name__)

VOLUME_ID = "volume-id"


class EtcdUnavailable(Exception):
    """No endpoint answered (or each refused): the engine cannot be asked now."""


class Endpoints:
    """The cluster's endpoints, each an `etcd3gw` client, tried in turn from the last that answered.
    One per thread: a client's timeout is set for each call."""

    def __init__(self, urls: list[str], *, ca: Path | None, cert: Path | None, key: Path | None):
        from etcd3gw.client import Etcd3Client

        self.clients = []
        for url in urls:
            parts = urlsplit(url)
            self.clients.append(Etcd3Client(
                host=parts.hostname or "127.0.0.1", port=parts.port or 2379, protocol=parts.scheme or "http",
                ca_cert=str(ca) if ca else None, cert_cert=str(cert) if cert else None,
                cert_key=str(key) if key else None, api_path="/v3/",
            ))
        self.urls = urls
        self.first = 0
        self.cluster_id: str | None = None  # etcd's cluster_id, from the last answer's header

    def post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        from etcd3gw.exceptions import Etcd3Exception

        problems = []
        n = len(self.clients)
        for i in range(n):
            at = (self.first + i) % n
            client = self.clients[at]
            client.timeout = max(0.05, timeout)
            try:
                doc = client.post(client.get_url(path), json=body)
            except (Etcd3Exception, ValueError, OSError) as exc:  # ValueError: not JSON
                problems.append(f"{self.urls[at]}: {str(exc).strip()[:200] or type(exc).__name__}")
                log.debug("etcd %s %s (timeout %.2fs): %s", self.urls[at], path, timeout, problems[-1])
                continue
            self.first = at
            header = doc.get("header") if isinstance(doc, dict) else None
            if isinstance(header, dict) and header.get("cluster_id") is not None:
                self.cluster_id = str(header["cluster_id"])
            return doc
        raise EtcdUnavailable("; ".join(problems))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


def volume_id(root: Path, create: bool = True) -> str | None:
    """The volume's id, made once (unless not `create`: None where there is none yet)."""
    try:
        return (root / LEASE_DIR / VOLUME_ID).read_text().strip()
    except FileNotFoundError:
        if not create:
            return None
    return put_volume_id(root, uuid.uuid4().hex)


def put_volume_id(root: Path, vid: str) -> str:
    """`vid` as the volume's id unless it has one: a temp file linked to `volume-id`; the first
    link wins. The id that won."""
    lease_dir = root / LEASE_DIR
    path = lease_dir / VOLUME_ID
    lease_dir.mkdir(exist_ok=True)
    tmp = lease_dir / f".{VOLUME_ID}.{uuid.uuid4().hex[:12]}.tmp"
    tmp.write_text(vid + "\n")
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink()
    return path.read_text().strip()


def root_led_here(root: Path) -> str | None:
    """Which processes of this host hold the root's own lock (the root directory's flock or
    `.ckptd/local.lock`: a live leader of any kind, `locks.RootLock`), by /proc/locks (nothing is
    tried, so nobody's lock is disturbed); None where none does or it cannot be seen."""
    pids = root_lock_holders(root)
    return f"pid {', '.join(map(str, sorted(pids)))} holds the root's lock" if pids else None


class EtcdLeadership:
    """One root's leadership by etcd. Thread-safe as `VolumeLease` is: a renewal thread, the
    daemon's filesystem thread (fence, held) and the event loop (status) share it."""

    kind = "etcd"

    def __init__(
        self,
        root: Path,
        *,
        endpoints: list[str],
        prefix: str,
        duration: float,
        margin: float,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        why: str = "",
        holder: Holder | None = None,
        mono: Callable[[], float] = boottime,
    ):
        self.root = root
        self.ttl = max(2, math.ceil(duration))  # etcd's smallest TTL with its default timings
        self.duration = float(self.ttl)
        self.margin = margin
        self.why = why
        self.prefix = prefix
        self.me = holder or Holder.me()
        self.mono = mono
        self.timeout = max(0.5, min(5.0, self.duration / 3))  # one request, to one endpoint
        self._conn = functools.partial(Endpoints, endpoints, ca=ca, cert=cert, key=key)
        self.urls = endpoints
        self.renewing = self._conn()  # the renewal thread's
        self.fencing = self._conn()  # the filesystem thread's
        self.key: str | None = None
        self.epoch: int | None = None  # the token held (the key's create_revision), or None
        self.lease_id: str | None = None
        self.deadline = float("-inf")
        self.since: float | None = None  # wall clock: when this process took it
        self.seen: dict[str, Any] | None = None  # the key's holder as last read (value, revision)
        self.error: str | None = None
        self.blocked: str | None = None
        self._mutex = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.want = True
        # The root's own lock, held for the tenure as a volume lease's leader holds it: a ckptd with
        # `leadership = "local"` and a prune take it too, so neither deletes beside this one.
        self.lock = RootLock(None, root)
        self.passed: PassedOver | None = None  # a lapsed leader's hold on the root's lock, passed over
        self.vid: str | None = None  # the volume id the key is named by, while this process leads
        self._ignored: Any = None  # another cluster's released or stale record, warned of once

    # --- questions ----------------------------------------------------------

    def held(self) -> bool:
        with self._mutex:
            return self.epoch is not None and self.mono() < self.deadline

    def current_epoch(self) -> int | None:
        with self._mutex:
            return self.epoch if self.held() else None

    def takeover_wait(self) -> float:
        """What another process's trash entry waits before a purge re-checks it: a leader stopped
        before a rename has that long, once it runs again, to see it lost the lead."""
        return self.duration + self.margin

    def fencer(self) -> Callable[[], str | None]:
        return functools.partial(self.fence, self.current_epoch())

    def fence(self, epoch: int | None) -> str | None:
        """Why this process may not rename now under `epoch`, or None if it may (the module doc)."""
        if epoch is None:
            return "this ckptd did not lead by etcd when the plan was made"
        with self._mutex:
            if self.epoch != epoch:
                return f"the etcd leadership changed since the plan was made (token {epoch}, now {self.epoch})"
            key, lease_id, left = self.key, self.lease_id, self.deadline - self.mono()
        if left <= 0 or key is None:
            return f"the etcd lease (token {epoch}) ran out without a renewal"
        try:
            doc = self.fencing.post("/kv/range", {"key": _b64(key)}, min(self.timeout, left))
        except EtcdUnavailable as exc:
            return f"cannot ask etcd whether this ckptd still leads: {exc}"
        kvs = doc.get("kvs") or []
        if not kvs or int(kvs[0].get("create_revision", 0)) != epoch or str(kvs[0].get("lease")) != lease_id:
            return f"the etcd key {key} no longer names this ckptd at token {epoch}"
        rec = read_engine_record(self.root)
        if rec is None or rec.get("epoch") != epoch or rec.get("holder", {}).get("id") != self.me.id:
            other = f"token {rec.get('epoch')}" if rec else "no readable record"
            return f"the volume's record ({LEASE_DIR}/{ENGINE_RECORD}) no longer names token {epoch} ({other})"
        if rec.get("key") != key:
            return f"the volume's record names etcd key {rec.get('key')}, not this ckptd's {key}"
        if not self.lock.held and self.passed is None:
            return f"this ckptd does not hold {self.lock.root_path}"
        if (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
            return mixed
        if self.mono() >= self.deadline:  # after the reads: a read that hung counts against it
            return f"the etcd lease (token {epoch}) ran out without a renewal"
        return None

    # --- one step ------------------------------------------------------------

    def step(self) -> None:
        with self._mutex:
            try:
                if self.epoch is not None:
                    if self.want:
                        self._renew()
                    else:
                        self.release()
                else:
                    self._try_take()
            except OSError as exc:  # the volume (its id, the record)
                self.error = f"cannot read or write {LEASE_DIR}/ on the volume: {exc}"
                self.blocked = self.error
                if self.epoch is not None and self.mono() >= self.deadline:
                    self._lose(self.error)

    def _renew(self) -> None:
        t0 = self.mono()
        try:
            doc = self.renewing.post("/lease/keepalive", {"ID": self.lease_id}, self.timeout)
        except EtcdUnavailable as exc:
            if self.error != str(exc):
                self.error = str(exc)
                log.warning("%s: cannot renew the etcd lease (token %s): %s; %.1fs left before this ckptd "
                            "stops deleting", self.root, self.epoch, exc, max(0.0, self.deadline - self.mono()))
            if self.mono() >= self.deadline:
                self._lose(f"no renewal succeeded before its deadline ({exc})")
            return
        ttl = int((doc.get("result") or doc).get("TTL", 0) or 0)
        log.debug("%s: etcd keepalive (token %s) answered in %.2fs: TTL %d", self.root, self.epoch,
                  self.mono() - t0, ttl)
        if ttl <= 0:
            self._lose("etcd says its lease is gone (expired or revoked)")
            return
        if (why := self._keep_anchor()) is not None or (why := self._keep_lock()) is not None:
            self._lose(why)
            return
        self.deadline = t0 + min(ttl, self.ttl)
        if self.error is not None:
            log.info("%s: the etcd lease is renewed again", self.root)
            self.error = None

    def _keep_anchor(self) -> str | None:
        """At each renewal: the volume still names this leader's key and token, or why it does
        not (and the lead is given up, its etcd lease revoked). `volume-id` and `engine.json` are
        written again where they were removed (`rm -rf <root>/.ckptd`): a standby that found no
        id would otherwise make a new one, and a second key would elect a second leader."""
        assert self.vid is not None and self.epoch is not None
        vid = volume_id(self.root, create=False) or put_volume_id(self.root, self.vid)
        if vid != self.vid:
            self._revoke_held()
            return (f"{LEASE_DIR}/{VOLUME_ID} names another volume id ({vid}, not {self.vid}, this "
                    f"ckptd's key {self.key}): it was made anew under this leader")
        rec = read_engine_record(self.root)
        if rec is not None and not self._same_cluster(rec):
            self._revoke_held()
            return (f"the volume's record names etcd cluster {rec.get('cluster_id')} "
                    f"(token {rec.get('epoch')}, {self._who(rec)}), not this ckptd's {self.cluster}: "
                    "every ckptd on a root must use the same [daemon.etcd] endpoints")
        if rec is not None and rec.get("epoch", 0) > self.epoch:
            return f"the volume's record names a later token ({rec.get('epoch')})"
        if (rec is not None and rec.get("epoch") == self.epoch and rec.get("key") == self.key
                and (rec.get("holder") or {}).get("id") != self.me.id):
            # One token of one key in one cluster names one holder: another holder there is a
            # leader this ckptd cannot order itself against; it stands down rather than overwrite it.
            self._revoke_held()
            return (f"the volume's record names this ckptd's token {self.epoch} held by {self._who(rec)}: "
                    "standing down rather than writing over it")
        if rec is not None and (rec.get("key") != self.key or rec.get("epoch") != self.epoch
                                or (rec.get("holder") or {}).get("id") != self.me.id):
            if rec.get("key") != self.key:
                self._revoke_held()
                return (f"the volume's record names etcd key {rec.get('key')} (token {rec.get('epoch')}), "
                        f"not this ckptd's {self.key}: every ckptd on a root must use the same "
                        "[daemon.etcd] prefix")
            rec = None  # an earlier token of this key, written late by a leader that was paused: ours over it
        if rec is None:
            log.warning("%s: %s/%s did not name this ckptd's token %s: written again", self.root, LEASE_DIR,
                        ENGINE_RECORD, self.epoch)
            self._write_record()
        else:
            # Touched at each renewal: a ckptd configured otherwise (volume, local) sees a live
            # engine leader by it (leaserecord.engine_record_live).
            with contextlib.suppress(OSError):
                os.utime(self.root / LEASE_DIR / ENGINE_RECORD)
        return None

    def _keep_lock(self) -> str | None:
        """At each renewal: the root's lock held again where it was lost (removed with `.ckptd/`)
        or passed over (its lapsed holder, frozen, let go of it since); or why not (another
        process than that holder has it now: this one stands down)."""
        if self.lock.held:
            with contextlib.suppress(LockHeld, OSError):
                if self.lock.footing() is not None:
                    self.lock.retake()
            return None
        try:
            self.lock.acquire()
        except RootLockHeld as exc:
            held = root_lock_holders(self.root)
            if self.passed is not None and (held <= self.passed.pids if held else not self.passed.pids):
                return None  # still the frozen holder's
            self._revoke_held()
            return f"{exc}, and it is not the lapsed leader's whose lock this ckptd passed over"
        except LockHeld as exc:
            self._revoke_held()
            return str(exc)
        if self.passed is not None:
            log.info("%s: this ckptd holds the root's lock again (%s let go of it)", self.root,
                     self.passed.who)
        self.passed = None
        return None

    def _write_record(self) -> None:
        passed = self.passed.pids if self.passed else ()  # frozen holders of the root's lock, passed over
        write_engine_record(self.root, {"backend": "etcd", "key": self.key, "volume_id": self.vid,
                                        "epoch": self.epoch, "cluster_id": self.cluster,
                                        "duration": self.duration,
                                        "holder": asdict(self.me), "since": self.since,
                                        **passed_over_doc(self.me.host, passed)})

    def _volume_id(self) -> str | None:
        """The volume id to name the key by at a take: the one on the volume; where there is none,
        the one a live `engine.json` names; a new one only where no live leader of this host holds
        the root's lock (it writes its own id again at its next renewal). None, and why in
        `blocked`, where none may be had now."""
        vid = volume_id(self.root, create=False)
        if vid is not None or not self.want:  # a dry run writes nothing
            if vid is None:
                self.blocked = "observing only (dry run)"
            return vid
        live = engine_record_live(self.root, self.margin)
        if live is not None and isinstance(live.get("volume_id"), str) and live["volume_id"]:
            return put_volume_id(self.root, live["volume_id"])
        if (led := root_led_here(self.root)) is not None:
            self.blocked = (f"{led} (a ckptd with leadership = \"local\", a prune or another leader "
                            f"deletes here) and {LEASE_DIR}/{VOLUME_ID} is missing: not making a new volume "
                            "id (a second etcd key) beside it; a leader by etcd writes its own again at its "
                            "next renewal")
            return None
        return volume_id(self.root, create=True)

    @property
    def cluster(self) -> str | None:
        return self.renewing.cluster_id

    def _same_cluster(self, rec: dict[str, Any]) -> bool:
        """Whether `rec` was written under this ckptd's etcd cluster (a record without one, from an
        earlier ckptd, counts as this cluster's): tokens are etcd revisions, comparable only there."""
        theirs = rec.get("cluster_id")
        return theirs is None or self.cluster is None or str(theirs) == self.cluster

    @staticmethod
    def _who(rec: dict[str, Any]) -> str:
        holder = rec.get("holder") or {}
        return f"{holder.get('host')} pid {holder.get('pid')}"

    def _other_cluster(self) -> str | None:
        """Why not take: the volume's record is live (not released, touched within its duration
        and margin) and names another etcd cluster (a node given other endpoints: its key is absent
        from this cluster, its token not comparable with this cluster's). A released or stale record
        of another cluster (the fleet moved to a new or rebuilt cluster) is passed over, said once."""
        rec = read_engine_record(self.root)
        if rec is None or self._same_cluster(rec):
            return None
        if engine_record_live(self.root, self.margin) is not None:
            return (f"the volume's record ({LEASE_DIR}/{ENGINE_RECORD}) names etcd cluster "
                    f"{rec.get('cluster_id')}, led by {self._who(rec)} (token {rec.get('epoch')}), "
                    f"and this ckptd's cluster is {self.cluster}: every ckptd on a root must use the "
                    "same [daemon.etcd] endpoints")
        if self._ignored != rec.get("cluster_id"):
            self._ignored = rec.get("cluster_id")
            log.warning("%s: %s/%s names another etcd cluster (%s, token %s, %s), released or stale: "
                        "its token is not compared with this cluster's (%s)", self.root, LEASE_DIR,
                        ENGINE_RECORD, rec.get("cluster_id"), rec.get("epoch"),
                        "released" if rec.get("released") is True else "stale", self.cluster)
        return None

    def _other_key(self) -> str | None:
        """Why not take this key: the volume's record names another key (a node with another
        `prefix`, or a volume id made anew) whose holder is live by the record or by etcd; else
        None."""
        rec = read_engine_record(self.root)
        other = rec.get("key") if rec is not None and rec.get("released") is not True else None
        if not isinstance(other, str) or other == self.key:
            return None
        holder = rec.get("holder") or {}
        why = (f"the volume's record ({LEASE_DIR}/{ENGINE_RECORD}) names etcd key {other}, led by "
               f"{holder.get('host')} pid {holder.get('pid')} (token {rec.get('epoch')}), and this ckptd's "
               f"key is {self.key}: every ckptd on a root must use the same [daemon.etcd] prefix and "
               "endpoints")
        if engine_record_live(self.root, self.margin) is not None:
            return why
        doc = self.renewing.post("/kv/range", {"key": _b64(other)}, self.timeout)
        return why if doc.get("kvs") else None

    def _lock_root(self) -> str | None:
        """Take the root's lock for the tenure: None if taken, or if it is held only by the leader
        whose key etcd has let go (`locks.take_root_lock`: passed over, and taken at a later renewal,
        `_keep_lock`); else why not."""
        why, self.passed = take_root_lock(self.lock, self._lapsed, self.me.host, lease="etcd lease")
        return why

    def _lapsed(self) -> LapsedLeader | None:
        """The leader the volume's record names, where its etcd lease has ended: not released, not
        this process, and its key absent from etcd (`_try_take` read it), which says so only where
        the record is of this cluster; another cluster's record is passed over only once it is stale
        too. With the frozen leaders it passed over itself (`engine.json`'s `passed_over`)."""
        rec = read_engine_record(self.root)
        gone = rec is not None and (self._same_cluster(rec)
                                    or engine_record_live(self.root, self.margin) is None)
        if not gone or rec.get("released") is True:
            return None
        holder = rec.get("holder") or {}
        if holder.get("id") == self.me.id:
            return None
        return LapsedLeader(holder.get("host"), holder.get("pid"),
                            frozenset(passed_over_pids(rec, self.me.host)))

    def _unlock_root(self) -> None:
        self.lock.release()
        self.passed = None

    def _try_take(self) -> None:
        if self.want and (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
            self.blocked = mixed
            return
        vid = self._volume_id()
        if vid is None:
            return
        self.key = f"{self.prefix}{vid}/leader"
        if not self.want:
            self.blocked = "observing only (dry run)"
            return
        lease_id = None
        try:
            doc = self.renewing.post("/kv/range", {"key": _b64(self.key)}, self.timeout)
            if doc.get("kvs"):
                self._saw(doc["kvs"][0])
                return
            why = self._other_cluster() or self._other_key() or self._lock_root()
            if why is not None:  # another key's live leader, or a ckptd that takes the root's lock
                self.blocked = why
                return
            t0 = self.mono()
            grant = self.renewing.post("/lease/grant", {"TTL": self.ttl}, self.timeout)
            lease_id = str(grant.get("ID"))
            value = json.dumps({"holder": asdict(self.me), "since": self._wall()}, sort_keys=True)
            txn = {
                "compare": [{"key": _b64(self.key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": _b64(self.key), "value": _b64(value), "lease": lease_id}}],
                "failure": [{"request_range": {"key": _b64(self.key)}}],
            }
            out = self.renewing.post("/kv/txn", txn, self.timeout)
        except EtcdUnavailable as exc:
            self._unlock_root()
            if lease_id is not None:
                self._revoke(lease_id)
            if self.error != str(exc):
                log.warning("%s: cannot reach etcd: %s", self.root, exc)
            self.error = str(exc)
            self.blocked = f"cannot reach etcd ({', '.join(self.urls)})"
            return
        if not out.get("succeeded"):
            self._unlock_root()
            self._revoke(lease_id)
            kvs = ((out.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
            if kvs:
                self._saw(kvs[0])
            return
        epoch = int(out["header"]["revision"])
        rec = read_engine_record(self.root)
        if (why := self._other_cluster()) is not None:  # another cluster's leader wrote it meanwhile
            self._unlock_root()
            self._revoke(lease_id)
            self.blocked = why
            return
        if rec is not None and self._same_cluster(rec) and rec.get("epoch", 0) > epoch:  # never ours
            self._unlock_root()
            self._revoke(lease_id)
            self.blocked = f"the volume's record names a later token ({rec.get('epoch')}) than etcd gave ({epoch})"
            return
        self.epoch, self.lease_id, self.deadline, self.vid = epoch, lease_id, t0 + self.ttl, vid
        self.since = self._wall()
        try:
            self._write_record()
        except OSError:
            self._revoke_held()
            self._lose(f"cannot write {LEASE_DIR}/{ENGINE_RECORD}")
            raise
        self.seen = {"holder": asdict(self.me), "since": self.since, "epoch": epoch}
        self.error = self.blocked = None

    def _saw(self, kv: dict[str, Any]) -> None:
        """The key exists: who holds it, for status and the standby's line."""
        try:
            value = json.loads(_unb64(kv.get("value", "")))
        except ValueError:
            value = {}
        holder = value.get("holder") if isinstance(value, dict) else None
        epoch = int(kv.get("create_revision", 0))
        self.seen = {"holder": holder, "since": value.get("since"), "epoch": epoch}
        who = f"{holder.get('host')} pid {holder.get('pid')}" if isinstance(holder, dict) else "another ckptd"
        self.blocked = f"{who} leads by etcd (token {epoch}); waiting for its lease to end"
        self.error = None

    def _revoke(self, lease_id: str) -> None:
        with contextlib.suppress(EtcdUnavailable):
            self.renewing.post("/lease/revoke", {"ID": lease_id}, self.timeout)

    def _revoke_held(self) -> None:
        """Give the key back at once (the lead is given up for a reason etcd does not know of)."""
        if self.lease_id is not None:
            self._revoke(self.lease_id)

    def _lose(self, why: str) -> None:
        log.error("%s: etcd leadership lost: %s; this ckptd no longer deletes here", self.root, why)
        self.epoch, self.lease_id, self.deadline, self.since = None, None, float("-inf"), None
        self._unlock_root()

    def release(self) -> None:
        """Stop leading: say so in `engine.json` (a ckptd configured otherwise need not wait for it
        to go stale), let go of the root's lock and revoke the lease (a standby need not wait for it
        to expire)."""
        with self._mutex:
            lease_id, held, epoch = self.lease_id, self.held(), self.epoch
            self.epoch, self.lease_id, self.deadline, self.since = None, None, float("-inf"), None
            if held and epoch is not None and self.key is not None:
                engine_leadership_ended(self.root, epoch, self.me.id, self.key)
            self._unlock_root()
            if lease_id is not None and held:
                self._revoke(lease_id)

    @staticmethod
    def _wall() -> float:
        return time.time()

    # --- the renewal thread ---------------------------------------------------

    @property
    def interval(self) -> float:
        return max(0.05, self.duration / 3)

    def start(self, on_change: Callable[[], None] = lambda: None) -> None:
        if self._thread is not None:
            return
        self._thread = renewal_thread(self, "etcd leadership", f"ckptd-etcd-{self.root.name}", on_change)

    def stop(self, release: bool = True, timeout: float = 5.0) -> bool:
        return stop_renewing(self, "etcd does not answer; the lease is left to expire", release, timeout)

    # --- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._mutex:
            seen = self.seen or {}
            return lease_status(self, {"epoch": seen.get("epoch"), "holder": seen.get("holder"),
                                       "since": seen.get("since"), "released": False, "key": self.key,
                                       "endpoints": self.urls}, self.error)


def prefix_mismatch(root: Path, prefix: str) -> str | None:
    """For start-up and check-config: where the root's `engine.json` names a key outside `prefix`
    (a node configured with another `[daemon.etcd] prefix`), what that means; else None."""
    rec = read_engine_record(root)
    key = rec.get("key") if rec is not None else None
    if not isinstance(key, str) or key.startswith(prefix):
        return None
    return (f"{LEASE_DIR}/{ENGINE_RECORD} names etcd key {key}, outside this ckptd's prefix {prefix}: a node "
            "with another [daemon.etcd] prefix leads or led here; while its record is live this ckptd "
            "deletes nothing (give every node of a root the same prefix and endpoints)")


def etcd_leadership(root: Path, daemon: Any, why: str) -> EtcdLeadership:
    """The root's etcd leadership from `[daemon]` and `[daemon.etcd]` (config.models)."""
    e = daemon.etcd
    return EtcdLeadership(root, endpoints=list(e.endpoints), prefix=e.prefix, duration=daemon.lease_duration,
                          margin=daemon.lease_margin, ca=e.ca, cert=e.cert, key=e.key, why=why)
