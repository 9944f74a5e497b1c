"""What ckptd's tests share: generators of real framework and DeepSpeed checkpoints, the daemon
as a subprocess, fault seams, a caching FUSE client. Imported as `tests.support.<module>`: pytest's
`pythonpath` option (pyproject.toml) puts the checkout's root and its src/ on sys.path; run one
as a script from the checkout's root with `PYTHONPATH=src python -m tests.support.<module> ...`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_pythonpath() -> str:
    """PYTHONPATH for a `python -m tests.support.<module>` child: this checkout's src/ (test this
    tree, not an installed ckptd) and its root (the `tests` package), then what was there."""
    return os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))
