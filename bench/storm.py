"""11. Save storm: 100 runs × 8 ranks saving at the same moment, as a synchronized sweep does.

`ckptd run --log-format json` (observer inotify, quiet_period 1 s, ckptd's default
poll_interval, a retention that keeps everything) watches the M volume plus 100 more
runs, each with one earlier checkpoint (`storm/run-<i>/`). Once it is READY, every
checkpoint complete and its CPU still, 100 threads released by one barrier each save
the next checkpoint of their run (8 ranks, every file written and closed, no `utime`),
in a process of their own, and note the monotonic time their last write ended.
Overhead = the `complete` line's arrival − that end − quiet_period. Meanwhile
/proc/<pid> is sampled every 20 ms: its threads, its inotify watches (`inotify wd:`
lines of its inotify descriptor's fdinfo) and RSS. CPU per save = the daemon's CPU
from the storm to stillness / 100. A queue overflow would show as a warning; a lost
checkpoint as a missing `complete` line. The storm's runs are removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.context import Context
from bench.daemon import KEEP_ALL, DaemonProc, is_complete, settle, until_complete
from bench.measure import check, env, fmt_time, median, percentile, run_child
from bench.report import Row, Section
from bench.volume import HOUR, STEP, write_checkpoint

NAME = "11. save storm"
TARGET_S = 1.0  # p99 overhead beyond quiet_period


def inotify_watches(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                n += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return n


class Sampler(threading.Thread):
    """Peak threads, inotify watches and RSS of a process, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak = {"threads": 0, "watches": 0, "rss_kib": 0}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every):
            try:
                threads = len(os.listdir(f"/proc/{self.pid}/task"))
                watches = inotify_watches(self.pid)
                with open(f"/proc/{self.pid}/status") as f:
                    rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
            except (OSError, StopIteration):
                return
            for k, v in (("threads", threads), ("watches", watches), ("rss_kib", rss)):
                self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join(5)
        return self.peak


def storm(root: Path, runs: int, world: int, shard: int, step: int) -> list[float]:
    """`runs` threads released by one barrier, each saving `checkpoint-<step>` of its run; the
    monotonic time each one's last write ended. In a process of its own, as trainers are: the
    writers' threads do not compete with the harness's log reader for its interpreter."""
    barrier = threading.Barrier(runs)

    def save(i: int) -> float:
        barrier.wait()
        write_checkpoint(root / f"run-{i}", step, world=world, run=i, mtime=None, shard_size=shard)
        return time.monotonic()

    with ThreadPoolExecutor(runs) as pool:
        return list(pool.map(save, range(runs)))


def run(ctx: Context) -> tuple[list[Row], Section]:
    shape = next((s for s in reversed(ctx.sizes) if s.name in ("M", "T")), ctx.sizes[-1])
    runs, world = (10, 2) if ctx.quick else (100, 8)
    shard = 4096 if ctx.quick else 64 << 10
    quiet = 0.3 if ctx.quick else 1.0
    v = ctx.volume(shape)
    storm = v.root / "storm"
    work = ctx.scratch("storm")
    section = Section(
        NAME,
        f"`ckptd run` (inotify, quiet_period {quiet:g} s, default poll_interval) on {shape.name} plus {runs} "
        f"runs with one checkpoint each; {runs} threads released by one barrier each save the next "
        f"checkpoint of their run ({world} ranks, {shard >> 10} KiB shards, every file written and closed), "
        "in a process of their own. "
        "Overhead = `complete` line received − the save's last write − quiet_period (p99 nearest-rank); "
        "threads, inotify watches and RSS sampled from /proc every 20 ms; CPU per save = the daemon's CPU "
        f"from the storm until still, / {runs}. Target: every checkpoint complete, p99 ≤ {TARGET_S:g} s.",
    )
    ctx.log(f"storm on {shape.name}: {runs} runs × {world} ranks saving at once")
    for i in range(runs):
        write_checkpoint(storm / f"run-{i}", STEP, world=world, run=i, mtime=time.time() - HOUR)
    config = work / "ckptd.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{work / 'state'}'\n[[roots]]\npath = '{v.root}'\nobserver = 'inotify'\n"
        f"world_size = {world}\nquiet_period = '{quiet:g}s'\nallow_short_quiet_period = true\n"
        "[[roots.runs]]\nmatch = 'team-*/*'\n"
        f"world_size = {shape.world}\n[roots.retention]\n{KEEP_ALL}"
    )
    writer = [sys.executable, "-m", "bench.storm", str(storm), *map(str, (runs, world, shard, 2 * STEP))]

    try:
        with DaemonProc(config, foreground=True) as d:
            until_complete(d, shape.runs * shape.checkpoints + runs, timeout=900)
            before = d.threads()
            sampler = Sampler(d.pid)
            sampler.start()
            start = d.mark()
            ends = json.loads(check(run_child(writer, env=env(torch=False)), "the storm's writers").stdout)
            storm_end = max(ends)
            name = f"checkpoint-{2 * STEP}"
            lines = d.wait_for(lambda ln: is_complete(ln, name), timeout=120, count=runs, start=start)
            settle(d, still_for=1.0)
            peak = sampler.stop()
            after = d.threads()
            warnings = [ln.message for ln in d.lines[start:] if ln.doc.get("level") == "warning"]
            errors = d.errors()
    finally:
        shutil.rmtree(storm, ignore_errors=True)
    if errors:
        raise RuntimeError(f"ckptd run logged errors in the storm: {errors[:3]}")
    by_run = {ln.doc.get("run"): ln for ln in lines}
    # When each was last seen changing (the start of the quiet period that ended in `complete`).
    seen, late = [], []
    for i in range(runs):
        run_rel, end = f"storm/run-{i}", ends[i]
        moves = [ln.received for ln in d.lines[start:] if ln.doc.get("run") == run_rel
                 and ln.doc.get("checkpoint") == name and ln.doc.get("level") == "debug"
                 and ("new -> " in ln.message or "-> writing" in ln.message)]  # fmt: skip
        if moves and run_rel in by_run:
            seen.append(moves[-1] - end)
            late.append(by_run[run_rel].received - moves[-1] - quiet)
    overheads = [
        by_run[f"storm/run-{i}"].received - ends[i] - quiet for i in range(runs) if f"storm/run-{i}" in by_run
    ]
    cpu = sum(c - before.get(tid, (0.0, 0))[0] for tid, (c, _) in after.items())
    rescans = [w for w in warnings if "overflow" in w or "rescanning" in w]
    p50, p99 = median(overheads), percentile(overheads, 99)
    complete = len(overheads)
    case = f"{shape.name} + {runs} runs × {world} ranks at once"
    rows = [
        Row(NAME, f"{case}: checkpoints complete, none lost",
            f"{complete}/{runs}, {len(rescans)} overflow rescans", target="all", met=complete == runs),
        Row(NAME, f"{case}: p50 / p99 overhead beyond quiet_period",
            f"{fmt_time(p50)} / {fmt_time(p99)}", target=f"p99 ≤ {TARGET_S:g} s", met=p99 <= TARGET_S,
            note="" if p99 <= TARGET_S else f"p99 {fmt_time(p99)} against {TARGET_S:g} s over {runs} saves"),
        Row(NAME, f"{case}: daemon CPU per save", f"{fmt_time(cpu / runs)}"),
        Row(NAME, f"{case}: peak threads / inotify watches / RSS",
            f"{peak['threads']} / {peak['watches']:,} / {peak['rss_kib'] / 1024:.0f} MiB"),
    ]  # fmt: skip
    section.details.append(
        f"{runs} saves of {2 * world + 13} files each, the last write of the slowest "
        f"{fmt_time(storm_end - min(ends))} after the first save's; overhead p50 {fmt_time(p50)}, "
        f"p99 {fmt_time(p99)}, max {fmt_time(max(overheads))}; {fmt_time(cpu)} of daemon CPU in all "
        f"({fmt_time(cpu / runs)} per save); last seen changing p50 {fmt_time(median(seen))}, max "
        f"{fmt_time(max(seen))} after the save's last write; complete p50 {fmt_time(median(late))}, max "
        f"{fmt_time(max(late))} after that quiet period; at the peak {peak['threads']} threads, "
        f"{peak['watches']:,} inotify watches, {peak['rss_kib'] / 1024:.0f} MiB RSS; warnings: "
        f"{len(warnings)} ({'; '.join(warnings[:2]) or 'none'})."
    )
    return rows, section


if __name__ == "__main__":  # the writers: python -m bench.storm ROOT RUNS WORLD SHARD_BYTES STEP
    root, *numbers = sys.argv[1:]
    print(json.dumps(storm(Path(root), *map(int, numbers))))
