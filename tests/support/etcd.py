"""A real 3-member etcd cluster on 127.0.0.1 ports, for the leadership tests (bench/etcdcluster.py: one
copy); a test that needs it is skipped where Debian's `etcd-server` is not installed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.etcdcluster import Cluster


@contextmanager
def running_cluster(where: Path) -> Iterator[Cluster]:
    """A cluster in `where` (made here), started; at the end its members stopped and, once they have
    exited, their data directories removed: etcd preallocates its write-ahead log (64 MB segments,
    about 120 MB a member), which would otherwise stay in every test's tmp_path. The members' logs
    stay, for a failure's report."""
    where.mkdir()
    cluster = Cluster(where)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()  # kills each member still running and waits for it (or raises: data kept)
        for m in cluster.members:
            shutil.rmtree(m.data, ignore_errors=True)


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    pytest.importorskip("etcd3gw", reason="needs etcd3gw (the etcd extra)")
    with running_cluster(tmp_path / "etcd") as cluster:
        yield cluster
