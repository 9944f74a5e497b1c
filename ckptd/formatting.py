"""Times and sizes written for people (`format_size`: `1.5GiB`; `format_age`: `5m12s`) and exactly,
to be read back, for the config (`format_duration`: `90s`; `format_size_exact`: `50GiB`), with the
tables of units they and the config's parsers (config/units.py) go by. Imports nothing of ckptd:
any stage may use it without reaching into the config.
"""

from __future__ import annotations

# --- units ---------------------------------------------------------------

DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
SIZE_UNITS = {
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


def format_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m", "s"):
        n = DURATION_UNITS[unit]
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
        n = SIZE_UNITS[unit.lower()]
        if size >= n:
            return f"{size / n:.1f}{unit}"
    return f"{int(size)}B"


def format_size_exact(size: int) -> str:
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        n = SIZE_UNITS[unit.lower()]
        if size >= n and size % n == 0:
            return f"{size // n}{unit}"
    return str(size)
