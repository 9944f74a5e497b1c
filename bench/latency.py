"""3. Detection latency: last shard written → checkpoint declared complete, minus quiet_period.

Needs `ckptd run` (issue 7). When it lands: start the daemon on a copy of the
S volume with a short quiet_period (e.g. 2 s) and `--log-format json`, once
with observer = "inotify" and once with "polling" (poll_interval 1 s); then,
N times, write a checkpoint with `bench.volume.write_checkpoint` and note the
monotonic time of its last write; read the daemon's "complete" log line for it
and record (declared - last write - quiet_period). Report p50 and p99 of each.
"""

from __future__ import annotations

from bench.context import Context
from bench.report import PENDING, Row, Section, pending

NAME = "3. detection latency"


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows = [
        pending(NAME, "inotify: p50 / p99 overhead beyond quiet_period", target="p99 ≤ 100 ms"),
        pending(
            NAME, "polling: p50 / p99 overhead beyond quiet_period", target="p99 ≤ poll_interval + 100 ms"
        ),
    ]
    return rows, Section(NAME, f"{PENDING}. The plan for it is in `bench/latency.py`.")
