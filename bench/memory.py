"""5. Memory: RSS after start-up, without torch and with it.

Measured now: a process that imports ckptd, scans a whole volume and plans
(what the daemon does at start-up, and what `ckptd plan` does), then reads its
own VmRSS and VmHWM from /proc/self/status (`python -m bench.probe scan`).
Without torch (hidden), and with torch installed, where the volume's DeepSpeed
`mp_rank_00_model_states.pt` files make ckptd import it to read world sizes.

The daemon's RSS needs `ckptd run` (issue 7): start it on the same volume,
wait for READY, read VmRSS from /proc/<pid>/status.
"""

from __future__ import annotations

import json
import sys

from bench.context import Context
from bench.measure import check, env, run_child
from bench.report import PENDING, Row, Section, pending

NAME = "5. memory"
TARGET_MIB = 80


def _probe(ctx: Context, config: str, *, torch: bool) -> dict:
    argv = [sys.executable, "-m", "bench.probe", "scan", config, "--reps", "1"]
    return json.loads(check(run_child(argv, env=env(torch=torch)), "probe scan").stdout)


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "RSS (VmRSS) of a process that imported ckptd, scanned the whole volume and planned, read "
        "from its own /proc/self/status; VmHWM is the peak. The target (≤ 80 MiB on M without torch) "
        f"is for the daemon, whose figure {PENDING}; the scanning process stands in until then.",
    )
    shapes = [s for s in ctx.sizes if s.name in ("M", "L")] or ctx.sizes[-1:]
    for shape in shapes:
        v = ctx.volume(shape)
        ctx.log(f"memory on {shape.name}: scan without torch")
        doc = _probe(ctx, str(v.config), torch=False)
        mib = doc["rss_first_kib"] / 1024
        target = f"≤ {TARGET_MIB} MiB" if shape.name == "M" else "—"
        met = mib <= TARGET_MIB if shape.name == "M" else None
        rows.append(
            Row(
                NAME,
                f"{shape.name}: RSS after scan + plan, no torch",
                f"{mib:.0f} MiB",
                target=target,
                met=met,
            )
        )
        section.details.append(
            f"{shape.name}, no torch: {doc['rss_imported_kib'] / 1024:.0f} MiB after imports, "
            f"{mib:.0f} MiB after the scan and plan ({sum(doc['states'].values()):,} checkpoints), "
            f"peak {doc['hwm_kib'] / 1024:.0f} MiB. The checkpoints hold {doc['history_steps']:,} parsed "
            "log-history steps between them: each keeps its own trainer_state.json's history, which "
            "grows with the run, so memory grows with checkpoints × run length; retention reads the "
            "newest history of each run first."
        )
        rows.append(pending(NAME, f"{shape.name}: `ckptd run` RSS after start-up, no torch", target=target))
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
            f"({loaded}: the model-states files are real torch zips), peak {doc['hwm_kib'] / 1024:.0f} MiB."
        )
    return rows, section
