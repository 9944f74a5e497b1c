"""`python -m bench`: build synthetic volumes, run every benchmark, print the table, write BENCHMARKS.md.

Benchmarks run in the order of their sections' numbers; each returns its rows and a note on how
it measured. The daemon's (latency, idle cost, its memory) start `ckptd run`
as a child process (`bench/daemon.py`).
"""

from __future__ import annotations

import argparse
import compileall
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from bench import (
    attest,
    coldstart,
    consolidation,
    deletion,
    idle,
    latency,
    memory,
    metadata,
    planning,
    polling,
    report,
    stall,
    stalled,
    standby,
    storm,
    watchscale,
)
from bench.context import Context
from bench.measure import REPO, env, hide_torch
from bench.report import Row, Section
from bench.volume import SIZES

Benchmark = Callable[[Context], tuple[list[Row], Section]]
BENCHMARKS: dict[str, Benchmark] = {
    "coldstart": coldstart.run,
    "polling": polling.run,
    "latency": latency.run,
    "idle": idle.run,
    "memory": memory.run,
    "planning": planning.run,
    "deletion": deletion.run,
    "stall": stall.run,
    "metadata": metadata.run,
    "stalled": stalled.run,
    "storm": storm.run,
    "attest": attest.run,  # two real 2-rank DeepSpeed jobs: 1-3 min on 2 shared cores
    "standby": standby.run,
}
OPT_IN: dict[str, Benchmark] = {
    "consolidation": consolidation.bench,  # `--consolidation`; minutes, ~8 GiB
    "watchscale": watchscale.run,  # `--only watchscale --sizes L,XL`: the watcher on whole volumes, ~20 min
}
ALL: dict[str, Benchmark] = {**BENCHMARKS, **OPT_IN}
LAST = ("attest", "standby", "watchscale")
ORDER = [*(n for n in ALL if n not in LAST), *LAST]  # in the sections' numbers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure ckptd against the baselines a user would pick instead, on the same synthetic "
        "volumes in the same run; print a table and write BENCHMARKS.md.",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="volumes to measure on, of S (~2k files), M (~75k), L (~500k), XL (~1M, watchscale only); "
        "default S,M",
    )
    p.add_argument("--large", action="store_true", help="add the L volume (~500k files; a few more minutes)")
    p.add_argument(
        "--quick", action="store_true", help="tiny volume and sizes, 2 repetitions: the CI smoke run"
    )
    p.add_argument("--consolidation", action="store_true",
                   help="add consolidating a real ZeRO-2 checkpoint of 1.1 GiB fp32 weights (minutes, ~8 GiB "
                        "of memory to write it once, cached)")  # fmt: skip
    p.add_argument("--only", action="append", choices=sorted(ALL), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(ALL)}",
                   )  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="where to write the report")
    p.add_argument("--workdir", type=Path, default=None, help="where to build volumes (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (volumes) afterwards")
    return p


def _sizes(args: argparse.Namespace) -> list[str]:
    names = [s.strip().upper() for s in args.sizes.split(",") if s.strip()] if args.sizes else None
    if names is None:
        names = ["T"] if args.quick else ["S", "M"]
    if args.large and "L" not in names:
        names.append("L")
    bad = [n for n in names if n not in SIZES]
    if bad:
        raise SystemExit(f"python -m bench: unknown size {', '.join(bad)} (choose from {', '.join(SIZES)})")
    return sorted(set(names), key=list(SIZES).index)


def _torch_version() -> str | None:
    proc = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True,
        text=True,
        env=env(torch=True),
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    # The harness measures ckptd as on a node without torch; rows that need torch run in a child.
    hide_torch()
    # ckptd as installed: pip byte-compiles what it installs. A box with PYTHONDONTWRITEBYTECODE=1
    # (this one) and an editable install would compile ckptd's modules from source at every start
    # (about 0.1 s of each `ckptd plan`), which no installed ckptd pays.
    import ckptd

    compileall.compile_dir(Path(ckptd.__file__).parent, quiet=1)
    parent = args.workdir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=parent))
    ctx = Context(workdir, [SIZES[n] for n in _sizes(args)], args.quick, _torch_version())
    # The tree is named now, before anything is measured: a commit made during a run of half an
    # hour would otherwise be named as the one measured.
    machine_info = report.machine(workdir, REPO, ctx.torch_version, args.out)
    opted = ["consolidation"] if args.consolidation else []
    names = args.only or [n for n in ORDER if n in BENCHMARKS or n in opted]
    rows: list[Row] = []
    sections: list[Section] = []
    print(f"ckptd benchmarks in {workdir}: sizes {', '.join(s.name for s in ctx.sizes)}", file=sys.stderr)
    try:
        for name in names:
            print(f"{name}:", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            r, s = ALL[name](ctx)
            rows += r
            s.details.append(f"took {time.perf_counter() - t0:.0f} s in this run.")
            sections.append(s)
        total = time.perf_counter() - started
        text = report.markdown(
            rows=rows,
            sections=sections,
            machine_info=machine_info,
            command=command,
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            total_s=total,
            volumes=ctx.built,
        )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report.text_table(rows))
    missed = [r for r in rows if r.met is False]
    print(f"\n{sum(r.met is True for r in rows)} targets met, {len(missed)} missed; total {total:.0f} s")
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0
