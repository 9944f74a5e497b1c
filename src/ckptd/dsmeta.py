"""Reading a DeepSpeed checkpoint's metadata, safely.

torch is imported here, lazily, on the first DeepSpeed checkpoint that needs
it: never on the daemon's start-up path (`import torch` costs ~1.4 s and
~220 MiB). Files are loaded with `weights_only=True` only: a file on a
shared volume must not be able to run code inside the daemon.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path


class MetadataUnavailable(Exception):
    """The world sizes cannot be read: no torch, or an unreadable file."""


@dataclass(frozen=True)
class WorldSizes:
    dp: int
    mp: int
    stage: int | None  # ZeRO stage from the saved ds_config, if recorded
    source: str  # where the numbers came from, for the evidence detail


_torch_lock = threading.Lock()


@functools.cache
def _torch():
    with _torch_lock:
        try:
            import torch
        except ImportError as exc:
            raise MetadataUnavailable(f"torch is not installed ({exc})") from None
        return torch


def torch_available() -> bool:
    try:
        _torch()
    except MetadataUnavailable:
        return False
    return True


def load_safely(path: Path) -> dict:
    """`torch.load(path, weights_only=True, mmap=True)` on the CPU, and nothing looser."""
    torch = _torch()
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds: UnpicklingError, RuntimeError, OSError...
        text = str(exc).strip()
        first_line = text.splitlines()[0][:160] if text else type(exc).__name__
        raise MetadataUnavailable(f"cannot load {path.name} with weights_only=True: {first_line}") from exc
    if not isinstance(obj, dict):
        raise MetadataUnavailable(f"{path.name} does not hold a dict")
    return obj


def read_world_sizes(path: Path) -> WorldSizes:
    """dp/mp world sizes and ZeRO stage from a model-states file."""
    sd = load_safely(path)
    dp, mp = sd.get("dp_world_size"), sd.get("mp_world_size")
    if not isinstance(dp, int) or not isinstance(mp, int) or isinstance(dp, bool) or dp < 1 or mp < 1:
        raise MetadataUnavailable(f"{path.name} has no usable dp_world_size/mp_world_size ({dp!r}, {mp!r})")
    stage = None
    ds_config = sd.get("ds_config")
    if isinstance(ds_config, dict):
        zero = ds_config.get("zero_optimization")
        if isinstance(zero, dict) and isinstance(zero.get("stage"), int):
            stage = zero["stage"]
    return WorldSizes(dp=dp, mp=mp, stage=stage, source=path.name)
