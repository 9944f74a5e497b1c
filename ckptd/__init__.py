"""ckptd: checkpoint retention for ML training volumes, outside the training process.

The Python API, for training scripts (docs/reference/python.md lists each name):

- `ckptd.latest(run_dir)`: the checkpoint a restarted job should load (`ckptd.resume`);
  `ckptd.NothingToResumeError` is what it raises with `strict=True` when none can be resumed from,
  `ckptd.CkptdError` the base of everything it raises.
- `ckptd.attest`: commit records written by the training job after each rank's save.
- `ckptd.integrations`: one line per framework that writes those records from its save hooks
  (`ckptd.integrations.hf`, `.accelerate`, `.deepspeed`, `.lightning`).

Each is imported on first use (PEP 562's module `__getattr__`), so `import ckptd` loads neither
the engine (pydantic, the scanner) nor any framework, and never torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "latest": ("ckptd.resume", "latest"),
    "NothingToResumeError": ("ckptd.resume", "NothingToResumeError"),
    "CkptdError": ("ckptd.errors", "CkptdError"),
    "attest": ("ckptd.attest", None),
    "integrations": ("ckptd.integrations", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # the next look-up finds it without calling here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
