"""ckptd: checkpoint retention for ML training volumes, outside the training process.

`ckptd.latest(run_dir)` names the checkpoint a restarted job should load (see `ckptd.resume`);
it is imported on first use, so `import ckptd` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "latest"]


def __getattr__(name: str) -> Any:
    if name == "latest":
        from ckptd.resume import latest

        return latest
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
