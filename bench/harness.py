"""`python -m bench`: build synthetic volumes, run every benchmark, print the table, write BENCHMARKS.md.

Benchmarks run in the order of their sections' numbers; each returns its rows and a note on how
it measured. Each section is recorded in bench/results.json with its run (bench/results.py) and
BENCHMARKS.md is rendered from that file alone, so `--only NAME` refreshes one section. The
daemon's (latency, idle cost, its memory) start `ckptd run` as a child process (`bench/daemon.py`).
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
    results,
    stall,
    stalled,
    standby,
    storm,
    takeover,
    watchscale,
)
from bench.context import Context
from bench.measure import REPO, env, hide_torch
from bench.report import Row, Section
from bench.volume import SIZES

DEFAULT_OUT = REPO / "BENCHMARKS.md"
DEFAULT_RESULTS = REPO / "bench" / "results.json"

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
    "takeover": takeover.run,  # `--only takeover`: a standby taking over, each backend; a few minutes
}
ALL: dict[str, Benchmark] = {**BENCHMARKS, **OPT_IN}
LAST = ("attest", "standby", "watchscale", "takeover")
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
    p.add_argument("--also", action="append", default=[], choices=sorted(OPT_IN), metavar="NAME",
                   help=f"add an opt-in benchmark to the run (repeatable): {', '.join(OPT_IN)}")
    p.add_argument("--only", action="append", choices=sorted(ALL), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(ALL)}",
                   )  # fmt: skip
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the report")
    p.add_argument("--results", type=Path, default=None,
                   help="the recorded results the report is rendered from; the sections run replace theirs "
                        "(default: bench/results.json for the default --out, else --out with .json)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: write the report from the recorded results")  # fmt: skip
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


def _results_path(args: argparse.Namespace) -> Path:
    if args.results is not None:
        return args.results
    if args.out.resolve() == DEFAULT_OUT.resolve():
        return DEFAULT_RESULTS
    return args.out.with_suffix(".json")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results_path = _results_path(args)
    if args.render:
        args.out.write_text(results.render(results.load(results_path)))
        print(f"wrote {args.out} from {results_path}")
        return 0
    recorded = results.load(results_path)  # before measuring: a bad file fails now, not after an hour
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
    opted = [*args.also, *(["consolidation"] if args.consolidation else [])]
    names = args.only or [n for n in ORDER if n in BENCHMARKS or n in opted]
    run = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "tree": f"ckptd {ckptd.__version__} at {report.tree(REPO, args.out, results_path)}",
        "machine": dict(report.machine(workdir, REPO, ctx.torch_version)),
        "sizes": [s.name for s in ctx.sizes],
        "asked": names,
        "volumes": ctx.built,  # filled in as the volumes are built
        "took_s": 0.0,
    }
    rows: list[Row] = []
    done = []
    load = results.LoadSampler().start()
    print(f"ckptd benchmarks in {workdir}: sizes {', '.join(s.name for s in ctx.sizes)}", file=sys.stderr)
    try:
        for name in names:
            print(f"{name}:", file=sys.stderr, flush=True)
            t0, mark = time.perf_counter(), load.mark()
            r, s = ALL[name](ctx)
            rows += r
            done.append(results.record(name, r, s, run, time.perf_counter() - t0, load.since(mark)))
            # Written after each section, each whole by itself: a run that fails or is stopped late
            # keeps what it finished (the report names the sections it did not reach).
            run["took_s"] = round(time.perf_counter() - started, 1)
            doc = results.merge(recorded, done)
            results_path.write_text(results.dump(doc))
            args.out.write_text(results.render(doc))
    finally:
        load.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.perf_counter() - started
    print(report.text_table(rows))
    missed = [r for r in rows if r.met is False]
    print(f"\n{sum(r.met is True for r in rows)} targets met, {len(missed)} missed; total {total:.0f} s")
    print(f"wrote {results_path} and {args.out}")
    return 0
