"""13. Commit records: the last rank's write of a real multi-rank DeepSpeed save → "complete".

A real 2-rank DeepSpeed job (tests/support/dsgen.py: ZeRO-2, gloo on the CPU, `torch.multiprocessing`,
bare layout: `<run>/global_stepN/` is the checkpoint) saves N times, a pause between saves (the
training), under a fresh `ckptd run --foreground --log-format json` (inotify, keep-all retention).
Twice: once with `ckptd.integrations.deepspeed.wrap` on the engine (each rank's commit record
written when its `save_checkpoint` returns), once without (the same job, no records: complete by
the quiet period). Lag = when the daemon's `<run>/global_stepN: complete` line reached the
harness (its monotonic time, put on the wall clock) − the newest mtime among the save's own files
(`.ckptd/` left out): the last rank's last write, as the filesystem stamped it.

Without records the lag is quiet_period + what the daemon adds; the quiet period is set short
here (the job does not wait for it), so the figure at ckptd's default (60 s) is derived: 60 s +
the overhead measured beyond the short one. `python -m bench.attest --quiet-period 60` measures it
at the default instead (a few minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.context import Context
from bench.daemon import DaemonProc, is_complete, write_config
from bench.measure import env, fmt_time, median
from bench.report import Row, Section

NAME = "13. commit records"
WORLD = 2
DEFAULT_QUIET_S = 60.0  # ckptd's default quiet_period
GAP_S = 2.0  # seconds of "training" before each save
TARGET_S = 1.0  # with records: complete within a second of the last rank's write


def _deepspeed_installed() -> bool:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('deepspeed') is not None)"],
        capture_output=True, text=True, env=env(torch=True),
    )  # fmt: skip
    return proc.stdout.strip() == "True"


def _last_write(ckpt: Path) -> float:
    """The newest mtime among the save's own files (ckptd's `.ckptd/` metadata left out)."""
    return max(p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file() and ".ckptd" not in p.parts)


def measure(work: Path, *, records: bool, saves: int, quiet: float, gap: float = GAP_S) -> dict:
    """One DeepSpeed job of `saves` saves under a fresh daemon; each save's lag, in seconds."""
    from tests.support import dsgen

    root = work / "root"
    run = root / "ds"
    config = write_config(work / "ckptd.toml", root, work / "state", observer="inotify", world=WORLD,
                          quiet_period=quiet)  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    steps = tuple(range(1, saves + 1))
    child = {"PYTHONPATH": env(torch=True)["PYTHONPATH"]}
    if records:
        child["DSGEN_ATTEST"] = "1"
    clock = time.time() - time.monotonic()  # monotonic -> wall clock, for comparing with mtimes
    with DaemonProc(config, foreground=True) as d:
        d.wait_message("ready:", timeout=120)
        start = d.mark()
        with dsgen.start(run, world_size=WORLD, stage=2, layout="bare", steps=steps, train_steps_per_save=1,
                         save_gap=gap, env=child, timeout=600) as job:  # fmt: skip
            job.wait()
        lags, from_record, how = [], [], []
        for step in steps:
            name = f"global_step{step}"
            complete = lambda ln, name=name: is_complete(ln, name)  # noqa: E731
            line = d.wait_for(complete, timeout=3 * quiet + 60, start=start)[0]
            ckpt = run / name
            done = line.received + clock
            lags.append(done - _last_write(ckpt))
            if records:
                from_record.append(done - max(p.stat().st_mtime for p in (ckpt / ".ckptd").glob("commit-*")))
            how.append(line.message.partition(": ")[2])
        errors = d.errors()
    if errors:
        raise RuntimeError(f"ckptd run logged errors: {errors[:3]}")
    return {"lags": lags, "from_record": from_record, "how": how}


def run(ctx: Context) -> tuple[list[Row], Section]:
    quiet = 1.0 if ctx.quick else 5.0
    saves = 2 if ctx.quick else 5
    section = Section(
        NAME,
        f"A real {WORLD}-rank DeepSpeed ZeRO-2 job (tests/support/dsgen.py, gloo on the CPU, bare layout) "
        f"saves {saves} times, {GAP_S:g} s of pause before each, under a fresh `ckptd run --foreground "
        f"--log-format json` (inotify, quiet_period {quiet:g} s, keep-all); once with "
        "`ckptd.integrations.deepspeed.wrap` (commit records), once without. Lag = the daemon's "
        "`complete` line, as received − the newest mtime of the save's own files (`.ckptd/` aside). "
        f"The figure at the default quiet_period ({DEFAULT_QUIET_S:g} s) is derived: it plus the "
        f"overhead measured beyond {quiet:g} s (`python -m bench.attest --quiet-period 60` measures it).",
    )
    if ctx.torch_version is None or not _deepspeed_installed():
        section.details.append("skipped: torch or deepspeed is not installed.")
        return [Row(NAME, "2-rank DeepSpeed save: last write → complete", "skipped (no deepspeed)")], section
    ctx.log(f"commit records: {saves} DeepSpeed saves with records, then {saves} without (quiet {quiet:g} s)")
    rec = measure(ctx.scratch("attest-records"), records=True, saves=saves, quiet=quiet)
    bare = measure(ctx.scratch("attest-quiet"), records=False, saves=saves, quiet=quiet)
    with_records, without = median(rec["lags"]), median(bare["lags"])
    overhead = without - quiet
    at_default = DEFAULT_QUIET_S + overhead
    rows = [
        Row(NAME, f"2-rank DeepSpeed save: last rank's write → complete, with records vs by quiet period "
                  f"({quiet:g} s)",
            fmt_time(with_records), fmt_time(without), f"1/{without / with_records:,.0f}",
            target=f"≤ {TARGET_S:g} s", met=with_records <= TARGET_S),
        Row(NAME, f"the same at the default quiet_period ({DEFAULT_QUIET_S:g} s; derived)",
            fmt_time(with_records), fmt_time(at_default), f"1/{at_default / with_records:,.0f}"),
    ]  # fmt: skip
    section.details += [
        f"with records: lag median {fmt_time(with_records)} over {saves} saves "
        f"({', '.join(fmt_time(x) for x in rec['lags'])}); from the last commit record's rename "
        f"{fmt_time(median(rec['from_record']))}; the daemon said: {rec['how'][-1]!r}.",
        f"without: median {fmt_time(without)} ({', '.join(fmt_time(x) for x in bare['lags'])}), "
        f"{fmt_time(overhead)} beyond the quiet period; at the default that is {fmt_time(at_default)}; "
        f"the daemon said: {bare['how'][-1]!r}.",
    ]
    return rows, section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attest", description=__doc__.split("\n\n")[0])
    p.add_argument("--quiet-period", type=float, default=DEFAULT_QUIET_S)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--records", action="store_true", help="with commit records (default: without)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp"))
    a = p.parse_args(argv)
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-attest-", dir=a.workdir))
    doc = measure(work, records=a.records, saves=a.saves, quiet=a.quiet_period)
    lags = doc["lags"]
    print(f"quiet_period {a.quiet_period:g} s, records {a.records}: lags {[round(x, 3) for x in lags]}, "
          f"median {statistics.median(lags):.3f} s; {doc['how'][-1]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
