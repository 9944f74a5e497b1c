"""A real `ckptd run` with `metrics_listen`: scrape /metrics after a prune; health and JSON logs of the same daemon.

One daemon serves the module (starting one costs seconds on 2 cores). Every
wait is on its log lines, with a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.errors import EX_CONFIG, EX_IOERR
from ckptd.journal import read_journal
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc, write_config

prometheus_parser = pytest.importorskip("prometheus_client.parser", reason="needs ckptd[metrics]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_bytes(path: Path) -> int:
    """What deleting `path` frees, as the filesystem counts it (ckptd's space.py): allocated blocks."""
    return sum(p.lstat().st_blocks * 512 for p in (path, *path.rglob("*")))


def metrics_config(tmp: Path, root: Path, listen: str) -> Path:
    # Polling: watchdog holds a move's first half 0.5 s to pair it (InotifyMoveEventGrouper), longer
    # than the 0.2 s quiet period, and a late event sends a complete checkpoint back to settling.
    cfg = write_config(tmp / "c.toml", root, tmp / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\nobserver = 'polling'\npoll_interval = '0.3s'",
                       retention="keep_last = 1\nkeep_best = 0")
    cfg.write_text(cfg.read_text().replace("[daemon]\n", f"[daemon]\nmetrics_listen = '{listen}'\n"))
    return cfg


@dataclass
class Pruned:
    daemon: DaemonProc
    config: Path
    root: Path
    port: int
    started: float
    reclaimed: int


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """checkpoint-1 and -2 on disk at start; -3 written while the daemon runs; keep_last=1: 1 and 2 go."""
    tmp = tmp_path_factory.mktemp("metrics")
    root = tmp / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    reclaimed = sum(tree_bytes(root / "job" / f"checkpoint-{s}") for s in (1, 2))
    port = free_port()
    cfg = metrics_config(tmp, root, f"127.0.0.1:{port}")
    started = time.time()
    daemon = DaemonProc("-c", cfg)
    try:
        daemon.wait_message("ready", timeout=60)
        daemon.wait_message("deleted job/checkpoint-1")
        hf_deepspeed_checkpoint(root / "job", 3, world=2)  # seen from its first write: its latency is measured
        [deleted] = daemon.wait_message("deleted job/checkpoint-2")
        after = daemon.lines.index(deleted)
        [first] = daemon.wait_message("trash entries")
        if "purged 2 " not in first["message"]:  # one purge per deletion, or both in one
            daemon.wait_message("trash entries", count=2)
        daemon.wait_message("state written", start=after)  # a snapshot taken after the last deletion
        yield Pruned(daemon, cfg, root, port, started, reclaimed)
    finally:
        daemon.stop()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_after_a_prune(pruned):
    m = scrape(pruned.port)
    root = str(pruned.root)

    def at_root(name: str, **labels: str) -> float:
        return m[(name, frozenset({"root": root, **labels}.items()))]

    assert m[("ckptd_deletions_total", frozenset())] == 2
    assert m[("ckptd_reclaimed_bytes_total", frozenset())] == pruned.reclaimed
    assert pruned.reclaimed == sum(r["bytes"] for r in read_journal(pruned.config.parent / "state")
                                   if r["event"] == "purged")
    assert m[("ckptd_slims_total", frozenset())] == 0
    states = {state: at_root("ckptd_checkpoints", state=state)
              for state in ("writing", "settling", "complete", "incomplete", "stalled")}
    assert states == {"writing": 0, "settling": 0, "complete": 1, "incomplete": 0, "stalled": 0}
    # only checkpoint-3 was seen appearing; 1 and 2 were on disk before the daemon started
    assert m[("ckptd_checkpoint_completion_seconds_count", frozenset())] == 1
    # Both ends are sampled at the end of a tick: the first sighting's tick may have had more work
    # after its look (a watch added, the trash's entries judged again at their purge) than the
    # completing one, so anything from a few milliseconds to well under a minute is fine; and a
    # checkpoint first seen by the tick that finds it complete (its save ended within one look)
    # counts 0 (seen once in a full run on a busy machine).
    assert 0 <= m[("ckptd_checkpoint_completion_seconds_sum", frozenset())] < 30
    assert m[("ckptd_checkpoint_completion_seconds_bucket", frozenset({"le": "1.0"}.items()))] == 1
    assert at_root("ckptd_oldest_incomplete_checkpoint_age_seconds") == 0
    assert at_root("ckptd_rescans_total") == 0
    assert pruned.started <= at_root("ckptd_last_reconcile_timestamp_seconds") <= time.time()
    assert at_root("ckptd_leader") == 1
    st = os.statvfs(root)
    assert at_root("ckptd_filesystem_size_bytes") == st.f_blocks * st.f_frsize
    assert 0 < at_root("ckptd_filesystem_free_bytes") <= at_root("ckptd_filesystem_size_bytes")
    assert at_root("ckptd_trash_entries") == 0 and at_root("ckptd_trash_bytes") == 0  # purged (grace 0)
    assert ("process_resident_memory_bytes", frozenset()) in m


def test_build_info_and_per_run_metrics(pruned):
    """Per run, never per checkpoint (a volume holds thousands): states, bytes, the newest save."""
    import platform

    from ckptd import __version__

    m = scrape(pruned.port)
    root = str(pruned.root)
    assert m[("ckptd_build_info", frozenset({"version": __version__, "python": platform.python_version()}.items()))] == 1
    assert m[("ckptd_consolidations_running", frozenset())] == 0

    def at_run(name: str, **labels: str) -> float:
        return m[(name, frozenset({"root": root, "run": "job", **labels}.items()))]

    assert at_run("ckptd_run_checkpoints", state="complete") == 1
    assert at_run("ckptd_run_checkpoints", state="incomplete") == 0
    ckpt = pruned.root / "job" / "checkpoint-3"
    assert at_run("ckptd_run_bytes") == tree_bytes(ckpt)
    newest = max(p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file())
    assert abs(at_run("ckptd_run_newest_complete_timestamp_seconds") - newest) < 5
    runs = {dict(labels).get("run") for name, labels in m if name.startswith("ckptd_run_")}
    assert runs == {"job"}  # one series set per run: no checkpoint label anywhere
    assert not any("checkpoint" in dict(labels) for _, labels in m)


def test_health_of_the_running_daemon_while_idle(pruned):
    mark = pruned.daemon.mark()
    pruned.daemon.wait_message("state written", start=mark, count=2)  # nothing changes; the heartbeat goes on
    proc = run_ckptd("health", "-c", pruned.config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"healthy: pid {pruned.daemon.proc.pid}, heartbeat ")


def test_json_log_lines_parse_and_decisions_explain_themselves(pruned):
    lines = pruned.daemon.lines
    assert [line for line in lines if line.get("level") == "raw"] == []  # every stderr line was one JSON object
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    decisions = [line for line in lines if line["message"].startswith(("decide ", "deleted "))]
    assert {line["checkpoint"] for line in decisions if line["action"] == "delete"} == {"checkpoint-1", "checkpoint-2"}
    for line in decisions:
        assert line["run"] == "job" and line["checkpoint"].startswith("checkpoint-")
        assert line["action"] in ("keep", "delete")
        assert isinstance(line["reasons"], list) and line["reasons"], line


def test_metrics_without_prometheus_client_is_a_config_error(tmp_path):
    fake = tmp_path / "site" / "prometheus_client"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed (simulated)')\n")
    (tmp_path / "vol").mkdir()
    cfg = metrics_config(tmp_path, tmp_path / "vol", "127.0.0.1:9")
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    proc = run_ckptd("run", "-c", cfg, env={"PYTHONPATH": path}, timeout=60)
    assert proc.returncode == EX_CONFIG, proc.stderr
    assert "ckptd: daemon.metrics_listen is set, but prometheus_client is not installed: " \
           "pip install 'ckptd[metrics]'" in proc.stderr


def test_metrics_port_taken_is_an_io_error(tmp_path):
    (tmp_path / "vol").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        proc = run_ckptd("run", "-c", metrics_config(tmp_path, tmp_path / "vol", listen), timeout=60)
    assert proc.returncode == EX_IOERR, proc.stderr
    assert f"ckptd: daemon.metrics_listen {listen}: cannot listen: " in proc.stderr
    assert "Traceback" not in proc.stderr


def test_completion_latency_is_measured_once_from_first_sighting():
    """Metrics.sample on its own, with stand-ins for the daemon's roots and a hand-driven clock."""
    from types import SimpleNamespace

    from ckptd.daemon.metrics import Metrics
    from ckptd.model import State

    on_disk: dict[str, State] = {"run/old": State.SETTLING}  # there before the first scan
    tracker = SimpleNamespace(rescans=0, last_reconcile=100.0,
                              checkpoints=lambda: [SimpleNamespace(rel=r, run="run", state=s, size_bytes=0, written_at=0.0)
                                                   for r, s in on_disk.items()])
    roots = [SimpleNamespace(root=SimpleNamespace(path=Path("/vol")), tracker=tracker, leader=True)]
    m = Metrics({})

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    m.sample(roots, 100.0)
    on_disk["run/new"] = State.WRITING
    m.sample(roots, 101.0)
    assert value("ckptd_oldest_incomplete_checkpoint_age_seconds", root="/vol") == 1.0
    on_disk.update({"run/old": State.COMPLETE, "run/new": State.SETTLING})
    m.sample(roots, 130.0)
    on_disk["run/new"] = State.COMPLETE
    m.sample(roots, 161.0)
    assert value("ckptd_checkpoint_completion_seconds_count") == 1  # "old" was there before: not measured
    assert value("ckptd_checkpoint_completion_seconds_sum") == 60.0
    assert value("ckptd_oldest_incomplete_checkpoint_age_seconds", root="/vol") == 0
    on_disk["run/new"] = State.WRITING  # written again, then complete again: still one checkpoint
    m.sample(roots, 170.0)
    assert value("ckptd_oldest_incomplete_checkpoint_age_seconds", root="/vol") == 0.0
    assert value("ckptd_checkpoints", root="/vol", state="writing") == 1
    on_disk["run/new"] = State.COMPLETE
    m.sample(roots, 200.0)
    assert value("ckptd_checkpoint_completion_seconds_count") == 1
    del on_disk["run/new"]  # deleted; a new checkpoint of the same name is new
    m.sample(roots, 210.0)
    on_disk["run/new"] = State.WRITING
    m.sample(roots, 220.0)
    on_disk["run/new"] = State.COMPLETE
    m.sample(roots, 300.0)
    assert value("ckptd_checkpoint_completion_seconds_count") == 2
    assert value("ckptd_checkpoint_completion_seconds_sum") == 140.0
    assert value("ckptd_checkpoints", root="/vol", state="complete") == 2


def test_a_budget_that_cannot_be_met_is_named_by_root_and_key():
    """ckptd_budget_unmet's source: the plan's own warnings and reasons (policy._take_oldest,
    keep_total's "over keep_total"), from a real plan of checkpoints that no budget may take."""
    from ckptd.config import FreeSpace, Retention, Root
    from ckptd.daemon.metrics import unmet_budgets
    from ckptd.decide.planner import DiskSpace, decide
    from tests.support.memruns import ck, run_of

    pinned = run_of(ck(1, pinned=True, size=100), ck(2, size=100))  # both protected: newest, pinned
    r = Root(path=Path("/vol"), retention=Retention(keep_last=1, keep_best=0, max_size=50,
                                                    min_free=FreeSpace(percent=50)))
    plan = decide([(r, [pinned])], space=lambda p: DiskSpace(free=10, total=1000), device=lambda p: 1)
    assert unmet_budgets(plan.warnings, plan.decisions, ["/vol", "/other"]) == {("/vol", "max_size"), ("/vol", "min_free")}
    r = Root(path=Path("/vol"), retention=Retention(keep_total=1))
    plan = decide([(r, [pinned])])
    assert unmet_budgets(plan.warnings, plan.decisions, ["/vol"]) == {("/vol", "keep_total")}
    r = Root(path=Path("/vol"), retention=Retention(keep_last=1, keep_best=0, max_size=10_000))
    assert unmet_budgets(decide([(r, [pinned])]).warnings, (), ["/vol"]) == set()


def test_the_oldest_incomplete_age_survives_a_restart(tmp_path):
    """The age of a checkpoint in flight counts from when a daemon first saw it so, kept in
    state_dir: it restarted at 0 with the daemon, so the shipped one-hour alert never fired across
    restarts. Once complete, or gone, it is forgotten."""
    from types import SimpleNamespace

    from ckptd.daemon.metrics import INCOMPLETE_SINCE, Metrics
    from ckptd.model import State

    on_disk: dict[str, State] = {"run/a": State.COMPLETE, "run/b": State.WRITING}
    tracker = SimpleNamespace(rescans=0, last_reconcile=None,
                              checkpoints=lambda: [SimpleNamespace(rel=r, run="run", state=s, size_bytes=0, written_at=0.0)
                                                   for r, s in on_disk.items()])
    roots = [SimpleNamespace(root=SimpleNamespace(path=Path("/vol")), tracker=tracker, leader=True)]

    def age(m: Metrics) -> float | None:
        return m.registry.get_sample_value("ckptd_oldest_incomplete_checkpoint_age_seconds", {"root": "/vol"})

    first = Metrics({}, tmp_path)
    first.sample(roots, 50.0, wall=10_000.0)
    first.sample(roots, 350.0, wall=10_300.0)
    assert age(first) == 300.0
    restarted = Metrics({}, tmp_path)  # a new process: its monotonic clock starts elsewhere
    restarted.sample(roots, 7.0, wall=13_600.0)
    assert age(restarted) == 3600.0
    on_disk["run/b"] = State.COMPLETE
    restarted.sample(roots, 8.0, wall=13_601.0)
    assert age(restarted) == 0.0
    assert json.loads((tmp_path / INCOMPLETE_SINCE).read_text()) == {}
    on_disk["run/c"] = State.SETTLING
    Metrics({}, tmp_path).sample(roots, 1.0, wall=20_000.0)
    del on_disk["run/c"]  # deleted while no daemon ran
    again = Metrics({}, tmp_path)
    again.sample(roots, 1.0, wall=30_000.0)
    assert age(again) == 0.0 and json.loads((tmp_path / INCOMPLETE_SINCE).read_text()) == {}
