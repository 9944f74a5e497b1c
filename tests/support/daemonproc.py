"""The real `ckptd run` as a subprocess, and waiting on its log lines with a timeout (never sleeping)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The child, its reader thread and stopping are the benchmarks' (bench/daemon.py): one copy.
from bench.daemon import JsonLogProc


class DaemonProc(JsonLogProc[dict[str, Any]]):
    """`ckptd run --foreground --log-format json ...`, its stderr parsed line by line."""

    def __init__(self, *args: str | os.PathLike[str], env: dict[str, str] | None = None,
                 command: list[str] | None = None):
        """`command` replaces `python -m ckptd run --foreground -v --log-format json` (it must log JSON).

        -v: the debug lines too (`state written` is what tests wait on for a fresh state file).
        """
        full_env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
        full_env.update(env or {})
        command = command or [sys.executable, "-m", "ckptd", "run", "--foreground", "-v", "--log-format", "json"]
        super().__init__([*command, *map(str, args)], env=full_env)

    def _record(self, received: float, doc: dict[str, Any]) -> dict[str, Any]:
        return doc

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30, count: int = 1,
                 start: int = 0) -> list[dict[str, Any]]:
        """Block until `count` log lines from index `start` on satisfy `pred`; fail after `timeout`."""
        deadline = time.monotonic() + timeout

        def matches() -> list[dict[str, Any]]:
            return [line for line in self.lines[start:] if pred(line)]

        with self._cond:
            while len(found := matches()) < count:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"waited {timeout}s for {count} log line(s); the daemon said:\n" + self.dump()
                    )
                self._cond.wait(left)
            return found

    def wait_message(self, text: str, timeout: float = 30, count: int = 1, start: int = 0) -> list[dict[str, Any]]:
        return self.wait_for(lambda line: text in line.get("message", ""), timeout, count, start)

    def dump(self) -> str:
        return "\n".join(f"{line.get('level')} {line.get('message')}" for line in self.lines[-80:])

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)


def write_config(path: Path, root: Path, state_dir: Path, *, root_extra: str = "", retention: str = "") -> Path:
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\n"
        f"[[roots]]\npath = '{root}'\n{root_extra}\n"
        f"[roots.retention]\n{retention}\n"
    )
    return path
