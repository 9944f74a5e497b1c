"""What many test files share: the checkout's root, the seed's losses, and the real `ckptd`
command line as a subprocess."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

__all__ = ["LOSSES", "REPO", "run_ckptd"]

# The best checkpoint is the oldest: the seed's case.
LOSSES = {10: 0.20, 20: 0.90, 30: 0.80, 40: 0.70}


def run_ckptd(*args: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 120,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real `ckptd` command line, as a subprocess."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckptd", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


def wake_paused_consolidator(pid: int) -> None:
    """End a consolidator's test pause (`consolidate._pause_for_tests`): SIGUSR1 to its main thread
    only (tgkill). Only that thread blocks SIGUSR1, and a process-directed signal may land on one of
    torch's threads, whose default action kills the child ("killed by signal 10")."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, pid, signal.SIGUSR1) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def shift_mtimes(root: Path, seconds: float) -> None:
    """Every mtime under `root` `seconds` further back, their order kept (never by sleeping)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(p := os.path.join(dirpath, n))
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)), follow_symlinks=False)


def in_trash(trash: Path) -> list[str]:
    """The entries of a trash directory, without the record of its decision beside each
    (`<entry>%decision`, removal/decision.py)."""
    return [n for n in os.listdir(trash) if not n.endswith("%decision")]
