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
        self._dir: tuple[int, int] | None = None  # the state_dir's (dev, inode) when the journal was opened

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            self._dir = _identity(os.stat(self.path.parent))
        return self._fd

    def footing(self) -> str | None:
        """Why the state_dir and the journal are no longer the ones this process opened (removed,
        replaced, not writable: what it records would go nowhere a reader looks), or None."""
        state_dir = self.path.parent
        with self._lock:
            try:
                st = os.stat(state_dir)
            except FileNotFoundError:
                return f"the state_dir {state_dir} was removed"
            except OSError as exc:
                return f"the state_dir {state_dir} cannot be looked at ({exc.strerror})"
            if self._fd is None:
                return None if os.access(state_dir, os.W_OK) else f"the state_dir {state_dir} is not writable"
            if _identity(st) != self._dir:
                return f"the state_dir {state_dir} was replaced by another directory"
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                return f"the journal {self.path} was removed"
            except OSError as exc:
                return f"the journal {self.path} cannot be looked at ({exc.strerror})"
            if _identity(now) != _identity(os.fstat(self._fd)):
                return f"the journal {self.path} was replaced by another file"
            if not os.access(self.path, os.W_OK):
                return f"the journal {self.path} is not writable"
            return None

    def reopen(self, why: str) -> None:
        """Start again at the journal's path (the state_dir made again if it must be), saying in
        the new one why: what the lost one held is not here."""
        with self._lock:  # nothing else recorded between the close and this first record
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._append("journal-reopened", {"why": why})

    def record(self, event: str, **fields: Any) -> None:
        """Append one record and fsync it. Raises OSError if it cannot: callers must not act then."""
        with self._lock:
            self._append(event, fields)

    def _append(self, event: str, fields: dict[str, Any]) -> None:
        line = (
            json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str, ensure_ascii=True) + "\n"
        )
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


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


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
