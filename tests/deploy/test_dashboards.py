"""The Prometheus alerting rules and the Grafana dashboard in deploy/: valid, firing on the series
they are meant for, and naming only series ckptd exports.

promtool is Debian's `prometheus` package (.ci/run installs it); the tests that need it skip
where it is absent and say so. The dashboard is checked against a small schema of what Grafana's
import needs (jsonschema where it is installed, else the same schema by a few lines below)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.support.common import REPO

RULES = REPO / "deploy" / "prometheus" / "ckptd-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "ckptd-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "ckptd-dashboard.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus): rules not checked here"
)


def promtool(*args: str, cwd=RULES.parent) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rules():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 10 rules found" in proc.stdout


@needs_promtool
def test_each_alert_fires_on_its_series_and_only_there():
    """ckptd-alerts.test.yml: input series and the alerts (labels, annotations) they must give."""
    proc = promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert tested == set(alert_names())


@needs_promtool
def test_the_rule_tests_can_fail(tmp_path):
    """A weakened rule (CkptdStuck's threshold an hour, not 15 minutes) fails the rule tests."""
    (tmp_path / "ckptd-alerts.yml").write_text(RULES.read_text().replace("> 3 * 300", "> 3600"))
    (tmp_path / "ckptd-alerts.test.yml").write_text(RULE_TESTS.read_text())
    proc = promtool("test", "rules", "ckptd-alerts.test.yml", cwd=tmp_path)
    assert proc.returncode != 0 and "CkptdStuck" in proc.stdout + proc.stderr
    (tmp_path / "bad.yml").write_text(RULES.read_text().replace("expr: up{", "expr: up{{", 1))
    assert promtool("check", "rules", "bad.yml", cwd=tmp_path).returncode != 0


def alert_names() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_alert_is_documented_and_every_documented_alert_exists():
    page = (REPO / "docs" / "operations.md").read_text()
    documented = re.findall(r"^\| `(Ckptd\w+)` \|", page, re.M)
    assert documented == alert_names()
    for rule in (r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]):
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# --- the dashboard ----------------------------------------------------------------------

DATASOURCE = {"type": "object", "required": ["type", "uid"],
              "properties": {"type": {"enum": ["prometheus"]}, "uid": {"enum": ["${datasource}"]}}}
GRID = {"type": "object", "required": ["x", "y", "w", "h"],
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 23},
                       "y": {"type": "integer", "minimum": 0},
                       "w": {"type": "integer", "minimum": 1, "maximum": 24},
                       "h": {"type": "integer", "minimum": 1}}}
TARGET = {"type": "object", "required": ["expr", "refId", "datasource"],
          "properties": {"expr": {"type": "string", "minLength": 1}, "refId": {"type": "string"},
                         "datasource": DATASOURCE}}
PANEL = {"type": "object", "required": ["id", "type", "title", "gridPos"],
         "properties": {"id": {"type": "integer"}, "title": {"type": "string", "minLength": 1},
                        "type": {"enum": ["row", "stat", "table", "timeseries", "gauge", "bargauge"]},
                        "gridPos": GRID, "datasource": DATASOURCE,
                        "targets": {"type": "array", "items": TARGET}}}
SCHEMA = {"type": "object",
          "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
          "properties": {"title": {"type": "string", "minLength": 1}, "uid": {"type": "string", "maxLength": 40},
                         "schemaVersion": {"type": "integer", "minimum": 36},
                         "panels": {"type": "array", "items": PANEL, "minLength": 1},
                         "templating": {"type": "object", "required": ["list"],
                                        "properties": {"list": {"type": "array", "items": {
                                            "type": "object", "required": ["name", "type"]}}}}}}
_TYPES = {"object": dict, "array": list, "string": str, "integer": int}


def check(value, schema, where="$") -> list[str]:
    """The subset of JSON Schema SCHEMA uses, for where jsonschema is not installed."""
    kind = schema.get("type")
    if kind and (not isinstance(value, _TYPES[kind]) or (kind == "integer" and isinstance(value, bool))):
        return [f"{where}: not {kind}"]
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} not one of {schema['enum']}")
    if ("minimum" in schema and value < schema["minimum"]) or ("maximum" in schema and value > schema["maximum"]):
        problems.append(f"{where}: {value} out of range")
    if isinstance(value, str | list) and len(value) < schema.get("minLength", 0):
        problems.append(f"{where}: empty")
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        problems.append(f"{where}: too long")
    for key in schema.get("required", ()):
        if key not in value:
            problems.append(f"{where}: {key} missing")
    for key, sub in schema.get("properties", {}).items():
        if isinstance(value, dict) and key in value:
            problems += check(value[key], sub, f"{where}.{key}")
    if "items" in schema:
        for i, item in enumerate(value):
            problems += check(item, schema["items"], f"{where}[{i}]")
    return problems


def validate(document) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        return check(document, SCHEMA)
    return [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(document)]


def test_the_dashboard_is_what_grafana_imports():
    dashboard = json.loads(DASHBOARD.read_text())
    assert validate(dashboard) == []
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(set(refs)) == len(refs), p["title"]
        assert p["type"] == "row" or refs, f"{p['title']} queries nothing"
    cells = {(x, y) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])}
    assert len(cells) == sum(p["gridPos"]["w"] * p["gridPos"]["h"] for p in panels), "panels overlap"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in exprs_of_dashboard():
        assert set(re.findall(r"\$(\w+)", expr)) <= variables, expr


def test_the_schema_check_can_fail():
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["gridPos"]["w"] = 30
    dashboard["panels"][2]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "my-prod-uid"}
    del dashboard["schemaVersion"]
    assert len(check(dashboard, SCHEMA)) == 3 and len(validate(dashboard)) == 3


# --- the series they name ----------------------------------------------------------------


def exprs_of_dashboard() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]


def exprs_of_rules() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def series(expr: str) -> set[str]:
    """ckptd's metric names in a PromQL expression, as registered: without the suffixes the
    exposition adds (a counter's _total, a histogram's _bucket/_sum/_count)."""
    return {re.sub(r"_(total|bucket|sum|count|created)$", "", name) for name in re.findall(r"\bckptd_\w+", expr)}


def exported() -> set[str]:
    """The names ckptd/daemon/metrics.py registers."""
    return set(re.findall(r'"(ckptd_\w+)"', (REPO / "ckptd" / "daemon" / "metrics.py").read_text()))


def documented() -> set[str]:
    """The series docs/operations.md lists (what the daemon exports, and those agreed for it)."""
    page = (REPO / "docs" / "operations.md").read_text()
    return {re.sub(r"_total$", "", n) for n in re.findall(r"^\| `(ckptd_\w+)", page, re.M)} | {
        re.sub(r"_total$", "", n) for n in re.findall(r"`(ckptd_\w+)\{", page)}


def test_every_series_the_alerts_and_dashboard_use_is_exported_or_documented():
    used = set().union(*map(series, exprs_of_rules() + exprs_of_dashboard()))
    assert {"ckptd_leader", "ckptd_budget_unmet", "ckptd_run_newest_complete_timestamp_seconds"} <= used
    assert used - (exported() | documented()) == set()
    # and what the code registers is documented
    assert exported() - documented() == set()


def test_a_misspelt_series_is_caught():
    assert series("time() - ckptd_last_reconcile_timestmp_seconds > 900") - (exported() | documented())


def test_ci_installs_promtool():
    assert "command -v promtool >/dev/null || (apt-get update && apt-get install -y --no-install-recommends " \
        "prometheus)" in (REPO / ".ci" / "run").read_text()
