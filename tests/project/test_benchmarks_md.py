"""BENCHMARKS.md is generated: bench/results.py's rendering of bench/results.json, the latest figures
only, and short. What changed between runs is in the history of bench/results.json, not in the report."""

from __future__ import annotations

import re
import sys

from tests.support.common import REPO

sys.path.insert(0, str(REPO))  # bench/ is not installed: it is run from a checkout

from bench import results

REPORT = REPO / "BENCHMARKS.md"
RECORDED = REPO / "bench" / "results.json"
LIMIT = 20 * 1024


def test_the_report_is_the_rendering_of_the_recorded_results():
    """A hand edit, or results.json changed without the report, fails here: `python -m bench --render`."""
    assert REPORT.read_text() == results.render(results.load(RECORDED))


def test_the_report_stays_under_20_kb():
    size = len(REPORT.read_bytes())
    assert size < LIMIT, f"BENCHMARKS.md is {size:,} bytes: the latest run's table and short notes only"


def test_every_section_names_its_run():
    """Each section says when, how and on what it was measured, so a partial rerun cannot pass for
    the whole run: the report names every section's run that differs from the main one."""
    doc = results.load(RECORDED)
    assert doc["sections"]
    for name, section in doc["sections"].items():
        run = section["run"]
        assert run["command"].startswith("python -m bench"), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", run["date"]), name
        assert " at " in run["tree"] and "cores" in run["machine"], name
        assert {"min", "median", "max"} <= section["load"].keys(), name
        assert section["rows"], name


def test_the_report_dates_nothing_but_its_runs():
    """No history in the report: every date in it is one of the recorded runs' own."""
    doc = results.load(RECORDED)
    days = {s["run"]["date"][:10] for s in doc["sections"].values()}
    found = set(re.findall(r"\b20\d\d-\d\d-\d\d\b", REPORT.read_text()))
    assert found <= days, f"dates in BENCHMARKS.md that are no run's: {sorted(found - days)}"


def test_a_section_rerun_alone_is_marked_with_its_own_run():
    """`--only NAME` replaces one section; its rows then say they come from another run."""
    doc = results.load(RECORDED)
    name, section = next(iter(doc["sections"].items()))
    again = {
        **section,
        "run": {
            **section["run"],
            "date": "2099-01-01 00:00 UTC",
            "command": "python -m bench --only " + name,
        },
    }
    text = results.render(results.merge(doc, [again]))
    if len(doc["sections"]) > 2:  # the main run is the one with the most sections
        assert "### Run B" in text and f"| {section['title']} (B) |" in text
    assert "2099-01-01 00:00 UTC" in text and text != REPORT.read_text()
