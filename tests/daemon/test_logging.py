"""Log formats: text with or without timestamps (journald stamps its own), JSON one object per line.

The JSON lines of a real daemon are checked in test_metrics.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest

from ckptd.cli import setup_logging


@pytest.fixture
def stderr(tmp_path, monkeypatch):
    """A real file to stand in for stderr (JOURNAL_STREAM names a device and inode), and its lines.

    The test swaps it in itself: pytest re-installs its own sys.stderr when the test body starts.
    The ckptd logger is restored after.
    """
    logger = logging.getLogger("ckptd")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    with open(tmp_path / "stderr", "w+") as f:

        def lines() -> list[str]:
            for h in logger.handlers:
                h.flush()
            f.seek(0)
            text = f.read()
            f.seek(0)
            f.truncate()
            return text.splitlines()

        yield f, lines
    logger.handlers[:], logger.level, logger.propagate = saved


def test_no_timestamps_when_stderr_is_the_journal(stderr, monkeypatch):
    f, lines = stderr
    monkeypatch.setattr(sys, "stderr", f)
    st = os.fstat(f.fileno())
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    setup_logging(False, "text", timestamps=True)
    logging.getLogger("ckptd.daemon").info("ready: watching %d root(s)", 1)
    assert lines() == ["INFO ready: watching 1 root(s)"]
    # JOURNAL_STREAM naming another file (stderr redirected elsewhere by the service): stamp the lines
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    setup_logging(False, "text", timestamps=True)
    logging.getLogger("ckptd.daemon").info("ready")
    [line] = lines()
    # local time with its UTC offset
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}[+-]\d{4} INFO ready", line), line


def test_json_lines_carry_the_decision_fields(stderr, monkeypatch):
    f, lines = stderr
    monkeypatch.setattr(sys, "stderr", f)
    setup_logging(False, "json", timestamps=True)
    log = logging.getLogger("ckptd.daemon")
    log.info("deleted %s", "job/checkpoint-1", extra={"run": "job", "checkpoint": "checkpoint-1",
                                                      "action": "delete", "reasons": ["outside keep_last=1"]})
    try:
        raise OSError("disk on fire")
    except OSError:
        log.exception("cannot look at the volume")
    first, second = (json.loads(line) for line in lines())
    assert first["message"] == "deleted job/checkpoint-1" and first["level"] == "info"
    assert {k: first[k] for k in ("run", "checkpoint", "action", "reasons")} == {
        "run": "job", "checkpoint": "checkpoint-1", "action": "delete", "reasons": ["outside keep_last=1"]}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])  # UTC
    assert second["level"] == "error" and "OSError: disk on fire" in second["traceback"]


@pytest.fixture
def kolkata(monkeypatch):
    """Local time +05:30 (no daylight saving), restored after."""
    import time

    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_log_times_carry_their_offset_and_json_is_utc(kolkata):
    from ckptd.cli import JsonFormatter, TextFormatter

    record = logging.LogRecord("ckptd.daemon", logging.INFO, __file__, 1, "ready", None, None)
    record.created, record.msecs = 1_800_000_000.25, 250.0  # 2027-01-15 08:00:00.250 UTC
    text = TextFormatter("%(asctime)s %(levelname)s %(message)s").format(record)
    assert text == "2027-01-15 13:30:00.250+0530 INFO ready"
    assert json.loads(JsonFormatter().format(record))["time"] == "2027-01-15T08:00:00.250Z"


def test_json_lines_carry_the_root_and_dry_run(stderr, monkeypatch):
    f, lines = stderr
    monkeypatch.setattr(sys, "stderr", f)
    setup_logging(False, "json", timestamps=True)
    logging.getLogger("ckptd.daemon").info("decide delete job/checkpoint-1: outside keep_last=1",
                                           extra={"root": "/vol", "dry_run": True, "action": "delete"})
    [line] = (json.loads(x) for x in lines())
    assert (line["root"], line["dry_run"], line["action"]) == ("/vol", True, "delete")
