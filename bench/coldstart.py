"""1. Cold start: `ckptd plan` classifying a whole volume vs `find ROOT -printf '%s\\n'`.

`find -printf '%s'` walks the tree and stats every entry: the floor for any
tool that must see every file. ckptd does that too, and more: it reads the
zip directory at the end of every torch file (the integrity evidence), parses
each trainer_state.json and safetensors header, and plans.

Measured four ways, each interleaved with `find` so noise hits both alike:
`ckptd plan` as a command (Python start-up included), the same scan in a
warm process (what the daemon pays at start-up), `ckptd plan` with torch
installed, which reads each checkpoint's `mp_rank_00_model_states.pt`, and
with the verdict cache a daemon or an earlier `plan` left in `state_dir`
(`verdicts.py`): `ckptd plan` again, and a daemon restarted on the unchanged
volume, to READY and until every checkpoint is complete again.
Without root the page cache cannot be dropped: every figure is warm-cache.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench import volume
from bench.context import Context
from bench.daemon import start_until_complete, write_config
from bench.measure import check, env, fmt_ratio, fmt_time, median, run_child
from bench.report import Row, Section
from bench.volume import Volume

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
        bare = [sys.executable, "-c", "pass"]
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
        ctx.facts[f"find_{shape.name}"] = f

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
                "`find` opens no file; ckptd reads every torch file's zip tail and does Python work per "
                "entry (classifying it, the fingerprint, each framework's checks), so a first look stays "
                "far from 2×. Only the first `plan` or daemon start on a volume pays it: the verdict cache "
                "makes the next ones re-read nothing but stats (the rows with the cache)."
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
        floor_doc = json.loads(
            check(run_child([sys.executable, "-m", "bench.probe", "floor", str(v.root), "--reps", str(n)]),
                  "probe floor").stdout
        )
        floor = median(floor_doc["floor_s"])
        rows.append(
            Row(
                NAME,
                f"{shape.name}: its I/O alone (lstat every entry; open, head and tail of every torch file) "
                "in a minimal Python loop vs `find -printf`",
                fmt_time(floor),
                fmt_time(f),
                fmt_ratio(floor / f),
            )
        )
        section.details.append(
            f"{shape.name}: the I/O floor (`python -m bench.probe floor`: {floor_doc['entries']:,} lstats, "
            f"{floor_doc['opened']:,} torch files opened, a head and a tail read each, nothing parsed) takes "
            f"{fmt_time(floor)}, {fmt_ratio(floor / f)} `find`; the warm scan + plan is "
            f"{fmt_ratio(scan / floor)} that floor: Python's work per entry, not the reads, is most of it."
        )
        section.details.append(
            f"{shape.name} ({shape.entries:,} entries, {zips:,} torch files): find {fmt_time(f)}; "
            f"`ckptd plan` {fmt_time(p)} wall, {fmt_time(median(cpu_plan))} CPU, "
            f"peak RSS {median(rss_plan) / 1024:.0f} MiB; start-up alone {fmt_time(s)}; warm scan + plan "
            f"{fmt_time(scan)} (walk {fmt_time(walk)}, integrity {fmt_time(integrity)}); "
            f"states {doc['states']}, plan {doc['summary']['keep']} keep / "
            f"{doc['summary']['delete']} delete; {n} repetitions."
        )

        cached_rows, cached_details = _with_cache(ctx, v, n, find, bare, notorch)
        rows.extend(cached_rows)
        section.details.extend(cached_details)

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


def _with_cache(
    ctx: Context, v: Volume, n: int, find: list[str], bare: list[str], notorch: dict[str, str]
) -> tuple[list[Row], list[str]]:
    """`ckptd plan` and a daemon restart with the verdict cache in state_dir, vs `find -printf`.

    The target is 2× `find`; Python's own start-up (`python -c pass`, the
    interpreter and site, no ckptd) is shown beside it and, as the L bar allows, subtracted in
    the second ratio."""
    shape = v.shape
    work = ctx.scratch(f"coldstart-cache-{shape.name}")
    state = work / "state"
    state.mkdir()
    config = work / "ckptd.toml"
    volume.write_config(config, v.root, state, world=shape.world)  # the volume's own, state_dir apart
    plan = [sys.executable, "-m", "ckptd", "plan", "-c", str(config)]
    ctx.log(f"cold start on {shape.name}: ckptd plan with the verdict cache, {n} ×")
    check(run_child(plan, env=notorch), "ckptd plan (writes the cache)")
    cache = sorted(p.stat().st_size for p in state.glob("verdicts-*.json"))
    t_find, t_plan, t_bare = [], [], []
    for _ in range(n):
        t_find.append(check(run_child(find), "find").wall)
        t_plan.append(check(run_child(plan, env=notorch), "ckptd plan (cached)").wall)
        t_bare.append(check(run_child(bare, env=notorch), "python -c pass").wall)
    f, p, b = median(t_find), median(t_plan), median(t_bare)
    rows = [_cached_row(shape.name, "`ckptd plan` with the verdict cache", p, f, b)]
    details = [
        f"{shape.name} with the verdict cache ({cache[-1] / 1024:.0f} KiB in state_dir, written by the "
        f"first `plan`): `ckptd plan` {fmt_time(p)} against find {fmt_time(f)}; Python itself "
        f"(`python -c pass`) {fmt_time(b)}; {n} repetitions."
    ]

    # A daemon restarted on the unchanged volume: the first start writes the cache, the next ones use it.
    k = 1 if shape.name == "L" else min(n, 3)
    ctx.log(f"cold start on {shape.name}: ckptd run, then {k} restarts with the verdict cache")
    dstate = work / "daemon-state"
    dconfig = write_config(
        work / "daemon.toml", v.root, dstate, observer="inotify", world=shape.world, quiet_period=1
    )
    count = shape.runs * shape.checkpoints
    first = _start_stop(dconfig, count)
    ready, complete, f2 = [], [], []
    for _ in range(k):
        f2.append(check(run_child(find), "find").wall)
        facts = _start_stop(dconfig, count)
        ready.append(facts["ready_s"])
        complete.append(facts["complete_s"])
    f2m, r, c = median(f2), median(ready), median(complete)
    rows.append(_cached_row(shape.name, "daemon restart with the verdict cache: READY", r, f2m, b))
    rows.append(
        Row(
            NAME,
            f"{shape.name}: daemon restart with the verdict cache: every checkpoint complete again",
            fmt_time(c),
            fmt_time(f2m),
            fmt_ratio(c / f2m),
        )
    )
    details.append(
        f"{shape.name}, `ckptd run` (inotify, quiet_period 1 s, torch hidden): the first start, with an "
        f"empty state_dir, READY after {fmt_time(first['ready_s'])} and every checkpoint complete after "
        f"{fmt_time(first['complete_s'])}; restarted with its verdict cache, READY after {fmt_time(r)} and "
        f"complete after {fmt_time(c)} (the quiet period, then one walk of each checkpoint: stats, no "
        f"file read), median of {k}; find {fmt_time(f2m)}."
    )
    shutil.rmtree(work, ignore_errors=True)
    return rows, details


def _start_stop(config: Path, checkpoints: int) -> dict[str, float]:
    d, facts = start_until_complete(config, checkpoints, timeout=1800, still_for=0.5)
    d.stop()
    return facts


def _cached_row(shape: str, what: str, took: float, find: float, python: float) -> Row:
    ratio = took / find
    net = max(0.0, took - python) / find
    note = ""
    if net > TARGET:
        note = (
            "What is left is ckptd's imports (pydantic and its own modules: `python -X importtime -m ckptd "
            "--version`), decoding the cache (a JSON line per checkpoint) and a stat per directory."
        )
    return Row(
        NAME,
        f"{shape}: {what} vs `find -printf` (less Python's start-up)",
        fmt_time(took),
        fmt_time(find),
        f"{fmt_ratio(ratio)} ({fmt_ratio(net)})",
        f"≤ {TARGET:g}×",
        net <= TARGET,
        note,
    )
