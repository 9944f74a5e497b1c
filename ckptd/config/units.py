"""The config's units: durations (`90s`), sizes (`50GiB`), free-space floors (`10%`), `host:port`.

Parsed where the models read them (`Duration`, `Size`, `FreeSpaceFloor`) and formatted back the
same way, for the effective config and for every message that names a time or a size.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

# --- units ---------------------------------------------------------------

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: Any) -> float:
    """`"90s"`, `"6h"`, `"1.5d"` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like '90s' or '6h'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if not m or m[2].lower() not in _DURATION_UNITS:
            raise ValueError(f"expected a duration like '90s', '10m', '6h' or '7d' (got {value!r})")
        seconds = float(m[1]) * _DURATION_UNITS[m[2].lower()]
    else:
        raise ValueError("expected a duration like '90s' or '6h'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"must be a finite, non-negative duration (got {value!r})")
    return seconds


def parse_size(value: Any) -> int:
    """`"500GiB"`, `"1.5TB"` or a number of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like '500GiB'")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if not m or m[2].lower() not in _SIZE_UNITS:
            raise ValueError(f"expected a size like '500GiB', '2TB' or a number of bytes (got {value!r})")
        size = int(float(m[1]) * _SIZE_UNITS[m[2].lower()])
    else:
        raise ValueError("expected a size like '500GiB' or a number of bytes")
    if size < 0:
        raise ValueError(f"must be >= 0 (got {value!r})")
    return size


def format_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m", "s"):
        n = _DURATION_UNITS[unit]
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def format_age(seconds: float) -> str:
    """An elapsed time for people, two units at most: `12s`, `5m12s`, `3h0m`, `2d3h`.

    Not for config values (`format_duration` writes those exactly, to be read back).
    """
    s = max(0, round(seconds))
    for big, small, unit, sub in ((86400, 3600, "d", "h"), (3600, 60, "h", "m"), (60, 1, "m", "s")):
        if s >= big:
            return f"{s // big}{unit}{s % big // small}{sub}"
    return f"{s}s"


def format_size(size: float) -> str:
    """Bytes for humans: `1.5GiB`, `312B`."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        n = _SIZE_UNITS[unit.lower()]
        if size >= n:
            return f"{size / n:.1f}{unit}"
    return f"{int(size)}B"


def format_size_exact(size: int) -> str:
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        n = _SIZE_UNITS[unit.lower()]
        if size >= n and size % n == 0:
            return f"{size // n}{unit}"
    return str(size)


class FreeSpace(BaseModel):
    """A free-space floor: absolute bytes, or a percentage of the filesystem."""

    model_config = ConfigDict(frozen=True)
    bytes: int | None = None
    percent: float | None = None

    def required(self, total_bytes: int) -> int:
        if self.percent is not None:
            return math.ceil(total_bytes * self.percent / 100)
        assert self.bytes is not None
        return self.bytes

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else format_size_exact(self.bytes or 0)


def parse_free_space(value: Any) -> FreeSpace:
    if isinstance(value, FreeSpace):
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"expected a percentage like '10%' (got {value!r})") from None
        if not 0 <= percent < 100:
            raise ValueError(f"a percentage must be in [0, 100) (got {value!r})")
        return FreeSpace(percent=percent)
    return FreeSpace(bytes=parse_size(value))


Duration = Annotated[float, BeforeValidator(parse_duration), PlainSerializer(format_duration)]
Size = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size_exact)]
FreeSpaceFloor = Annotated[FreeSpace, BeforeValidator(parse_free_space), PlainSerializer(str)]


def parse_listen(value: str) -> tuple[str, int]:
    """`"127.0.0.1:9464"`, `"[::1]:9464"` -> (host, port). The host is required: where the
    metrics are exposed is a choice to write down, not a default."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"put an IPv6 address in brackets, e.g. '[::1]:9464' (got {value!r})")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, e.g. '127.0.0.1:9464' (got {value!r})")
    return host, int(port)
