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

Prints one JSON object: per role, CPU % and stat calls per minute. `python -m bench` runs it too
(`run`: benchmark 13, on M, 20 s windows; 2 s on T with --quick).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.context import Context
from bench.daemon import KEEP_ALL, DaemonProc, settle, until_complete
from bench.measure import fmt_ratio
from bench.report import Row, Section
from bench.volume import SIZES, build

NAME = "14. standing by"
WINDOW_S = 20.0  # in `python -m bench`: short; `python -m bench.standby` defaults to 60 s
STAT_RATIO = 10  # a standby at most 1/10 of the leader's stat calls
TARGET_PCT = 0.1  # each at most 0.1 % of a core


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


def measure(root: Path, world: int, checkpoints: int, work: Path, window: float) -> dict[str, dict]:
    """A leader and a standby on `root` (two state_dirs: two hosts), each once every checkpoint is
    complete and it is still: per role, CPU % over `window` seconds, then stat calls per minute
    over another `window` (None where strace is missing), and when it declared them complete."""
    leader = DaemonProc(config(work / "a" / "ckptd.toml", root, work / "a" / "state", world))
    standby = None
    out: dict[str, dict] = {}
    try:
        leader.wait_message("this ckptd deletes here", timeout=600)
        standby = DaemonProc(config(work / "b" / "ckptd.toml", root, work / "b" / "state", world))
        standby.wait_message("standby, observing only", timeout=600)
        roles = (("leader", leader), ("standby", standby))
        for role, d in roles:
            out[role] = until_complete(d, checkpoints, timeout=900)
        for _, d in roles:
            settle(d)
        before = {role: cpu(d) for role, d in roles}
        t0 = time.monotonic()
        time.sleep(window)  # a measurement window, not a synchronisation
        t1 = time.monotonic()
        for role, d in roles:
            out[role]["cpu_pct"] = 100 * (cpu(d) - before[role]) / (t1 - t0)
        results: dict[str, int] = {}
        if shutil.which("strace") is not None:

            def count(role: str, pid: int) -> None:
                results[role] = stat_calls(pid, window, work / f"strace-{role}.txt")

            threads = [threading.Thread(target=count, args=(role, d.pid)) for role, d in roles]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for role, _ in roles:
            out[role]["stat_calls_per_min"] = results[role] * 60 / window if role in results else None
    finally:
        leader.stop()
        if standby is not None:
            standby.stop()
    return out


def run(ctx: Context) -> tuple[list[Row], Section]:
    """Benchmark 13 for `python -m bench`: on M where it is built (T in --quick), a short window."""
    shape = next((s for s in reversed(ctx.sizes) if s.name in ("M", "T")), ctx.sizes[-1])
    window = 2.0 if ctx.quick else WINDOW_S
    v = ctx.volume(shape)
    ctx.log(f"standby on {shape.name}: a leader and a standby, {window:g} s windows")
    out = measure(v.root, shape.world, shape.runs * shape.checkpoints, ctx.scratch("standby"), window)
    lead, stand = out["leader"], out["standby"]
    section = Section(
        NAME,
        f"`python -m bench.standby` as a benchmark: a leader and a standby of one volume lease side by "
        f"side on {shape.name} (their own state_dirs: two hosts), `leadership = \"volume\"`, observer "
        "polling, ckptd's default poll_interval (10 s), reconcile_interval (5 min) and lease_duration "
        "(30 s); once both declared every checkpoint complete and are still, CPU from the threads' "
        f"schedstat over {window:g} s, then stat-family calls by `strace -f -c` over another {window:g} s. "
        f"Targets: a standby at most 1/{STAT_RATIO:g} of the leader's stat calls, both at most "
        f"{TARGET_PCT:g} % of a core. A short window "
        "holds few polls: `python -m bench.standby --window 60` measures longer.",
    )
    rows = []
    ls, ss = lead["stat_calls_per_min"], stand["stat_calls_per_min"]
    if ls is None or ss is None:
        rows.append(Row(NAME, f"{shape.name}: stat calls / min, standby vs leader", "—",
                        note="strace is not installed: not counted"))  # fmt: skip
    else:
        met = ss <= ls / STAT_RATIO if ls else None
        rows.append(Row(
            NAME, f"{shape.name}: stat calls / min, standby vs leader", f"{ss:.3g}", f"{ls:.3g} (leader)",
            fmt_ratio(ss / ls) if ls and ss else "—", f"≤ 1/{STAT_RATIO:g}", met,
            "" if met is not False else f"{ss:.3g} against {ls / STAT_RATIO:.3g}: the standby's lease looks "
            "and reconcile scans over a short window",
        ))  # fmt: skip
    met = max(lead["cpu_pct"], stand["cpu_pct"]) <= TARGET_PCT
    rows.append(Row(
        NAME, f"{shape.name}: CPU % idle, standby vs leader", f"{stand['cpu_pct']:.2g} %",
        f"{lead['cpu_pct']:.2g} % (leader)", "—", f"≤ {TARGET_PCT:g} % each", met,
        "" if met else f"{max(lead['cpu_pct'], stand['cpu_pct']):.2g} % over {window:g} s against "
        f"{TARGET_PCT:g} %: a short window on a shared machine",
    ))  # fmt: skip
    section.details.append(
        f"leader complete after {lead['complete_s']:.1f} s, standby after {stand['complete_s']:.1f} s."
    )
    return rows, section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.standby")
    p.add_argument("--shape", default="M", choices=sorted(SIZES))
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    shape = SIZES[args.shape]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-bench-standby-"))
    v = build(work / "volumes", shape, now=time.time())
    out = measure(v.root, shape.world, shape.runs * shape.checkpoints, work, args.window)
    keys = ("cpu_pct", "stat_calls_per_min", "complete_s")
    roles = {r: {k: out[r][k] for k in keys} for r in out}
    print(json.dumps({"shape": shape.name, "window_s": args.window, **roles}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
