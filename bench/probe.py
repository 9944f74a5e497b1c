"""Measurements that must run in a process of their own: `python -m bench.probe KIND ...`.

Each prints one JSON document on stdout.

- `scan CONFIG --reps N`: import ckptd, then N times scan every root afresh and
  plan (what `ckptd plan` does, minus printing). Reports each scan's time, the
  RSS after the first (start-up: imports + one full scan + plan) and at the end,
  where the time went (walk, integrity check), and whether torch got loaded.
- `watchdog ROOT --cycles N`: what one cycle of watchdog's `PollingObserver`
  costs: a fresh `DirectorySnapshot` of the whole tree and a `DirectorySnapshotDiff`
  against the previous one, in CPU seconds and stat calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from bench.measure import proc_status_kib


def _timed(module: object, name: str, acc: dict[str, float]) -> None:
    """Wrap `module.name` to add its run time to `acc[name]`."""
    fn = getattr(module, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    setattr(module, name, wrapper)


def scan(config_path: Path, reps: int) -> dict:
    t0 = time.perf_counter()
    from ckptd import evidence, planner
    from ckptd.config import load_config
    from ckptd.policy import summarise

    import_s = time.perf_counter() - t0
    rss_imported = proc_status_kib("VmRSS")
    config = load_config(config_path)
    acc: dict[str, float] = Counter()
    _timed(evidence, "walk", acc)
    _timed(evidence, "_integrity", acc)
    scans, breakdown = [], []
    rss_first = 0
    states: Counter[str] = Counter()
    summary: dict[str, int] = {}
    history = 0
    for i in range(reps):
        acc.clear()
        t = time.perf_counter()
        scanners = {root.path: planner.Scanner(root) for root in config.roots}
        roots = [(root, scanners[root.path].runs(now=time.time())) for root in config.roots]
        plan = planner.decide(roots)
        scans.append(time.perf_counter() - t)
        breakdown.append(dict(acc))
        if i == 0:
            rss_first = proc_status_kib("VmRSS")
            states = Counter(str(d.checkpoint.state) for d in plan.decisions)
            summary = summarise(plan.decisions)
            history = sum(
                len(d.checkpoint.trainer_state.history) for d in plan.decisions if d.checkpoint.trainer_state
            )
    torch = sys.modules.get("torch")
    return {
        "import_s": import_s,
        "scan_s": scans,
        "breakdown": breakdown,
        "rss_imported_kib": rss_imported,
        "rss_first_kib": rss_first,
        "rss_end_kib": proc_status_kib("VmRSS"),
        "hwm_kib": proc_status_kib("VmHWM"),
        "torch_loaded": torch is not None,
        "states": dict(states),
        "summary": summary,
        "history_steps": history,  # log_history steps held, summed over every checkpoint's trainer state
    }


def watchdog_cycles(root: Path, cycles: int) -> dict:
    from watchdog.utils.dirsnapshot import DirectorySnapshot, DirectorySnapshotDiff

    calls = 0

    def counting_stat(path: str) -> os.stat_result:
        nonlocal calls
        calls += 1
        return os.stat(path)

    def one(prev: DirectorySnapshot | None, stat=os.stat) -> tuple[DirectorySnapshot, float, float]:
        c, w = time.process_time(), time.perf_counter()
        snap = DirectorySnapshot(str(root), recursive=True, stat=stat)
        if prev is not None:
            DirectorySnapshotDiff(prev, snap)
        return snap, time.process_time() - c, time.perf_counter() - w

    snap, first_cpu, first_wall = one(None)
    cpu, wall = [], []
    for _ in range(cycles):  # plain os.stat: the wrapper would inflate the CPU figure
        snap, c, w = one(snap)
        cpu.append(c)
        wall.append(w)
    rss = proc_status_kib("VmRSS")
    snap, _, _ = one(snap, stat=counting_stat)  # one more cycle, counting
    return {
        "first_cpu_s": first_cpu,
        "first_wall_s": first_wall,
        "cycle_cpu_s": cpu,
        "cycle_wall_s": wall,
        "stat_calls_per_cycle": calls,
        "entries": len(snap.paths),
        "rss_kib": rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe")
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("scan")
    s.add_argument("config", type=Path)
    s.add_argument("--reps", type=int, default=1)
    w = sub.add_parser("watchdog")
    w.add_argument("root", type=Path)
    w.add_argument("--cycles", type=int, default=3)
    args = p.parse_args(argv)
    doc = scan(args.config, args.reps) if args.kind == "scan" else watchdog_cycles(args.root, args.cycles)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
