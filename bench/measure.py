"""Measuring: child processes timed with their own CPU and peak memory, medians, percentiles.

These machines are shared and noisy, so every figure is a median of
repetitions, and comparisons are ratios measured in the same run.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTORCH = REPO / "bench" / "notorch"


def env(*, torch: bool) -> dict[str, str]:
    """The environment for a child: this checkout's ckptd and bench first; torch hidden unless asked."""
    paths = [str(REPO)]
    if not torch:
        paths.insert(0, str(NOTORCH))
    extra = os.environ.get("PYTHONPATH")
    out = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    out["PYTHONPATH"] = os.pathsep.join(paths + ([extra] if extra else []))
    return out


def hide_torch() -> None:
    """In this process, `import torch` fails from now on (what notorch/sitecustomize.py does)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]


def torch_installed() -> bool:
    """Whether torch can be imported, asked in a child so this process stays torch-free."""
    proc = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)"],
        capture_output=True,
        text=True,
        env=env(torch=True),
    )
    return proc.stdout.strip() == "True"


@dataclass(frozen=True)
class Child:
    """A finished child process: wall and CPU seconds, peak RSS, exit status, output."""

    wall: float
    cpu: float
    maxrss_kib: int
    rc: int
    stdout: str
    stderr: str


def run_child(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> Child:
    """Run `argv` to completion; its own rusage comes from wait4, not from all children together."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        # A blocking wait4 times the child exactly and costs no CPU; a timer kills it if it hangs.
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
            killer.join()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return Child(
            wall=wall,
            cpu=ru.ru_utime + ru.ru_stime,
            maxrss_kib=ru.ru_maxrss,
            rc=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


def check(child: Child, what: str) -> Child:
    if child.rc != 0:
        raise RuntimeError(f"{what} exited {child.rc}: {child.stderr.strip()[-800:]}")
    return child


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: with few samples p99 is the maximum, and says so honestly."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def proc_status_kib(field: str) -> int:
    """`VmRSS` / `VmHWM` of this process from /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(r: float) -> str:
    """ckptd / baseline: `17.1×`, or `1/21,373` when ckptd takes a tiny fraction of the baseline."""
    return f"{r:.3g}×" if r >= 0.01 else f"1/{1 / r:,.0f}"


def settle(directory: Path, pause: float = 0.5) -> None:
    """Write dirty data back and let the filesystem's journal commit finish before timing.

    Right after `sync`, the next metadata change on this box waits ~100 ms for the
    journal commit (ext4 with `discard`): a cost of the sync, not of what we time.
    """
    os.sync()
    probe = directory / ".settle"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(probe)
    time.sleep(pause)


def spread(xs: Sequence[float]) -> str:
    """`median 41 ms (36.5–59.8 ms, n=5)`: the median, and how noisy it was."""
    return f"median {fmt_time(median(xs))} ({fmt_time(min(xs))}–{fmt_time(max(xs))}, n={len(xs)})"
