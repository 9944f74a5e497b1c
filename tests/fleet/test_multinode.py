"""Many nodes, one volume: real `ckptd run` processes with their own state_dirs.

Two daemons with different state_dirs stand for two hosts: their local locks cannot see each
other, so only the volume lease (lease.py) keeps them to one deleter. Short leases (1.5s,
0.5s margin) keep this to seconds. Every wait is on a daemon's log lines or the lease record
with a deadline; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptd.journal import read_journal
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.nodes import D, M, ckpts, lease_record, listing, logged_at, node_config, trashed


def test_two_nodes_one_deletes_and_a_killed_leader_is_replaced_after_its_lease(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("deleted job/checkpoint-1")
        b = DaemonProc("-c", node_config(tmp_path, "b", root))
        b.wait_message("standby, observing only")
        ckpts(root, 3)
        a.wait_message("deleted job/checkpoint-2")
        a.proc.kill()  # SIGKILL: no release, no last word; the kernel drops its POSIX lock
        a.proc.wait(30)
        final = lease_record(root)  # a's last renewal: nobody else may write before it expires
        assert final["holder"]["pid"] == a.proc.pid and final["epoch"] == 1 and not final["released"]
        b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=30)
        taken = lease_record(root)
        assert taken["holder"]["pid"] == b.proc.pid and taken["epoch"] == 2
        # Not before the expiry plus the margin; within it plus a few of b's looks (every D/3).
        assert final["expires"] + M <= taken["since"] <= final["expires"] + M + 2 * D
        ckpts(root, 4)
        b.wait_message("deleted job/checkpoint-3")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    by_a, by_b = trashed(tmp_path / "a"), trashed(tmp_path / "b")
    assert [n for n, _ in by_a] == ["checkpoint-1", "checkpoint-2"]
    # a may be killed before it purged checkpoint-2: b's purge re-checks that entry, and while
    # checkpoint-3 is not yet complete to b it is the run's newest, so b moves it back (journalled
    # "restored") and deletes it again once checkpoint-3 completes. Anything else b trashed is wrong.
    restored = {Path(r["path"]).name for r in read_journal(tmp_path / "b") if r["event"] == "restored"}
    assert [n for n, _ in by_b if n not in restored] == ["checkpoint-3"]
    assert restored <= {"checkpoint-2"}
    assert all(t <= final["expires"] for _, t in by_a)  # nothing after a's deadline
    assert all(t >= taken["since"] for _, t in by_b)  # nothing before b held the lease
    assert listing(root / "job") == ["checkpoint-4"]
    assert lease_record(root)["released"]  # b stopped cleanly: handed back


@pytest.mark.parametrize("fault", ["EIO", "ESTALE"])
def test_a_leader_whose_renewals_fail_stops_deleting_before_its_lease_can_be_taken(tmp_path, fault):
    """The leader's writes of the lease record fail (injected: tests/support/leasefault.py says why a seam)."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    trigger = tmp_path / "fault"
    a = DaemonProc("-c", node_config(tmp_path, "a", root), command=[sys.executable, "-m", "tests.support.leasefault"],
                   env={"CKPTD_TEST_LEASE_FAULT": str(trigger)})
    b = None
    try:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("deleted job/checkpoint-1")
        b = DaemonProc("-c", node_config(tmp_path, "b", root))
        b.wait_message("standby, observing only")
        trigger.write_text(fault)
        a.wait_message("cannot renew the volume lease")
        last = lease_record(root)  # a can write no more: this is its last successful renewal
        assert last["holder"]["pid"] == a.proc.pid
        [lost] = a.wait_message("volume lease lost")
        ckpts(root, 3)  # now checkpoint-2 is to be deleted: a decides so, but must not act
        b.wait_message("this ckptd deletes here (volume lease, epoch", timeout=30)
        b.wait_message("deleted job/checkpoint-2")
        taken = lease_record(root)
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert logged_at(lost) < taken["since"]  # a stopped before b could take the lease
    assert taken["since"] >= last["expires"] + M
    by_a = trashed(tmp_path / "a")
    assert [n for n, _ in by_a] == ["checkpoint-1"] and all(t < logged_at(lost) for _, t in by_a)
    assert [n for n, _ in trashed(tmp_path / "b")] == ["checkpoint-2"]
    assert listing(root / "job") == ["checkpoint-3"]


def test_prune_on_another_node_does_not_delete_while_a_daemon_leads_the_volume(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = node_config(tmp_path, "cron", root, keep_last=1)  # another node's one-shot prune
    with DaemonProc("-c", node_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.wait_message("state written")
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f"pid {a.proc.pid} holds the volume lease (epoch 1)" in proc.stderr
        assert "is not renewed; waiting" not in proc.stderr  # a live holder's lease is not waited out
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
        status = run_ckptd("status", "-c", tmp_path / "a.toml")
        assert status.returncode == 0, status.stderr
        assert f"leadership: volume lease epoch 1, held by {os.uname().nodename} pid {a.proc.pid} (this ckptd), " \
               "expires in" in status.stdout
        [doc] = json.loads(run_ckptd("status", "-c", tmp_path / "a.toml", "--json").stdout)
        lead = doc["roots"][0]["leadership"]
        assert lead["kind"] == "volume" and lead["held"] and lead["epoch"] == 1 and lead["expires"] > time.time() - D
    # The daemon stopped and handed the lease back: the prune may lead at once.
    proc = run_ckptd("prune", "-c", cron)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]
    assert lease_record(root)["epoch"] == 2 and lease_record(root)["released"]


# --- the attribute cache, read from a captured mountinfo (this kernel has no NFS client) ---------

def nfs_mountinfo(point: Path, options: str) -> str:
    return (
        "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        f"60 22 0:80 / {point} rw,relatime shared:50 - nfs4 srv:/exp rw,vers=4.2,rsize=1048576,"
        f"wsize=1048576,namlen=255,{options}hard,proto=tcp,timeo=600,retrans=2,sec=sys,local_lock=none,addr=10.0.0.1\n"
    )


def mounts_seen(monkeypatch, read) -> None:
    """The mount table the command line reads, in every module of it that reads one: NFS cannot be
    mounted here (no NFS module in this kernel), so its mountinfo lines stand in for one."""
    import importlib
    import pkgutil

    import ckptd.cli

    for info in pkgutil.iter_modules(ckptd.cli.__path__):
        module = importlib.import_module(f"ckptd.cli.{info.name}")
        if hasattr(module, "read_mounts"):
            monkeypatch.setattr(module, "read_mounts", read)


def test_check_config_warns_about_the_attribute_cache_and_names_the_leadership(tmp_path, monkeypatch, capsys):
    from ckptd import cli
    from ckptd.volume.mounts import parse_mountinfo

    ckptd_logger = logging.getLogger("ckptd")  # cli.main installs its own handlers: undone after
    for attr in ("handlers", "propagate", "level"):
        monkeypatch.setattr(ckptd_logger, attr, list(ckptd_logger.handlers) if attr == "handlers" else
                            getattr(ckptd_logger, attr))
    root = tmp_path / "vol"
    root.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 's'}'\n[[roots]]\npath = '{root}'\nquiet_period = '60s'\n")
    mounts_seen(monkeypatch, lambda: parse_mountinfo(nfs_mountinfo(tmp_path, "")))
    assert cli.main(["check-config", "-c", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert f"roots[0] {root}: leadership=volume (auto: {tmp_path} is nfs4)" in err
    assert "POSIX locks: cluster-wide" in err
    assert "acregmax=60s (default), acdirmax=60s (default)" in err and "watched as 120s" in err
    mounts_seen(monkeypatch, lambda: parse_mountinfo(nfs_mountinfo(tmp_path, "acregmin=0,"
                                                                                  "acregmax=0,acdirmin=0,acdirmax=0,noac,")))
    assert cli.main(["check-config", "-c", str(cfg)]) == 0
    assert "watched as" not in capsys.readouterr().err  # noac: nothing cached, nothing to add


@pytest.mark.asyncio
async def test_the_daemon_watches_quiet_for_longer_on_a_caching_mount_and_says_so(tmp_path, monkeypatch, caplog):
    from ckptd.config import load_config
    from ckptd.daemon import Daemon, roots
    from ckptd.volume.mounts import parse_mountinfo

    root = tmp_path / "vol"
    ckpts(root, 1)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 's'}'\nleadership = 'local'\n"
                   f"[[roots]]\npath = '{root}'\nquiet_period = '2s'\nallow_short_quiet_period = true\nworld_size = 2\n")
    captured = parse_mountinfo(nfs_mountinfo(tmp_path, "acregmin=5,acregmax=5,acdirmin=5,acdirmax=5,"))
    monkeypatch.setattr(roots, "read_mounts", lambda: captured)
    d = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(d.serve())
    try:
        await asyncio.wait_for(d.ready.wait(), 30)
        [r] = d.state()["roots"]
        assert (r["quiet_period"], r["effective_quiet_period"]) == (2.0, 7.0)
        assert "caches attributes up to 5s" in r["attribute_cache"]
        assert d.roots[0].tracker.settler.quiet_period == 7.0  # what settling actually waits for
        assert any("quiet_period 2s is watched as 7s" in m for m in caplog.messages)
    finally:
        d.request_stop("test")
        await asyncio.wait_for(task, 30)


def test_plan_and_prune_go_by_the_effective_quiet_period(tmp_path, monkeypatch, capsys):
    """Last written 90s ago, quiet_period 60s: complete on a local disk, not yet on a default NFS
    mount (60s of attribute cache: watched as 120s)."""
    from ckptd import cli
    from ckptd.cli.demo_volume import age
    from ckptd.volume.mounts import parse_mountinfo

    ckptd_logger = logging.getLogger("ckptd")
    monkeypatch.setattr(ckptd_logger, "handlers", list(ckptd_logger.handlers))
    monkeypatch.setattr(ckptd_logger, "propagate", ckptd_logger.propagate)
    monkeypatch.setattr(ckptd_logger, "level", ckptd_logger.level)
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    for step in (1, 2):
        age(root / "job" / f"checkpoint-{step}", time.time() - 90)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 's'}'\nleadership = 'local'\n[[roots]]\npath = '{root}'\n"
                   "quiet_period = '60s'\nworld_size = 2\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")

    def plan() -> dict[str, str]:
        assert cli.main(["plan", "-c", str(cfg), "--json"]) == 0
        return {Path(c["path"]).name: c["state"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}

    assert plan() == {"checkpoint-1": "complete", "checkpoint-2": "complete"}  # this disk: ext4
    mounts_seen(monkeypatch, lambda: parse_mountinfo(nfs_mountinfo(tmp_path, "")))
    assert plan() == {"checkpoint-1": "writing", "checkpoint-2": "writing"}
    assert cli.main(["prune", "-c", str(cfg)]) == 0
    out = capsys.readouterr()
    assert "quiet_period 60s is watched as 120s" in out.err and "prune: 0 deleted" in out.out
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2"]


def test_prune_takes_over_a_dead_daemons_lease_only_after_watching_it_unrenewed(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    # A lease long enough that the first prune surely starts inside it, on a loaded machine too.
    d, m = 5.0, 1.0
    with DaemonProc("-c", node_config(tmp_path, "a", root, keep_last=5, duration=d, margin=m)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        a.proc.kill()
        a.proc.wait(30)
    final = lease_record(root)
    cron = node_config(tmp_path, "cron", root, keep_last=1, duration=d, margin=m)
    proc = run_ckptd("prune", "-c", cron)  # straight after: the lease has not expired
    assert time.time() < final["expires"], "the first prune came too late to test the refusal"
    assert proc.returncode == 75 and "holds the volume lease (epoch 1), renewed" in proc.stderr
    expired = threading.Event()  # a clock condition, not another process: wait until it holds
    while time.time() <= final["expires"] + m:
        expired.wait(0.05)
    proc = run_ckptd("prune", "-c", cron)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the volume lease is not renewed; waiting up to 6s" in proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]
    taken = lease_record(root)
    assert taken["epoch"] == 2 and taken["released"] and taken["since"] >= final["expires"] + m + d
