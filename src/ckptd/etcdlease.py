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

from ckptd.layouts import LEASE_DIR
from ckptd.lease import boottime, renewal_thread
from ckptd.leaserecord import ENGINE_RECORD, Holder, read_engine_record, volume_lease_live, write_engine_record

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
                continue
            self.first = at
            return doc
        raise EtcdUnavailable("; ".join(problems))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


def volume_id(root: Path, create: bool = True) -> str | None:
    """The volume's id, made once (unless not `create`: None where there is none yet): a temp
    file linked to `volume-id`; the first link wins."""
    lease_dir = root / LEASE_DIR
    path = lease_dir / VOLUME_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        if not create:
            return None
    lease_dir.mkdir(exist_ok=True)
    tmp = lease_dir / f".{VOLUME_ID}.{uuid.uuid4().hex[:12]}.tmp"
    tmp.write_text(uuid.uuid4().hex + "\n")
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink()
    return path.read_text().strip()


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
        if (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
            return mixed
        if self.mono() >= self.deadline:  # after the reads: a read that hung counts against it
            return f"the etcd lease (token {epoch}) ran out without a renewal"
        return None

    # --- one step ------------------------------------------------------------

    def step(self) -> None:
        with self._mutex:
            try:
                if self.key is None:
                    vid = volume_id(self.root, create=self.want)  # a dry run writes nothing
                    if vid is None:
                        self.blocked = "observing only (dry run)"
                        return
                    self.key = f"{self.prefix}{vid}/leader"
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
        if ttl <= 0:
            self._lose("etcd says its lease is gone (expired or revoked)")
            return
        rec = read_engine_record(self.root)
        if rec is not None and rec.get("epoch", 0) > (self.epoch or 0):
            self._lose(f"the volume's record names a later token ({rec.get('epoch')})")
            return
        self.deadline = t0 + min(ttl, self.ttl)
        # Touched at each renewal: a volume lease's holder (a host configured otherwise) sees a
        # live engine leader by it (leaserecord.engine_leader_seen).
        with contextlib.suppress(OSError):
            os.utime(self.root / LEASE_DIR / ENGINE_RECORD)
        if self.error is not None:
            log.info("%s: the etcd lease is renewed again", self.root)
            self.error = None

    def _try_take(self) -> None:
        if not self.want:
            self.blocked = "observing only (dry run)"
            return
        assert self.key is not None
        try:
            doc = self.renewing.post("/kv/range", {"key": _b64(self.key)}, self.timeout)
            if doc.get("kvs"):
                self._saw(doc["kvs"][0])
                return
            if (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
                self.blocked = mixed
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
            if self.error != str(exc):
                log.warning("%s: cannot reach etcd: %s", self.root, exc)
            self.error = str(exc)
            self.blocked = f"cannot reach etcd ({', '.join(self.urls)})"
            return
        if not out.get("succeeded"):
            self._revoke(lease_id)
            kvs = ((out.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
            if kvs:
                self._saw(kvs[0])
            return
        epoch = int(out["header"]["revision"])
        rec = read_engine_record(self.root)
        if rec is not None and rec.get("epoch", 0) > epoch:  # a later token on the volume: never ours
            self._revoke(lease_id)
            self.blocked = f"the volume's record names a later token ({rec.get('epoch')}) than etcd gave ({epoch})"
            return
        write_engine_record(self.root, {"backend": "etcd", "key": self.key, "epoch": epoch, "duration": self.duration,
                                        "holder": asdict(self.me), "since": self._wall()})
        self.epoch, self.lease_id, self.deadline = epoch, lease_id, t0 + self.ttl
        self.since = self._wall()
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

    def _lose(self, why: str) -> None:
        log.error("%s: etcd leadership lost: %s; this ckptd no longer deletes here", self.root, why)
        self.epoch, self.lease_id, self.deadline, self.since = None, None, float("-inf"), None

    def release(self) -> None:
        """Stop leading; revoke the lease so that a standby need not wait for it to expire."""
        with self._mutex:
            lease_id, held = self.lease_id, self.held()
            self.epoch, self.lease_id, self.deadline, self.since = None, None, float("-inf"), None
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s: etcd does not answer; the lease is left to expire", self.root)
                return False
            self._thread = None
        if release:
            self.release()
        return True

    # --- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._mutex:
            seen = self.seen or {}
            held = self.held()
            return {
                "kind": self.kind,
                "why": self.why,
                "held": held,
                "epoch": seen.get("epoch"),
                "holder": seen.get("holder"),
                "since": seen.get("since"),
                "released": False,
                "key": self.key,
                "endpoints": self.urls,
                "duration": self.duration,
                "margin": self.margin,
                "waiting": None if held else self.blocked,
                "error": self.error,
            }


def etcd_leadership(root: Path, daemon: Any, why: str) -> EtcdLeadership:
    """The root's etcd leadership from `[daemon]` and `[daemon.etcd]` (config.models)."""
    e = daemon.etcd
    return EtcdLeadership(root, endpoints=list(e.endpoints), prefix=e.prefix, duration=daemon.lease_duration,
                          margin=daemon.lease_margin, ca=e.ca, cert=e.cert, key=e.key, why=why)
