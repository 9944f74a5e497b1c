"""2. Polling cycle: ckptd's targeted poller vs watchdog's `PollingObserver`, same volume.

watchdog's `PollingObserver` re-snapshots the whole tree every interval
(`DirectorySnapshot`: one stat per entry) and diffs it against the last. That
side is measured here: CPU seconds and stat calls per cycle, in a process of
its own (`python -m bench.probe watchdog`). CPU is timed with plain `os.stat`;
one extra cycle with a counting `stat=` wrapper counts the calls.

ckptd's side needs its targeted poller, which is part of `ckptd run`
(issue 7). When it lands: run the daemon in polling mode on the same volume
with no checkpoint in flight, read its CPU time (/proc/<pid>/stat) across K
cycles, and its stat calls (a counting `stat=` seam, or `strace -c -f`), and
fill `ckptd` and `ratio` below.
"""

from __future__ import annotations

import json
import sys

from bench.context import Context
from bench.measure import check, env, fmt_time, median, run_child
from bench.report import PENDING, Row, Section

NAME = "2. polling cycle"


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "watchdog's `PollingObserver` cycle (a fresh `DirectorySnapshot` of the root plus a "
        "`DirectorySnapshotDiff`), CPU seconds per cycle (median) and stat calls per cycle. "
        f"ckptd's targeted poller: {PENDING}.",
    )
    for shape in ctx.sizes:
        v = ctx.volume(shape)
        n = ctx.reps(shape)
        ctx.log(f"polling on {shape.name}: {n} watchdog PollingObserver cycles")
        argv = [sys.executable, "-m", "bench.probe", "watchdog", str(v.root), "--cycles", str(n)]
        doc = json.loads(check(run_child(argv, env=env(torch=False)), "probe watchdog").stdout)
        cpu = median(doc["cycle_cpu_s"])
        ctx.facts[f"watchdog_cycle_cpu_s/{shape.name}"] = cpu
        stats = doc["stat_calls_per_cycle"]
        rows.append(
            Row(
                NAME,
                f"{shape.name}: CPU and stat calls per cycle vs watchdog `PollingObserver`",
                PENDING,
                f"{fmt_time(cpu)} CPU, {stats:,} stats",
                target="≥ 50× cheaper (on M)" if shape.name == "M" else "—",
            )
        )
        section.details.append(
            f"{shape.name}: watchdog cycle {fmt_time(cpu)} CPU "
            f"({fmt_time(median(doc['cycle_wall_s']))} wall), {stats:,} stat calls for "
            f"{doc['entries']:,} entries; first snapshot {fmt_time(doc['first_cpu_s'])} CPU; the observer "
            f"holds {doc['rss_kib'] / 1024:.0f} MiB RSS with two snapshots; "
            f"polling every 10 s (ckptd's default poll_interval) it would use {100 * cpu / 10:.2g} % of a "
            "core while nothing changes."
        )
    return rows, section
