"""3. Detection latency: last write of a checkpoint → the daemon declares it complete, minus quiet_period.

`ckptd run --foreground --log-format json` runs on a root of its own holding
one run (its first checkpoint already complete), with a short quiet_period,
once with observer = "inotify" and once with "polling" (poll_interval 1 s).
Then, one after another, N checkpoints (Trainer + DeepSpeed, 16 ranks, tiny
shards) are written with `bench.volume.write_checkpoint`; the monotonic time
it returns is the last write. The daemon's `<run>/<checkpoint>: complete` line
is stamped with the monotonic time the reader thread received it (the JSON's
own "time" has only millisecond precision and the wall clock).
Overhead = received − last write − quiet_period: what the daemon adds to the
wait that quiet_period asks for. With polling, each write starts after a random
pause of up to poll_interval, so that writes fall at every phase of the poll.

The overhead is split with the daemon's debug lines (its state changes): *seen*
= when it last saw the checkpoint change (`new -> ...` or `... -> writing`, the
start of the quiet period that ended in `complete`) − the last write; *deadline*
= complete − that start − quiet_period.
"""

from __future__ import annotations

import random
import time

from bench.context import Context
from bench.daemon import DaemonProc, is_complete, write_config
from bench.measure import fmt_time, median, percentile
from bench.report import Row, Section
from bench.volume import HOUR, STEP, write_checkpoint
from ckptd.tracker import HINT_DEBOUNCE

NAME = "3. detection latency"
SLACK_S = 0.100  # the target: p99 overhead ≤ 100 ms (inotify), ≤ poll_interval + 100 ms (polling)
WORLD = 16


def measure(ctx: Context, observer: str, *, n: int, quiet: float, poll: float) -> dict:
    """Write `n` checkpoints one after another under a fresh daemon; the overhead of each, in seconds."""
    work = ctx.scratch(f"latency-{observer}")
    run = work / "root" / "run-0"
    write_checkpoint(run, STEP, world=WORLD, mtime=time.time() - HOUR)
    config = write_config(
        work / "ckptd.toml", work / "root", work / "state", observer=observer, world=WORLD,
        quiet_period=quiet, poll_interval=poll,
    )  # fmt: skip
    rng = random.Random(7)
    overheads: list[float] = []
    seen: list[float] = []  # last write -> the daemon saw the last change (its quiet period started)
    deadline: list[float] = []  # quiet period started -> complete, minus quiet_period
    timeout = 10 * (quiet + poll) + 30
    with DaemonProc(config, foreground=True) as d:
        d.wait_message("ready:", timeout=60)
        d.wait_for(is_complete, timeout=timeout)  # the seed: the daemon is in its steady state
        for i in range(n):
            step = (i + 2) * STEP
            name = f"checkpoint-{step}"
            if observer == "polling":
                time.sleep(rng.uniform(0, poll))
            start = d.mark()
            write_checkpoint(run, step, world=WORLD, mtime=time.time())
            written = time.monotonic()
            line = d.wait_for(lambda ln, name=name: is_complete(ln, name), timeout=timeout, start=start)[0]
            overheads.append(line.received - written - quiet)
            changed = [
                ln.received for ln in d.lines[start:]
                if ln.doc.get("checkpoint") == name and ln.doc.get("level") == "debug"
                and ("new -> " in ln.message or "-> writing" in ln.message)
            ]  # fmt: skip
            if changed:
                seen.append(changed[-1] - written)
                deadline.append(line.received - changed[-1] - quiet)
        errors = d.errors()
    if errors:
        raise RuntimeError(f"ckptd run ({observer}) logged errors: {errors[:3]}")
    return {"overheads": overheads, "seen": seen, "deadline": deadline}


def run(ctx: Context) -> tuple[list[Row], Section]:
    n = 2 if ctx.quick else 20
    quiet = 0.3 if ctx.quick else 1.0
    poll = 0.3 if ctx.quick else 1.0
    section = Section(
        NAME,
        f"A fresh `ckptd run --foreground --log-format json` per mode on a root of its own, quiet_period "
        f"{quiet:g} s; {n} checkpoints ({WORLD} ranks, {2 * WORLD + 13} files each) written one after "
        "another, each once the previous one was declared complete. Overhead = the monotonic time the "
        "`complete` line reached the harness − the end of the checkpoint's last write − quiet_period; "
        "p99 is nearest-rank, so with 20 samples it is the maximum.",
    )
    rows = []
    for observer in ("inotify", "polling"):
        ctx.log(f"latency, {observer}: {n} checkpoints, quiet_period {quiet:g} s, poll_interval {poll:g} s")
        doc = measure(ctx, observer, n=n, quiet=quiet, poll=poll)
        xs = doc["overheads"]
        p50, p99 = median(xs), percentile(xs, 99)
        limit = SLACK_S if observer == "inotify" else poll + SLACK_S
        target = "p99 ≤ 100 ms" if observer == "inotify" else f"p99 ≤ poll_interval + 100 ms ({limit:g} s)"
        note = ""
        if p99 > limit:
            note = (
                f"p99 {fmt_time(p99)} against {fmt_time(limit)}, missed by {fmt_time(p99 - limit)}: "
                f"the daemon saw the last change {_split(doc['seen'])} after the last write, and declared "
                f"the checkpoint complete {_split(doc['deadline'])} after its quiet period ran out."
            )
        rows.append(
            Row(
                NAME,
                f"{observer}{'' if observer == 'inotify' else f' every {poll:g} s'}: p50 / p99 overhead "
                "beyond quiet_period",
                f"{fmt_time(p50)} / {fmt_time(p99)}",
                target=target,
                met=p99 <= limit,
                note=note,
            )
        )
        section.details.append(
            f"{observer}: overhead p50 {fmt_time(p50)}, p99 {fmt_time(p99)}, min {fmt_time(min(xs))} "
            f"over {n} checkpoints; seen {_split(doc['seen'])} after the last write"
            + (
                f" (the {HINT_DEBOUNCE * 1e3:.0f} ms hint debounce, then a look)"
                if observer == "inotify"
                else " (the next poll)"
            )
            + f"; complete {_split(doc['deadline'])} after the quiet period ran out."
        )
    return rows, section


def _split(xs: list[float]) -> str:
    return f"p50 {fmt_time(median(xs))}, max {fmt_time(max(xs))}" if xs else "(no state changes logged)"
