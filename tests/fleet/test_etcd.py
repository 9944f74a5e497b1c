"""Leadership by etcd (`leadership = "etcd"`, etcdlease.py): real `ckptd run` processes, elected
by a real 3-member etcd on 127.0.0.1 ports (tests/support/etcd.py; skipped where Debian's
etcd-server is not installed), the token fenced on the volume too. Two "hosts" with their own
state_dirs, as in test_multinode.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time
from pathlib import Path

from tests.support import fleet
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.etcd import etcd  # noqa: F401 (the fixture)
from tests.support.fleet import (
    ETCD_TOOK,
    D,
    M,
    either_says,
    engine_record,
    etcd_config,
    leader_and_standby,
    said,
    stop_all,
)
from tests.support.nodes import ckpts, listing, logged_at, node_config, trashed, wait_stopped

# The stop to the takeover's log line: the TTL etcd waits, a step (D/3) to see the key gone and
# one to act, and slack for a loaded machine (the measured figures: bench/standby.py).
TAKEOVER_BOUND = D + M + 2 * D / 3 + 3.0
# A node that takes the root's lock, on the engine's timings.
local_config = functools.partial(fleet.local_config, duration=D, margin=M)


def test_one_deletes_and_a_killed_leader_is_replaced_after_its_ttl(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: etcd_config(tmp_path, n, root, etcd.endpoints), ETCD_TOOK)
        a.wait_message("deleted job/checkpoint-1")
        token = engine_record(root)["epoch"]
        assert engine_record(root)["holder"]["pid"] == a.proc.pid
        status = run_ckptd("status", "-c", tmp_path / "b.toml")
        assert "leadership: etcd key /test/" in status.stdout and f"token {token}, held by" in status.stdout, \
            status.stdout
        health = run_ckptd("health", "-c", tmp_path / "b.toml")
        assert health.returncode == 0, health.stdout
        assert f"standby at {root}, led by {os.uname().nodename} pid {a.proc.pid} (etcd lease since" \
            in health.stdout, health.stdout
        a.proc.kill()
        killed = time.time()
        a.proc.wait(30)
        [took] = b.wait_message("this ckptd deletes here (etcd, token", timeout=30)
        assert logged_at(took) - killed <= TAKEOVER_BOUND, b.dump()
        assert engine_record(root)["epoch"] > token and engine_record(root)["holder"]["pid"] == b.proc.pid
        ckpts(root, 3)
        b.wait_message("deleted job/checkpoint-2")
    finally:
        stop_all(a, b)
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1"]
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


def test_a_frozen_leader_is_replaced_and_deletes_nothing_when_it_wakes(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: etcd_config(tmp_path, n, root, etcd.endpoints), ETCD_TOOK)
        a.signal(signal.SIGSTOP)
        stopped = time.time()
        wait_stopped(a.proc.pid)
        [took] = b.wait_message("this ckptd deletes here (etcd, token", timeout=30)
        assert logged_at(took) - stopped <= TAKEOVER_BOUND, b.dump()
        # a, frozen, still holds the root's lock: passed over, as its pid alone holds it on this host.
        b.wait_message(f"pid {a.proc.pid}, whose etcd lease ended, still holds the root's lock")
        since = engine_record(root)["since"]
        ckpts(root, 2)
        b.wait_message("deleted job/checkpoint-1")
        ckpts(root, 3)  # a wakes to a checkpoint it would delete if it still led
        mark = a.mark()
        a.signal(signal.SIGCONT)
        a.wait_message("etcd leadership lost", start=mark)
        b.wait_message("deleted job/checkpoint-2")
        a.wait_message("state written", start=mark)
        b.wait_message(f"this ckptd holds the root's lock again ({os.uname().nodename} pid {a.proc.pid} let "
                       "go of it)")
        proc = run_ckptd("prune", "-c", local_config(tmp_path, "cron", root, keep_last=0))
        assert proc.returncode == 75 and f"pid {b.proc.pid} leads {root} by etcd" in proc.stderr, proc.stderr
    finally:
        stop_all(a, b)
    assert all(t < since for _, t in trashed(tmp_path / "a")), a.dump()
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


def test_with_quorum_lost_nobody_deletes_and_one_leads_again_when_it_is_back(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: etcd_config(tmp_path, n, root, etcd.endpoints), ETCD_TOOK)
        for m in etcd.members[1:]:
            m.signal(signal.SIGSTOP)  # two of three: no quorum, the third cannot answer
        a.wait_message("etcd leadership lost", timeout=30)
        ma, mb = a.mark(), b.mark()
        ckpts(root, 2)
        # Longer than a TTL and its margin on both (a state file is written at most once a second):
        # long enough for either to have taken over, were etcd able to elect.
        a.wait_message("state written", start=ma, count=int(D + M) + 2)
        b.wait_message("state written", start=mb, count=int(D + M) + 2)
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2"]
        assert not said(a, "deleted job/") and not said(b, "deleted job/")
        for m in etcd.members[1:]:
            m.signal(signal.SIGCONT)
        either_says((a, b), "deleted job/checkpoint-1")
    finally:
        stop_all(a, b)
        for m in etcd.members:
            m.signal(signal.SIGCONT)
    trashed_by = trashed(tmp_path / "a") + trashed(tmp_path / "b")
    assert [n for n, _ in trashed_by] == ["checkpoint-1"]
    assert listing(root / "job") == ["checkpoint-2"]


# --- the fence, one check at a time: two leaderships in this process, a clock the test drives ---


def pair(root: Path, endpoints: list[str]):
    from ckptd.fleet.etcdlease import EtcdLeadership
    from ckptd.fleet.leaserecord import Holder

    mono = [100.0]
    # Both of this process's pid: the root's lock each takes is this process's, so the second, once
    # etcd let go of the first's key, passes over the first's lock as a frozen leader's
    # (EtcdLeadership._lock_root: held by that leader's pid alone, on this host).
    made = [EtcdLeadership(root, endpoints=endpoints, prefix="/unit/", duration=D, margin=M,
                           holder=Holder("h", os.getpid(), 0.0, f"id{n}"), mono=lambda: mono[0])
            for n in (1, 2)]
    return made[0], made[1], mono


def test_the_fence_asks_etcd_and_refuses_once_the_key_is_not_this_leaders(tmp_path, etcd):  # noqa: F811
    a, b, _mono = pair(tmp_path, etcd.endpoints)
    a.step()
    token = a.current_epoch()
    assert token is not None and a.fence(token) is None
    a.renewing.post("/lease/revoke", {"ID": a.lease_id}, 5)  # its key goes with its lease
    # By its own clock it still leads (no renewal has run to notice): etcd says otherwise.
    assert a.held()
    assert "no longer names this ckptd" in (a.fence(token) or ""), a.fence(token)
    b.step()
    assert b.held() and b.current_epoch() > token
    assert "no longer names this ckptd" in (a.fence(token) or "")
    b.release()


def test_a_keepalive_that_finds_the_lease_gone_stands_the_leader_down(tmp_path, etcd):  # noqa: F811
    """As a leader frozen past its TTL finds it when it runs again (no other leader has written
    the volume's record yet: the keepalive's answer alone says so)."""
    a, _b, _mono = pair(tmp_path, etcd.endpoints)
    a.step()
    assert a.held()
    token = a.current_epoch()
    a.renewing.post("/lease/revoke", {"ID": a.lease_id}, 5)
    a.step()
    assert not a.held() and a.current_epoch() is None
    a.step()  # it stood down, so it may take the free key again, under a later token
    assert a.held() and a.current_epoch() > token
    a.release()


def test_the_fence_refuses_where_the_volume_names_another_token(tmp_path, etcd):  # noqa: F811
    from ckptd.fleet.etcdlease import read_engine_record, write_engine_record

    a, _b, _mono = pair(tmp_path, etcd.endpoints)
    a.step()
    token = a.current_epoch()
    assert a.fence(token) is None
    rec = read_engine_record(tmp_path)
    write_engine_record(tmp_path, {**rec, "epoch": token + 5})  # a later leader's, over another key
    assert "no longer names token" in (a.fence(token) or ""), a.fence(token)
    a.step()  # its renewal reads it too, and stands down
    assert not a.held()
    a.release()


def test_the_fence_refuses_past_the_deadline_by_its_own_clock(tmp_path, etcd):  # noqa: F811
    a, _b, mono = pair(tmp_path, etcd.endpoints)
    a.step()
    token = a.current_epoch()
    mono[0] += D  # no renewal for the TTL, however etcd sees it
    assert "ran out without a renewal" in (a.fence(token) or ""), a.fence(token)
    a.release()


# --- two hosts configured with different backends: neither deletes beside the other ---------------


def test_an_etcd_daemon_beside_a_volume_leader_stands_by_and_says_why(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = b = None
    try:
        a = DaemonProc("-c", node_config(tmp_path, "a", root, duration=D, margin=M))
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        b = DaemonProc("-c", etcd_config(tmp_path, "b", root, etcd.endpoints))
        b.wait_message(f"pid {a.proc.pid} leads {root} under a volume lease (epoch 1): every ckptd that "
                       "deletes in a root must use the same leadership")
        ckpts(root, 3)
        a.wait_message("deleted job/checkpoint-2")
        b.wait_message("state written", start=b.mark())
    finally:
        stop_all(a, b)
    assert trashed(tmp_path / "b") == []
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1", "checkpoint-2"]


def test_a_volume_daemon_beside_an_etcd_leader_stands_by_and_says_why(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = b = None
    try:
        a = DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints))
        a.wait_message("this ckptd deletes here (etcd, token")
        b = DaemonProc("-c", node_config(tmp_path, "b", root, duration=D, margin=M))
        b.wait_message(f"pid {a.proc.pid} leads {root} by etcd (token")
        for _ in range(3):  # past the volume lease's own wait: still standing by
            b.wait_message("state written", start=b.mark(), count=int(D + M) + 1)
        ckpts(root, 3)
        a.wait_message("deleted job/checkpoint-2")
        # Asked before a stops: a stopping etcd leader marks engine.json released, and b then leads.
        assert not said(b, "this ckptd deletes here"), b.dump()
    finally:
        stop_all(a, b)
    assert trashed(tmp_path / "b") == []
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1", "checkpoint-2"]


def test_a_prune_does_not_delete_while_a_daemon_leads_by_etcd_and_does_once_it_stopped(tmp_path, etcd):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = etcd_config(tmp_path, "cron", root, etcd.endpoints, keep_last=1)
    with DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (etcd, token")
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f"pid {a.proc.pid} leads by etcd (token" in proc.stderr, proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    proc = run_ckptd("prune", "-c", cron)  # it stopped and revoked its lease: the key is gone at once
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]


def test_an_etcd_member_frozen_under_the_leader_leaves_one_deleter(tmp_path, etcd):  # noqa: F811
    """The member each daemon asks first (the first endpoint) SIGSTOPped: requests to it time out and
    go to the next; if it was etcd's own leader, the others elect another (and extend the leases).
    Retention goes on, by one daemon at a time. Under load a fence's read can time out on the frozen
    member while the leader goes on leading: the refused rename is tried again after its next
    renewal (Retention._act), not at the next reconcile."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: etcd_config(tmp_path, n, root, etcd.endpoints), ETCD_TOOK)
        etcd.members[0].signal(signal.SIGSTOP)
        ckpts(root, 2)
        either_says((a, b), "deleted job/checkpoint-1")
        ckpts(root, 3)
        either_says((a, b), "deleted job/checkpoint-2")
    finally:
        stop_all(a, b)
        etcd.members[0].signal(signal.SIGCONT)
    by_a, by_b = trashed(tmp_path / "a"), trashed(tmp_path / "b")
    assert sorted(n for n, _ in by_a + by_b) == ["checkpoint-1", "checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


# --- an etcd leader and a ckptd that takes the root's lock (local, prune): one deletes ----------------


def test_a_local_daemon_and_a_local_prune_beside_an_etcd_leader_delete_nothing(tmp_path, etcd):  # noqa: F811
    """The etcd leader holds the root's lock for its tenure (`.ckptd/local.lock` and the directory's
    flock), as a volume lease's leader does; and a local ckptd that finds a live `engine.json`
    says who leads and stands by. Before, both deleted: b trashed checkpoint-2 beside a."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    a = b = None
    try:
        a = DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints, keep_last=2))
        a.wait_message("this ckptd deletes here (etcd, token")
        a.wait_message("deleted job/checkpoint-1")
        b = DaemonProc("-c", local_config(tmp_path, "b", root, keep_last=1))
        b.wait_message(f"pid {a.proc.pid} leads {root} by etcd (token")
        b.wait_message("standby, observing only")
        b.wait_message("decide delete job/checkpoint-2")  # decided; not carried out
        cron = local_config(tmp_path, "cron", root, keep_last=1)
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f"pid {a.proc.pid} leads {root} by etcd (token" in proc.stderr, proc.stderr
        check = run_ckptd("check-config", "-c", cron)
        assert f"pid {a.proc.pid} leads {root} by etcd" in check.stdout + check.stderr, check.stdout
        for d in (a, b):  # a look or two more each, after the prune
            d.wait_message("state written", start=d.mark(), count=2)
        assert listing(root / "job") == ["checkpoint-2", "checkpoint-3"]
        assert not said(b, "this ckptd deletes here"), b.dump()
    finally:
        stop_all(b, a)  # b first: once a has stopped (engine.json marked released), b leads
    assert trashed(tmp_path / "b") == [] and trashed(tmp_path / "cron") == []
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1"]


def test_auto_with_etcd_endpoints_on_one_node_only_leaves_one_deleter(tmp_path, etcd):  # noqa: F811
    """`leadership = "auto"` on both, `CKPTD_ETCD_ENDPOINTS` on one: that one resolves to etcd, the
    other (on a local filesystem) to local. The local one leads first and holds the root's lock:
    the etcd one neither takes the key nor deletes, and says why; an etcd prune is refused too.
    Once the local one stops, the etcd one leads. Before, both deleted.

    The root was led by etcd before, by a ckptd killed since: its `engine.json`, never marked
    released, names a holder whose pid holds no lock, so the local one's lock is not taken for
    that (frozen) leader's and passed over."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    env = {"CKPTD_ETCD_ENDPOINTS": ",".join(etcd.endpoints)}
    cron = local_config(tmp_path, "cron", root, keep_last=1, leadership="auto")
    a = b = None
    try:
        earlier = local_config(tmp_path, "once", root, keep_last=5, leadership="auto")
        with DaemonProc("-c", earlier, env=env) as once:
            once.wait_message("this ckptd deletes here (etcd, token")
            once.proc.kill()
            once.proc.wait(30)
        assert "released" not in engine_record(root)
        a = DaemonProc("-c", local_config(tmp_path, "a", root, keep_last=5, leadership="auto"))
        a.wait_message("leadership=local (auto:")
        a.wait_message("this ckptd deletes here (holds")
        b = DaemonProc("-c", local_config(tmp_path, "b", root, keep_last=1, leadership="auto"), env=env)
        b.wait_message("leadership=etcd (auto: etcd endpoints are configured)")
        held = (f"another ckptd is deleting in {root} (holds {root / '.ckptd' / 'local.lock'}): held by pid "
                f"{a.proc.pid}, neither the lapsed leader's nor a frozen one it passed over: a ckptd with "
                "leadership = \"local\" or a prune deletes here")
        b.wait_message(f"standby, observing only: {held}")
        b.wait_message("decide delete job/checkpoint-1")  # decided; not carried out
        proc = run_ckptd("prune", "-c", cron, env=env)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert held in proc.stderr, proc.stderr
        b.wait_message("state written", start=b.mark(), count=int(D + M) + 2)  # past a TTL: still standing by
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
        assert not said(b, "this ckptd deletes here"), b.dump()
        a.stop()
        b.wait_message("this ckptd deletes here (etcd, token")
        b.wait_message("deleted job/checkpoint-2")
    finally:
        stop_all(a, b)
    assert trashed(tmp_path / "a") == [] and trashed(tmp_path / "cron") == []
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2"]


# --- one root, one key: a volume id made anew or another prefix elect no second leader -------------


def test_a_removed_ckptd_dir_under_an_etcd_leader_makes_no_second_key(tmp_path, etcd):  # noqa: F811
    """`rm -rf <root>/.ckptd` under a live leader: a node that starts then finds no volume id, but
    the leader's lock on the root directory (which the removal cannot take away) says a live
    leader is there, so it makes no new id (a second key, a second leader); the leader writes its
    id and `engine.json` again at its next renewal, and the newcomer stands by under the same
    key. Before, the newcomer led under a new key, and the two took turns at every token."""
    from ckptd.fleet.etcdlease import EtcdLeadership

    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = c = None
    try:
        a = DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints))
        a.wait_message("deleted job/checkpoint-1")
        vid = (root / ".ckptd" / "volume-id").read_text()
        token = engine_record(root)["epoch"]
        mark = a.mark()
        # The removal and a newcomer's first look, with a held still (well within its TTL) so that
        # its renewal cannot write the id back first: the look finds none and makes none.
        a.signal(signal.SIGSTOP)
        wait_stopped(a.proc.pid)
        shutil.rmtree(root / ".ckptd")
        look = EtcdLeadership(root, endpoints=etcd.endpoints, prefix="/test/", duration=D, margin=M)
        look.step()
        a.signal(signal.SIGCONT)
        assert not look.held(), look.blocked
        assert f"pid {a.proc.pid} holds the root's lock" in (look.blocked or ""), look.blocked
        assert "volume-id is missing: not making a new volume id" in (look.blocked or ""), look.blocked
        assert not (root / ".ckptd" / "volume-id").exists()
        c = DaemonProc("-c", etcd_config(tmp_path, "c", root, etcd.endpoints))
        c.wait_message("standby, observing only")
        a.wait_message(f".ckptd/engine.json did not name this ckptd's token {token}: written again",
                       start=mark)
        c.wait_message(f"leads by etcd (token {token}); waiting for its lease to end")
        for step in (3, 4):
            ckpts(root, step)
            a.wait_message(f"deleted job/checkpoint-{step - 1}")
        c.wait_message("state written", start=c.mark(), count=int(D + M) + 2)
        assert not said(c, "this ckptd deletes here"), c.dump()
        assert not said(a, "etcd leadership lost"), a.dump()
        assert (root / ".ckptd" / "volume-id").read_text() == vid
        assert engine_record(root)["epoch"] == token and engine_record(root)["holder"]["pid"] == a.proc.pid
    finally:
        stop_all(c, a)
    assert trashed(tmp_path / "c") == []
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_node_with_another_prefix_stands_by_and_says_why(tmp_path, etcd):  # noqa: F811
    """Two keys for one root from a `[daemon.etcd] prefix` that differs: the root's `engine.json`
    names the leader's key, and a node whose key is another neither takes its own nor deletes
    while that record is live, and says why (as check-config does). Before, each led under its
    own key in turn."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = b = None
    try:
        a = DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints))
        a.wait_message("deleted job/checkpoint-1")
        key = engine_record(root)["key"]
        other = etcd_config(tmp_path, "b", root, etcd.endpoints)
        other.write_text(other.read_text().replace("prefix = '/test/'", "prefix = '/other/'"))
        b = DaemonProc("-c", other)
        b.wait_message(f".ckptd/engine.json names etcd key {key}, outside this ckptd's prefix /other/")
        b.wait_message(f"standby, observing only: the volume's record (.ckptd/engine.json) names etcd key "
                       f"{key}, led by {os.uname().nodename} pid {a.proc.pid}")
        check = run_ckptd("check-config", "-c", other)
        assert f"names etcd key {key}, outside this ckptd's prefix /other/" in check.stdout + check.stderr
        for step in (3, 4):
            ckpts(root, step)
            a.wait_message(f"deleted job/checkpoint-{step - 1}")
        b.wait_message("state written", start=b.mark(), count=int(D + M) + 2)
        assert not said(b, "this ckptd deletes here"), b.dump()
        assert engine_record(root)["key"] == key
    finally:
        stop_all(b, a)
    assert trashed(tmp_path / "b") == []
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_lone_leader_writes_a_removed_engine_record_again(tmp_path, etcd):  # noqa: F811
    """engine.json removed under a lone leader: its fence refuses every rename while the record
    does not name it, so it writes it again at its next renewal and deletes again. Before, it
    never did, and refused every deletion while `status` said it led."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    with DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints)) as a:
        a.wait_message("this ckptd deletes here (etcd, token")
        token = engine_record(root)["epoch"]
        (root / ".ckptd" / "engine.json").unlink()
        a.wait_message(f".ckptd/engine.json did not name this ckptd's token {token}: written again")
        ckpts(root, 2)
        a.wait_message("deleted job/checkpoint-1")
        assert engine_record(root)["epoch"] == token


def test_a_rename_the_fence_refused_is_tried_again_while_this_ckptd_still_leads(tmp_path, etcd):  # noqa: F811
    """A fence that refuses for a while (here: a volume lease's record, live for 3 s, of a host
    configured otherwise; under load, an etcd read that timed out or a renewal late) while this
    ckptd goes on leading: nothing on the volume changes for that, and the pass came back only at
    the next reconcile (5 minutes). It is tried again after the lead's next renewal. Before, the
    frozen-member case failed so under load (nobody deleted within 60 s)."""
    from ckptd.fleet.leaserecord import Holder, Record, RecordIO

    root = tmp_path / "vol"
    ckpts(root, 1)
    with DaemonProc("-c", etcd_config(tmp_path, "a", root, etcd.endpoints)) as a:
        a.wait_message("this ckptd deletes here (etcd, token")
        now = time.time()
        elsewhere = Holder("elsewhere", 1, 0.0, "x" * 32)
        RecordIO(root).write(Record(1, elsewhere, now + 2, now, 0, 2.0, 1.0, since=now))
        ckpts(root, 2)
        a.wait_message("not deleting job/checkpoint-1: not the leader: elsewhere pid 1 leads")
        a.wait_message("deleted job/checkpoint-1")
        assert not said(a, "etcd leadership lost"), a.dump()


def test_check_config_names_etcd_leadership_from_the_environment(tmp_path):
    root = tmp_path / "vol"
    root.mkdir()
    env = {"CKPTD_ROOTS": str(root), "CKPTD_ETCD_ENDPOINTS": "http://127.0.0.1:2379,http://127.0.0.1:2380",
           "CKPTD_STATE_DIR": str(tmp_path / "state")}
    proc = run_ckptd("check-config", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (f"roots[0] {root}: leadership=etcd (auto: etcd endpoints are configured); lease TTL 30s at "
            "http://127.0.0.1:2379, http://127.0.0.1:2380, key prefix /ckptd/") in proc.stdout + proc.stderr


def test_after_a_restart_of_the_whole_etcd_cluster_one_deletes_again(tmp_path, etcd):  # noqa: F811
    """Every member killed and started again on its data: while none answers nobody deletes (the
    leader's deadline passes), and afterwards one leads again, its token above the last."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: etcd_config(tmp_path, n, root, etcd.endpoints), ETCD_TOOK)
        token = engine_record(root)["epoch"]
        for m in etcd.members:
            m.stop()
        a.wait_message("etcd leadership lost", timeout=30)
        for m in etcd.members:
            m.start(etcd.cluster)
        etcd.wait_healthy()
        ckpts(root, 2)
        either_says((a, b), "deleted job/checkpoint-1")
    finally:
        stop_all(a, b)
    assert engine_record(root)["epoch"] > token
    assert [n for n, _ in trashed(tmp_path / "a") + trashed(tmp_path / "b")] == ["checkpoint-1"]
    assert listing(root / "job") == ["checkpoint-2"]
