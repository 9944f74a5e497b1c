"""Many nodes on one volume seen through a FUSE mount that caches (bindfs with kernel_cache and
30-second attribute and entry caches): a standby whose reads of the lease record are stale never
deposes a live leader. Real `ckptd run` processes; the second "host" sees the volume only
through its own FUSE mount. Before, it read the record it saw first for 30 s, took it for
unrenewed and claimed the lease from a healthy leader, again and again.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.leaserecord import RECORD
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.nodes import ckpts, node_config

CACHING = ("kernel_cache", "attr_timeout=30", "entry_timeout=30")


def test_a_standby_on_a_caching_mount_never_deposes_a_live_leader(tmp_path, bindfs):
    root = tmp_path / "vol"
    ckpts(root, 1)
    with DaemonProc("-c", node_config(tmp_path, "a", root)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        seen_by_b = bindfs(root, tmp_path / "vol-b", *CACHING)
        with DaemonProc("-c", node_config(tmp_path, "b", seen_by_b)) as b:
            b.wait_message("standby, observing only")
            b.wait_message("return an older renewal than the directory shows", timeout=60)
            # a renews every D/3: wait, by its record on the volume itself, for five lease
            # durations of renewals; all the while b must not claim.
            first = json.loads((root / LEASE_DIR / RECORD).read_text())["seq"]
            tick = threading.Event()  # never set: a timer between looks at the record
            for _ in range(int(120 / 0.1)):
                if json.loads((root / LEASE_DIR / RECORD).read_text())["seq"] >= first + 15:
                    break
                tick.wait(0.1)
            else:
                raise AssertionError("the leader did not renew 15 times in 120s")
            assert not [m for m in b.lines if "deletes here" in m.get("message", "")], b.dump()
            assert not [m for m in a.lines if "volume lease lost" in m.get("message", "")], a.dump()
    record = json.loads((root / LEASE_DIR / RECORD).read_text())
    assert record["epoch"] == 1 and record["holder"]["pid"] == a.proc.pid  # one tenure all along


def volume_config(tmp: Path, root: Path, extra: str = "") -> Path:
    path = node_config(tmp, "n", root)
    path.write_text(path.read_text().replace("poll_interval = '0.3s'\n", f"poll_interval = '0.3s'\n{extra}\n"))
    return path


def test_check_config_says_what_the_lease_relies_on_where_coherence_is_unknown(tmp_path, bindfs):
    root = tmp_path / "vol"
    root.mkdir()
    fuse = bindfs(root, tmp_path / "vol-b")
    said = run_ckptd("check-config", "-c", volume_config(tmp_path, fuse))
    assert said.returncode == 0, said.stderr
    out = said.stdout + said.stderr
    assert "is fuse: ckptd cannot tell whether a read there sees another host's writes: the volume lease " \
           "relies on renewals being seen there" in out
    assert "set coherent = true where reads are fresh" in out
    said = run_ckptd("check-config", "-c", volume_config(tmp_path, fuse, "coherent = true"))
    assert "ckptd cannot tell whether" not in said.stdout + said.stderr and "never leads" not in said.stdout + said.stderr
    said = run_ckptd("check-config", "-c", volume_config(tmp_path, root))  # ext4: known
    assert "ckptd cannot tell whether" not in said.stdout + said.stderr


def test_a_mount_declared_incoherent_is_never_led(tmp_path, bindfs):
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    fuse = bindfs(root, tmp_path / "vol-b")
    cfg = volume_config(tmp_path, fuse, "coherent = false")
    said = run_ckptd("check-config", "-c", cfg)
    assert "coherent = false: a read of the lease record may not see another host's renewal, so this ckptd " \
           "never leads there" in said.stdout + said.stderr
    with DaemonProc("-c", cfg) as d:
        d.wait_message("standby, observing only: coherent = false")
        d.wait_message("decide delete job/checkpoint-1")  # decided, never carried out
        d.wait_message("state written", start=d.mark())
    assert sorted(p.name for p in (root / "job").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert not (root / LEASE_DIR / RECORD).exists()


def test_both_nodes_on_caching_mounts_one_deleter_through_a_kill_and_a_restart(tmp_path, bindfs):
    """As a user following the docs would set it up: every node through its own caching FUSE
    mount. The leader is killed (-9); the standby takes over; the killed node comes back, its mount
    still caching the record it wrote last, and must stand by rather than take its old epoch for
    unrenewed."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    via_a = bindfs(root, tmp_path / "vol-a", *CACHING)
    via_b = bindfs(root, tmp_path / "vol-b", *CACHING)
    a = DaemonProc("-c", node_config(tmp_path, "a", via_a))
    b = a2 = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("deleted job/checkpoint-1")
        b = DaemonProc("-c", node_config(tmp_path, "b", via_b))
        b.wait_message("standby, observing only")
        a.proc.kill()
        a.proc.wait(30)
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        a2 = DaemonProc("-c", node_config(tmp_path, "a", via_a))
        a2.wait_message("standby, observing only")
        ckpts(root, 3)
        b.wait_message("deleted job/checkpoint-2")
        first = json.loads((root / LEASE_DIR / RECORD).read_text())["seq"]
        tick = threading.Event()  # never set: a timer between looks at the record
        for _ in range(int(120 / 0.1)):
            if json.loads((root / LEASE_DIR / RECORD).read_text())["seq"] >= first + 12:
                break
            tick.wait(0.1)
        else:
            raise AssertionError("the leader did not renew 12 times in 120s")
        assert not [m for m in a2.lines if "deletes here" in m.get("message", "")], a2.dump()
        assert not [m for m in b.lines if "volume lease lost" in m.get("message", "")], b.dump()
    finally:
        for d in (a, a2, b):  # a2 first: b hands the lease back, and a2 must not take it
            if d is not None:
                d.stop()
    record = json.loads((root / LEASE_DIR / RECORD).read_text())
    assert record["epoch"] == 2 and record["released"]  # b's tenure throughout, handed back at the end
    assert sorted(p.name for p in (root / "job").iterdir()) == ["checkpoint-3"]
