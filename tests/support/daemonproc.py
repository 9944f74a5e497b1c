"""The real `ckptd run` as a subprocess, and waiting on its log lines with a timeout (never sleeping)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DaemonProc:
    """`ckptd run --foreground --log-format json ...`, its stderr parsed line by line."""

    def __init__(self, *args: str | os.PathLike[str], env: dict[str, str] | None = None,
                 command: list[str] | None = None):
        """`command` replaces `python -m ckptd run --foreground -v --log-format json` (it must log JSON).

        -v: the debug lines too (`state written` is what tests wait on for a fresh state file).
        """
        full_env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
        full_env.update(env or {})
        command = command or [sys.executable, "-m", "ckptd", "run", "--foreground", "-v", "--log-format", "json"]
        self.proc = subprocess.Popen(
            [*command, *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            try:
                line = json.loads(raw)
            except ValueError:
                line = {"message": raw.rstrip("\n"), "level": "raw"}
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

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

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    def dump(self) -> str:
        return "\n".join(f"{line.get('level')} {line.get('message')}" for line in self.lines[-80:])

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()
        return rc

    def __enter__(self) -> DaemonProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_config(path: Path, root: Path, state_dir: Path, *, root_extra: str = "", retention: str = "") -> Path:
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\n"
        f"[[roots]]\npath = '{root}'\n{root_extra}\n"
        f"[roots.retention]\n{retention}\n"
    )
    return path
