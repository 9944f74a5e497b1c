"""4. Idle cost: CPU % of `ckptd run` over 60 s on the M volume, nothing being written.

Needs `ckptd run` (issue 7). When it lands: start the daemon on the M volume,
wait for its start-up scan to finish (sd_notify READY=1 or its log line), read
utime+stime from /proc/<pid>/stat, sleep 60 s, read again; CPU % = delta / 60 s.
Once with inotify, once with polling at the default poll_interval. The baseline
for polling is watchdog's `PollingObserver` at the same interval, whose cost
per cycle benchmark 2 already measures.
"""

from __future__ import annotations

from bench.context import Context
from bench.report import PENDING, Row, Section, pending

NAME = "4. idle cost"


POLL_INTERVAL_S = 10.0  # ckptd's default poll_interval


def run(ctx: Context) -> tuple[list[Row], Section]:
    cycle = ctx.facts.get("watchdog_cycle_cpu_s/M")
    watchdog = "—" if cycle is None else f"{100 * cycle / POLL_INTERVAL_S:.2g} % (watchdog, from 2.)"
    rows = [
        pending(NAME, "M: CPU % over 60 s, inotify", target="≤ 0.2 %"),
        pending(NAME, "M: CPU % over 60 s, polling every 10 s", baseline=watchdog),
    ]
    section = Section(NAME, f"{PENDING}. The plan for it is in `bench/idle.py`.")
    if cycle is not None:
        section.details.append(
            f"baseline: watchdog's `PollingObserver` every {POLL_INTERVAL_S:g} s on M, derived from its "
            f"measured cycle ({cycle:.3g} s CPU, benchmark 2) / {POLL_INTERVAL_S:g} s."
        )
    return rows, section
