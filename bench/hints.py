"""`python -m bench.hints`: the inotify layer alone (`ckptd.daemon.watch.Watcher`), without the daemon.

A `Watcher` on an event loop watches the root holding RUNS in-flight checkpoint directories (one
recursive watch, as the daemon schedules a root); a child
process (`python -m bench.hints --write`) writes SAVES × FILES files into them, as fast as it can,
and prints when each file was closed (CLOCK_MONOTONIC, the same clock in both processes). Per
file: the time from its close to its last hint reaching the loop (`on_path`). CPU per event: this
process's CPU (the loop and any reader thread) from the first write until every hint arrived,
/ the events handed over. Threads: `threading.active_count()` with the watches in place, against
before `start()`. The ckptd measured is this checkout's (`bench/__init__.py`): to compare two in
one session, copy this file into the other's `bench/` and run both, alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RUNS, FILES = 100, 29


def _write(root: Path, runs: int, files: int) -> None:
    closed: dict[str, float] = {}
    for i in range(runs):
        for j in range(files):
            p = root / f"run-{i}" / f"file-{j}"
            with open(p, "wb") as f:
                f.write(b"x" * 4096)
            closed[str(p)] = time.monotonic()
    json.dump(closed, sys.stdout)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _once(root: Path, runs: int, files: int) -> dict[str, float]:
    from ckptd.daemon.watch import Watcher

    loop = asyncio.get_running_loop()
    last: dict[str, float] = {}
    events = 0
    want = {str(root / f"run-{i}" / f"file-{j}") for i in range(runs) for j in range(files)}
    closes = asyncio.Event()  # every file's IN_CLOSE_WRITE arrived (its last event)
    done_paths: set[str] = set()

    def on_path(path: str) -> None:
        nonlocal events
        events += 1
        last[path] = time.monotonic()
        if path in want and path not in done_paths:
            done_paths.add(path)
            if len(done_paths) == len(want):
                closes.set()

    for i in range(runs):
        (root / f"run-{i}").mkdir()
    await asyncio.to_thread(lambda: None)
    before = threading.active_count()
    w = Watcher(loop, on_path, lambda: None)
    w.start()
    try:
        await asyncio.to_thread(w.reconcile, {(str(root), True)})
        threads = threading.active_count()
        cpu0 = _cpu()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.hints", "--write", str(root), str(runs), str(files),
            stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        await asyncio.wait_for(closes.wait(), 60)
        # the close is the last event of each file: wait until it arrived for every file
        closed = json.loads(out)
        deadline = time.monotonic() + 10
        while any(last.get(p, 0) < t for p, t in closed.items()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cpu = _cpu() - cpu0
    finally:
        await asyncio.to_thread(w.stop)
    lat = sorted(last[p] - t for p, t in closed.items() if p in last)
    return {
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        "max_ms": lat[-1] * 1e3,
        "cpu_us_per_event": cpu / max(1, events) * 1e6,
        "events": events,
        "threads_added": threads - before,
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hints", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--write", nargs=3, metavar=("ROOT", "RUNS", "FILES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write:
        _write(Path(args.write[0]), int(args.write[1]), int(args.write[2]))
        return 0
    import ckptd.daemon.watch

    results = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="ckptd-hints-") as d:
            results.append(asyncio.run(_once(Path(d), RUNS, FILES)))
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(json.dumps({"watch": os.path.abspath(ckptd.daemon.watch.__file__), "median": med, "reps": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
