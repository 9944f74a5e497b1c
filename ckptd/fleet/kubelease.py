"""Leadership by a Kubernetes Lease (`leadership = "kubernetes"`): the API server elects, the volume fences.

client-go's leader election (k8s.io/client-go/tools/leaderelection, `tryAcquireOrRenew`) on a
`coordination.k8s.io/v1` Lease, with its clock taken out of the wall clock:

- The Lease: `<namespace>/<lease_name>`, by default `ckptd-<volume id>` (the id kept on the volume,
  `<root>/.ckptd/volume-id`, as etcd's key is named: every pod names the same Lease whatever path
  it mounts the volume at). Its spec: `holderIdentity` (`<host>_<pid>_<random id>`, this process),
  `leaseDurationSeconds`, `acquireTime`, `renewTime` (MicroTime) and `leaseTransitions`.
- Taking it: GET it; absent, POST it (409 AlreadyExists: another process made it first). Present,
  it is free when `holderIdentity` is empty (a leader that stopped handed it back) or names this
  process, else once it has gone unchanged for its `leaseDurationSeconds` (or ours, the larger)
  plus `lease_margin`, as this process saw it. That wait runs on this process's MONOTONIC clock
  from when it last saw the spec change (client-go's `observedTime`): the holder's `renewTime` is
  its wall clock, and comparing another host's wall clock with ours is exactly what skew breaks.
  It is taken by a PUT carrying the `resourceVersion` of that GET: the API server refuses it with
  409 Conflict if anyone wrote in between, so of two standbys at most one wins.
- The token: `leaseTransitions`, incremented on every change of holder (client-go's rule) and at
  every new tenure of this process, and never below the volume's record's token plus one (a Lease
  deleted and made afresh starts at 0). It goes into `<root>/.ckptd/engine.json` as etcd's does,
  before anything is deleted; a record of this Lease with a larger token stands a leader down.
- Renewing: every third of `lease_duration` (client-go's retry period), a GET then a PUT of
  `renewTime` at that `resourceVersion`. The leader's own deadline (client-go's renew deadline) is
  its monotonic clock taken before that GET, plus `lease_duration`: a standby waits at least that
  plus the margin from a change it saw, which the PUT made after. A GET that finds another holder
  or another token stands it down at once; where the API server does not answer, the deadline
  passes and it stops deleting, by its own clock.
- The fence, before every rename: this process still holds that token and its deadline has not
  passed; a GET of the Lease (bounded by the request timeout) names this process at that token;
  the volume's record names that token and this process; no live volume lease. The deadline is
  looked at again after the reads. As with etcd, no API server can fence a write to a POSIX
  filesystem: hence the record on the volume, and another process's trash waiting `takeover_wait`.

The root's own lock, `<root>/.ckptd/local.lock`, is held for the tenure, as the volume lease's
holder holds it: a ckptd with `leadership = "local"` or a prune holds it while it deletes, so the
two exclude each other. It is taken before the Lease (`_try_take`: one held by another process
refuses the take) and let go in `_lose` and `release`. One held by the lapsed holder itself (a
frozen process keeps its locks; the lock table shows its pid, or it is on another host) is passed
over, by the rule etcd's leader follows too (`locks.take_root_lock`), and taken at a later renewal
once that holder lets go.

The client is `lightkube` (the `kubernetes` extra): a synchronous client for the renewal thread
(kubernetes_asyncio is async only), kubeconfig and in-cluster configuration with exec credential
plugins and rotated service-account tokens, in a few hundred kilobytes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.etcdlease import volume_id
from ckptd.fleet.lease import boottime, lease_status, renewal_thread, stop_renewing
from ckptd.fleet.leaserecord import (
    ENGINE_RECORD,
    Holder,
    engine_leader_seen,
    engine_leadership_ended,
    engine_record_refusal,
    passed_over_doc,
    passed_over_pids,
    read_engine_record,
    volume_lease_live,
    write_engine_record,
)
from ckptd.fleet.locks import LapsedLeader, LockHeld, RootLock, take_root_lock

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class KubeUnavailable(Exception):
    """The API server did not answer, or refused for a reason other than a conflict."""


class KubeConflict(Exception):
    """409: the Lease changed since it was read (Conflict), or exists already (AlreadyExists)."""


class KubeConfigMissing(Exception):
    """No kubeconfig and not in a pod: nowhere to find the API server."""


def kube_source(kubeconfig: Path | None, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """Where the API server and credentials come from: ("kubeconfig", file) or ("in-cluster",
    service-account dir). In order: the `kubeconfig` key; $KUBECONFIG (its first file); in a pod
    (KUBERNETES_SERVICE_HOST set and a service-account token mounted); ~/.kube/config."""
    env = dict(os.environ) if env is None else env
    if kubeconfig is not None:
        return "kubeconfig", kubeconfig
    if env.get("KUBECONFIG"):
        return "kubeconfig", Path(env["KUBECONFIG"].split(os.pathsep)[0]).expanduser()
    if env.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").is_file():
        return "in-cluster", SERVICE_ACCOUNT
    home = Path("~/.kube/config").expanduser()
    if home.is_file():
        return "kubeconfig", home
    raise KubeConfigMissing(
        "no kubeconfig ([daemon.kubernetes] kubeconfig, $KUBECONFIG, ~/.kube/config) and not in a pod "
        f"(KUBERNETES_SERVICE_HOST and {SERVICE_ACCOUNT}/token)")


def micro_time(wall: float) -> datetime:
    """A MicroTime for the Lease. The API server parses it with RFC3339Micro (apimachinery
    meta/v1/micro_time.go, `UnmarshalJSON`), which wants the six fraction digits; the JSON encoder
    (msgspec) leaves them out of a whole second, so a whole second is moved on by a microsecond."""
    when = datetime.fromtimestamp(wall, UTC)
    return when.replace(microsecond=1) if when.microsecond == 0 else when


def parse_micro(text: Any) -> float | None:
    if isinstance(text, datetime):
        return text.timestamp()
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def identity_of(holder: Holder) -> str:
    return f"{holder.host}_{holder.pid}_{holder.id}"


def holder_of(identity: str) -> dict[str, Any] | None:
    """A `holderIdentity` as status shows it: ckptd's `<host>_<pid>_<id>`, or another's as it is."""
    if not identity:
        return None
    host, _, rest = identity.rpartition("_")
    host, _, pid = host.rpartition("_")
    if host and pid.isdigit():
        return {"host": host, "pid": int(pid), "id": rest}
    return {"host": identity, "pid": "?", "id": None}


class KubeApi:
    """The three calls on one Lease, through one lightkube client (one per thread)."""

    def __init__(self, source: tuple[str, Path], namespace: str | None, timeout: float):
        import httpx2
        from lightkube import Client, KubeConfig

        kind, where = source
        if kind == "in-cluster":
            config = KubeConfig.from_service_account(where)
        else:
            config = KubeConfig.from_file(where)
        self.client = Client(config, namespace=namespace, timeout=httpx2.Timeout(timeout),
                             field_manager="ckptd")
        self.namespace = self.client.namespace
        self.server = self.client.config.cluster.server

    def _call(self, what: Callable[[], Any], absent_ok: bool = False) -> dict[str, Any] | None:
        import httpx2
        from lightkube import ApiError, ConfigError

        try:
            return what().to_dict()
        except ApiError as exc:
            if exc.status.code == 404 and absent_ok:
                return None
            if exc.status.code == 409:
                raise KubeConflict(exc.status.message or exc.status.reason or "409") from None
            raise KubeUnavailable(f"{exc.status.code} {exc.status.reason}: {exc.status.message}") from None
        except (httpx2.HTTPError, ConfigError, OSError, ValueError) as exc:
            raise KubeUnavailable(f"{self.server}: {str(exc).strip()[:200] or type(exc).__name__}") from None

    def get(self, name: str) -> dict[str, Any] | None:
        """The Lease, or None where there is none (404)."""
        from lightkube.resources.coordination_v1 import Lease

        return self._call(lambda: self.client.get(Lease, name, namespace=self.namespace), absent_ok=True)

    def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        from lightkube.resources.coordination_v1 import Lease

        out = self._call(lambda: self.client.create(Lease.from_dict(doc), namespace=self.namespace))
        assert out is not None
        return out

    def replace(self, doc: dict[str, Any]) -> dict[str, Any]:
        from lightkube.resources.coordination_v1 import Lease

        out = self._call(lambda: self.client.replace(Lease.from_dict(doc), namespace=self.namespace))
        assert out is not None
        return out


def _spec(lease: dict[str, Any] | None) -> dict[str, Any]:
    return (lease or {}).get("spec") or {}


def _token(spec: dict[str, Any]) -> int:
    """leaseTransitions, 0 where a Lease made by another tool has none."""
    value = spec.get("leaseTransitions")
    return value if isinstance(value, int) else 0


class KubeLeadership:
    """One root's leadership by a Kubernetes Lease. Thread-safe as `VolumeLease` is: a renewal
    thread, the daemon's filesystem thread (fence, held) and the event loop (status) share it."""

    kind = "kubernetes"

    def __init__(
        self,
        root: Path,
        *,
        duration: float,
        margin: float,
        namespace: str | None = None,
        lease_name: str | None = None,
        kubeconfig: Path | None = None,
        why: str = "",
        holder: Holder | None = None,
        mono: Callable[[], float] = boottime,
        wall: Callable[[], float] = time.time,
    ):
        self.root = root
        self.duration = float(duration)
        self.seconds = max(1, math.ceil(duration))  # leaseDurationSeconds: whole seconds
        self.margin = margin
        self.why = why
        self.me = holder or Holder.me()
        self.identity = identity_of(self.me)
        self.mono, self.wall = mono, wall
        self.timeout = max(0.5, min(5.0, self.duration / 3))  # one request
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.name = lease_name  # None until the volume id is read
        self._api = functools.partial(KubeApi, namespace=namespace, timeout=self.timeout)
        self.renewing: KubeApi | None = None  # the renewal thread's
        self.fencing: KubeApi | None = None  # the filesystem thread's
        self.server: str | None = None
        self.epoch: int | None = None  # the token held (leaseTransitions), or None
        self.deadline = float("-inf")
        self._passed_over: frozenset[int] = frozenset()  # frozen holders of local.lock passed over
        self.since: float | None = None
        self.seen: dict[str, Any] | None = None  # the Lease's spec as last read
        self._key: str | None = None  # the spec last seen, as text: a change restarts the wait
        self._changed_at = 0.0  # `mono` time it was first seen
        self.error: str | None = None
        self.blocked: str | None = None
        self._mutex = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.want = True
        # The root's own lock, held for the tenure as a volume lease's leader holds it: a ckptd with
        # `leadership = "local"` and a prune take it too, so neither deletes beside this one.
        self.lock = RootLock(None, root)

    @property
    def key(self) -> str:
        return f"{self.namespace or '?'}/{self.name or '?'}"

    # --- questions ----------------------------------------------------------

    def held(self) -> bool:
        with self._mutex:
            return self.epoch is not None and self.mono() < self.deadline

    def current_epoch(self) -> int | None:
        with self._mutex:
            return self.epoch if self.held() else None

    def takeover_wait(self) -> float:
        """What another process's trash entry waits before a purge re-checks it: what a standby
        waits before taking over, so a leader stopped before a rename has that long, once it runs
        again, to see it lost the lead."""
        return self.duration + self.margin

    def fencer(self) -> Callable[[], str | None]:
        return functools.partial(self.fence, self.current_epoch())

    def fence(self, epoch: int | None) -> str | None:
        """Why this process may not rename now under `epoch`, or None if it may (the module doc)."""
        if epoch is None:
            return "this ckptd did not hold the Kubernetes Lease when the plan was made"
        with self._mutex:
            if self.epoch != epoch:
                return (f"the Kubernetes Lease changed hands since the plan was made (token {epoch}, "
                        f"now {self.epoch})")
            name, left = self.name, self.deadline - self.mono()
        if left <= 0 or name is None:
            return f"the Kubernetes Lease (token {epoch}) ran out without a renewal"
        try:
            if self.fencing is None:
                self.fencing = self._connect()
            spec = _spec(self.fencing.get(name))
        except (KubeUnavailable, KubeConfigMissing) as exc:
            return f"cannot ask the API server whether this ckptd still leads: {exc}"
        if spec.get("holderIdentity") != self.identity or _token(spec) != epoch:
            return f"the Lease {self.key} no longer names this ckptd at token {epoch}"
        if (why := engine_record_refusal(self.root, epoch, self.me.id, self.key)) is not None:
            return why
        if (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
            return mixed
        if self.mono() >= self.deadline:  # after the reads: a read that hung counts against it
            return f"the Kubernetes Lease (token {epoch}) ran out without a renewal"
        return None

    # --- one step ------------------------------------------------------------

    def _connect(self) -> KubeApi:
        source = kube_source(self.kubeconfig)
        try:
            api = self._api(source)
        except Exception as exc:  # lightkube's ConfigError, a missing or unparsable file, ...
            raise KubeConfigMissing(f"{source[1]}: {str(exc).strip()[:200] or type(exc).__name__}") from None
        self.namespace, self.server = api.namespace, api.server
        return api

    def step(self) -> None:
        with self._mutex:
            try:
                if self.renewing is None:
                    self.renewing = self._connect()
                if self.name is None:
                    vid = volume_id(self.root, create=self.want)  # a dry run writes nothing
                    if vid is None:
                        self.blocked = "observing only (dry run)"
                        return
                    self.name = f"ckptd-{vid}"
                if self.epoch is not None:
                    if self.want:
                        self._renew()
                    else:
                        self.release()
                else:
                    self._try_take()
            except KubeConfigMissing as exc:  # the configuration: read again at the next step
                self.error = self.blocked = f"cannot load the Kubernetes configuration: {exc}"
            except OSError as exc:  # the volume (its id, the record)
                self.error = f"cannot read or write {LEASE_DIR}/ on the volume: {exc}"
                self.blocked = self.error
                if self.epoch is not None and self.mono() >= self.deadline:
                    self._lose(self.error)

    def _observe(self, spec: dict[str, Any], now: float) -> float:
        """Seconds the Lease's spec has been seen unchanged by this process (client-go's
        observedTime: the local clock from the last change seen, never the holder's renewTime)."""
        key = json.dumps(spec, sort_keys=True, default=str)
        if key != self._key:
            self._key, self._changed_at = key, now
        return now - self._changed_at

    def _unreachable(self, exc: Exception) -> None:
        if self.error != str(exc):
            log.warning("%s: cannot reach the Kubernetes API server: %s", self.root, exc)
        self.error = str(exc)
        self.blocked = f"cannot reach the Kubernetes API server ({self.server})"

    def _try_take(self) -> None:
        assert self.renewing is not None and self.name is not None
        t0 = self.mono()
        try:
            lease = self.renewing.get(self.name)
        except KubeUnavailable as exc:
            self._unreachable(exc)
            return
        spec = _spec(lease)
        self.seen = spec or None
        unchanged_for = self._observe(spec, self.mono())  # after the answer: the change was made before it
        self.error = None
        if not self.want:
            self.blocked = "observing only (dry run)"
            return
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity:
            wait = max(self.duration, float(spec.get("leaseDurationSeconds") or 0)) + self.margin
            if unchanged_for < wait:
                who = holder_of(holder) or {}
                self.blocked = (f"{who.get('host')} pid {who.get('pid')} holds the Lease {self.key} (token "
                                f"{spec.get('leaseTransitions')}); taking it once unrenewed for {wait:g}s "
                                f"(unchanged for {unchanged_for:.1f}s)")
                return
        if (mixed := volume_lease_live(self.root)) is not None:  # a host configured otherwise
            self.blocked = mixed
            return
        rec = read_engine_record(self.root)
        if rec is not None and rec.get("key") != self.key \
                and (other := engine_leader_seen(self.root, self.margin)) is not None:  # another Lease, etcd
            self.blocked = other
            return
        if (busy := self._take_root_lock(holder)) is not None:
            self.blocked = busy
            return
        floor = rec["epoch"] if rec is not None and rec.get("key") == self.key else -1
        epoch = max(_token(spec) + (1 if lease else 0), floor + 1)
        now = self.wall()
        new = {"holderIdentity": self.identity, "leaseDurationSeconds": self.seconds,
               "acquireTime": micro_time(now), "renewTime": micro_time(now), "leaseTransitions": epoch}
        try:
            if lease is None:
                out = self.renewing.create({"metadata": {"name": self.name, "namespace": self.namespace},
                                            "spec": new})
            else:
                out = self.renewing.replace({**lease, "spec": {**spec, **new}})
        except KubeConflict as exc:
            self.lock.release()
            self.blocked = f"another process wrote the Lease {self.key} first ({exc})"
            return
        except KubeUnavailable as exc:
            self.lock.release()
            self._unreachable(exc)
            return
        self._observe(_spec(out), self.mono())
        if self.mono() >= t0 + self.duration:  # paused past its own deadline: took nothing
            self.lock.release()
            self.blocked = "took the Lease too late to lead on it (past its own deadline)"
            return
        self._record(epoch, now)
        self.epoch, self.deadline, self.since = epoch, t0 + self.duration, now
        self.seen = _spec(out)
        self.error = self.blocked = None

    def _renew(self) -> None:
        assert self.renewing is not None and self.name is not None and self.epoch is not None
        t0 = self.mono()
        epoch = self.epoch
        try:
            lease = self.renewing.get(self.name)
            spec = _spec(lease)
            if lease is None or spec.get("holderIdentity") != self.identity \
                    or _token(spec) != epoch:
                who = holder_of(spec.get("holderIdentity") or "") or {}
                taken = (f"was taken over ({who.get('host')} pid {who.get('pid')}, token "
                         f"{spec.get('leaseTransitions')})" if lease else "is gone")
                self._lose(f"the Lease {self.key} {taken}")
                return
            if (why := self._keep_record(epoch)) is not None:
                self._lose(why)
                return
            out = self.renewing.replace({**lease, "spec": {**spec, "renewTime": micro_time(self.wall())}})
        except (KubeUnavailable, KubeConflict) as exc:
            if self.error != str(exc):
                self.error = str(exc)
                log.warning("%s: cannot renew the Kubernetes Lease (token %s): %s; %.1fs left before this "
                            "ckptd stops deleting", self.root, epoch, exc,
                            max(0.0, self.deadline - self.mono()))
            if self.mono() >= self.deadline:
                self._lose(f"no renewal succeeded before its deadline ({exc})")
            return
        self.seen = _spec(out)
        self._observe(self.seen, self.mono())
        self.deadline = t0 + self.duration
        if not self.lock.held:  # taken over from a frozen holder: its lock, once it lets go
            with contextlib.suppress(LockHeld, OSError):
                self.lock.acquire()
                log.info("%s: this ckptd holds %s/local.lock again", self.root, LEASE_DIR)
        # Touched at each renewal: a volume lease's holder (a host configured otherwise) sees a
        # live engine leader by it (leaserecord.engine_leader_seen).
        with contextlib.suppress(OSError):
            os.utime(self.root / LEASE_DIR / ENGINE_RECORD)
        if self.error is not None:
            log.info("%s: the Kubernetes Lease is renewed again", self.root)
            self.error = None

    def _keep_record(self, epoch: int) -> str | None:
        """Why the volume's record means this leader must stand down, or None. A record of another
        Lease or backend (a host configured otherwise, leading since), or of a later token, stands
        it down; an earlier token of this Lease found over ours (its writer took it, paused, and
        wrote after we took over) is written over."""
        rec = read_engine_record(self.root)
        if rec is not None and rec.get("key") == self.key and rec["epoch"] == epoch \
                and (rec.get("holder") or {}).get("id") == self.me.id:
            return None
        if rec is not None and rec.get("key") != self.key:
            return f"the volume's record names {rec.get('backend')} {rec.get('key')} (token {rec['epoch']})"
        if rec is not None and rec["epoch"] > epoch:
            return f"the volume's record names a later token ({rec['epoch']})"
        if rec is not None:
            log.warning("%s: the volume's record named token %s of the Lease (an earlier leader's late "
                        "write): written over with token %s", self.root, rec["epoch"], epoch)
        self._record(epoch, self.since)
        return None

    def _record(self, epoch: int, since: float | None) -> None:
        passed = () if self.lock.held else self._passed_over
        write_engine_record(self.root, {"backend": self.kind, "key": self.key, "epoch": epoch,
                                        "duration": self.duration, "holder": asdict(self.me), "since": since,
                                        **passed_over_doc(self.me.host, passed)})

    def _take_root_lock(self, holder: str) -> str | None:
        """Take `<root>/.ckptd/local.lock` (`locks.take_root_lock`): None if taken (or it cannot be on
        a read-only root: the Lease alone decides), or if it is held only by the Lease's lapsed
        `holder` or frozen holders it passed over in turn (recorded again by this one until it holds
        the lock itself); else why not (a ckptd with `leadership = "local"` or a prune deletes here)."""
        why, passed = take_root_lock(self.lock, functools.partial(self._lapsed, holder), self.me.host,
                                     lease="Lease")
        self._passed_over = passed.pids if passed is not None else frozenset()
        return why

    def _lapsed(self, holder: str) -> LapsedLeader | None:
        """The Lease's holder whose tenure `_try_take` found lapsed, where it is another ckptd (a pid
        in its identity), with the frozen holders it passed over itself where the volume's record of
        this Lease is its (`engine.json`'s `passed_over`)."""
        lapsed = holder_of(holder) if holder and holder != self.identity else None
        if lapsed is None or not isinstance(lapsed.get("pid"), int):
            return None
        rec = read_engine_record(self.root)
        mine = rec is not None and rec.get("key") == self.key \
            and (rec.get("holder") or {}).get("id") == lapsed.get("id")
        return LapsedLeader(lapsed["host"], lapsed["pid"],
                            frozenset(passed_over_pids(rec, self.me.host)) if mine else frozenset())

    def _lose(self, why: str) -> None:
        log.error("%s: Kubernetes leadership lost: %s; this ckptd no longer deletes here", self.root, why)
        self.epoch, self.deadline, self.since = None, float("-inf"), None
        self.lock.release()

    def release(self) -> None:
        """Stop leading; hand the Lease back (client-go's release: no holder, the transitions
        kept) so that a standby need not wait for it to expire, and say so in `engine.json` (a
        ckptd configured otherwise need not wait for the record to go stale, as etcd's release)."""
        with self._mutex:
            epoch, held = self.epoch, self.held()
            # first: nothing renames from here on
            self.epoch, self.deadline, self.since = None, float("-inf"), None
            if held and epoch is not None:
                engine_leadership_ended(self.root, epoch, self.me.id, self.key)
            if epoch is None or not held or self.renewing is None or self.name is None:
                self.lock.release()
                return
            try:
                lease = self.renewing.get(self.name)
                spec = _spec(lease)
                if lease is not None and spec.get("holderIdentity") == self.identity \
                        and _token(spec) == epoch:
                    now = micro_time(self.wall())
                    handed_back = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now,
                                   "acquireTime": now}
                    self.renewing.replace({**lease, "spec": handed_back})
            except (KubeUnavailable, KubeConflict) as exc:
                log.warning("%s: cannot hand the Kubernetes Lease back (it will expire): %s", self.root, exc)
            finally:
                self.lock.release()

    # --- the renewal thread ---------------------------------------------------

    @property
    def interval(self) -> float:
        return max(0.05, self.duration / 3)

    def start(self, on_change: Callable[[], None] = lambda: None) -> None:
        if self._thread is not None:
            return
        self._thread = renewal_thread(self, "Kubernetes leadership", f"ckptd-kube-{self.root.name}",
                                      on_change)

    def stop(self, release: bool = True, timeout: float = 5.0) -> bool:
        return stop_renewing(self, "the Kubernetes API server does not answer; the Lease is left to expire",
                             release, timeout)

    # --- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._mutex:
            spec = self.seen or {}
            holder = spec.get("holderIdentity")
            return lease_status(self, {"epoch": spec.get("leaseTransitions"),
                                       "holder": holder_of(holder) if holder else None,
                                       "since": parse_micro(spec.get("acquireTime")),
                                       "released": bool(spec) and not holder, "key": self.key,
                                       "server": self.server}, self.error)


def take_for_prune(lead: KubeLeadership, tell: Callable[[str], None]) -> bool:
    """For one prune: whether `lead` took the Lease. A holder seen renewing it is not waited for; one
    that does not (killed, frozen) is watched for the duration plus the margin first, as any
    standby must (the holder's renewTime cannot say: it is another host's clock)."""
    lead.step()
    first = lead._key
    deadline = lead.mono() + lead.duration + lead.margin + 2 * lead.interval
    between_looks = threading.Event()  # never set: a timer between looks, nothing to synchronise with
    said = False
    while not lead.held():
        if lead.error is not None or lead._key != first or lead.mono() >= deadline or lead.name is None:
            return False  # unreachable, renewed while watched (a live holder), or past the wait
        if not said and lead.blocked:
            tell(f"{lead.root}: {lead.blocked}; watching it for up to {lead.duration + lead.margin:g}s")
            said = True
        between_looks.wait(lead.interval)
        lead.step()
    return True


def kube_leadership(root: Path, daemon: Any, why: str) -> KubeLeadership:
    """The root's Kubernetes leadership from `[daemon]` and `[daemon.kubernetes]` (config.models)."""
    k = daemon.kubernetes
    return KubeLeadership(root, duration=daemon.lease_duration, margin=daemon.lease_margin,
                          namespace=k.namespace, lease_name=k.lease_name, kubeconfig=k.kubeconfig, why=why)
