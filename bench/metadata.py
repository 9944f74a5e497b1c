"""9. Metadata load: what ckptd asks of the filesystem, per reconcile and per idle hour.

On Lustre, NFS or GPFS every stat, directory listing and open is a round trip to a
metadata server the whole cluster shares, so the count of those operations is the cost
that matters there, more than CPU. Counted two ways, checked against each other:

- In-process (`python -m bench.probe reconcile` and `hours --count`): wrappers around
  os.stat, os.lstat, DirEntry.stat, os.scandir, os.listdir, os.open and open (io.open)
  count what ckptd asks for on paths below the root. Deterministic, and it can run an
  idle hour on a fake monotonic clock: `Tick.run` (daemon/tick.py) driven as `main_loop` drives it,
  the clock jumping to each deadline (360 polls and 12 reconciles at the defaults).
- `strace -f -y` of the same probe, between marker stats around each phase: the system
  calls that reach the kernel. A listing is an `openat(O_DIRECTORY)`, an `fstat` of it and
  `getdents64` calls, so strace's stat calls = the wrappers' stats + listings, its
  directory opens = listings, its file opens = opens; the benchmark says whether they agree.

Baselines, on the same volume: watchdog's `PollingObserver` (a stat per entry and a
listing per directory, every cycle; at ckptd's poll_interval of 10 s that is 360 cycles
an hour) and one `find ROOT -printf '%s\\n'` (counted by `strace -c`).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from bench.context import Context
from bench.daemon import write_config
from bench.measure import check, env, fmt_ratio, fmt_time, run_child
from bench.probe import MARKER
from bench.report import Row, Section

NAME = "9. metadata load"
POLLS_PER_HOUR, RECONCILES_PER_HOUR = 360, 12  # ckptd's defaults: poll_interval 10 s, reconcile 5 min
STAT_CALLS = ("newfstatat", "statx", "stat", "lstat", "fstat", "fstatat64", "stat64", "lstat64")


def _n(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.3g}M"
    if x >= 1e4:
        return f"{x / 1e3:.3g}k"
    return f"{x:,.0f}"


def ops_text(ops: dict[str, int]) -> str:
    parts = [f"{_n(ops.get('stat', 0))} stats", f"{_n(ops.get('listing', 0))} listings"]
    parts.append(f"{_n(ops.get('open', 0))} opens")
    return ", ".join(parts)


def keep_all_config(ctx: Context, shape_name: str, root: Path, world: int, name: str = "metadata") -> Path:
    work = ctx.scratch(f"{name}-{shape_name}")
    return write_config(work / "ckptd.toml", root, work / "state", observer="polling", world=world,
                        quiet_period=60.0)  # fmt: skip


def strace_phases(argv: list[str], root: Path, phases: list[str], work: Path) -> dict[str, dict[str, int]]:
    """System calls on paths below `root` made by `argv` between each phase's markers."""
    trace = work / "strace.txt"
    cmd = ["strace", "-f", "-qq", "-y", "-e", "trace=%file,%desc,getdents64", "-o", str(trace), *argv]
    check(run_child(cmd, env=env(torch=False), timeout=1800), "strace probe")
    prefix = str(root).rstrip("/") + "/"
    out: dict[str, dict[str, int]] = {}
    current: Counter[str] | None = None
    with trace.open(errors="replace") as f:
        for line in f:
            if MARKER in line:
                m = re.search(re.escape(MARKER) + r"-(\w+)-(begin|end)", line)
                if m and m[2] == "begin" and m[1] in phases:
                    current = Counter()
                elif m and current is not None:
                    out[m[1]] = dict(current)
                    current = None
                continue
            if current is None or not (prefix in line or f'"{root}"' in line or f"{root}>" in line):
                continue
            call = line.split(" ", 1)[1].split("(", 1)[0].strip()
            if call in STAT_CALLS:
                current["stat"] += 1
            elif call == "getdents64":
                current["getdents64"] += 1
            elif call in ("openat", "open"):
                current["open_dir" if "O_DIRECTORY" in line else "open"] += 1
            elif call != "close":
                current[call] += 1
    trace.unlink()
    return out


def find_counts(root: Path, work: Path) -> dict[str, int]:
    """`strace -c` of one `find ROOT -printf '%s\\n'`."""
    summary = work / "find-strace.txt"
    cmd = ["strace", "-f", "-c", "-o", str(summary), "find", str(root), "-printf", "%s\n"]
    check(run_child(cmd, timeout=1800), "strace find")
    counts: Counter[str] = Counter()
    for line in summary.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1].isidentifier() and parts[3].isdigit():
            call, n = parts[-1], int(parts[3])
            if call in STAT_CALLS:
                counts["stat"] += n
            elif call in ("getdents64", "openat"):
                counts[call] += n
    summary.unlink()
    return dict(counts)


def agree(py: dict[str, int], st: dict[str, int]) -> bool:
    return (
        st.get("stat", 0) == py.get("stat", 0) + py.get("listing", 0)
        and st.get("open_dir", 0) == py.get("listing", 0)
        and st.get("open", 0) == py.get("open", 0)
    )


def _reconcile_note(ops: dict[str, int], directories: int, checkpoints: int) -> str:
    """Why a reconcile stats more than each directory once: the files a decision reads."""
    extra = ops.get("stat", 0) - directories
    text = f"a reconcile made {ops_text(ops)} on a volume of {directories:,} directories"
    if extra <= 0 or ops.get("open", 0):
        return text
    return (
        "Beyond a stat per directory, one stat per file whose contents a decision rests on "
        "(trainer_state.json, the JSON and metadata files read whole): a file rewritten in place changes "
        "no directory, only its own ctime (docs/design/hazards.md). The target predates that check and "
        "is kept as the floor."
    )


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "Metadata operations on the volume (stat calls, directory listings, file opens), the load a "
        "shared filesystem's metadata server carries: counted in-process by wrappers around the os calls "
        "(`python -m bench.probe reconcile`, and an idle hour simulated on a fake monotonic clock, "
        "`python -m bench.probe hours --count`: 360 polls and 12 reconciles at ckptd's defaults, after a "
        "simulated warm-up), checked against `strace -f -y` of the same probe between markers (a listing "
        "is an openat(O_DIRECTORY), an fstat and getdents64 calls). Baselines: watchdog's `PollingObserver` "
        "(counted per cycle, × 360 cycles an hour at a 10 s interval) and one `find -printf` (`strace -c`). "
        "Target: a reconcile stats each directory once, opens no file.",
    )
    have_strace = shutil.which("strace") is not None
    for shape in ctx.sizes:
        v = ctx.volume(shape)
        config = keep_all_config(ctx, shape.name, v.root, shape.world)
        ctx.log(f"metadata on {shape.name}: one reconcile, an idle hour, watchdog, find")
        argv = [sys.executable, "-m", "bench.probe", "reconcile", str(config)]
        rec = json.loads(check(run_child(argv, env=env(torch=False), timeout=1800), "probe reconcile").stdout)
        argv = [sys.executable, "-m", "bench.probe", "hours", str(config), "--count",
                "--warmup", "0.2", "--hours", "1"]  # fmt: skip
        hour = json.loads(check(run_child(argv, env=env(torch=False), timeout=1800), "probe hours").stdout)
        hour_ops = hour["ops"][str(v.root)]
        argv = [sys.executable, "-m", "bench.probe", "watchdog", str(v.root), "--cycles", "1"]
        wd = json.loads(check(run_child(argv, env=env(torch=False), timeout=1800), "probe watchdog").stdout)
        directories = wd["listings_per_cycle"]
        wd_cycle = {"stat": wd["stat_calls_per_cycle"], "listing": directories}
        wd_hour = {k: POLLS_PER_HOUR * n for k, n in wd_cycle.items()}
        work = ctx.scratch(f"metadata-strace-{shape.name}")
        found = find_counts(v.root, work) if have_strace else None

        r_ops, deep_ops = rec["reconcile"]["ops"], rec["deep_reconcile"]["ops"]
        met = r_ops.get("stat", 0) <= directories + 1 and r_ops.get("open", 0) == 0
        find_text = (
            f"find: {_n(found['stat'])} stats, {_n(found.get('openat', 0))} opens, "
            f"{_n(found.get('getdents64', 0))} getdents64"
            if found else f"find: ≥ {_n(v.shape.entries)} stats"
        )  # fmt: skip
        rows.append(
            Row(
                NAME,
                f"{shape.name}: metadata ops per reconcile, vs walking every checkpoint (before)",
                ops_text(r_ops),
                ops_text(deep_ops),
                fmt_ratio(max(r_ops.get("stat", 0), 1) / max(deep_ops.get("stat", 1), 1)),
                f"≤ 1 stat per directory ({directories:,}), no opens",
                met,
                "" if met else _reconcile_note(r_ops, directories, shape.runs * shape.checkpoints),
            )
        )
        rows.append(
            Row(
                NAME,
                f"{shape.name}: metadata ops per idle hour, vs watchdog `PollingObserver` every 10 s",
                ops_text(hour_ops),
                ops_text(wd_hour),
                fmt_ratio(max(hour_ops.get("stat", 0), 1) / max(wd_hour["stat"], 1)),
            )
        )
        poll_stats = rec["poll"]["ops"].get("stat", 0)
        predicted = POLLS_PER_HOUR * poll_stats + RECONCILES_PER_HOUR * r_ops.get("stat", 0)
        detail = (
            f"{shape.name} ({shape.entries:,} entries, {directories:,} directories, {rec['checkpoints']:,} "
            f"checkpoints, {rec['dirs']} directories on the way to runs): a reconcile {ops_text(r_ops)} "
            f"({fmt_time(rec['reconcile']['cpu_s'])} CPU), an idle poll {ops_text(rec['poll']['ops'])} "
            f"({fmt_time(rec['poll']['cpu_s'])}); a reconcile walking every checkpoint, as every one did "
            f"before, {ops_text(deep_ops)} ({fmt_time(rec['deep_reconcile']['cpu_s'])} CPU; no file opened: "
            f"what was read is remembered). An idle hour ({hour['polls']} polls, {hour['reconciles']} "
            f"reconciles): {ops_text(hour_ops)}; {POLLS_PER_HOUR} × poll + {RECONCILES_PER_HOUR} "
            "× reconcile "
            f"would be {_n(predicted)} stats. watchdog: {ops_text(wd_cycle)} per cycle, "
            f"{ops_text(wd_hour)} an hour. {find_text}."
        )
        if have_strace and shape.name != "L":
            argv = [sys.executable, "-m", "bench.probe", "reconcile", str(config), "--no-deep"]
            st = strace_phases(argv, v.root, ["reconcile", "poll"], work)
            checks = []
            for phase in ("reconcile", "poll"):
                py, kern = rec[phase]["ops"], st.get(phase, {})
                kern_text = ", ".join(f"{n:,} {k}" for k, n in sorted(kern.items()))
                checks.append(f"{phase}: {kern_text} ({'agrees' if agree(py, kern) else 'DIFFERS'})")
            detail += " strace of the same probe: " + "; ".join(checks) + "."
        elif not have_strace:
            detail += " strace not installed: the in-process counts were not checked against it."
        section.details.append(detail)
    return rows, section
