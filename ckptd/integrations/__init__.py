"""Commit records from the frameworks' own save hooks (`ckptd.attest`), one line in a training
script each. Every module imports its framework only when used, so importing ckptd needs none;
each module here is itself imported on first use (`ckptd.integrations.hf` after `import ckptd`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["accelerate", "deepspeed", "hf", "lightning"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'ckptd.integrations' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")  # the import binds it here for next time
