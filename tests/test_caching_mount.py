"""Many nodes on one volume seen through a FUSE mount that caches (bindfs with kernel_cache and
30-second attribute and entry caches): a standby whose reads of the lease record are stale never
deposes a live leader. Real `ckptd run` processes; the second "host" sees the volume only
through its own FUSE mount. Before, it read the record it saw first for 30 s, took it for
unrenewed and claimed the lease from a healthy leader, again and again.
"""

from __future__ import annotations

import json
import threading

from ckptd.layouts import LEASE_DIR
from ckptd.lease import RECORD

from daemonproc import DaemonProc
from test_multinode import ckpts, node_config

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
