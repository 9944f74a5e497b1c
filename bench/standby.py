"""What standing by costs: a leader and a standby of one volume lease, side by side on M.

`python -m bench.standby [--shape M] [--window 60] [--workdir DIR]` builds the volume (bench.volume),
starts two `ckptd run --log-format json` with `leadership = "volume"`, observer polling (a network
filesystem's), ckptd's default poll_interval (10 s) and reconcile_interval (5 min), a retention
that keeps everything and their own state_dirs (two hosts); the second stands by. Once both have
declared every checkpoint complete and are still, two windows of `--window` seconds each:

1. CPU: each daemon's threads' CPU time (/proc/<pid>/task/*/schedstat) across the window, as
   benchmark 4 (idle) measures it.
2. Stat calls: `strace -f -c -e trace=%stat` attached to each for the window (attaching slows
   them, which is why CPU has a window of its own).

Prints one JSON object: per role, CPU % and stat calls per minute.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.daemon import KEEP_ALL, DaemonProc, settle, until_complete
from bench.volume import SIZES, build


def config(path: Path, root: Path, state_dir: Path, world: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\nleadership = 'volume'\n"
        f"[[roots]]\npath = '{root}'\nobserver = 'polling'\nworld_size = {world}\nquiet_period = '1s'\n"
        "allow_short_quiet_period = true\n"
        f"\n[roots.retention]\n{KEEP_ALL}"
    )
    return path


def cpu(d: DaemonProc) -> float:
    return sum(c for c, _ in d.threads().values())


def stat_calls(pid: int, window: float, out: Path) -> int:
    """Stat-family system calls (stat, lstat, fstat, newfstatat, statx) of `pid` and its threads
    over `window` seconds, by `strace -f -c`."""
    proc = subprocess.Popen(["strace", "-f", "-c", "-o", str(out), "-p", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=window)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # strace detaches and writes its summary
        proc.wait(timeout=60)
    calls = 0
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and re.fullmatch(r"(new)?f?(l)?stat(at|x|64)?|newfstatat", parts[-1]):
            calls += int(parts[3])
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.standby")
    p.add_argument("--shape", default="M", choices=sorted(SIZES))
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    shape = SIZES[args.shape]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-bench-standby-"))
    v = build(work / "volumes", shape, now=time.time())
    leader = DaemonProc(config(work / "a" / "ckptd.toml", v.root, work / "a" / "state", shape.world))
    leader.wait_message("this ckptd deletes here", timeout=600)
    standby = DaemonProc(config(work / "b" / "ckptd.toml", v.root, work / "b" / "state", shape.world))
    out: dict[str, dict] = {}
    try:
        standby.wait_message("standby, observing only", timeout=600)
        n = shape.runs * shape.checkpoints
        for role, d in (("leader", leader), ("standby", standby)):
            out[role] = until_complete(d, n, timeout=900)
        for d in (leader, standby):
            settle(d)
        before = {role: cpu(d) for role, d in (("leader", leader), ("standby", standby))}
        t0 = time.monotonic()
        time.sleep(args.window)  # a measurement window, not a synchronisation
        t1 = time.monotonic()
        for role, d in (("leader", leader), ("standby", standby)):
            out[role]["cpu_pct"] = 100 * (cpu(d) - before[role]) / (t1 - t0)
        counting = {role: d.pid for role, d in (("leader", leader), ("standby", standby))}
        results: dict[str, int] = {}

        def count(role: str, pid: int) -> None:
            results[role] = stat_calls(pid, args.window, work / f"strace-{role}.txt")

        threads = [threading.Thread(target=count, args=item) for item in counting.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for role, calls in results.items():
            out[role]["stat_calls_per_min"] = calls * 60 / args.window
    finally:
        leader.stop()
        standby.stop()
    keys = ("cpu_pct", "stat_calls_per_min", "complete_s")
    roles = {r: {k: out[r][k] for k in keys} for r in out}
    print(json.dumps({"shape": shape.name, "window_s": args.window, **roles}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
