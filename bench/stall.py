"""8. Training-loop stall: retention in-process (as the HF Trainer rotates) vs ckptd out of process.

The Trainer with `save_total_limit` rotates right after each save: rank 0 calls
`shutil.rmtree` on the oldest checkpoints, and the loop (and, at the next
collective, every other rank) waits for it. With ckptd the loop calls nothing;
a separate `ckptd prune` deletes while training goes on, and what remains is
interference: CPU and disk shared with the deleter.

`bench/trainer.py` is the loop: fixed CPU-bound steps, saves of R ranks × B-byte
shards. Run twice on the same shape: rotating in-process, then with the harness
starting `ckptd prune` (keep_last=2, like save_total_limit=2) on each save.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.context import Context
from bench.measure import check, env, fmt_bytes, fmt_ratio, fmt_time, median, run_child, settle
from bench.report import Row, Section
from bench.volume import write_config

NAME = "8. training-loop stall"


def _trainer(
    ctx: Context, mode: str, args: list[str], config: Path
) -> tuple[dict, list[tuple[float, float]]]:
    """Run the loop; in the external mode start `ckptd prune` on each save. Returns (done, prunes)."""
    work = ctx.scratch(f"stall-{mode}")
    argv = [sys.executable, "-m", "bench.trainer", "--run", str(work / "run"), "--mode", mode, *args]
    prunes: list[tuple[float, float]] = []
    prune = [sys.executable, "-m", "ckptd", "prune", "-c", str(config)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env(torch=False)) as proc:
        assert proc.stdout is not None
        done: dict = {}
        for line in proc.stdout:
            msg = json.loads(line)
            if msg["event"] == "saved" and mode == "external":
                t0 = time.monotonic()
                out = check(run_child(prune, env=env(torch=False)), "ckptd prune")
                prunes.append((t0, time.monotonic()))
                ctx.log(f"  ckptd prune after step {msg['step']}: {out.stdout.strip().splitlines()[-1]}")
            elif msg["event"] == "done":
                done = msg
    if proc.returncode != 0 or not done:
        raise RuntimeError(f"bench.trainer ({mode}) exited {proc.returncode}")
    shutil.rmtree(work, ignore_errors=True)
    return done, prunes


def run(ctx: Context) -> tuple[list[Row], Section]:
    ranks, shard = (8, 1 << 20) if ctx.quick else (8, 256 << 20)
    saves, steps, step_s = (3, 5, 0.01) if ctx.quick else (5, 40, 0.05)
    keep = 2
    # keep + the one being saved + the one in ckptd's trash, and a margin
    while (keep + 2) * ranks * shard * 1.2 > ctx.free_bytes() and shard > (1 << 20):
        shard //= 2
    label = f"{ranks} ranks × {fmt_bytes(shard)}"
    section = Section(
        NAME,
        f"A loop of {step_s * 1e3:.0f} ms CPU-bound steps, {steps} between saves, {saves} saves of {label} "
        f"shards (+ rng states and small files), keeping {keep}: once rotating in-process "
        "(`shutil.rmtree` right after the save, as the HF Trainer's rank 0 does), once with `ckptd prune` "
        "(keep_last=2) started in another process at each save. Blocked = save finished → next step "
        "started. Interference = median step time while a prune ran vs while none did.",
    )
    args = [
        "--saves", str(saves), "--ranks", str(ranks), "--shard-bytes", str(shard),
        "--keep", str(keep), "--steps", str(steps), "--step-s", str(step_s),
    ]  # fmt: skip
    configs = ctx.scratch("stall-config")
    for mode in ("inprocess", "external"):
        root = ctx.workdir / f"stall-{mode}" / "run"
        write_config(
            configs / f"{mode}.toml", root, configs / "state", world=ranks, keep_last=keep, keep_best=0
        )

    settle(ctx.workdir)
    ctx.log(f"stall: in-process rotation, {saves} saves of {label}")
    a, _ = _trainer(ctx, "inprocess", args, configs / "inprocess.toml")
    settle(ctx.workdir)
    ctx.log(f"stall: ckptd prune out of process, {saves} saves of {label}")
    b, prunes = _trainer(ctx, "external", args, configs / "external.toml")

    rotations = [s["blocked_s"] for s in a["saves"] if s["rotated"]]
    stall_a = median(rotations)
    blocked_b = median([s["blocked_s"] for s in b["saves"]])

    def overlaps(t0: float, t1: float) -> bool:
        return any(p0 < t1 and t0 < p1 for p0, p1 in prunes)

    during = [t1 - t0 for t0, t1 in b["steps"] if overlaps(t0, t1)]
    idle = [t1 - t0 for t0, t1 in b["steps"] if not overlaps(t0, t1)]
    idle_a = [t1 - t0 for t0, t1 in a["steps"]]
    rows = [
        Row(
            NAME,
            f"{label}: loop blocked by each rotation, ckptd vs in-process `shutil.rmtree`",
            fmt_time(blocked_b),
            fmt_time(stall_a),
            fmt_ratio(blocked_b / stall_a),
        )
    ]
    if during and idle:
        extra = median(during) / median(idle) - 1
        rows.append(
            Row(
                NAME,
                f"{label}: step time while `ckptd prune` runs vs idle",
                f"{fmt_time(median(during))} ({extra:+.0%})",
                fmt_time(median(idle)),
                f"{median(during) / median(idle):.3g}×",
            )
        )
    section.details += [
        f"in-process: each rotation blocked the loop {', '.join(fmt_time(x) for x in rotations)} "
        f"(median {fmt_time(stall_a)}); saves took {fmt_time(median([s['save_s'] for s in a['saves']]))}; "
        f"steps {fmt_time(median(idle_a))}.",
        f"ckptd: the loop was blocked {fmt_time(blocked_b)} after a save (nothing to call); "
        f"{len(prunes)} prunes took {', '.join(fmt_time(p1 - p0) for p0, p1 in prunes)}, each in its own "
        f"process; saves took {fmt_time(median([s['save_s'] for s in b['saves']]))}; {len(during)} steps "
        "overlapped a prune "
        f"(median {fmt_time(median(during)) if during else '—'}), {len(idle)} did not "
        f"(median {fmt_time(median(idle)) if idle else '—'}).",
    ]
    if shard < (256 << 20) and not ctx.quick:
        section.details.append(f"shards shrunk to {fmt_bytes(shard)} to fit the free disk.")
    shutil.rmtree(configs, ignore_errors=True)
    return rows, section
