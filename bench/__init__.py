"""Benchmarks for ckptd against what a user would compare it with: `python -m bench`."""

import sys as _sys
from pathlib import Path as _Path

# Measure the checkout these benchmarks sit in, not whichever ckptd is installed (an editable
# install points at one checkout; a worktree beside it would otherwise measure that one).
# The checkout's root too: the real DeepSpeed jobs come from its tests.support.dsgen.
_REPO = _Path(__file__).resolve().parent.parent
for _path in (str(_REPO),):
    if _path not in _sys.path:
        _sys.path.insert(0, _path)
