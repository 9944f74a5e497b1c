"""Benchmarks for ckptd against what a user would compare it with: `python -m bench`."""

import sys as _sys
from pathlib import Path as _Path

# Measure the checkout these benchmarks sit in, not whichever ckptd is installed (an editable
# install points at one checkout; a worktree beside it would otherwise measure that one).
_SRC = str(_Path(__file__).resolve().parent.parent / "src")
if _SRC not in _sys.path:
    _sys.path.insert(0, _SRC)
