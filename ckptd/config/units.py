"""The config's units: durations (`90s`), sizes (`50GiB`), free-space floors (`10%`), `host:port`.

Parsed where the models read them (`Duration`, `Size`, `FreeSpaceFloor`) and formatted back the
same way (ckptd/formatting.py, which every message that names a time or a size uses too).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from ckptd.formatting import DURATION_UNITS, SIZE_UNITS, format_duration, format_size_exact

# --- units ---------------------------------------------------------------

_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: Any) -> float:
    """`"90s"`, `"6h"`, `"1.5d"` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like '90s' or '6h'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if not m or m[2].lower() not in DURATION_UNITS:
            raise ValueError(f"expected a duration like '90s', '10m', '6h' or '7d' (got {value!r})")
        seconds = float(m[1]) * DURATION_UNITS[m[2].lower()]
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
        if not m or m[2].lower() not in SIZE_UNITS:
            raise ValueError(f"expected a size like '500GiB', '2TB' or a number of bytes (got {value!r})")
        size = int(float(m[1]) * SIZE_UNITS[m[2].lower()])
    else:
        raise ValueError("expected a size like '500GiB' or a number of bytes")
    if size < 0:
        raise ValueError(f"must be >= 0 (got {value!r})")
    return size


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
