"""5. Memory: RSS after start-up, without torch and with it.

Measured now: a process that imports ckptd, scans a whole volume and plans
(what the daemon does at start-up, and what `ckptd plan` does), then reads its
own VmRSS and VmHWM from /proc/self/status (`python -m bench.probe scan`).
Without torch (hidden), and with torch installed, where the volume's DeepSpeed
`mp_rank_00_model_states.pt` files make ckptd import it to read world sizes.

The daemon's: `ckptd run` (inotify, torch hidden, a retention that keeps
everything) on the same volume; VmRSS from /proc/<pid>/status when its READY
line arrives (start-up scan done), again once every checkpoint is complete, and
VmHWM (the peak) then.
"""

from __future__ import annotations

import json
import sys

from bench.context import Context
from bench.daemon import start_until_complete, write_config
from bench.measure import check, env, run_child
from bench.report import Row, Section
from ckptd.daemon.watch import MAX_WATCHES

NAME = "5. memory"
TARGET_MIB = 80  # the daemon on M
TARGET_MIB_L = 150  # the daemon on L
POLL_INTERVAL_S = 10.0  # ckptd's default poll_interval


def _probe(ctx: Context, config: str, *, torch: bool) -> dict:
    argv = [sys.executable, "-m", "bench.probe", "scan", config, "--reps", "1"]
    return json.loads(check(run_child(argv, env=env(torch=torch)), "probe scan").stdout)


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "RSS (VmRSS) of a process that imported ckptd, scanned the whole volume and planned, read "
        "from its own /proc/self/status; VmHWM is the peak. The daemon's: `ckptd run --log-format json` "
        "(observer inotify, quiet_period 1 s, torch hidden, a retention that keeps everything), VmRSS "
        "from /proc/<pid>/status when its READY line arrives and once every checkpoint is complete. "
        "Target: ≤ 80 MiB on M and ≤ 150 MiB on L without torch, for the daemon.",
    )
    shapes = [s for s in ctx.sizes if s.name in ("M", "L")] or ctx.sizes[-1:]
    for shape in shapes:
        v = ctx.volume(shape)
        ctx.log(f"memory on {shape.name}: scan without torch")
        doc = _probe(ctx, str(v.config), torch=False)
        mib = doc["rss_first_kib"] / 1024
        rows.append(Row(NAME, f"{shape.name}: RSS after scan + plan, no torch", f"{mib:.0f} MiB"))
        section.details.append(
            f"{shape.name}, no torch: {doc['rss_imported_kib'] / 1024:.0f} MiB after imports, "
            f"{mib:.0f} MiB after the scan and plan ({sum(doc['states'].values()):,} checkpoints), "
            f"peak {doc['hwm_kib'] / 1024:.0f} MiB. The checkpoints hold {doc['history_steps']:,} parsed "
            "log-history steps between them: each keeps its own trainer_state.json's history, which "
            "grows with the run, so memory grows with checkpoints × run length; retention reads the "
            "newest history of each run first."
        )
        ctx.log(f"memory on {shape.name}: ckptd run until every checkpoint is complete")
        work = ctx.scratch("memory-daemon")
        config = write_config(
            work / "ckptd.toml",
            v.root,
            work / "state",
            observer="inotify",
            world=shape.world,
            quiet_period=0.3 if ctx.quick else 1,
        )
        d, facts = start_until_complete(
            config, shape.runs * shape.checkpoints, timeout=900, still_for=0.3 if ctx.quick else 1.0
        )
        d.stop()
        ready, complete = facts["rss_ready_kib"] / 1024, facts["rss_complete_kib"] / 1024
        daemon = max(ready, complete)
        target = {"M": TARGET_MIB, "L": TARGET_MIB_L}.get(shape.name)
        on_target = target is not None
        note = ""
        if target is not None and daemon > target:
            note = (
                f"{daemon:.0f} MiB against {target} MiB, {daemon - target:.0f} MiB over; a process "
                f"that only scans and plans holds {mib:.0f} MiB, so the rest is the daemon's own: "
                f"{facts['threads_ready']} threads at READY (watchdog: observer, inotify reader and dispatcher, "
                f"one emitter per root)."
            )
        rows.append(
            Row(
                NAME,
                f"{shape.name}: `ckptd run` RSS after start-up, no torch",
                f"{ready:.0f} MiB at READY, {complete:.0f} MiB all complete",
                target=f"≤ {target} MiB" if on_target else "—",
                met=daemon <= target if target is not None else None,
                note=note,
            )
        )
        section.details.append(
            f"{shape.name}, `ckptd run`: {ready:.0f} MiB RSS at READY ({facts['ready_s']:.1f} s after the "
            f"start; {facts['threads_ready']} threads: the root is watched by one recursive watchdog watch, "
            f"a kernel watch per directory on one inotify instance, up to {MAX_WATCHES} scheduled watches), "
            f"{complete:.0f} MiB once every "
            f"checkpoint was complete ({facts['complete_s']:.1f} s) and "
            f"the daemon still ({facts['still_s']:.1f} s; {facts['threads']} threads), peak "
            f"{facts['hwm_kib'] / 1024:.0f} MiB."
        )
        if complete > 1.2 * ready and facts["ready_s"] > POLL_INTERVAL_S:
            section.details[-1] += (
                f" The start-up scan outlasted poll_interval ({POLL_INTERVAL_S:g} s), so the "
                "checkpoints were found quiet by a poll, and the RSS grew by more than a fifth after READY: "
                "`RootTracker.poll` loops over names so that each replaced `Checkpoint` can go at once; "
                "look there first."
            )
    if ctx.torch_version:
        shape = next((s for s in reversed(ctx.sizes) if s.name != "L"), ctx.sizes[0])
        v = ctx.volume(shape)
        ctx.log(f"memory on {shape.name}: scan with torch")
        doc = _probe(ctx, str(v.config), torch=True)
        mib = doc["rss_first_kib"] / 1024
        loaded = "torch loaded" if doc["torch_loaded"] else "torch NOT loaded"
        rows.append(
            Row(
                NAME,
                f"{shape.name}: RSS after scan + plan, {loaded} by DeepSpeed checkpoints",
                f"{mib:.0f} MiB",
            )
        )
        section.details.append(
            f"{shape.name}, torch {ctx.torch_version} installed: {mib:.0f} MiB after the scan "
            f"({loaded}: the model-states files are real torch zips, which ckptd reads with its own "
            f"restricted unpickler, torch only for legacy files), peak {doc['hwm_kib'] / 1024:.0f} MiB."
        )
    return rows, section
