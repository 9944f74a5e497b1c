"""`ckptd health`: the verdict from the daemon's state file (a running daemon is in test_metrics.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptd.daemon.health import judge
from tests.support.common import run_ckptd

NOW = 1_800_000_000.0
STATE = Path("/var/lib/ckptd")


def doc(pid: int = 123, age: float = 4, roots: tuple[str, ...] = ("/vol",), poll: float = 10) -> dict:
    return {"pid": pid, "heartbeat": NOW - age, "dry_run": False,
            "roots": [{"path": r, "poll_interval": poll} for r in roots]}


def standby() -> dict:
    d = doc()
    d["roots"][0].update(role="standby", leadership={
        "kind": "volume", "holder": {"host": "n7", "pid": 9}, "since": NOW - 60, "released": False,
        "waiting": "waiting for the lease to go unrenewed for 40s (unchanged for 3.0s)"})
    return d


@pytest.mark.parametrize(
    ("docs", "kw", "healthy", "line"),
    [
        ([doc()], {}, True, "healthy: pid 123, heartbeat 4s ago (max 30s)"),
        ([doc(age=312)], {}, False, "unhealthy: pid 123, heartbeat 5m12s ago (max 30s)"),
        # the limit is 3 poll intervals when that is longer than 30 s
        ([doc(age=100, poll=60)], {}, True, "healthy: pid 123, heartbeat 1m40s ago (max 3m0s)"),
        ([doc(age=100)], {"max_age": 60}, False, "unhealthy: pid 123, heartbeat 1m40s ago (max 1m0s)"),
        ([], {}, False, "unhealthy: no ckptd state file in /var/lib/ckptd"),
        # a standby is healthy by its heartbeat, and says who leads and what it waits for
        ([standby()], {}, True,
         "healthy: pid 123, heartbeat 4s ago (max 30s); standby at /vol, led by n7 pid 9 (volume lease since "
         "1m0s ago): waiting for the lease to go unrenewed for 40s (unchanged for 3.0s)"),
        ([], {"dead_pids": [77]}, False, "unhealthy: no ckptd is running (state file in /var/lib/ckptd of pid 77, gone)"),
        # the freshest of several daemons decides
        ([doc(pid=1, age=500), doc(pid=2, age=1)], {}, True, "healthy: pid 2, heartbeat 1s ago (max 30s)"),
        # with roots configured, only a daemon for one of them counts
        ([doc(roots=("/other",))], {"roots": [Path("/vol")]}, False,
         "unhealthy: no ckptd is running for /vol (pid 123 runs others)"),
        ([doc(pid=1, roots=("/other",)), doc(pid=2, age=200)], {"roots": [Path("/vol")]}, False,
         "unhealthy: pid 2, heartbeat 3m20s ago (max 30s)"),
        # a wall clock stepped back is not an error
        ([doc(age=-5)], {}, True, "healthy: pid 123, heartbeat 0s ago (max 30s)"),
    ],
)
def test_judge(docs, kw, healthy, line):
    assert judge(docs, now=NOW, state_dir=STATE, **kw) == (healthy, line)


def write_state(state_dir: Path, heartbeat: float, pid: int | None = None) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    pid = pid or os.getpid()  # this test process: alive while `ckptd health` runs
    doc = {"pid": pid, "version": "x", "heartbeat": heartbeat, "started": heartbeat, "dry_run": False,
           "counters": {}, "roots": [{"path": "/vol", "poll_interval": 10.0}]}
    (state_dir / f"daemon.{pid}.json").write_text(json.dumps(doc))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '/vol'\n")
    return path


def test_health_fresh(tmp_path, config):
    write_state(tmp_path / "state", time.time())
    proc = run_ckptd("health", "-c", config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"healthy: pid {os.getpid()}, heartbeat ") and proc.stdout.endswith("(max 30s)\n")


def test_health_stale(tmp_path, config):
    write_state(tmp_path / "state", time.time() - 312)
    proc = run_ckptd("health", "-c", config)
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"unhealthy: pid {os.getpid()}, heartbeat 5m1") and "(max 30s)" in proc.stdout
    assert run_ckptd("health", "-c", config, "--max-age", "600").returncode == 0


def test_health_missing(tmp_path, config):
    proc = run_ckptd("health", "-c", config)
    assert (proc.returncode, proc.stdout) == (1, f"unhealthy: no ckptd state file in {tmp_path / 'state'}\n")


def test_health_of_a_daemon_that_died_without_cleaning_up(tmp_path, config):
    pid = 2**22 + 1  # above the largest pid_max Linux allows, so no process has it
    write_state(tmp_path / "state", time.time(), pid=pid)
    proc = run_ckptd("health", "-c", config)
    assert proc.returncode == 1 and f"of pid {pid}, gone" in proc.stdout
