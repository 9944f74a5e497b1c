"""1. Cold start: `ckptd plan` classifying a whole volume vs `find ROOT -printf '%s\\n'`.

`find -printf '%s'` walks the tree and stats every entry: the floor for any
tool that must see every file. ckptd does that too, and more: it reads the
zip directory at the end of every torch file (the integrity evidence), parses
each trainer_state.json and safetensors header, and plans.

Measured three ways, each interleaved with `find` so noise hits both alike:
`ckptd plan` as a command (Python start-up included), the same scan in a
warm process (what the daemon pays at start-up), and `ckptd plan` with torch
installed, which reads each checkpoint's `mp_rank_00_model_states.pt`.
Without root the page cache cannot be dropped: every figure is warm-cache.
"""

from __future__ import annotations

import json
import sys

from bench.context import Context
from bench.measure import check, env, fmt_ratio, fmt_time, median, run_child
from bench.report import Row, Section

NAME = "1. cold start"
TARGET = 2.0  # × find -printf


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "Wall time of `python -m ckptd plan -c CONFIG` (torch hidden: world sizes from the config) "
        "vs `find ROOT -printf '%s\\n'`, both to /dev/null, interleaved, after one untimed warm-up "
        "of each; the in-process row scans and plans in an already-started Python "
        "(`python -m bench.probe scan`). Ratio = ckptd / find; target ≤ 2×.",
    )
    notorch, withtorch = env(torch=False), env(torch=True)
    for shape in ctx.sizes:
        v = ctx.volume(shape)
        n = ctx.reps(shape)
        find = ["find", str(v.root), "-printf", "%s\n"]
        plan = [sys.executable, "-m", "ckptd", "plan", "-c", str(v.config)]
        startup = [sys.executable, "-m", "ckptd", "--version"]
        ctx.log(f"cold start on {shape.name}: {n} × find, ckptd plan, ckptd --version")
        check(run_child(find), "find")
        check(run_child(plan, env=notorch), "ckptd plan")
        t_find, t_plan, t_start, cpu_plan, rss_plan = [], [], [], [], []
        for _ in range(n):
            t_find.append(check(run_child(find), "find").wall)
            c = check(run_child(plan, env=notorch), "ckptd plan")
            t_plan.append(c.wall)
            cpu_plan.append(c.cpu)
            rss_plan.append(c.maxrss_kib)
            t_start.append(check(run_child(startup, env=notorch), "ckptd --version").wall)
        f, p, s = median(t_find), median(t_plan), median(t_start)

        probe = check(
            run_child(
                [sys.executable, "-m", "bench.probe", "scan", str(v.config), "--reps", str(n)], env=notorch
            ),
            "probe scan",
        )
        doc = json.loads(probe.stdout)
        scan = median(doc["scan_s"])
        integrity = median([b["_integrity"] for b in doc["breakdown"]])
        walk = median([b["walk"] for b in doc["breakdown"]])
        zips = shape.runs * shape.checkpoints * (2 * shape.world + 3)

        ratio = p / f
        note = ""
        if ratio > TARGET:
            note = (
                f"{shape.name}: `ckptd plan` takes {fmt_time(p)}, {fmt_ratio(ratio)} `find` ({fmt_time(f)}); "
                f"the target is {TARGET:g}×, missed by {fmt_ratio(ratio / TARGET)}. "
                f"Python start-up and imports (`ckptd --version`) take {fmt_time(s)}; the scan itself "
                f"{fmt_time(scan)} in a warm process, of which {fmt_time(integrity)} is the integrity check "
                f"(opening {zips:,} torch files to read their zip directory) and {fmt_time(walk)} the walk "
                "with lstat. `find` opens no file, so 2× is out of reach while every torch file's tail is "
                "read: what would narrow it is an `os.pread` of the last bytes (the walk already has the "
                "size) instead of `zipfile.is_zipfile`'s buffered seeks, plain `str` paths instead of "
                "`pathlib` in `evidence.walk`/`_integrity`, and a (path, size, mtime) evidence cache in "
                "`state_dir` so that a repeated `plan` re-reads only what changed. A daemon pays this at "
                "start-up only."
            )
        rows.append(
            Row(
                NAME,
                f"{shape.name}: `ckptd plan` (no torch) vs `find -printf`",
                fmt_time(p),
                fmt_time(f),
                fmt_ratio(ratio),
                f"≤ {TARGET:g}×",
                ratio <= TARGET,
                note,
            )
        )
        rows.append(
            Row(
                NAME,
                f"{shape.name}: scan + plan in a warm process vs `find -printf`",
                fmt_time(scan),
                fmt_time(f),
                fmt_ratio(scan / f),
            )
        )
        section.details.append(
            f"{shape.name} ({shape.entries:,} entries, {zips:,} torch files): find {fmt_time(f)}; "
            f"`ckptd plan` {fmt_time(p)} wall, {fmt_time(median(cpu_plan))} CPU, "
            f"peak RSS {median(rss_plan) / 1024:.0f} MiB; start-up alone {fmt_time(s)}; warm scan + plan "
            f"{fmt_time(scan)} (walk {fmt_time(walk)}, integrity {fmt_time(integrity)}); "
            f"states {doc['states']}, plan {doc['summary']['keep']} keep / "
            f"{doc['summary']['delete']} delete; {n} repetitions."
        )

        if ctx.torch_version:
            k = 1 if shape.name == "L" else min(n, 3)
            ctx.log(f"cold start on {shape.name}: {k} × ckptd plan with torch")
            t_torch = [check(run_child(plan, env=withtorch), "ckptd plan (torch)").wall for _ in range(k)]
            t_f2 = [check(run_child(find), "find").wall for _ in range(k)]
            pt, f2 = median(t_torch), median(t_f2)
            rows.append(
                Row(
                    NAME,
                    f"{shape.name}: `ckptd plan` with torch (reads each model-states file)",
                    fmt_time(pt),
                    fmt_time(f2),
                    fmt_ratio(pt / f2),
                )
            )
            section.details.append(
                f"{shape.name} with torch {ctx.torch_version}: `ckptd plan` {fmt_time(pt)}, against "
                f"{fmt_time(p)} without: torch importable, but each model-states zip is read by ckptd's own "
                f"restricted unpickler (`dsmeta.read_plain_data`), not `torch.load`; {k} repetition(s)."
            )
    return rows, section
