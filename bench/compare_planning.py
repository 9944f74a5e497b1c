"""Benchmark 6 (planning) for two versions of ckptd, interleaved: which one plans faster, by how much.

    mkdir -p /tmp/before && git archive COMMIT ckptd | tar -x -C /tmp/before
    python3 -m bench.compare_planning /tmp/before .

Each round plans bench.planning's runs (1 × 10,000 and 1,000 × 10) once with each version, in a
fresh process of its own (alternating which goes first), and takes the median CPU time of a few
repetitions after a warm-up; the report is the median over the rounds and the ratio. On a shared
machine only the ratio means much: both versions see the same load, round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ((1, 10_000), (1_000, 10))

_CHILD = """
import gc, json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from bench.planning import RETENTION, ROOT, make_runs
from ckptd import planner
assert planner.__file__.startswith(sys.argv[1]), planner.__file__
from ckptd.config import Root
root = Root(path=ROOT, retention=RETENTION)
space = lambda p: planner.DiskSpace(free=50 << 40, total=100 << 40)
out = {}
for runs, per_run in json.loads(sys.argv[3]):
    data = make_runs(runs, per_run)
    plan = lambda: planner.decide([(root, data)], space=space, device=lambda p: 1)
    plan()
    times = []
    for _ in range(int(sys.argv[4])):
        gc.collect()
        t0 = time.process_time()
        plan()
        times.append(time.process_time() - t0)
    out[f"{runs}x{per_run}"] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


def measure(src: Path, reps: int) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src.resolve()), str(REPO), json.dumps(CASES), str(reps)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    return json.loads(proc.stdout)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_planning", description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="the directory holding the ckptd package to compare against")
    p.add_argument("after", type=Path, help="the directory holding the ckptd package measured")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=7, help="repetitions per process (median taken)")
    args = p.parse_args()
    got: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for which in order:
            for case, t in measure(getattr(args, which), args.reps).items():
                got[which].setdefault(case, []).append(t)
    for runs, per_run in CASES:
        case = f"{runs}x{per_run}"
        before, after = (statistics.median(got[w][case]) for w in ("before", "after"))
        print(
            f"{runs:,} × {per_run:,}: before {before * 1e3:.1f} ms, after {after * 1e3:.1f} ms CPU "
            f"(medians of {args.rounds} interleaved rounds × {args.reps}): {before / after:.2f}× faster"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
