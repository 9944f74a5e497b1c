"""One root, two etcd clusters: `engine.json` names the cluster (etcd's `cluster_id`) its token came
from, and a token is compared only with tokens of that cluster (ckptd/fleet/etcdlease.py). In-process
leaderships on the real etcd of tests/support/etcd.py, a clock the test drives (tests/fleet/test_etcd.py
`pair`); the end-to-end cases, real daemons on two real clusters, are in test_leadership_attack.py."""

from __future__ import annotations

import json
from pathlib import Path

from ckptd.fleet.leaserecord import read_engine_record, write_engine_record
from tests.fleet.test_etcd import pair
from tests.support.etcd import etcd  # noqa: F401 (the fixture)


def other_record(root: Path, **over) -> None:
    """A live record as a leader of another etcd cluster on another host writes it. Hand-made: the
    leader on another host, whose root's lock this host's lock table cannot show, cannot run here."""
    rec = {"backend": "etcd", "key": "/unit/x/leader", "volume_id": "x", "epoch": 7, "cluster_id": "123",
           "duration": 2.0, "holder": {"host": "elsewhere", "pid": 1, "start": 0.0, "id": "far"}, "since": 0.0}
    write_engine_record(root, {**rec, **over})


def test_a_live_record_of_another_cluster_refuses_the_take(tmp_path, etcd):  # noqa: F811
    (tmp_path / ".ckptd").mkdir()
    other_record(tmp_path)
    a, _b, _mono = pair(tmp_path, etcd.endpoints)
    a.step()
    assert not a.held(), read_engine_record(tmp_path)
    assert "names etcd cluster 123" in (a.blocked or ""), a.blocked
    assert read_engine_record(tmp_path)["holder"]["id"] == "far"


def take(tmp_path: Path, endpoints: list[str]):
    a, _b, mono = pair(tmp_path, endpoints)
    a.step()
    assert a.held() and a.cluster is not None
    assert read_engine_record(tmp_path)["cluster_id"] == a.cluster
    return a, mono


def test_a_leader_stands_down_before_another_clusters_record_and_keeps_it(tmp_path, etcd):  # noqa: F811
    a, mono = take(tmp_path, etcd.endpoints)
    # An earlier token (by number) than this leader's, from another cluster: not "ours over it".
    other_record(tmp_path, key=a.key, epoch=a.epoch - 1)
    mono[0] += a.interval
    a.step()
    assert not a.held()
    assert read_engine_record(tmp_path)["holder"]["id"] == "far", "written over another cluster's record"


def test_a_leader_stands_down_before_its_own_token_held_by_another(tmp_path, etcd):  # noqa: F811
    a, mono = take(tmp_path, etcd.endpoints)
    other_record(tmp_path, key=a.key, epoch=a.epoch, cluster_id=a.cluster)
    mono[0] += a.interval
    a.step()
    assert not a.held()
    assert json.loads((tmp_path / ".ckptd" / "engine.json").read_text())["holder"]["id"] == "far"
