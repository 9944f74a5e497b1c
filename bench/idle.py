"""4. Idle cost: CPU % of `ckptd run` on the M volume while nothing is written.

`ckptd run --log-format json` (as under systemd: info level) starts on the M
volume with ckptd's default poll_interval (10 s) and reconcile_interval (5 min),
a quiet_period of 1 s and a retention that keeps everything (the volume is
shared with the other benchmarks). Once it is READY and has declared every
checkpoint complete, and its CPU time has stopped moving, its threads' CPU time
is read from /proc before and after a 60 s window; CPU % = delta / window.
One daemon with inotify and one with polling run side by side (each with its
own state_dir, so each holds its own lock), so that the box's noise hits both
alike. The baseline for polling is watchdog's
`PollingObserver` at the same interval, from its cycle measured in benchmark 2.

A 60 s window holds no reconcile. What a reconcile costs, and where a poll
tick's CPU goes, comes from the same daemon run in a probe's process
(`python -m bench.probe tick`), timed on its filesystem thread.
"""

from __future__ import annotations

import json
import sys
import time

from bench.context import Context
from bench.daemon import DaemonProc, settle, until_complete, write_config
from bench.measure import check, env, fmt_ratio, fmt_time, median, run_child
from bench.report import Row, Section
from bench.volume import Shape

NAME = "4. idle cost"
TARGET_PCT = 0.2  # with inotify, on M
TARGET_PCT_L = 0.1  # with inotify, on L
POLL_INTERVAL_S = 10.0  # ckptd's default poll_interval
RECONCILE_INTERVAL_S = 300.0  # ckptd's default reconcile_interval
OBSERVERS = ("inotify", "polling")


def measure(
    ctx: Context, shape: Shape, *, window: float, poll: float | None, still: float, quiet: float
) -> dict:
    """Both daemons, inotify and polling, side by side on the same volume over the same window."""
    v = ctx.volume(shape)
    daemons: dict[str, DaemonProc] = {}
    out: dict[str, dict] = {}
    try:
        for observer in OBSERVERS:
            work = ctx.scratch(f"idle-{observer}")
            config = write_config(
                work / "ckptd.toml", v.root, work / "state", observer=observer, world=shape.world,
                quiet_period=quiet, poll_interval=poll,
            )  # fmt: skip
            daemons[observer] = DaemonProc(config)
            out[observer] = {"config": config}
        for observer, d in daemons.items():
            out[observer].update(
                until_complete(d, shape.runs * shape.checkpoints, timeout=600, still_for=still)
            )
        for d in daemons.values():
            settle(d, still_for=still)  # the other one may have been busy meanwhile
        before = {o: (d.cpu_s(), d.threads()) for o, d in daemons.items()}
        t0 = time.monotonic()
        time.sleep(window)
        after = {o: (d.cpu_s(), d.threads()) for o, d in daemons.items()}
        t1 = time.monotonic()
        errors = {o: d.errors() for o, d in daemons.items()}
    finally:
        for d in daemons.values():
            d.stop()
    for observer in OBSERVERS:
        if errors[observer]:
            raise RuntimeError(f"ckptd run ({observer}) logged errors: {errors[observer][:3]}")
        (cpu0, threads0), (cpu1, threads1) = before[observer], after[observer]
        # Per-thread schedstat has nanoseconds; utime+stime counts clock ticks (10 ms), dead threads included.
        cpu = sum(c - threads0.get(tid, (0.0, 0))[0] for tid, (c, _) in threads1.items())
        pid = daemons[observer].pid
        out[observer].update(
            cpu_s=cpu,
            ticks_cpu_s=cpu1 - cpu0,
            window_s=t1 - t0,
            pct=100 * cpu / (t1 - t0),
            wakeups=sum(s - threads0.get(tid, (0.0, 0))[1] for tid, (_, s) in threads1.items()),
            threads_now=len(threads1),
            threads_busy=sum(1 for tid, (c, _) in threads1.items() if c > threads0.get(tid, (0.0, 0))[0]),
            main_thread_s=threads1.get(pid, (0.0, 0))[0] - threads0.get(pid, (0.0, 0))[0],
            busiest_other_s=max(
                (c - threads0.get(tid, (0.0, 0))[0] for tid, (c, _) in threads1.items() if tid != pid),
                default=0.0,
            ),
        )
    return out


def run(ctx: Context) -> tuple[list[Row], Section]:
    """On M (T when quick), and on L too when it is measured (`--large`)."""
    shapes = [next((s for s in reversed(ctx.sizes) if s.name in ("M", "T")), ctx.sizes[-1])]
    shapes += [s for s in ctx.sizes if s.name == "L" and s not in shapes]
    measured = [_run_one(ctx, shape) for shape in shapes]
    section = measured[0][1]
    for _, more in measured[1:]:
        section.details += more.details
    return [row for rows, _ in measured for row in rows], section


def _run_one(ctx: Context, shape: Shape) -> tuple[list[Row], Section]:
    window = 1.0 if ctx.quick else 60.0
    still = 0.3 if ctx.quick else 1.0
    quiet = 0.3 if ctx.quick else 1.0
    poll = 1.0 if ctx.quick else None  # None: ckptd's default, 10 s
    interval = poll or POLL_INTERVAL_S
    cycle = ctx.facts.get(f"watchdog_cycle_cpu_s/{shape.name}")
    section = Section(
        NAME,
        "One `ckptd run --log-format json` with inotify and one with polling, side by side on "
        f"M, and on L with `--large` (their own state_dirs), with poll_interval {interval:g} s and "
        f"reconcile_interval {RECONCILE_INTERVAL_S / 60:g} min, torch hidden, a retention that keeps "
        f"everything; after READY, every checkpoint complete and their CPU time still for {still:g} s: "
        "the CPU time of each one's threads from /proc/<pid>/task/*/schedstat (nanoseconds; utime+stime from "
        f"/proc/<pid>/stat, in 10 ms ticks, as a check) across a {window:g} s window. Where a tick goes: "
        "`python -m bench.probe tick` (the same daemon in a probe's process, its filesystem "
        "thread's CPU time).",
    )
    rows: list[Row] = []
    ctx.log(f"idle on {shape.name}: both daemons start, then {window:g} s of nothing")
    results = measure(ctx, shape, window=window, poll=poll, still=still, quiet=quiet)
    for observer, r in results.items():
        section.details.append(
            f"{observer}: {r['pct']:.2g} % ({fmt_time(r['cpu_s'])} CPU in {r['window_s']:.1f} s by the "
            f"threads' schedstat; {fmt_time(r['ticks_cpu_s'])} by utime+stime, in 10 ms ticks); "
            f"{r['wakeups']} voluntary context switches over {r['threads_now']} threads, "
            f"{r['threads_busy']} of which ran (the main thread, the event loop, "
            f"{fmt_time(r['main_thread_s'])}; the busiest other {fmt_time(r['busiest_other_s'])}); "
            f"READY {r['ready_s']:.1f} s after the start, every "
            f"checkpoint complete at {r['complete_s']:.1f} s."
        )
    ctx.log(f"idle on {shape.name}: where a tick goes (probe tick)")
    argv = [sys.executable, "-m", "bench.probe", "tick", str(results["inotify"]["config"])]
    argv += ["--ticks", "3" if ctx.quick else "7"]
    tick = json.loads(check(run_child(argv, env=env(torch=False)), "probe tick").stdout)
    t = {k: median(v) for k, v in tick.items() if isinstance(v, list)}
    write = t["state_doc_s"] + t["dumps_compact_s"]  # the daemon writes it compact (C encoder)
    reconcile = tick["reconcile_tick_s"]
    section.details.append(
        f"a poll tick on {shape.name} ({tick['checkpoints']:,} complete checkpoints) takes "
        f"{fmt_time(t['tick_s'])} CPU: the poll {fmt_time(t['poll_s'])} (of which `in_flight()` "
        f"{fmt_time(t['in_flight_s'])}, called again by `step`), the state file's "
        f"document {fmt_time(t['state_doc_s'])} (rows reused for unchanged checkpoints) and its compact "
        f"encoding {fmt_time(t['dumps_compact_s'])} ({tick['state_bytes'] / 1024:.0f} KiB; with `indent=1`, "
        f"json's pure-Python encoder, it would be {fmt_time(t['dumps_indent_s'])}). A reconcile tick "
        f"(every checkpoint looked at again, retention decided) takes {fmt_time(reconcile)} CPU: every "
        f"{RECONCILE_INTERVAL_S / 60:g} min that is {100 * reconcile / RECONCILE_INTERVAL_S:.2g} % of a "
        f"core. The first reconcile after start-up took {fmt_time(tick['reconcile_first_s'])}: it also "
        "writes the verdict cache of every checkpoint looked at (once; later ones only when something "
        "changed)."
    )

    r = results["inotify"]
    target = {"M": TARGET_PCT, "L": TARGET_PCT_L}.get(shape.name)
    on_target = target is not None
    met = r["pct"] <= target if target is not None else None
    note = ""
    if met is False:
        rest = max(0.0, t["tick_s"] - write - 3 * t["in_flight_s"])
        note = (
            f"Each poll tick costs {fmt_time(t['tick_s'])} of CPU, {fmt_time(write)} of it rewriting the "
            f"whole state file ({tick['state_bytes'] / 1024:.0f} KiB, every checkpoint with its decision). "
            f"Rewriting it only when something changed would leave about {fmt_time(rest)} a tick."
        )
    rows.append(
        Row(NAME, f"{shape.name}: CPU % over {window:g} s, inotify", f"{r['pct']:.2g} %",
            target=f"≤ {target:g} %" if on_target else "—", met=met, note=note)
    )  # fmt: skip
    r = results["polling"]
    base = None if cycle is None else 100 * cycle / interval
    rows.append(
        Row(
            NAME,
            f"{shape.name}: CPU % over {window:g} s, polling every {interval:g} s",
            f"{r['pct']:.2g} %",
            "—" if base is None else f"{base:.2g} % (watchdog, from 2.)",
            "—" if not base or not r["pct"] else fmt_ratio(r["pct"] / base),
        )
    )
    with_reconcile = results["inotify"]["pct"] + 100 * reconcile / RECONCILE_INTERVAL_S
    rows.append(
        Row(
            NAME,
            f"{shape.name}: inotify, with a reconcile every {RECONCILE_INTERVAL_S / 60:g} min (derived)",
            f"{with_reconcile:.2g} %",
        )
    )
    if cycle is not None:
        section.details.append(
            f"baseline: watchdog's `PollingObserver` every {interval:g} s on {shape.name}, derived from its "
            f"measured cycle ({cycle:.3g} s CPU, benchmark 2) / {interval:g} s."
        )
    return rows, section
