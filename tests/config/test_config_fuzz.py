"""Any TOML document yields a valid config or one line per problem and exit 78: never a traceback.

Through the real `check-config`, a valid config may still fail as `ckptd run` would: no
roots (64), a root not there (66), a file where the state directory goes (74).
"""

from __future__ import annotations

import os
import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.config import Config, ConfigError, Retention, Root, parse_config
from ckptd.errors import EX_CONFIG, EX_IOERR, EX_NOINPUT, EX_USAGE
from tests.support.common import run_ckptd

KEYS = sorted(set(Config.model_fields) | set(Root.model_fields) | set(Retention.model_fields)
              | {"state_dir", "dry_run", "log_format", "path", "match", "bogus"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["60s", "6h", "10%", "500GiB", "/tmp", "min", "max", "auto", "-1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=5) | st.fixed_dictionaries(
    {"roots": st.lists(st.dictionaries(st.sampled_from(KEYS), values, max_size=5), max_size=2)}
)


def _strip_none(v):
    """TOML has no null: drop them, as a parsed document would never hold one."""
    if isinstance(v, dict):
        return {k: _strip_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_strip_none(x) for x in v if x is not None]
    return v


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_document_is_a_config_or_one_line_per_problem(doc):
    try:
        config = parse_config(_strip_none(doc), "fuzz.toml")
    except ConfigError as exc:
        assert exc.problems
        for line in exc.problems:
            assert line.startswith("fuzz.toml: ") and "\n" not in line, line
    else:
        assert isinstance(config, Config)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_any_text_through_the_real_command_exits_as_run_would(tmp_path_factory, text):
    tmp = tmp_path_factory.mktemp("fuzz")
    path = tmp / "c.toml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    proc = run_ckptd("check-config", "-c", path, env={"XDG_STATE_HOME": str(tmp)})
    assert proc.returncode in (0, EX_USAGE, EX_NOINPUT, EX_IOERR, EX_CONFIG), proc.stderr
    assert "Traceback" not in proc.stderr
    if proc.returncode == EX_CONFIG:
        assert all(line.startswith(f"ckptd: {path}: ") for line in proc.stderr.splitlines()), proc.stderr
    else:
        tomllib.loads(text)  # it really was valid TOML
    assert os.listdir(tmp) == ["c.toml"]  # and it wrote nothing
