"""10. Stalled checkpoints: what abandoned saves cost an idle daemon, for as long as they stay.

Every crashed job leaves one: a checkpoint whose rank's shard was left truncated. ckptd
never deletes it (it is not complete), and walking it, every file, at every poll would cost
that for as long as it stays. Each look that finds it unchanged doubles the polls to the next,
up to reconcile_interval; between looks a poll stats its directories and the file that failed.
The baseline is the same daemon looking at it every poll.

Measured on the fake monotonic clock of `python -m bench.probe hours` (the daemon's
filesystem thread, driven as `main_loop` drives it) with two roots: the M volume and a
root of 20 abandoned 64-rank saves (`stall_after` 1 h, so they are stalled by the measured
hour). After two simulated hours of warm-up (back-offs at their cap), one hour: the CPU the
stalled root's tracker took (polls, reconciles, steps: its own work, timed on the thread),
and its metadata operations; then the same with looks at every poll (no back-off: the
baseline, as before). Target: ≤ 0.02 % of a core added.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.context import Context
from bench.measure import check, env, fmt_ratio, fmt_time, run_child
from bench.metadata import keep_all_config, ops_text
from bench.report import Row, Section
from bench.volume import write_checkpoint

NAME = "10. stalled checkpoints"
TARGET_PCT = 0.02


def write_abandoned(root: Path, count: int, world: int, *, mtime: float) -> None:
    """`count` checkpoints of `world` ranks, each with rank 1's shard left truncated (not a zip)."""
    for i in range(count):
        ckpt = write_checkpoint(root / f"run-{i}", 1000, world=world, run=i, mtime=mtime)
        shard = ckpt / "global_step1000" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(b"\0" * 64)
        os.utime(shard, (mtime, mtime))


def run(ctx: Context) -> tuple[list[Row], Section]:
    shape = next((s for s in reversed(ctx.sizes) if s.name in ("M", "T")), ctx.sizes[-1])
    count, world = (4, 8) if ctx.quick else (20, 64)
    warmup, hours = (0.5, 0.5) if ctx.quick else (2.0, 1.0)
    v = ctx.volume(shape)
    stalled_root = ctx.scratch("stalled") / "root"
    write_abandoned(stalled_root, count, world, mtime=time.time() - 7200)
    config = keep_all_config(ctx, shape.name, v.root, shape.world, name="stalled-config")
    text = config.read_text()
    config.write_text(
        text
        + f"\n[[roots]]\npath = '{stalled_root}'\nobserver = 'polling'\nworld_size = {world}\n"
        "quiet_period = '60s'\nstall_after = '1h'\n[roots.retention]\nkeep_last = 1000000\nkeep_best = 0\n"
    )
    section = Section(
        NAME,
        f"`python -m bench.probe hours` (the daemon's filesystem thread on a fake monotonic clock) with two "
        f"roots, {shape.name} and {count} abandoned saves of {world} ranks (rank 1's shard truncated; "
        f"stall_after 1 h), poll_interval 10 s and reconcile_interval 5 min; after {warmup:g} simulated "
        f"hours of warm-up, {hours:g} hour measured: the stalled root's own tracker CPU (thread time of its "
        "polls, reconciles and steps) as a share of a core, and its metadata operations; baseline: the "
        f"same with a look at every poll (no back-off, as before). Target: ≤ {TARGET_PCT:g} % added.",
    )
    ctx.log(f"stalled on {shape.name}: {count} × {world}-rank saves, {warmup:g}+{hours:g} simulated h")
    results = {}
    for label, extra in (("backoff", []), ("every poll", ["--no-backoff"])):
        argv = [sys.executable, "-m", "bench.probe", "hours", str(config), "--warmup", str(warmup),
                "--hours", str(hours), *extra]  # fmt: skip
        child = check(run_child(argv, env=env(torch=False), timeout=1800), "probe hours")
        results[label] = json.loads(child.stdout)
    argv = [sys.executable, "-m", "bench.probe", "hours", str(config), "--warmup", str(warmup),
            "--hours", str(hours), "--count"]  # fmt: skip
    counted = json.loads(check(run_child(argv, env=env(torch=False), timeout=1800), "probe count").stdout)
    key = str(stalled_root)
    ours = results["backoff"]["per_root_cpu_s"].get(key, 0.0) / hours
    before = results["every poll"]["per_root_cpu_s"].get(key, 0.0) / hours
    pct, pct_before = 100 * ours / 3600, 100 * before / 3600
    states = results["backoff"]["states"]
    met = pct <= TARGET_PCT
    rows = [
        Row(
            NAME,
            f"{shape.name} + {count} stalled {world}-rank saves: idle CPU added, back-off vs every poll",
            f"{pct:.2g} % ({fmt_time(ours)}/h)",
            f"{pct_before:.2g} % ({fmt_time(before)}/h)",
            fmt_ratio(ours / before) if before else "—",
            f"≤ {TARGET_PCT:g} %",
            met,
            ""
            if met
            else f"{pct:.2g} % against {TARGET_PCT:g} %: {fmt_time(ours)} of CPU an hour for {count} stalled "
            "checkpoints; a look at one (walk, fingerprint, checks) is what it costs, and each reconcile "
            "looks at each",
        )
    ]
    ops = counted["ops"].get(key, {})
    section.details.append(
        f"{count} abandoned saves ({states}): with back-off {fmt_time(ours)} of their tracker's CPU an hour "
        f"({pct:.2g} % of a core), {ops_text(ops)} an hour on their root; looked at every poll "
        f"{fmt_time(before)} ({pct_before:.2g} %). The whole daemon's thread: "
        f"{fmt_time(results['backoff']['cpu_s'] / hours)}/h with back-off, "
        f"{fmt_time(results['every poll']['cpu_s'] / hours)}/h without ({shape.name} included); "
        f"{results['backoff']['polls']} polls, {results['backoff']['reconciles']} reconciles (both roots)."
    )
    return rows, section
