"""Leadership by an engine, end to end (tests/fleet/test_etcd.py, test_kubernetes.py,
test_leadership_attack.py): the nodes' configs, a leader and its standby as real `ckptd run`
processes, the fake Lease API as a fixture, and bounded waits on what the daemons say."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.daemonproc import DaemonProc
from tests.support.nodes import ckpts, node_config, trashed

D, M = 2.0, 1.0  # an engine's lease_duration and lease_margin (etcd's smallest TTL is 2 s by default)
ETCD_TOOK = "this ckptd deletes here (etcd, token"
KUBE_TOOK = "this ckptd deletes here (kubernetes, token"
STANDBY = "standby, observing only"


def engine_config(tmp: Path, name: str, root: Path, leadership: str, table: str, keep_last: int = 1) -> Path:
    """A node's config (`nodes.node_config`) with `leadership` and its table, on the engine's timings."""
    path = node_config(tmp, name, root, keep_last=keep_last, duration=D, margin=M, lease=table)
    path.write_text(path.read_text().replace("leadership = 'volume'", f"leadership = '{leadership}'"))
    return path


def etcd_config(tmp: Path, name: str, root: Path, endpoints: list[str], keep_last: int = 1) -> Path:
    table = "[daemon.etcd]\nendpoints = [" + ", ".join(f"'{e}'" for e in endpoints) + "]\nprefix = '/test/'\n"
    return engine_config(tmp, name, root, "etcd", table, keep_last)


def kube_config(tmp: Path, name: str, root: Path, kubeconfig: Path, keep_last: int = 1) -> Path:
    return engine_config(tmp, name, root, "kubernetes", f"[daemon.kubernetes]\nkubeconfig = '{kubeconfig}'\n",
                         keep_last)


def local_config(tmp: Path, name: str, root: Path, *, keep_last: int, leadership: str = "local",
                 **timing: float) -> Path:
    """A node that takes the root's lock (`leadership = "local"`, or `auto` resolving to it);
    `timing`: `nodes.node_config`'s duration and margin, where not its own."""
    path = node_config(tmp, name, root, keep_last=keep_last, **timing)
    path.write_text(path.read_text().replace("leadership = 'volume'", f"leadership = '{leadership}'"))
    return path


def leader_and_standby(config: Callable[[str], Path], took: str) -> tuple[DaemonProc, DaemonProc]:
    """`a`, started first, leads (it logs `took`); `b`, started next, stands by. Where either does
    not, both are stopped before the failure goes on."""
    a = b = None
    try:
        a = DaemonProc("-c", config("a"))
        a.wait_message(took)
        b = DaemonProc("-c", config("b"))
        b.wait_message(STANDBY)
    except BaseException:
        stop_all(a, b)
        raise
    return a, b


def stop_all(*ds: DaemonProc | None) -> None:
    """Each daemon started (a frozen one woken first, so that it can stop)."""
    for d in ds:
        if d is not None:
            if d.proc.poll() is None:
                d.signal(signal.SIGCONT)
            d.stop()


def engine_record(root: Path) -> dict:
    return json.loads((root / ".ckptd" / "engine.json").read_text())


def said(d: DaemonProc, text: str, start: int = 0) -> list[dict]:
    return [m for m in d.lines[start:] if text in m.get("message", "")]


def wait_until(pred: Callable[[], bool], timeout: float = 30, what: str = "a condition") -> None:
    """Until `pred()`, bounded (looks every 50 ms)."""
    tick = threading.Event()  # never set: a timer between looks
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {what}")
        tick.wait(0.05)


def either_says(ds: tuple[DaemonProc, ...], text: str, timeout: float = 60) -> DaemonProc:
    """The first of `ds` to log `text`, bounded (looks every 50 ms)."""
    tick = threading.Event()  # never set: a timer between looks
    deadline = time.monotonic() + timeout
    while True:
        for d in ds:
            if said(d, text):
                return d
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {text!r}:\n" + "\n---\n".join(d.dump() for d in ds))
        tick.wait(0.05)


def arrive_one_by_one(tmp: Path, root: Path, steps: range) -> None:
    """Checkpoints `steps` made one at a time (`nodes.ckpts`), each only once the one before it was
    trashed by node `a` or `b` (their state_dirs under `tmp`): with keep_last = 1, as many renames
    as there could be, each a chance for a second deleter."""
    for step in steps:
        ckpts(root, step)
        wait_until(lambda n=step - 1: len(trashed(tmp / "a")) + len(trashed(tmp / "b")) >= n,
                   30, f"checkpoint-{step - 1} trashed")


@pytest.fixture
def kube(tmp_path):
    """The fake Lease API (tests/support/fakekube.py: no API server can run here), its store in
    tmp_path/kube; woken if a test froze it, then stopped."""
    pytest.importorskip("lightkube", reason="needs lightkube (the kubernetes extra)")
    from tests.support.fakekube import FakeKube

    (tmp_path / "kube").mkdir()
    server = FakeKube(tmp_path / "kube")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.signal(signal.SIGCONT)
        server.stop()
