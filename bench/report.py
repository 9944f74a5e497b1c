"""Results: one `Row` per measured comparison, printed as a table; the machine and the tree measured."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Row:
    """One line of the table: ckptd's figure beside the baseline's, on the same tree, in the same run.

    `met` is None where there is no target or nothing to compare yet.
    """

    benchmark: str  # "1. cold start"
    case: str  # "M: `ckptd plan` vs `find -printf`"
    ckptd: str
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    met: bool | None = None
    note: str = ""  # why a target is missed, in 1-3 sentences: the figures are in the row itself

    @property
    def verdict(self) -> str:
        return "—" if self.met is None else ("yes" if self.met else "**no**")


@dataclass
class Section:
    """What one benchmark measured and how, for the notes below the table."""

    title: str
    method: str
    details: list[str] = field(default_factory=list)


COLUMNS = ("benchmark", "case", "ckptd", "baseline", "ratio", "target", "met?")


def _cells(r: Row) -> tuple[str, ...]:
    return (r.benchmark, r.case, r.ckptd, r.baseline, r.ratio, r.target, r.verdict)


def text_table(rows: list[Row]) -> str:
    cells = [COLUMNS, *(_cells(r) for r in rows)]
    widths = [max(len(c[i].replace("**", "")) for c in cells) for i in range(len(COLUMNS))]
    lines = []
    for i, c in enumerate(cells):
        lines.append("  ".join(v.replace("**", "").ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(v.replace("|", "\\|") for v in _cells(r)) + " |" for r in rows]
    return "\n".join(out)


# --- the machine ---------------------------------------------------------


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of the filesystem holding `path`."""
    real = os.path.realpath(path)
    best = ("/", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, opts, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, opts)
    except OSError:
        pass
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _memory() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return f"{kib / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        return "?"


def _git(repo: Path, leave_out: list[Path]) -> str:
    exclude = [
        f":(exclude){p.resolve().relative_to(repo.resolve())}"
        for p in leave_out
        if p.resolve().is_relative_to(repo.resolve())
    ]
    try:
        rev = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--", ".", *exclude],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + (" (uncommitted changes)" if dirty else "")


def machine(bench_dir: Path, repo: Path, torch_version: str | None) -> list[tuple[str, str]]:
    import watchdog.version

    mnt, fstype, opts = _mount_of(bench_dir)
    return [
        ("CPU", f"{os.cpu_count()} × {_cpu_model()}"),
        ("cores", str(len(os.sched_getaffinity(0)))),
        ("memory", _memory()),
        ("kernel", platform.release()),
        ("bench directory", f"{fstype} ({mnt}, {opts})"),
        ("python", sys.version.split()[0]),
        ("watchdog", watchdog.version.VERSION_STRING),
        ("torch", torch_version or "not installed"),
    ]


def tree(repo: Path, report: Path | None = None, results: Path | None = None) -> str:
    """The commit measured, and whether tracked files differ from it (the report and its results aside)."""
    return _git(repo, [p for p in (report, results) if p is not None])
