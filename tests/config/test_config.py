from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from ckptd.config import (
    Config,
    ConfigError,
    Daemon,
    Etcd,
    FreeSpace,
    Kubernetes,
    Pattern,
    Retention,
    Root,
    RunRule,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from ckptd.config.archive import Archive
from ckptd.errors import EX_CONFIG
from tests.support.common import REPO, run_ckptd

EXAMPLE = REPO / "config.example.toml"
# "# key = value", "# [[table]]", "# # comment" inside an example: a line to uncomment
_COMMENTED_TOML = re.compile(r"^# (?=\[|[a-z_]+ = |# |\s*\{|\]$|$)")


def test_config_example_loads_and_sets_every_key():
    config = load_config(EXAMPLE)
    assert config.roots[0].path == Path("/mnt/experiments")  # the one key without a default
    # every field of every model appears in the example, set or as an example line
    text = EXAMPLE.read_text()
    for model in (Config, Root, Retention, Daemon, Etcd, Kubernetes, RunRule, Pattern, Archive):
        for name in model.model_fields:
            if name not in ("roots", "daemon", "retention", "runs", "etcd", "kubernetes"):
                assert f"{name} =" in text, f"config.example.toml does not document {model.__name__}.{name}"


def test_config_example_holds_the_defaults(monkeypatch):
    """Installed as the real config (the systemd recipe), the example changes nothing: each key
    it sets is at the models' default. state_dir is written as the units' StateDirectory= makes
    the default, so that `ckptd status -c` from a shell looks where the daemon writes."""
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/ckptd")
    config = load_config(EXAMPLE)
    defaults = Config(roots=(Root(path=config.roots[0].path),))
    assert config.model_dump(mode="json") == defaults.model_dump(mode="json")
    assert config.roots[0].runs == () and config.roots[0].retention.keep_full_last is None
    assert config.daemon.metrics_listen is None
    # and every key the example sets, it sets explicitly (a key left out would be a default too,
    # but the example is where a user reads every key's comment beside its value)
    data = tomllib.loads(EXAMPLE.read_text())
    tables = ((data["daemon"], Daemon, set()), (data["roots"][0], Root, {"runs"}),
              (data["roots"][0]["retention"], Retention, set()))
    for table, model, left_out in tables:
        unset = {n for n, f in model.model_fields.items() if f.default is None} | left_out
        want = set(model.model_fields) - unset
        assert set(table) == want, (
            f"{model.__name__}: write {sorted(want - set(table))} as `key = <default>` in config.example.toml "
            f"(a key whose default is unset goes in as a commented example); not {sorted(set(table) - want)}"
        )


def test_config_example_would_fail_on_a_value_that_is_not_the_default(tmp_path, monkeypatch):
    """So that the test above can fail: the old example's keep_within = "6h" is caught."""
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/ckptd")
    bad = tmp_path / "c.toml"
    bad.write_text(EXAMPLE.read_text().replace('# keep_within = "6h"', 'keep_within = "6h"'))
    config = load_config(bad)
    defaults = Config(roots=(Root(path=config.roots[0].path),))
    assert config.model_dump(mode="json") != defaults.model_dump(mode="json")


def test_config_examples_commented_out_are_valid_and_mean_what_they_say(tmp_path):
    """The example lines, uncommented (each group on its own: keep_total replaces keep_last),
    load: an example a user uncomments must not be a config error."""
    lines = EXAMPLE.read_text().splitlines()
    runs_at = next(i for i, line in enumerate(lines) if line == "# [[roots.runs]]")
    uncommented = [_COMMENTED_TOML.sub("", line) if i >= runs_at else line for i, line in enumerate(lines)]
    for key in ("metric", "keep_within", "max_size", "min_free", "pins", "keep_full_last", "world_size",
                "metrics_listen", "patterns"):
        uncommented = [line.removeprefix("# ") if line.startswith(f"# {key} = ") else line
                       for line in uncommented]
    text = "\n".join(uncommented) + "\n"
    text = text.replace("\n#   {", "\n  {").replace("\n# ]\n", "\n]\n")  # the multi-line example
    path = tmp_path / "c.toml"
    path.write_text(text.replace("patterns = []\n", "", 1).replace("pins = []\n", "", 1))
    config = load_config(path)
    root = config.roots[0]
    assert root.retention.metric == "eval_loss" and root.retention.keep_within == 6 * 3600
    assert root.retention.max_size == 2 * 1024**4 and root.retention.min_free == FreeSpace(percent=10.0)
    assert root.retention.keep_full_last == 1 and root.world_size == 4
    assert [p.name for p in root.patterns] == ["snapshot-{step}"] and root.patterns[0].ranks == "shard_{rank}.pt"
    assert config.daemon.metrics_listen == "127.0.0.1:9464"
    # the run rules: they replace only what they set
    retention, world = root.retention_for("sweeps/lr-3e-4")
    assert (retention.keep_last, retention.keep_best, world) == (1, 0, 4)
    assert retention.metric == "eval_loss" and retention.max_size == root.retention.max_size
    retention, world = root.retention_for("hf-migrated/bert")
    assert retention.keep_total == 2
    retention, world = root.retention_for("main-run")
    assert (retention.keep_last, world) == (2, 4)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("6h", 21600), ("1.5d", 129600), ("500ms", 0.5), (42, 42), ("2w", 1209600)],
)
def test_durations(text, seconds):
    assert math.isclose(parse_duration(text), seconds)


@pytest.mark.parametrize(
    ("text", "size"),
    [("500GiB", 500 * 1024**3), ("2TB", 2 * 10**12), ("1.5KiB", 1536), (1234, 1234), ("10 MiB", 10 * 1024**2)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


def test_free_space_percent_rounds_up():
    assert FreeSpace(percent=10).required(1001) == 101


BAD = [
    ("[[roots]]\npath = 'relative'\n", "roots[0].path: must be an absolute path (got 'relative')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nkeep_last = -1\n", "roots[0].retention.keep_last: must be >= 0 (got -1)"),
    ("[[roots]]\npath = '/x'\nkeep_lats = 3\n",
     "roots[0].keep_lats: unknown key (did you mean keep_last, in [roots.retention]?)"),
    # a valid key in the wrong table says which table it belongs in
    ("[[roots]]\npath = '/x'\nkeep_last = 3\n",
     "roots[0].keep_last: unknown key; keep_last belongs in [roots.retention], not [[roots]]"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nquiet_period = '5s'\n",
     "roots[0].retention.quiet_period: unknown key; quiet_period belongs in [[roots]], not [roots.retention]"),
    ("state_dir = '/x'\n", "state_dir: unknown key; state_dir belongs in [daemon], not the top level"),
    ("[daemon]\nstatedir = '/x'\n", "daemon.statedir: unknown key (did you mean state_dir?)"),
    ("[daemon]\ndry_run = 'yes'\n", "daemon.dry_run: input should be a valid boolean (got 'yes')"),
    ("[daemon]\nlog_format = 'xml'\n", "daemon.log_format: input should be 'text' or 'json' (got 'xml')"),
    ("[[roots]]\npath = '/x'\nquiet_period = 'soon'\n",
     "roots[0].quiet_period: expected a duration like '90s', '10m', '6h' or '7d' (got 'soon')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nmax_size = 'lots'\n",
     "roots[0].retention.max_size: expected a size like '500GiB', '2TB' or a number of bytes (got 'lots')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nmin_free = '150%'\n",
     "roots[0].retention.min_free: a percentage must be in [0, 100) (got '150%')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nmode = 'median'\n",
     "roots[0].retention.mode: input should be 'min' or 'max' (got 'median')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nkeep_last = '3'\n",
     "roots[0].retention.keep_last: input should be a valid integer (got '3')"),
    ("[[roots]]\npath = '/x'\n[[roots.runs]]\nmatch = 'a/*'\nmin_free = '5%'\n",
     "roots[0].runs[0]: min_free is per filesystem: set it in [roots.retention], not per run"),
    ("[[roots]]\npath = '/x'\n[[roots.runs]]\nkeep_last = 1\n", "roots[0].runs[0].match: required key is missing"),
    ("[[roots]]\npath = '/x'\npatterns = ['ckpt']\n",
     "roots[0].patterns[0].name: a pattern is one name with exactly one {step} or {time} field (got 'ckpt')"),
    ("[[roots]]\npath = '/x'\n[[roots]]\npath = '/x/y'\n",
     "roots: roots[1].path '/x/y' overlaps roots[0].path '/x'"),
    ("[[roots]]\n", "roots[0].path: required key is missing"),
    ("[[roots]]\npath = '/x'\nmax_depth = '4'\n", "roots[0].max_depth: input should be a valid integer (got '4')"),
    ("[[roots]]\npath = '/x'\nworld_size = '2'\n", "roots[0].world_size: input should be a valid integer (got '2')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nkeep_best = '1'\n",
     "roots[0].retention.keep_best: input should be a valid integer (got '1')"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nkeep_missing_metric = 'no'\n",
     "roots[0].retention.keep_missing_metric: input should be a valid boolean (got 'no')"),
    ("[[roots]]\npath = '/x/y'\n[[roots]]\npath = '/x'\n", "roots: roots[1].path '/x' overlaps roots[0].path '/x/y'"),
    ("[[roots]]\npath = '/x'\nmp_world_size = 2.0\n", "roots[0].mp_world_size: input should be a valid integer (got 2.0)"),
    ("[[roots]]\npath = '/x'\n[roots.retention]\nkeep_every_steps = '1000'\n",
     "roots[0].retention.keep_every_steps: input should be a valid integer (got '1000')"),
    ("[[roots]]\npath = '/x'\n[[roots.runs]]\nmatch = 'a/*'\nworld_size = '8'\n",
     "roots[0].runs[0].world_size: input should be a valid integer (got '8')"),
    ("roots = 3\n", "roots: input should be a valid tuple (got 3)"),
    ("colour = 'blue'\n", "colour: unknown key"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_each_mistake_is_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: {message}"]


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[daemon]\nlog_format = 'xml'\n[[roots]]\npath = 'rel'\nquiet_period = -5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 3


def test_invalid_toml_names_the_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[daemon]\nlog_format = \n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    [line] = info.value.problems
    assert line.startswith(f"{path}: invalid TOML: ") and "line 2" in line


@pytest.mark.parametrize("command", ["plan", "prune", "check-config"])
def test_bad_config_exits_78_without_traceback_and_deletes_nothing(tmp_path, command, state_env):
    root = tmp_path / "vol"
    (root / "run" / "checkpoint-1").mkdir(parents=True)
    path = tmp_path / "c.toml"
    path.write_text(f"[[roots]]\npath = '{root}'\n[roots.retention]\nkeep_last = -1\n")
    proc = run_ckptd(command, "-c", path, env=state_env)
    assert proc.returncode == EX_CONFIG
    assert proc.stderr == f"ckptd: {path}: roots[0].retention.keep_last: must be >= 0 (got -1)\n"
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (root / "run" / "checkpoint-1").is_dir()


def test_config_from_environment(tmp_path, state_env):
    path = tmp_path / "c.toml"
    path.write_text("[daemon]\nlog_format = 'xml'\n")
    proc = run_ckptd("check-config", env={**state_env, "CKPTD_CONFIG": str(path)})
    assert proc.returncode == EX_CONFIG and "daemon.log_format" in proc.stderr


def test_check_config_prints_the_effective_config(tmp_path, state_env):
    path = tmp_path / "c.toml"
    path.write_text(f"[[roots]]\npath = '{tmp_path}'\n[roots.retention]\nkeep_within = 5400\n")
    proc = run_ckptd("check-config", "-c", path, env=state_env)
    assert proc.returncode == 0, proc.stderr
    assert '"keep_within": "90m"' in proc.stdout and '"quiet_period": "1m"' in proc.stdout


def test_run_pins_add_to_the_roots_pins():
    root = Root.model_validate({"path": "/v", "retention": {"pins": ["a/*"]}, "runs": [{"match": "b", "pins": ["b/x"]}]})
    assert root.retention_for("b")[0].pins == ("a/*", "b/x")


def test_roots_overlapping_through_a_symlink_are_refused(tmp_path):
    (tmp_path / "data" / "team").mkdir(parents=True)
    (tmp_path / "mnt").symlink_to(tmp_path / "data")
    path = tmp_path / "c.toml"
    path.write_text(f"[[roots]]\npath = '{tmp_path / 'mnt'}'\n[[roots]]\npath = '{tmp_path / 'data' / 'team'}'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "overlaps roots[0].path" in info.value.problems[0]


# --- roots and quiet periods that cannot be meant: refused (exit 78) unless a key says so ---


@pytest.mark.parametrize("command", ["plan", "prune", "run", "check-config"])
@pytest.mark.parametrize(("path", "says"), [
    ("/", "'/' is the whole filesystem"),
    ("/proc", "'/proc' is in the system directory /proc"),
    ("/etc/ckptd", "'/etc/ckptd' is in the system directory /etc"),
    ("/var", "'/var' is the system directory /var"),
    ("/usr/share", "'/usr/share' is in the system directory /usr"),
])
def test_a_system_root_is_refused_naming_the_key(tmp_path, state_env, command, path, says):
    """`path = "/"` walked /proc and other jobs' temp directories and proposed deletions: every
    command that reads the config refuses it before it looks at anything."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{path}'\n")
    proc = run_ckptd(command, "-c", cfg, env=state_env, timeout=60)
    assert proc.returncode == EX_CONFIG, proc.stderr
    assert f"ckptd: {cfg}: roots[0].path: {says}: " in proc.stderr and "allow_any_path = true" in proc.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was set up


def test_a_root_argument_and_a_symlink_to_a_system_directory_are_refused(tmp_path, state_env):
    (tmp_path / "everything").symlink_to("/")
    for root in ("/", tmp_path / "everything", "/sys/fs"):
        proc = run_ckptd("plan", root, env=state_env, timeout=60)
        assert proc.returncode == EX_CONFIG, proc.stderr
        assert "roots[0].path: " in proc.stderr and ("system directory" in proc.stderr or "whole filesystem" in proc.stderr)


def test_a_root_holding_the_state_dir_is_refused_unless_allowed(tmp_path, state_env):
    (tmp_path / "vol" / "run" / "checkpoint-1").mkdir(parents=True)
    cfg = tmp_path / "c.toml"
    body = f"[daemon]\nstate_dir = '{tmp_path / 'vol' / '.state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
    cfg.write_text(body)
    proc = run_ckptd("plan", "-c", cfg, env=state_env)
    assert proc.returncode == EX_CONFIG
    assert f"roots[0].path: '{tmp_path / 'vol'}' holds daemon.state_dir '{tmp_path / 'vol' / '.state'}'" in proc.stderr
    cfg.write_text(body + "allow_any_path = true\n")
    proc = run_ckptd("plan", "-c", cfg, env=state_env)
    assert proc.returncode == 0, proc.stderr


def test_allow_any_path_lets_a_system_root_through():
    config = parse_config({"roots": [{"path": "/", "allow_any_path": True}]})
    assert config.roots[0].path == Path("/")
    with pytest.raises(ConfigError) as info:
        parse_config({"roots": [{"path": "/data"}, {"path": "/usr"}]}, "c.toml")
    assert info.value.problems[0].startswith("c.toml: roots[1].path: '/usr' is in the system directory /usr")


@pytest.mark.parametrize(("value", "refused"), [
    ("0s", True), ("60ms", True), ("4.9s", True), ("5s", False), ("60s", False), (0, True), (5, False)])
def test_a_quiet_period_below_the_floor_is_refused_with_the_reason(tmp_path, state_env, value, refused):
    (tmp_path / "vol").mkdir()
    cfg = tmp_path / "c.toml"
    body = (f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
            f"[[roots]]\npath = '{tmp_path / 'vol'}'\nquiet_period = {value!r}\n")
    cfg.write_text(body)
    proc = run_ckptd("check-config", "-c", cfg, env=state_env)
    assert proc.returncode == (EX_CONFIG if refused else 0), proc.stderr
    if refused:
        assert f"{cfg}: roots[0].quiet_period: " in proc.stderr
        assert "is below 5s: a save pauses that long between its own writes" in proc.stderr
        assert "allow_short_quiet_period = true" in proc.stderr
        cfg.write_text(body + "allow_short_quiet_period = true\n")
        proc = run_ckptd("check-config", "-c", cfg, env=state_env)
        assert proc.returncode == 0, proc.stderr
