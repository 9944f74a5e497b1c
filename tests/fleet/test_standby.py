"""A standby for a volume lease watches the lease closely and the volume loosely: no polls,
a full scan at each reconcile, and a catch-up scan at takeover before its first deletion.
Real `ckptd run` processes, two "hosts" (their own state_dirs) as in test_multinode.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.nodes import D, ckpts, lease_record, listing, node_config


def at(line: dict) -> float:
    return datetime.fromisoformat(line["time"]).timestamp()


def test_a_standby_does_not_track_the_volume_and_catches_up_before_its_first_deletion(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("deleted job/checkpoint-1")
        cfg = node_config(tmp_path, "b", root)
        # As on a network filesystem: polling (inotify does not see other hosts' writes).
        cfg.write_text(cfg.read_text().replace("poll_interval = '0.3s'\n", "poll_interval = '0.3s'\n"
                                               "reconcile_interval = '1h'\nobserver = 'polling'\n"))
        b = DaemonProc("-c", cfg)
        b.wait_message("standby, observing only")
        b.wait_message("job/checkpoint-2: complete")  # its start-up scan
        ckpts(root, 3)
        a.wait_message("deleted job/checkpoint-2")
        mark = b.mark()
        b.wait_message("state written", start=mark)  # b ticked since, and
        assert not [m for m in b.lines if "checkpoint-3" in m.get("message", "")], b.dump()  # never looked
        a.proc.kill()
        a.proc.wait(30)
        ckpts(root, 4)
        [took] = b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        [seen] = b.wait_message("job/checkpoint-4: complete")
        [deleted] = b.wait_message("deleted job/checkpoint-3")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert at(took) <= at(seen) <= at(deleted)
    assert listing(root / "job") == ["checkpoint-4"]
    print(f"takeover to first enforced deletion: {at(deleted) - at(took):.2f}s")


def liveness_probe() -> list[str]:
    """The shipped Kubernetes sidecar's liveness probe, as its manifest has it."""
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (the test extra)")
    docs = yaml.safe_load_all((REPO / "k8s" / "ckptd-sidecar.yaml").read_text())
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    [ckptd] = [c for c in pod["spec"]["initContainers"] if c["name"] == "ckptd"]
    return ckptd["livenessProbe"]["exec"]["command"]


def renewed(root: Path, n: int, timeout: float = 30) -> dict:
    """Until the lease record on the volume shows `n` more renewals (or another epoch), bounded."""
    first = lease_record(root)
    tick = threading.Event()  # never set: a timer between looks at the record
    deadline = time.monotonic() + timeout
    while (now := lease_record(root))["epoch"] == first["epoch"] and now["seq"] < first["seq"] + n:
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {n} renewals of epoch {first['epoch']}")
        tick.wait(0.05)
    return now


@contextlib.contextmanager
def leader_and_loose_standby(tmp_path: Path, extra: str = ""):
    """A leader `a` and a standby `b` on one volume of one checkpoint, b's reconcile an hour away
    (`extra`: more of b's config); yields (root, b's config, a, b), both stopped after."""
    root = tmp_path / "vol"
    ckpts(root, 1)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        cfg = node_config(tmp_path, "b", root)
        cfg.write_text(cfg.read_text().replace("poll_interval = '0.3s'\n", "poll_interval = '0.3s'\n"
                                               "reconcile_interval = '1h'\n" + extra))
        b = DaemonProc("-c", cfg)
        b.wait_message("standby, observing only")
        yield root, cfg, a, b
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_the_liveness_probe_finds_a_standby_healthy_lease_period_after_lease_period(tmp_path):
    """The sidecar's probe (`ckptd health`) against a live standby, once a lease period for eight
    periods, then after the leader is killed and the standby takes over. Its limit scaled with the
    lease (the probe's 30 s to twice the test's 1.5 s duration); the standby's reconcile put off
    for an hour, as a standby looks at the volume loosely."""
    probe = liveness_probe()
    assert probe[0] == "ckptd"
    with leader_and_loose_standby(tmp_path) as (root, cfg, a, b):
        for _ in range(8):
            renewed(root, 3)  # one lease period of the leader's renewals
            proc = run_ckptd(*probe[1:], "-c", cfg, "--max-age", f"{2 * D:g}")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout.startswith(f"healthy: pid {b.proc.pid}, heartbeat "), proc.stdout
            assert (f"; standby at {root}, led by {os.uname().nodename} pid {a.proc.pid} (volume lease since "
                    in proc.stdout), proc.stdout
            assert "waiting for the lease to go unrenewed" in proc.stdout, proc.stdout
        a.proc.kill()
        a.proc.wait(30)
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)")
        renewed(root, 3)
        proc = run_ckptd(*probe[1:], "-c", cfg, "--max-age", f"{2 * D:g}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "standby" not in proc.stdout, proc.stdout
        status = run_ckptd("status", "-c", cfg)  # who leads, on which backend, since when
        assert re.search(rf"leadership: volume lease epoch 2, held by {re.escape(os.uname().nodename)} pid "
                         rf"{b.proc.pid} \(this ckptd\), expires in \d+s, taken \d+s ago", status.stdout), status.stdout


def test_a_standby_on_a_polled_root_keeps_its_heartbeat_fresh(tmp_path):
    """On a polled root (a network filesystem: no inotify) nothing from the volume wakes a standby
    and its reconcile is an hour away: it steps every poll all the same, so the heartbeat the
    liveness probe reads stays fresh for lease period after lease period."""
    probe = liveness_probe()
    with leader_and_loose_standby(tmp_path, "observer = 'polling'\n") as (root, cfg, _, b):
        for _ in range(3):
            renewed(root, 3)  # one lease period of the leader's renewals
            proc = run_ckptd(*probe[1:], "-c", cfg, "--max-age", f"{2 * D:g}")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout.startswith(f"healthy: pid {b.proc.pid}, heartbeat "), proc.stdout
