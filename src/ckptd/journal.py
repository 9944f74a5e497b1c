"""The journal: an append-only record of every deletion ckptd attempted.

JSON lines in `state_dir/journal.jsonl`, each flushed and fsynced before the
action it announces, so after a crash the journal says what was under way.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

JOURNAL_NAME = "journal.jsonl"


class Journal:
    def __init__(self, state_dir: Path):
        self.path = state_dir / JOURNAL_NAME
        self._lock = threading.Lock()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        return self._fd

    def record(self, event: str, **fields: Any) -> None:
        """Append one record and fsync it. Raises OSError if it cannot: callers must not act then."""
        line = (
            json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str, ensure_ascii=True) + "\n"
        )
        with self._lock:
            try:
                fd = self._open()
                os.write(fd, line.encode())
                os.fsync(fd)
            except OSError as exc:  # a write through a descriptor names no file: name the journal
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_journal(state_dir: Path) -> list[dict[str, Any]]:
    """Every complete record; a torn last line (a crash mid-write) is skipped."""
    path = state_dir / JOURNAL_NAME
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
