"""Leadership by a Kubernetes Lease (`leadership = "kubernetes"`, kubelease.py): real `ckptd run`
processes, elected through a FAKE API server (tests/support/fakekube.py: no real one can be
installed here; it serves Leases over HTTP on 127.0.0.1 with resourceVersion conflicts as the API
server does), reached through a kubeconfig the test writes; the token fenced on the volume too.
Two "hosts" with their own state_dirs, as in test_etcd.

The same cases run against a real cluster where CKPTD_TEST_KUBECONFIG names a kubeconfig
(test_kubernetes_real.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.fakekube import FakeKube
from tests.support.fleet import KUBE_TOOK as TOOK
from tests.support.fleet import (  # noqa: F401 (kube: the fixture)
    D,
    M,
    either_says,
    engine_record,
    kube,
    kube_config,
    leader_and_standby,
    local_config,
    said,
    stop_all,
)
from tests.support.nodes import ckpts, listing, logged_at, trashed, wait_stopped

pytest.importorskip("lightkube", reason="needs lightkube (the kubernetes extra)")

TAKEOVER_BOUND = D + M + 2.0  # the stop to the takeover's log line (issue 35's target)


def the_lease(kube: FakeKube, root: Path) -> dict:  # noqa: F811 (the fixture's value)
    """The spec of `root`'s Lease (ckptd-<its volume id>), as the API server holds it."""
    lease = kube.lease(f"ckptd-{(root / '.ckptd' / 'volume-id').read_text().strip()}")
    assert lease is not None
    return lease["spec"]


def test_one_deletes_and_a_killed_leader_is_replaced_with_the_next_token(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: kube_config(tmp_path, n, root, kube.kubeconfig), TOOK)
        a.wait_message("deleted job/checkpoint-1")
        lease = the_lease(kube, root)
        assert lease["leaseTransitions"] == 0 and lease["holderIdentity"].split("_")[-2] == str(a.proc.pid), \
            (lease, a.dump(), b.dump())
        assert engine_record(root)["epoch"] == 0 and engine_record(root)["holder"]["pid"] == a.proc.pid
        assert engine_record(root)["key"] == f"{kube.namespace}/ckptd-{(root / '.ckptd' / 'volume-id').read_text().strip()}"
        status = run_ckptd("status", "-c", tmp_path / "b.toml")
        assert f"leadership: kubernetes Lease {kube.namespace}/ckptd-" in status.stdout, status.stdout
        assert f"token 0, held by {os.uname().nodename} pid {a.proc.pid}, taken" in status.stdout, status.stdout
        health = run_ckptd("health", "-c", tmp_path / "b.toml")
        assert health.returncode == 0, health.stdout
        assert f"standby at {root}, led by {os.uname().nodename} pid {a.proc.pid} (kubernetes lease since" \
            in health.stdout, health.stdout
        a.proc.kill()
        killed = time.time()
        a.proc.wait(30)
        [took] = b.wait_message(TOOK, timeout=30)
        assert logged_at(took) - killed <= TAKEOVER_BOUND, b.dump()
        lease = the_lease(kube, root)
        assert lease["leaseTransitions"] == 1 and lease["holderIdentity"].split("_")[-2] == str(b.proc.pid)
        assert engine_record(root)["epoch"] == 1 and engine_record(root)["holder"]["pid"] == b.proc.pid
        ckpts(root, 3)
        b.wait_message("deleted job/checkpoint-2")
    finally:
        stop_all(a, b)
    assert [n for n, _ in trashed(tmp_path / "a")] == ["checkpoint-1"]
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


def test_a_frozen_leader_is_replaced_and_deletes_nothing_when_it_wakes(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: kube_config(tmp_path, n, root, kube.kubeconfig), TOOK)
        a.signal(signal.SIGSTOP)
        stopped = time.time()
        wait_stopped(a.proc.pid)
        [took] = b.wait_message(TOOK, timeout=30)
        assert logged_at(took) - stopped <= TAKEOVER_BOUND, b.dump()
        assert the_lease(kube, root)["leaseTransitions"] == 1
        since = engine_record(root)["since"]
        ckpts(root, 2)
        b.wait_message("deleted job/checkpoint-1")
        ckpts(root, 3)  # a wakes to a checkpoint it would delete if it still led
        mark = a.mark()
        a.signal(signal.SIGCONT)
        a.wait_message("Kubernetes leadership lost", start=mark)
        b.wait_message("deleted job/checkpoint-2")
        a.wait_message("state written", start=mark)
    finally:
        stop_all(a, b)
    assert all(t < since for _, t in trashed(tmp_path / "a")), a.dump()
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-1", "checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_with_the_api_server_gone_nobody_deletes_and_one_leads_again_when_it_is_back(tmp_path, kube, how):  # noqa: F811
    """Killed: connections refused. Frozen (SIGSTOP): requests hang until their timeout, as behind
    a partition."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = b = None
    try:
        a, b = leader_and_standby(lambda n: kube_config(tmp_path, n, root, kube.kubeconfig), TOOK)
        if how == "killed":
            kube.stop()
        else:
            kube.signal(signal.SIGSTOP)
        a.wait_message("Kubernetes leadership lost", timeout=30)
        ma, mb = a.mark(), b.mark()
        ckpts(root, 2)
        # Longer than a lease and its margin on both (a state file is written at most once a second):
        # long enough for either to have taken over, were the API server there to ask.
        a.wait_message("state written", start=ma, count=int(D + M) + 2)
        b.wait_message("state written", start=mb, count=int(D + M) + 2)
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2"]
        assert not said(a, "deleted job/") and not said(b, "deleted job/")
        if how == "killed":
            kube.start()  # the same port, the same store
        else:
            kube.signal(signal.SIGCONT)
        either_says((a, b), "deleted job/checkpoint-1")
    finally:
        stop_all(a, b)
    assert [n for n, _ in trashed(tmp_path / "a") + trashed(tmp_path / "b")] == ["checkpoint-1"]
    assert listing(root / "job") == ["checkpoint-2"]


def test_a_prune_does_not_delete_while_a_daemon_holds_the_lease_and_does_once_it_stopped(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = kube_config(tmp_path, "cron", root, kube.kubeconfig, keep_last=1)
    with DaemonProc("-c", kube_config(tmp_path, "a", root, kube.kubeconfig, keep_last=5)) as a:
        a.wait_message(TOOK)
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f"pid {a.proc.pid} holds the Lease {kube.namespace}/ckptd-" in proc.stderr, proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert the_lease(kube, root)["holderIdentity"] == ""  # handed back as it stopped: no wait for it to expire
    proc = run_ckptd("prune", "-c", cron)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]
    assert the_lease(kube, root)["leaseTransitions"] == 1


def test_a_prune_after_a_killed_holder_watches_its_lease_lapse_then_deletes(tmp_path, kube):  # noqa: F811
    """The holder's renewTime is another host's clock: the prune watches the Lease go unrenewed for
    the duration plus the margin by its own, then takes it (one token on) and deletes."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    with DaemonProc("-c", kube_config(tmp_path, "a", root, kube.kubeconfig, keep_last=5)) as a:
        a.wait_message(TOOK)
        a.proc.kill()
        a.proc.wait(30)
    assert the_lease(kube, root)["holderIdentity"].split("_")[-2] == str(a.proc.pid)  # not handed back
    started = time.monotonic()
    proc = run_ckptd("prune", "-c", kube_config(tmp_path, "cron", root, kube.kubeconfig, keep_last=1))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started >= D + M
    assert f"pid {a.proc.pid} holds the Lease" in proc.stderr and f"watching it for up to {D + M:g}s" in proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]
    assert the_lease(kube, root)["leaseTransitions"] == 1


def test_check_config_says_where_the_lease_is_and_run_refuses_without_a_kubeconfig(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    root.mkdir()
    proc = run_ckptd("check-config", "-c", kube_config(tmp_path, "a", root, kube.kubeconfig))
    assert proc.returncode == 0, proc.stderr
    assert (f"roots[0] {root}: leadership=kubernetes (configured (") in proc.stdout + proc.stderr
    assert "Lease <the pod's or context's namespace>/ckptd-<volume id>, 2s + 1s margin" in proc.stdout + proc.stderr
    missing = kube_config(tmp_path, "b", root, tmp_path / "nowhere")
    env = {"HOME": str(tmp_path), "KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": ""}
    proc = run_ckptd("run", "--foreground", "-c", missing, env=env)
    assert proc.returncode == 78, proc.stderr
    assert f"daemon.kubernetes.kubeconfig: {tmp_path / 'nowhere'} does not exist" in proc.stderr, proc.stderr


# --- one check at a time: two leaderships in this process, a clock the test drives ------------------


def pair(root: Path, kubeconfig: Path):
    from ckptd.fleet.kubelease import KubeLeadership
    from ckptd.fleet.leaserecord import Holder

    # This host and process, as a process frozen here would show in the lock table: each takes the
    # root's lock over the lapsed holder's (kubelease._take_root_lock).
    mono = [100.0]
    made = [KubeLeadership(root, duration=D, margin=M, kubeconfig=kubeconfig, mono=lambda: mono[0],
                           holder=Holder(socket.gethostname(), os.getpid(), 0.0, f"id{n}")) for n in (1, 2, 3)]
    return made, mono


def test_the_fence_asks_the_api_server_and_refuses_once_the_lease_is_not_this_leaders(tmp_path, kube):  # noqa: F811
    (a, b, _c), mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    token = a.current_epoch()
    assert token == 0 and a.fence(token) is None
    b.step()  # watches it from now
    mono[0] += D + M  # by b's clock, unrenewed for the duration and the margin: b takes it
    b.step()
    assert b.held() and b.current_epoch() == 1
    mono[0] -= D + M  # a's own deadline has not passed (a frozen clock, a slow renewal)
    assert a.held()
    assert "no longer names this ckptd at token 0" in (a.fence(token) or ""), a.fence(token)
    a.step()  # its renewal finds the other holder and stands it down
    assert not a.held()


def test_the_fence_refuses_where_the_volume_names_another_token(tmp_path, kube):  # noqa: F811
    from ckptd.fleet.leaserecord import read_engine_record, write_engine_record

    (a, _b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    token = a.current_epoch()
    assert a.fence(token) is None
    rec = read_engine_record(tmp_path)
    write_engine_record(tmp_path, {**rec, "epoch": token + 5})  # a later leader's of this Lease
    assert "no longer names token" in (a.fence(token) or ""), a.fence(token)
    a.step()  # its renewal reads it too, and stands down
    assert not a.held()


def test_the_fence_refuses_past_the_deadline_by_its_own_clock(tmp_path, kube):  # noqa: F811
    (a, _b, _c), mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    token = a.current_epoch()
    mono[0] += D  # no renewal for the duration, whatever the API server holds
    assert "ran out without a renewal" in (a.fence(token) or ""), a.fence(token)


def test_expiry_is_judged_by_this_processs_monotonic_clock_never_by_the_holders_renew_time(tmp_path, kube):  # noqa: F811
    """The holder's renewTime is its wall clock: an hour behind ours (skew), the Lease still is not
    taken before this process has itself seen it unchanged for the duration and the margin; an hour
    ahead, it is taken once it has."""
    from ckptd.fleet.kubelease import parse_micro

    (a, b, c), mono = pair(tmp_path, kube.kubeconfig)
    a.wall = lambda: time.time() - 3600
    a.step()
    assert a.held()
    b.step()  # first look: the renewTime an hour old means nothing yet
    assert not b.held() and "unchanged for 0.0s" in (b.blocked or ""), b.blocked
    mono[0] += D + M - 0.1
    b.step()
    assert not b.held(), "taken before it was seen unrenewed for duration + margin"
    mono[0] += 0.1
    b.step()
    assert b.held() and b.current_epoch() == 1
    b.wall = lambda: time.time() + 3600  # now the holder's clock runs an hour ahead
    b.step()  # renews: renewTime an hour in our future
    assert b.seen is not None and parse_micro(b.seen["renewTime"]) > time.time() + 1800
    c.step()
    mono[0] += D + M
    c.step()
    assert c.held() and c.current_epoch() == 2


def test_of_two_standbys_that_decide_at_once_the_api_server_lets_one_win(tmp_path, kube):  # noqa: F811
    """Both read the expired Lease at one resourceVersion; the second's update is refused (409)."""
    (a, b, c), mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    b.step()
    c.step()
    mono[0] += D + M
    stale = c.renewing.get(c.name)  # c's read, before b writes
    b.step()
    assert b.held()
    real_get = c.renewing.get
    c.renewing.get = lambda name: stale  # c acts on what it read before b's update landed
    c.step()
    c.renewing.get = real_get
    assert not c.held() and "wrote the Lease" in (c.blocked or "") and "modified" in (c.blocked or ""), c.blocked
    lease = the_lease(kube, tmp_path)
    assert lease["holderIdentity"] == b.identity and lease["leaseTransitions"] == 1


def test_a_lease_made_afresh_never_gives_a_token_below_the_volumes(tmp_path, kube):  # noqa: F811
    """Deleted and made again, a Lease starts at leaseTransitions 0: the token stays above the one
    the volume records, so a fence bound to an earlier tenure can never match again."""
    (a, b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    token = a.current_epoch()
    a.release()
    store = kube.store()
    kube.stop()
    store["leases"] = {}
    kube.state.write_text(json.dumps(store))
    kube.start()
    b.kubeconfig = a.kubeconfig
    b.step()
    assert b.held() and b.current_epoch() == token + 1
    assert the_lease(kube, tmp_path)["leaseTransitions"] == token + 1


# --- the shipped sidecar's RBAC ----------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
VERBS = {"GET": "get", "POST": "create", "PUT": "update"}  # the API server's verb for each method


def test_the_sidecars_role_grants_every_call_ckptd_makes_on_leases_and_nothing_more(tmp_path, kube):  # noqa: F811
    """The calls are those a whole tenure makes against the API server (made here, counted by it):
    made, taken, renewed, fenced, handed back, taken again by another."""
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (the test extra)")
    docs = list(yaml.safe_load_all((REPO / "k8s" / "ckptd-sidecar.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "Role"]
    [binding] = [d for d in docs if d["kind"] == "RoleBinding"]
    [account] = [d for d in docs if d["kind"] == "ServiceAccount"]
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account["metadata"]["name"])]
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert pod["spec"].get("automountServiceAccountToken", True) is True
    [ckptd] = [c for c in pod["spec"]["initContainers"] if c["name"] == "ckptd"]
    assert {e["name"]: e["value"] for e in ckptd["env"]}["CKPTD_LEADERSHIP"] == "kubernetes"
    installs = [line for line in (REPO / "Dockerfile").read_text().splitlines() if "pip install '." in line]
    assert installs and all("kubernetes" in line for line in installs), installs

    (a, b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    b.step()
    a.step()
    assert a.fence(a.current_epoch()) is None
    a.release()
    b.step()
    assert b.held()
    used = {VERBS[method] for method in kube.store()["requests"]}
    [rule] = role["rules"]  # one rule: leases alone
    assert rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
    assert used == set(rule["verbs"]) == {"get", "create", "update"}, (used, rule)


def test_a_whole_second_goes_out_with_the_six_fraction_digits_the_api_server_parses(tmp_path, kube):  # noqa: F811
    """apimachinery parses a MicroTime with RFC3339Micro: "…:05Z" is refused (400), as the fake does."""
    (a, _b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.wall = lambda: 1796676000.0
    a.step()
    assert a.held(), a.error or a.blocked
    assert the_lease(kube, tmp_path)["renewTime"].endswith(".000001Z")


def test_a_second_lease_for_the_same_root_is_not_taken_beside_a_live_one(tmp_path, kube):  # noqa: F811
    """Two pods configured with different lease_names: the one that finds the volume's record
    naming the other Lease, renewed, stands by and says why."""
    from ckptd.fleet.kubelease import KubeLeadership
    from ckptd.fleet.leaserecord import Holder

    (a, _b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    assert a.held()
    other = KubeLeadership(tmp_path, duration=D, margin=M, kubeconfig=kube.kubeconfig, lease_name="another",
                           holder=Holder("h", 9, 0.0, "id9"))
    other.step()
    assert not other.held() and f"leads {tmp_path} by kubernetes (token 0)" in (other.blocked or ""), other.blocked
    assert a.fence(a.current_epoch()) is None


def test_a_renewal_that_finds_another_holder_stands_down_before_the_volume_says_so(tmp_path, kube):  # noqa: F811
    """The new holder took the Lease and has not written the volume's record yet (frozen between
    the two, or not a ckptd): the Lease alone says so, and the old leader stands down."""
    from ckptd.fleet.kubelease import KubeApi, kube_source

    (a, _b, _c), _mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    assert a.held()
    api = KubeApi(kube_source(kube.kubeconfig), None, 5.0)
    lease = api.get(a.name)
    assert lease is not None
    api.replace({**lease, "spec": {**lease["spec"], "holderIdentity": "elsewhere_7_x", "leaseTransitions": 1}})
    a.step()
    assert not a.held() and a.current_epoch() is None


def test_every_take_moves_leasetransitions_on_even_with_no_record_on_the_volume(tmp_path, kube):  # noqa: F811
    """client-go's rule, which other readers of the Lease count on: one up at every change of holder,
    whatever the volume holds (here its record is gone)."""
    (a, b, _c), mono = pair(tmp_path, kube.kubeconfig)
    a.step()
    b.step()
    (tmp_path / ".ckptd" / "engine.json").unlink()
    mono[0] += D + M
    b.step()
    assert b.held() and b.current_epoch() == 1
    assert the_lease(kube, tmp_path)["leaseTransitions"] == 1


# --- the root's own lock: a Lease's holder and a `local` ckptd exclude each other -----------------


def test_a_local_prune_does_not_delete_while_a_lease_holder_deletes_there(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = local_config(tmp_path, "cron", root, keep_last=1)
    with DaemonProc("-c", kube_config(tmp_path, "a", root, kube.kubeconfig, keep_last=5)) as a:
        a.wait_message(TOOK)
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        # Refused by the live engine record (engine.json names the Lease's holder), which a local
        # ckptd reads before it takes the root's lock; the lock the holder keeps refuses it too.
        assert f"leads {root} by kubernetes" in proc.stderr, proc.stderr
        assert 'this ckptd has leadership = "local"' in proc.stderr, proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # Marked released as it stopped: a local ckptd need not wait for the record to go stale (which a
    # slow enough prune start would hide).
    assert engine_record(root)["released"] is True
    proc = run_ckptd("prune", "-c", cron)  # the holder gone (its record released), the lock with it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]


def test_a_lease_is_not_taken_while_a_local_ckptd_deletes_there(tmp_path, kube):  # noqa: F811
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    with DaemonProc("-c", local_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (holds")
        proc = run_ckptd("prune", "-c", kube_config(tmp_path, "cron", root, kube.kubeconfig, keep_last=1))
        assert proc.returncode == 75, proc.stdout + proc.stderr
        # The rule etcd's leader follows too (locks.take_root_lock): the holder named by the lock table.
        assert (f"another ckptd is deleting in {root} (holds {root / '.ckptd' / 'local.lock'}): held by pid "
                f"{a.proc.pid}, neither the lapsed leader's nor a frozen one it passed over: a ckptd with "
                'leadership = "local" or a prune deletes here') in proc.stderr, proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
        assert kube.lease(f"ckptd-{(root / '.ckptd' / 'volume-id').read_text().strip()}") is None
