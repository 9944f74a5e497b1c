"""`ckptd run` as a child process, for the daemon's benchmarks (3. latency, 4. idle cost, 5. memory).

Its JSON log lines (`--log-format json`) are read on a thread, each stamped with
the monotonic time it arrived; its CPU time and memory are read from
/proc/<pid>. Waiting is on log lines, with a timeout.

The child and its reader thread (`JsonLogProc`) are also what the tests' `ckptd run`
(tests/support/daemonproc.py) is built on: one reader and one way of stopping, for both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

from bench.measure import env

CLK_TCK = os.sysconf("SC_CLK_TCK")
KEEP_ALL = "keep_last = 1000000\nkeep_best = 0\n"  # nothing to delete: the volumes are shared


def write_config(
    path: Path,
    root: Path,
    state_dir: Path,
    *,
    observer: str,
    world: int,
    quiet_period: float,
    poll_interval: float | None = None,
    reconcile_interval: float | None = None,
) -> Path:
    """A config for one root that keeps every checkpoint; intervals left out take ckptd's defaults."""
    lines = [
        f"[daemon]\nstate_dir = '{state_dir}'\n",
        f"[[roots]]\npath = '{root}'\nobserver = '{observer}'\nworld_size = {world}",
        f"quiet_period = '{quiet_period:g}s'\nallow_short_quiet_period = true",
    ]
    if poll_interval is not None:
        lines.append(f"poll_interval = '{poll_interval:g}s'")
    if reconcile_interval is not None:
        lines.append(f"reconcile_interval = '{reconcile_interval:g}s'")
    lines.append(f"\n[roots.retention]\n{KEEP_ALL}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


@dataclass(frozen=True)
class Line:
    received: float  # time.monotonic() when the reader thread got it
    doc: dict[str, Any]

    @property
    def message(self) -> str:
        return str(self.doc.get("message", ""))


R = TypeVar("R")


class JsonLogProc(Generic[R]):
    """A child whose stderr is JSON log lines, read on a thread as they come.

    Each line is kept in `lines` as `_record(received, doc)` makes it (a line that is not
    JSON is `{"message": ..., "level": "raw"}`); `_cond` is notified at each line and at
    the end of stderr. `stop()` sends SIGTERM, then SIGKILL after `timeout`.
    """

    _reader_name: str | None = None  # the reader thread's name (None: threading's own)

    def __init__(self, argv: list[str], *, env: dict[str, str]):
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.started = time.monotonic()
        self.lines: list[R] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=self._reader_name, daemon=True)
        self._reader.start()

    def _record(self, received: float, doc: dict[str, Any]) -> R:
        raise NotImplementedError

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            received = time.monotonic()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = {"message": raw.rstrip("\n"), "level": "raw"}
            with self._cond:
                self.lines.append(self._record(received, doc))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DaemonProc(JsonLogProc[Line]):
    """`python -m ckptd run --log-format json -c CONFIG [--foreground]`, torch hidden."""

    _reader_name = "bench-daemon-reader"

    def __init__(self, config: Path, *, foreground: bool = False):
        argv = [sys.executable, "-m", "ckptd", "run", "--log-format", "json", "-c", str(config)]
        if foreground:
            # every state change, at debug level (-v since `--foreground` says only what a person
            # watching wants at info)
            argv += ["--foreground", "-v"]
        super().__init__(argv, env=env(torch=False))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _record(self, received: float, doc: dict[str, Any]) -> Line:
        return Line(received, doc)

    def wait_for(
        self, pred: Callable[[Line], bool], *, timeout: float, count: int = 1, start: int = 0
    ) -> list[Line]:
        """The first `count` lines from index `start` on that satisfy `pred`; RuntimeError after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [line for line in self.lines[start:] if pred(line)]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise RuntimeError(
                        f"waited {timeout:.0f} s for {count} daemon log line(s), saw {len(found)}; "
                        f"exit status {self.proc.poll()}; it said:\n{self.tail()}"
                    )
                self._cond.wait(min(left, 1.0))

    def wait_message(self, text: str, *, timeout: float, count: int = 1, start: int = 0) -> list[Line]:
        return self.wait_for(lambda line: text in line.message, timeout=timeout, count=count, start=start)

    def tail(self, n: int = 30) -> str:
        return "\n".join(f"{line.doc.get('level')} {line.message}" for line in self.lines[-n:])

    def errors(self) -> list[str]:
        return [line.message for line in self.lines if line.doc.get("level") in ("error", "critical", "raw")]

    # --- /proc ------------------------------------------------------------------

    def cpu_s(self) -> float:
        """utime + stime of the whole process (every thread, dead ones included), in seconds."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)

    def threads(self) -> dict[int, tuple[float, int]]:
        """Per thread: (CPU seconds from schedstat, nanosecond precision; voluntary context switches)."""
        out = {}
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{self.pid}/task/{tid}/status") as f:
                    switches = next(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches"))
            except (OSError, StopIteration):
                continue
            out[int(tid)] = (ns / 1e9, switches)
        return out

    def status_kib(self, field: str) -> int:
        """`VmRSS`, `VmHWM`, ... of the daemon, from /proc/<pid>/status, in KiB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)


def is_complete(line: Line, name: str | None = None) -> bool:
    """The daemon's info line `<run>/<checkpoint>: complete (...)` (not the debug transition line)."""
    d = line.doc
    return (
        d.get("level") == "info"
        and d.get("state") == "complete"
        and (name is None or d.get("checkpoint") == name)
    )


def is_settled(line: Line) -> bool:
    """The daemon's totals line (`retention: N kept, ...`), said once everything found at start has
    settled and been decided: those checkpoints' own `complete` lines are debug lines."""
    return line.doc.get("level") == "info" and line.message.startswith("retention: ")


def settle(d: DaemonProc, *, still_for: float = 1.0, timeout: float = 120) -> None:
    """Wait until the daemon's CPU time has not moved for `still_for` (the work it had in hand is done)."""
    deadline = time.monotonic() + timeout
    last = d.cpu_s()
    while time.monotonic() < deadline:
        time.sleep(still_for)
        now = d.cpu_s()
        if now == last:
            return
        last = now


def until_complete(
    d: DaemonProc, checkpoints: int, *, timeout: float, still_for: float = 1.0
) -> dict[str, float]:
    """Wait until `d` is READY, has settled and decided the `checkpoints` found at start (its
    totals line) and is still again.

    Returns when each stage was reached (seconds after its start), its RSS at READY and
    once still, its peak RSS and its thread count.
    """
    ready = d.wait_message("ready:", timeout=timeout)[0]
    facts = {"ready_s": ready.received - d.started, "rss_ready_kib": d.status_kib("VmRSS")}
    facts["threads_ready"] = len(os.listdir(f"/proc/{d.pid}/task"))
    last = d.wait_for(is_settled, timeout=timeout)[-1]
    facts["complete_s"] = last.received - d.started
    # The tick that completed them goes on (retention, watches, the state file): wait it out.
    settle(d, still_for=still_for, timeout=timeout)
    facts["still_s"] = time.monotonic() - d.started
    facts["rss_complete_kib"] = d.status_kib("VmRSS")
    facts["hwm_kib"] = d.status_kib("VmHWM")
    facts["threads"] = len(os.listdir(f"/proc/{d.pid}/task"))
    return facts


def start_until_complete(
    config: Path, checkpoints: int, *, timeout: float, still_for: float = 1.0
) -> tuple[DaemonProc, dict[str, float]]:
    """Start a daemon and wait until it is READY, has declared `checkpoints` complete and is still."""
    d = DaemonProc(config)
    try:
        return d, until_complete(d, checkpoints, timeout=timeout, still_for=still_for)
    except BaseException:
        d.stop()
        raise
