"""Results: one `Row` per measured comparison, printed as a table and written as BENCHMARKS.md."""

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
    note: str = ""  # the closing note: by how much a target is missed, and what would close it

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


def _git(repo: Path, report: Path | None = None) -> str:
    """The commit measured, and whether tracked files differ from it (the report itself aside)."""
    exclude = []
    if report is not None and report.resolve().is_relative_to(repo.resolve()):
        exclude = [f":(exclude){report.resolve().relative_to(repo.resolve())}"]
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


def machine(
    bench_dir: Path, repo: Path, torch_version: str | None, report: Path | None = None
) -> list[tuple[str, str]]:
    import watchdog.version

    import ckptd

    mnt, fstype, opts = _mount_of(bench_dir)
    return [
        ("CPU", f"{os.cpu_count()} × {_cpu_model()} (nproc {len(os.sched_getaffinity(0))})"),
        ("memory", _memory()),
        ("kernel", platform.release()),
        ("bench directory", f"{bench_dir} on {fstype} ({mnt}, {opts})"),
        ("python", sys.version.split()[0]),
        ("ckptd", f"{ckptd.__version__} at {_git(repo, report)}, byte-compiled first (as pip does)"),
        ("watchdog", watchdog.version.VERSION_STRING),
        ("torch", torch_version or "not installed"),
        ("page cache", "warm: caches cannot be dropped without root on a shared box; every figure is warm"),
    ]


def markdown(
    *,
    rows: list[Row],
    sections: list[Section],
    machine_info: list[tuple[str, str]],
    command: str,
    date: str,
    total_s: float,
    volumes: list[str],
) -> str:
    out = [
        "# ckptd benchmarks",
        "",
        "Written by `python -m bench`; rerun it to refresh. Every figure is a median of repetitions,",
        "measured beside its baseline on the same tree in the same run: these machines are shared",
        "and noisy, so read the ratios, not single times.",
        "",
        f"- **date**: {date}",
        f"- **command**: `{command}`",
        f"- **total run time**: {total_s / 60:.1f} min ({total_s:.0f} s, volumes built included)",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in machine_info),
        "",
        "## Volumes",
        "",
        "Synthetic Trainer + DeepSpeed ZeRO-2 volumes (`bench/volume.py`): R runs × C checkpoints,",
        "each checkpoint one shard and one `rng_state_<r>.pth` per rank plus 12 small files",
        "(model states, trainer_state.json, model.safetensors, config, tokenizer, ...), all complete,",
        "aged with `os.utime`.",
        "",
        *(f"- {v}" for v in volumes),
        "",
        "## Results",
        "",
        markdown_table(rows),
        "",
    ]
    notes = [r for r in rows if r.note]
    if notes:
        out += ["## Targets missed, and what would close them", ""]
        out += [f"- **{r.benchmark}, {r.case}**: {r.note}" for r in notes]
        out.append("")
    out += ["## How each benchmark measures", ""]
    for s in sections:
        out += [f"### {s.title}", "", s.method, ""]
        out += [f"- {d}" for d in s.details]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
