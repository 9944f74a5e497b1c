"""What many test files share: the checkout's root, the seed's losses, and the real `ckptd`
command line as a subprocess."""

from __future__ import annotations

import os
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
