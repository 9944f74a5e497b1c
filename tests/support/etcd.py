"""A real 3-member etcd cluster on 127.0.0.1 ports, for the leadership tests (bench/etcdcluster.py: one
copy); a test that needs it is skipped where Debian's `etcd-server` is not installed."""

from __future__ import annotations

import shutil

import pytest

from bench.etcdcluster import Cluster


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    pytest.importorskip("etcd3gw", reason="needs etcd3gw (the etcd extra)")
    cluster = Cluster(tmp_path / "etcd")
    (tmp_path / "etcd").mkdir()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
