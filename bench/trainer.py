"""A stand-in training loop, for benchmark 8: `python -m bench.trainer ...`.

It alternates "training steps" (fixed CPU work, the GIL held, as a Python
training loop's host side is) with saves of a Trainer + DeepSpeed checkpoint
of `ranks` shards of `shard_bytes` each. After each save it either rotates
in-process as the Hugging Face Trainer does with `save_total_limit` (rank 0
calls `shutil.rmtree` on the oldest checkpoints, and the loop waits for it),
or leaves retention to ckptd in another process and carries on.

It prints one JSON line per save ({"event": "saved", ...}; the harness starts
`ckptd prune` on it in the "external" mode) and a last line with every step's
start and end (time.monotonic, comparable across processes on Linux).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from bench.volume import HOUR, write_checkpoint


def calibrate(seconds: float) -> int:
    """Iterations of `work` that take about `seconds` here, now."""
    n = 10_000
    while True:
        t0 = time.perf_counter()
        work(n)
        took = time.perf_counter() - t0
        if took > 0.05:
            return max(1, int(n * seconds / took))
        n *= 4


def work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


def rotate(run: Path, keep: int) -> list[str]:
    """The Trainer's `_rotate_checkpoints`: the oldest checkpoints beyond `keep`, removed with rmtree."""
    ckpts = sorted(
        (p for p in run.iterdir() if re.fullmatch(r"checkpoint-\d+", p.name)), key=lambda p: int(p.name[11:])
    )
    doomed = ckpts[: max(0, len(ckpts) - keep)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in doomed]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainer")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--mode", choices=("inprocess", "external"), required=True)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--shard-bytes", type=int, default=256 << 20)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="training steps between saves")
    p.add_argument("--step-s", type=float, default=0.05)
    args = p.parse_args(argv)

    n = calibrate(args.step_s)
    steps: list[tuple[float, float]] = []
    saves: list[dict[str, float]] = []
    for k in range(1, args.saves + 1):
        for _ in range(args.steps):
            t0 = time.monotonic()
            work(n)
            steps.append((t0, time.monotonic()))
        t0 = time.monotonic()
        step = k * 500
        # Saved "two hours ago": ckptd must find the old ones quiet and delete them at once.
        write_checkpoint(
            args.run, step, world=args.ranks, mtime=time.time() - 2 * HOUR + k, shard_size=args.shard_bytes
        )
        saved = time.monotonic()
        print(json.dumps({"event": "saved", "step": step, "t": saved}), flush=True)
        rotated: list[str] = []
        if args.mode == "inprocess":
            rotated = rotate(args.run, args.keep)
        resumed = time.monotonic()
        saves.append(
            {"step": step, "save_s": saved - t0, "blocked_s": resumed - saved, "rotated": len(rotated)}
        )
    for _ in range(args.steps):  # steps after the last save, while a last prune may run
        t0 = time.monotonic()
        work(n)
        steps.append((t0, time.monotonic()))
    print(json.dumps({"event": "done", "steps": steps, "saves": saves}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
