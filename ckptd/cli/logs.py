"""Log handlers and formats; only the command line installs them."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for docker log drivers and log shippers. Times in UTC."""

    FIELDS = ("root", "run", "checkpoint", "state", "action", "reasons", "outcome", "dry_run",
              "kept", "deleted", "slimmed", "incomplete", "bytes_freed", "done", "total")

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """`2026-03-01 14:02:03.120+0100 INFO ...`: local time with its UTC offset, so lines from
    machines in other zones (or around a DST change) can be put in order."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.datetime.fromtimestamp(record.created).astimezone()
        return when.strftime("%Y-%m-%d %H:%M:%S") + f".{int(record.msecs):03d}" + when.strftime("%z")


def _stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to stderr's device:inode when stderr goes to the journal."""
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


def setup_logging(verbose: bool, log_format: str = "text", timestamps: bool = False) -> None:
    """Handlers for the `ckptd` loggers; only the command line installs them.

    The daemon (`timestamps`) logs at INFO: state changes, decisions, deletions; `-v` adds
    DEBUG (every look, every transition). The other commands log warnings only.
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif timestamps and not _stderr_is_journal():  # the journal stamps lines itself
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger("ckptd")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.DEBUG if verbose else logging.INFO if timestamps else logging.WARNING)
