"""2. Polling cycle: ckptd's targeted poller vs watchdog's `PollingObserver`, same volume.

watchdog's `PollingObserver` re-snapshots the whole tree every interval
(`DirectorySnapshot`: one stat per entry) and diffs it against the last
(`python -m bench.probe watchdog`).

ckptd's targeted poller is `RootTracker.poll()`, what `ckptd run` does every
poll_interval in every mode: stat the directories on the way to runs, re-list
those whose mtime moved, walk the checkpoints not yet complete. Measured in a
process of its own (`python -m bench.probe tracker`) on the same volume after a
`full_scan()`, with every checkpoint complete (a fake monotonic clock moves the
quiet period on), then with a few checkpoints in flight (the next save of a few
runs, written for the measurement and removed afterwards).

Both sides: CPU seconds per cycle (median, plain `os` calls), then one more
cycle through counting wrappers for the stat calls, listings and opens.
"""

from __future__ import annotations

import json
import sys

from bench.context import Context
from bench.measure import check, env, fmt_ratio, fmt_time, median, run_child
from bench.report import Row, Section

NAME = "2. polling cycle"
TARGET = 50.0  # × cheaper than watchdog on M
IN_FLIGHT = 4


def _calls(counts: dict[str, int]) -> str:
    parts = [f"{counts.get('stat', 0):,} stats"]
    if counts.get("listing"):
        parts.append(f"{counts['listing']:,} listings")
    if counts.get("open"):
        parts.append(f"{counts['open']:,} opens")
    return ", ".join(parts)


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "watchdog's `PollingObserver` cycle (a fresh `DirectorySnapshot` of the root plus a "
        "`DirectorySnapshotDiff`) vs ckptd's targeted poller (`RootTracker.poll()` after a `full_scan()`, "
        "every checkpoint complete; then with checkpoints in flight), each in a process of its own: "
        "CPU seconds per cycle (median), and the calls of one more cycle through counting wrappers "
        "(os.stat, os.lstat, DirEntry.stat; os.scandir; open). Ratio = ckptd / watchdog CPU; "
        f"target ≥ {TARGET:g}× cheaper on M.",
    )
    for shape in ctx.sizes:
        v = ctx.volume(shape)
        n = ctx.reps(shape)
        k = 3 if ctx.quick else 21
        ctx.log(f"polling on {shape.name}: {n} watchdog PollingObserver cycles, {k} ckptd polls")
        argv = [sys.executable, "-m", "bench.probe", "watchdog", str(v.root), "--cycles", str(n)]
        wd = json.loads(check(run_child(argv, env=env(torch=False)), "probe watchdog").stdout)
        argv = [sys.executable, "-m", "bench.probe", "tracker", str(v.config), "--cycles", str(k)]
        argv += ["--in-flight", str(IN_FLIGHT)]
        tr = json.loads(check(run_child(argv, env=env(torch=False)), "probe tracker").stdout)

        base = median(wd["cycle_cpu_s"])
        ctx.facts[f"watchdog_cycle_cpu_s/{shape.name}"] = base
        ctx.facts[f"reconcile_cpu_s/{shape.name}"] = tr["reconcile_cpu_s"]
        ctx.facts[f"poll_cpu_s/{shape.name}"] = median(tr["cycle_cpu_s"])
        stats = wd["stat_calls_per_cycle"]
        baseline = f"{fmt_time(base)} CPU, {stats:,} stats"
        ours = median(tr["cycle_cpu_s"])
        cheaper = base / ours
        on_target = shape.name == "M"
        note = ""
        if on_target and cheaper < TARGET:
            note = (
                f"{fmt_time(ours)} per poll is {cheaper:.3g}× cheaper than watchdog's {fmt_time(base)}; the "
                f"target is {TARGET:g}×. Of it, picking out the in-flight checkpoints "
                f"(`RootTracker.in_flight()`, kept as they change) takes "
                f"{fmt_time(median(tr['in_flight_query_cpu_s']))}; the rest is a stat per directory on "
                "the way to runs."
            )
        rows.append(
            Row(
                NAME,
                f"{shape.name}: CPU and calls per cycle, all complete, vs watchdog `PollingObserver`",
                f"{fmt_time(ours)} CPU, {_calls(tr['calls_per_cycle'])}",
                baseline,
                fmt_ratio(ours / base),
                f"≥ {TARGET:g}× cheaper" if on_target else "—",
                cheaper >= TARGET if on_target else None,
                note,
            )
        )
        busy = median(tr["in_flight_cycle_cpu_s"])
        if shape.name != "S":
            rows.append(
                Row(
                    NAME,
                    f"{shape.name}: the same with {len(tr['in_flight'])} checkpoints in flight",
                    f"{fmt_time(busy)} CPU, {_calls(tr['in_flight_calls_per_cycle'])}",
                    baseline,
                    fmt_ratio(busy / base),
                )
            )
        section.details.append(
            f"{shape.name}: watchdog cycle {fmt_time(base)} CPU ({fmt_time(median(wd['cycle_wall_s']))} "
            f"wall), {stats:,} stat calls and {wd['listings_per_cycle']:,} listings for {wd['entries']:,} "
            f"entries; first snapshot {fmt_time(wd['first_cpu_s'])} CPU; the observer holds "
            f"{wd['rss_kib'] / 1024:.0f} MiB RSS with two snapshots; polling every 10 s (ckptd's default "
            f"poll_interval) it would use {100 * base / 10:.2g} % of a core while nothing changes."
        )
        section.details.append(
            f"{shape.name}: ckptd poll {fmt_time(ours)} CPU (median of {k}; "
            f"{fmt_time(min(tr['cycle_cpu_s']))}–{fmt_time(max(tr['cycle_cpu_s']))}), "
            f"{_calls(tr['calls_per_cycle'])}: one stat for each of the {tr['dirs_polled']} directories "
            "on the way to runs, nothing below them; of it, `in_flight()` (an index kept as checkpoints "
            f"change, {tr['checkpoints']:,} complete) {fmt_time(median(tr['in_flight_query_cpu_s']))}. "
            f"With {len(tr['in_flight'])} "
            f"checkpoints in flight ({tr['in_flight_files']} files, the next save of {len(tr['in_flight'])} "
            f"runs) {fmt_time(busy)} per poll ({_calls(tr['in_flight_calls_per_cycle'])}: each walked, its "
            f"torch files' zip directories read and trainer_state.json parsed); the poll that first found "
            f"them {fmt_time(tr['first_look_cpu_s'])}. At start-up, the first look at every checkpoint "
            f"took {fmt_time(tr['first_scan_cpu_s'])} CPU and the looks when their quiet periods ended "
            f"(each walked again, nothing read again) {fmt_time(tr['quiet_looks_cpu_s'])}; a reconcile "
            "(every reconcile_interval: each complete checkpoint's directories stat'ed, none walked) "
            f"{fmt_time(tr['reconcile_cpu_s'])}; the poller holds {tr['rss_kib'] / 1024:.0f} MiB RSS."
        )
    return rows, section
