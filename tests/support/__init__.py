"""What ckptd's tests share: generators of real framework and DeepSpeed checkpoints, the daemon
as a subprocess, fault seams, a caching FUSE client. Imported as `tests.support.<module>`: pytest's
`pythonpath` option (pyproject.toml) puts the checkout's root and its src/ on sys.path; run one
as a script from the checkout's root with `PYTHONPATH=. python -m tests.support.<module> ...`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Set (to the test's id) by tests/conftest.py in a test marked neither frameworks nor deepspeed.
LIGHT_TEST = "CKPTD_TEST_LIGHT"


def child_pythonpath() -> str:
    """PYTHONPATH for a `python -m tests.support.<module>` child: this checkout's src/ (test this
    tree, not an installed ckptd) and its root (the `tests` package), then what was there."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def refuse_in_light_test(what: str) -> None:
    """Exit, naming the test, when a real framework or DeepSpeed job starts in a test that is not
    marked for one: the fast tier (`-m fast`) would be slow without saying why."""
    if test := os.environ.get(LIGHT_TEST):
        sys.exit(f"{test} starts {what} but is marked neither frameworks nor deepspeed (tests/conftest.py)")
