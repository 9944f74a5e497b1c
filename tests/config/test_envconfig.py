"""CKPTD_* variables (envconfig.py): how a container configures ckptd, and errors that name the variable."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import ConfigError, FreeSpace, parse_listen
from ckptd.config.effective import KNOWN, effective_config
from ckptd.daemon import Daemon
from ckptd.errors import EX_CONFIG
from tests.support.common import REPO, run_ckptd
from tests.support.daemonproc import write_config


def two_roots(tmp_path: Path) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        "[daemon]\nstate_dir = '/var/lib/ckptd'\n"
        "[[roots]]\npath = '/a'\nquiet_period = '5m'\n[roots.retention]\nkeep_last = 3\n"
        "[[roots.runs]]\nmatch = 'sweeps/*'\nkeep_last = 5\n"
        "[[roots]]\npath = '/b'\n"
    )
    return path


def test_variables_override_the_file_in_every_root(tmp_path):
    env = {"CKPTD_KEEP_LAST": "1", "CKPTD_METRIC": "eval_loss", "CKPTD_MIN_FREE": "10%",
           "CKPTD_WORLD_SIZE": "8", "CKPTD_DRY_RUN": "yes", "CKPTD_METRICS_LISTEN": "0.0.0.0:9464"}
    config = effective_config(two_roots(tmp_path), env)
    a, b = config.roots
    assert [r.retention.keep_last for r in (a, b)] == [1, 1]
    assert [r.retention.metric for r in (a, b)] == ["eval_loss", "eval_loss"]
    assert a.retention.min_free == FreeSpace(percent=10) and a.world_size == 8
    assert a.quiet_period == 300  # what no variable names stays as the file says
    assert config.daemon.dry_run and config.daemon.metrics_listen == "0.0.0.0:9464"
    assert a.retention_for("sweeps/x")[0].keep_last == 5  # [[roots.runs]] still wins for its runs


def test_roots_from_the_environment_alone(tmp_path):
    env = {"CKPTD_ROOTS": "/data:/scratch/ckpt/", "CKPTD_KEEP_BEST": "0", "CKPTD_STATE_DIR": str(tmp_path)}
    config = effective_config(None, env)
    assert [str(r.path) for r in config.roots] == ["/data", "/scratch/ckpt"]
    assert all(r.retention.keep_best == 0 for r in config.roots)
    assert config.daemon.state_dir == tmp_path


def test_a_configured_root_keeps_its_settings_and_command_line_roots_win(tmp_path):
    path = two_roots(tmp_path)
    [a, new] = effective_config(path, {"CKPTD_ROOTS": "/a:/c"}).roots
    assert (a.quiet_period, a.retention.keep_last) == (300, 3) and (new.quiet_period, new.retention.keep_last) == (60, 2)
    [b] = effective_config(path, {"CKPTD_ROOTS": "/a", "CKPTD_KEEP_LAST": "4"}, [Path("/b")]).roots
    assert str(b.path) == "/b" and b.retention.keep_last == 4


def test_an_empty_variable_is_unset(tmp_path):
    config = effective_config(two_roots(tmp_path), {"CKPTD_KEEP_LAST": "", "CKPTD_ROOTS": " "})
    assert [r.retention.keep_last for r in config.roots] == [3, 2]


BAD = [
    ("CKPTD_KEEP_LAST", "-1", "CKPTD_KEEP_LAST: must be >= 0 (got -1)"),
    ("CKPTD_KEEP_LAST", "three", "CKPTD_KEEP_LAST: expected an integer (got 'three')"),
    ("CKPTD_DRY_RUN", "maybe", "CKPTD_DRY_RUN: expected true or false (got 'maybe')"),
    ("CKPTD_LOG_FORMAT", "xml", "CKPTD_LOG_FORMAT: input should be 'text' or 'json' (got 'xml')"),
    ("CKPTD_ROOTS", "data", "CKPTD_ROOTS: must be an absolute path (got 'data')"),
    ("CKPTD_ROOTS", "/a:/a/b", "CKPTD_ROOTS: roots[1].path '/a/b' overlaps roots[0].path '/a'"),
    ("CKPTD_QUIET_PERIOD", "soon", "CKPTD_QUIET_PERIOD: expected a duration like '90s', '10m', '6h' or '7d' (got 'soon')"),
    ("CKPTD_MIN_FREE", "150%", "CKPTD_MIN_FREE: a percentage must be in [0, 100) (got '150%')"),
    ("CKPTD_MODE", "median", "CKPTD_MODE: input should be 'min' or 'max' (got 'median')"),
    ("CKPTD_METRICS_LISTEN", "9464", "CKPTD_METRICS_LISTEN: expected host:port, e.g. '127.0.0.1:9464' (got '9464')"),
    ("CKPTD_ETCD_ENDPOINTS", "http://a:2379,10.0.0.5", "CKPTD_ETCD_ENDPOINTS: '10.0.0.5' is not http(s)://HOST:PORT"),
]


def test_etcd_endpoints_from_the_environment(tmp_path):
    env = {"CKPTD_ROOTS": "/a", "CKPTD_ETCD_ENDPOINTS": "https://10.0.0.5:2379, https://10.0.0.6:2379"}
    config = effective_config(None, env)
    assert config.daemon.etcd.endpoints == ("https://10.0.0.5:2379", "https://10.0.0.6:2379")
    with pytest.raises(ConfigError) as info:
        effective_config(None, {"CKPTD_ROOTS": "/a", "CKPTD_LEADERSHIP": "etcd"})
    assert info.value.problems == [
        "CKPTD_LEADERSHIP: leadership = 'etcd' needs [daemon.etcd] endpoints (or $CKPTD_ETCD_ENDPOINTS)"]


@pytest.mark.parametrize(("name", "value", "message"), BAD)
def test_a_bad_value_is_one_line_naming_the_variable(tmp_path, name, value, message):
    env = {name: value} if name == "CKPTD_ROOTS" else {"CKPTD_ROOTS": "/a:/b", name: value}
    with pytest.raises(ConfigError) as info:
        effective_config(None, env)
    assert info.value.problems == [message]


def test_file_problems_still_point_into_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[[roots]]\npath = '/a'\n[roots.retention]\nkeep_best = -2\n")
    with pytest.raises(ConfigError) as info:
        effective_config(path, {"CKPTD_KEEP_LAST": "-1"})
    assert info.value.problems == [
        "CKPTD_KEEP_LAST: must be >= 0 (got -1)",
        f"{path}: roots[0].retention.keep_best: must be >= 0 (got -2)",
    ]


@pytest.mark.parametrize(
    ("text", "host_port"),
    [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:80", ("::1", 80)), ("0.0.0.0:9464", ("0.0.0.0", 9464)),
     ("localhost:1", ("localhost", 1))],
)
def test_metrics_listen_parses(text, host_port):
    assert parse_listen(text) == host_port


@pytest.mark.parametrize("text", [":9464", "localhost", "::1:9464", "host:0", "host:65536", "host:http"])
def test_metrics_listen_rejects(text):
    with pytest.raises(ValueError):
        parse_listen(text)


def test_check_config_says_what_came_from_the_environment(tmp_path, state_env):
    data = tmp_path / "data"  # check-config checks the roots are there, as `ckptd run` would
    data.mkdir()
    proc = run_ckptd("check-config", env={**state_env, "CKPTD_ROOTS": str(data), "CKPTD_KEEP_LAST": "5",
                                          "CKPTD_TRASH_GRACE": ""})  # the suite sets it (conftest.py)
    assert proc.returncode == 0, proc.stderr
    assert "CKPTD_KEEP_LAST, CKPTD_ROOTS from the environment" in proc.stderr
    assert '"keep_last": 5' in proc.stdout and f'"path": "{data}"' in proc.stdout
    proc = run_ckptd("check-config", env={**state_env, "CKPTD_KEEP_LAST": "-1", "CKPTD_ROOTS": "/data"})
    assert proc.returncode == EX_CONFIG
    assert proc.stderr == "ckptd: CKPTD_KEEP_LAST: must be >= 0 (got -1)\n"


def test_the_docs_document_every_variable():
    page = (REPO / "docs" / "reference" / "environment.md").read_text()
    for name in KNOWN:
        assert f"`{name}`" in page, f"docs/reference/environment.md does not document {name}"


@pytest.mark.asyncio
async def test_a_reload_keeps_the_environment_on_top_of_the_new_file(tmp_path, monkeypatch):
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="world_size = 2",
                       retention="keep_last = 3\nkeep_best = 0")
    monkeypatch.setenv("CKPTD_KEEP_BEST", "4")
    daemon = Daemon(effective_config(cfg, {"CKPTD_KEEP_BEST": "4"}), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 30)
        cfg.write_text(cfg.read_text().replace("keep_last = 3", "keep_last = 1"))
        await daemon.reload()
        retention = daemon.roots[0].root.retention
        assert (retention.keep_last, retention.keep_best) == (1, 4)
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("90s", 90.0), (" 1.5m ", 90.0), ("7.5", 7.5)])
def test_quiet_period_from_the_environment_takes_seconds_as_toml_does(text, seconds):
    """`quiet_period = 90` is accepted in the file; CKPTD_QUIET_PERIOD=90 is too."""
    [root] = effective_config(None, {"CKPTD_ROOTS": "/x", "CKPTD_QUIET_PERIOD": text}).roots
    assert root.quiet_period == seconds


@pytest.mark.parametrize(("text", "message"), [
    ("-5", "CKPTD_QUIET_PERIOD: must be a finite, non-negative duration (got -5.0)"),
    ("soon", "CKPTD_QUIET_PERIOD: expected a duration like '90s', '10m', '6h' or '7d' (got 'soon')"),
])
def test_a_bad_quiet_period_from_the_environment_names_the_variable(text, message):
    with pytest.raises(ConfigError) as info:
        effective_config(None, {"CKPTD_ROOTS": "/x", "CKPTD_QUIET_PERIOD": text})
    assert info.value.problems == [message]


def test_a_refusal_from_the_environment_names_the_variable():
    """Below the floor, or a root that cannot be meant: the variable that said so is named."""
    with pytest.raises(ConfigError) as info:
        effective_config(None, {"CKPTD_ROOTS": "/x", "CKPTD_QUIET_PERIOD": "2.5"})
    assert info.value.problems == [
        "CKPTD_QUIET_PERIOD: roots[0].quiet_period: 2.5s is below 5s: a save pauses that long between its "
        "own writes, so a checkpoint still being written would look finished; set allow_short_quiet_period "
        "= true in its [[roots]] if nothing writes there while ckptd looks (a finished job, a test)"]
    with pytest.raises(ConfigError) as info:
        effective_config(None, {"CKPTD_ROOTS": "/x:/etc"})
    [line] = info.value.problems
    assert line.startswith("CKPTD_ROOTS: roots[1].path: '/etc' is the system directory /etc") or \
        line.startswith("CKPTD_ROOTS: roots[1].path: '/etc' is in the system directory /etc"), line


def test_a_conflict_between_a_variable_and_the_file_names_the_variable(tmp_path):
    """CKPTD_KEEP_TOTAL over a file that sets keep_last: the conflict is the table's, and the
    variable that brought keep_total into it is named first, the file's place beside it."""
    path = tmp_path / "c.toml"
    path.write_text("[[roots]]\npath = '/a'\n[roots.retention]\nkeep_last = 3\n")
    with pytest.raises(ConfigError) as info:
        effective_config(path, {"CKPTD_KEEP_TOTAL": "3"})
    [line] = info.value.problems
    assert line.startswith("CKPTD_KEEP_TOTAL: keep_total replaces keep_last: "), line
    assert line.endswith(f"({path}: roots[0].retention)")


def test_a_misspelled_variable_is_warned_with_the_nearest_one(tmp_path):
    """CKPTD_KEEP_LST was ignored silently, and the file's keep_last applied."""
    (tmp_path / "vol").mkdir()
    proc = run_ckptd("check-config", env={"CKPTD_ROOTS": str(tmp_path / "vol"), "CKPTD_KEEP_LST": "1",
                                          "CKPTD_WOBBLE": "x", "CKPTD_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 0, proc.stderr
    assert "CKPTD_KEEP_LST is not a ckptd variable: ignored; did you mean CKPTD_KEEP_LAST?" in proc.stderr
    assert "CKPTD_WOBBLE is not a ckptd variable: ignored; ckptd reads CKPTD_CONFIG," in proc.stderr
    assert "CKPTD_TEST" not in proc.stderr.replace("CKPTD_KEEP_LST", "")  # the suite's own are not users'


def test_keep_nothing_and_a_quiet_period_over_a_day_are_warned(tmp_path):
    """keep_last = 0 with keep_best = 0 keeps only what is always kept (in torchtitan 0 keeps all);
    quiet_period = "3650d" completes nothing for ten years: both valid, both said."""
    (tmp_path / "vol").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "quiet_period = '3650d'\n[roots.retention]\nkeep_last = 0\nkeep_best = 0\n"
                   "[[roots.runs]]\nmatch = 'kept/*'\nkeep_last = 2\n")
    proc = run_ckptd("check-config", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning: roots[0]")]
    assert len(warned) == 2, proc.stderr  # the run rule keeps 2: not warned
    assert warned[0].startswith("warning: roots[0].quiet_period: 3650d is over a day")
    assert warned[1].startswith("warning: roots[0].retention: keep_last = 0 and keep_best = 0 keep only what "
                                "is always kept (each run's newest complete checkpoint")
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert any("keep_last = 0 and keep_best = 0" in w for w in json.loads(plan.stdout)["warnings"]), plan.stdout
