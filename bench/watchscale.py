"""15. The watcher at scale: `ckptd run` watching a whole volume (L, XL: a million files).

`python -m bench --only watchscale --sizes L,XL` (opt-in: not part of a full run; about 20 min).

On each volume, `ckptd run --foreground -v --log-format json` (observer inotify, quiet_period 1 s,
ckptd's default poll_interval of 10 s, torch hidden, a retention that keeps everything) starts on
the volume's root; once READY, every checkpoint found at start decided (its totals line) and its
CPU time still, it is sampled from /proc/<pid>: threads, inotify instances and kernel watches (the
`inotify wd:` lines of its inotify descriptors' fdinfo) and RSS; then its threads' CPU time
(schedstat) across an idle window. Then checkpoints (16 ranks, 45 files each) are saved live, one
after another, into a new run inside the volume (`team-0/run-live/`), and the overhead of each is
measured as in 3.: the `complete` line's arrival − the save's last write − quiet_period.

With `BENCH_WATCH_COMPARE=DIR` (a directory holding another tree's `ckptd` package, e.g.
`git archive COMMIT ckptd | tar -x -C /tmp/old`; `src/` for trees from before the package left
it), a daemon of that tree runs
beside this one on the same volume, through the same idle window and the same saves
(`BENCH_WATCH_COMPARE_NAME` names it in the table); on L and the small sizes, not on XL.

The watch limit's fallback: a third daemon runs in a user namespace of its own (`unshare -Ur`)
whose `user.max_inotify_watches` is set below the number of directories in the volume, so that
watchdog's recursive schedule is refused for real (ENOSPC) without touching the machine's limit
(other programs share it): the daemon should say so once and poll the root. Sampled the same way,
then a few live saves with a random pause of up to poll_interval before each (saves fall at every
phase of the poll).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.context import Context
from bench.daemon import DaemonProc, is_complete, settle, until_complete, write_config
from bench.measure import NOTORCH, REPO, env, fmt_time, median, percentile
from bench.report import Row, Section
from bench.volume import HOUR, STEP, Shape, write_checkpoint
from bench.watchprobe import sample
from ckptd.daemon.watch import RETRY_AFTER

NAME = "15. watcher at scale"
WORLD = 16
QUIET_S = 1.0
POLL_S = 10.0  # ckptd's default poll_interval
TARGET_P99_S = 1.0  # detection p99 beyond the quiet period (issue: ≤ 1 s)
TARGET_IDLE_PCT = 0.1
TARGET_RSS_MIB_L = 150
LIVE_RUN = ("team-0", "run-live")
COMPARE_ON = ("T", "S", "L")  # the other checkout's daemon beside this one (not on XL: two cold scans)


class Daemon(DaemonProc):
    """`python -m ckptd run --foreground -v --log-format json -c CONFIG` of this checkout or of
    `src`, in a user namespace with its own inotify watch limit when `watch_limit` is given."""

    def __init__(self, config: Path, *, src: str | None = None, watch_limit: int | None = None):
        argv = [sys.executable, "-m", "ckptd", "run", "--log-format", "json", "-c", str(config)]
        argv += ["--foreground", "-v"]
        e = env(torch=False)
        if src is not None:
            e["PYTHONPATH"] = os.pathsep.join([str(NOTORCH), src, str(REPO)])
        if watch_limit is not None:
            # unshare and sh exec: the pid stays the daemon's
            script = f'echo {watch_limit} > /proc/sys/user/max_inotify_watches && exec "$@"'
            argv = ["unshare", "-Ur", "sh", "-c", script, "sh", *argv]
        super(DaemonProc, self).__init__(argv, env=e)


def directories(root: Path) -> int:
    return sum(1 for _ in os.walk(root))


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def user_inotify() -> dict[str, int]:
    """inotify instances and watches held by every process of this user now (the per-user limits'
    use by other programs)."""
    instances = watches = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                    continue
                instances += 1
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    watches += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return {"instances": instances, "watches": watches}


def idle(daemons: dict[str, Daemon], window: float, still: float) -> dict[str, dict[str, float]]:
    """CPU % of each daemon's threads over one window, all side by side."""
    for d in daemons.values():
        settle(d, still_for=still, timeout=300)
    before = {k: d.threads() for k, d in daemons.items()}
    t0 = time.monotonic()
    time.sleep(window)
    after = {k: d.threads() for k, d in daemons.items()}
    span = time.monotonic() - t0
    out = {}
    for k in daemons:
        b, a = before[k], after[k]
        cpu = sum(c - b.get(tid, (0.0, 0))[0] for tid, (c, _) in a.items())
        switches = sorted((s - b.get(tid, (0.0, 0))[1] for tid, (_, s) in a.items()), reverse=True)
        out[k] = {"pct": 100 * cpu / span, "cpu_s": cpu, "window_s": span, "switches": switches}
    return out


def saves(daemons: dict[str, Daemon], run: Path, first: int, n: int, *, pause: float = 0.0) -> dict:
    """`n` live saves one after another, each once every daemon called the previous one complete."""
    rng = random.Random(7)
    over: dict[str, list[float]] = {k: [] for k in daemons}
    timeout = 3 * (QUIET_S + POLL_S) + 60
    for i in range(n):
        step = (first + i) * STEP
        name = f"checkpoint-{step}"
        if pause:
            time.sleep(rng.uniform(0, pause))
        marks = {k: d.mark() for k, d in daemons.items()}
        write_checkpoint(run, step, world=WORLD, mtime=None)  # a live save: no utime afterwards
        written = time.monotonic()
        for k, d in daemons.items():
            line = d.wait_for(lambda ln, name=name: is_complete(ln, name), timeout=timeout, start=marks[k])[0]
            over[k].append(line.received - written - QUIET_S)
    return over


def _pcts(xs: list[float]) -> str:
    return f"{fmt_time(median(xs))} / {fmt_time(percentile(xs, 99))}"


def measure(ctx: Context, shape: Shape, n: int, window: float) -> dict:
    v = ctx.volume(shape)
    run = v.root.joinpath(*LIVE_RUN)
    shutil.rmtree(run, ignore_errors=True)
    write_checkpoint(run, STEP, world=WORLD, mtime=time.time() - HOUR)  # the live run's first, complete
    dirs = directories(v.root)
    compare = os.environ.get("BENCH_WATCH_COMPARE") if shape.name in COMPARE_ON else None
    out: dict = {"dirs": dirs, "load": [load()], "user_inotify_before": user_inotify()}
    srcs = {"watchdog": None, **({"compare": compare} if compare else {})}
    daemons: dict[str, Daemon] = {}
    try:
        for k, src in srcs.items():
            work = ctx.scratch(f"watchscale-{k}")
            config = write_config(work / "ckptd.toml", v.root, work / "state", observer="inotify",
                                  world=shape.world, quiet_period=QUIET_S)  # fmt: skip
            daemons[k] = Daemon(config, src=src)
        for k, d in daemons.items():
            facts = until_complete(d, 0, timeout=1800, still_for=1.0)
            facts.update(sample(d.pid))
            out[k] = facts
        ctx.log(f"watchscale {shape.name}: idle {window:g} s (load {load()})")
        for k, r in idle(daemons, window, 1.0).items():
            out[k]["idle"] = r
        for k, d in daemons.items():
            out[k]["settled"] = sample(d.pid)
        out["load"].append(load())
        ctx.log(f"watchscale {shape.name}: {n} live saves (load {load()})")
        for k, xs in saves(daemons, run, 2, n).items():
            out[k]["overheads"] = xs
            out[k]["after_saves"] = sample(daemons[k].pid)
            out[k]["errors"] = daemons[k].errors()
        out["load"].append(load())
    finally:
        for d in daemons.values():
            d.stop()
    ctx.log(f"watchscale {shape.name}: {json.dumps(out, default=str)}")  # kept, should a later step fail
    same = ctx.workdir / "watchscale-watchdog" / "ckptd.toml"
    out["fallback"] = fallback(ctx, shape, same, run, dirs, first=2 + n, n=max(4, n // 5), window=window)
    ctx.log(f"watchscale {shape.name} fallback: {json.dumps(out['fallback'], default=str)}")
    shutil.rmtree(run, ignore_errors=True)
    return out


def fallback(
    ctx: Context, shape: Shape, config: Path, run: Path, dirs: int, *, first: int, n: int, window: float
) -> dict:
    """A daemon whose recursive schedule the kernel refuses (a watch limit of half the directories),
    restarted on the first daemon's config and state_dir (its verdict cache: no cold scan again)."""
    limit = dirs // 2
    script = f"echo {limit} > /proc/sys/user/max_inotify_watches"
    probe = subprocess.run(["unshare", "-Ur", "sh", "-c", script], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"skipped": f"no user namespace with its own watch limit here: {probe.stderr.strip()}"}
    ctx.log(f"watchscale {shape.name}: fallback, watch limit {limit} for {dirs} directories")
    d = Daemon(config, watch_limit=limit)
    try:
        out: dict = {"limit": limit, **until_complete(d, 0, timeout=1800, still_for=1.0)}
        out.update(sample(d.pid))
        out["warnings"] = [ln.message for ln in d.lines if ln.doc.get("level") == "warning"]
        out["idle"] = idle({"f": d}, window, 1.0)["f"]
        out["overheads"] = saves({"f": d}, run, first, n, pause=POLL_S)["f"]
        out["after_saves"] = sample(d.pid)
        out["errors"] = d.errors()
    finally:
        d.stop()
    return out


def _rows(shape: Shape, who: str, x: dict, window: float, section: Section) -> list[Row]:
    s = x["settled"]
    idle_pct = x["idle"]["pct"]
    p99 = percentile(x["overheads"], 99)
    rss = max(x["rss_complete_kib"], s["rss_mib"] * 1024) / 1024
    on_l = shape.name == "L"
    rows = [
        Row(NAME, f"{shape.name} ({who}): detection p50 / p99 beyond quiet_period", _pcts(x["overheads"]),
            target=f"p99 ≤ {TARGET_P99_S:g} s", met=p99 <= TARGET_P99_S),
        Row(NAME, f"{shape.name} ({who}): idle CPU over {window:g} s", f"{idle_pct:.2g} %",
            target=f"≤ {TARGET_IDLE_PCT:g} %", met=idle_pct <= TARGET_IDLE_PCT),
        Row(NAME, f"{shape.name} ({who}): RSS all decided; threads; instances; kernel watches",
            f"{rss:.0f} MiB; {s['threads']}; {s['inotify_instances']}; {s['kernel_watches']:,}",
            target=f"≤ {TARGET_RSS_MIB_L} MiB" if on_l else "—",
            met=rss <= TARGET_RSS_MIB_L if on_l else None),
    ]  # fmt: skip
    after = x["after_saves"]
    section.details.append(
        f"{shape.name}, {who}: READY {x['ready_s']:.1f} s, all decided {x['complete_s']:.1f} s after "
        f"the start; RSS {x['rss_ready_kib'] / 1024:.0f} MiB at READY, {rss:.0f} MiB all decided, "
        f"peak {x['hwm_kib'] / 1024:.0f} MiB; idle {idle_pct:.2g} % ({fmt_time(x['idle']['cpu_s'])} "
        f"CPU in {x['idle']['window_s']:.0f} s; voluntary context switches per thread "
        f"{x['idle']['switches']}); {len(x['overheads'])} saves: overhead p50 / p99 "
        f"{_pcts(x['overheads'])}, max {fmt_time(max(x['overheads']))}; after them {after['threads']} "
        f"threads, {after['kernel_watches']:,} kernel watches, {after['rss_mib']} MiB; errors logged: "
        f"{len(x['errors'])}."
    )
    return rows


def _fallback_rows(shape: Shape, dirs: int, f: dict, section: Section) -> list[Row]:
    p99 = percentile(f["overheads"], 99)
    case = f"{shape.name}, watch limit {f['limit']:,} < {dirs:,} directories: detection p50 / p99 (polled)"
    limit = POLL_S + TARGET_P99_S
    warned = [w for w in f["warnings"] if "watch limit" in w]
    section.details.append(
        f"{shape.name}, watch limit {f['limit']:,} (a user namespace's): READY {f['ready_s']:.1f} s; "
        f"{len(warned)} warning(s) of the limit: {warned[:1]}; then {f['kernel_watches']:,} kernel "
        f"watches, {f['inotify_instances']} instance(s), {f['threads']} threads, {f['rss_mib']} MiB; "
        f"idle {f['idle']['pct']:.2g} % (the refused schedule is asked for again every {RETRY_AFTER:g} s: "
        f"a walk of the tree each time); {len(f['overheads'])} saves after a random pause of up to "
        f"{POLL_S:g} s: overhead p50 / p99 {_pcts(f['overheads'])}; errors {len(f['errors'])}."
    )
    target = f"p99 ≤ poll_interval + {TARGET_P99_S:g} s ({limit:g} s)"
    return [Row(NAME, case, _pcts(f["overheads"]), target=target, met=p99 <= limit)]


def run(ctx: Context) -> tuple[list[Row], Section]:
    n = 2 if ctx.quick else 40
    window = 2.0 if ctx.quick else 60.0
    section = Section(
        NAME,
        f"`ckptd run --foreground -v` (inotify, quiet_period {QUIET_S:g} s, poll_interval {POLL_S:g} s, "
        "torch hidden, keep everything) on the whole volume: sampled from /proc once every checkpoint "
        f"found at start is decided and its CPU time still; idle CPU over {window:g} s (threads' "
        f"schedstat); then {n} live saves of {WORLD} ranks into a new run inside the volume, overhead = "
        "`complete` − last write − quiet_period (p99 nearest-rank: the maximum under 100 saves). The "
        "fallback: a daemon in a user namespace whose `user.max_inotify_watches` is half the volume's "
        "directories (`unshare -Ur`), so that the recursive schedule is refused for real. Volumes' build "
        "times are under Volumes.",
    )
    rows: list[Row] = []
    names = {"watchdog": "this tree", "compare": os.environ.get("BENCH_WATCH_COMPARE_NAME", "compared")}
    for shape in ctx.sizes:
        r = measure(ctx, shape, n, window)
        for k, who in names.items():
            if k in r:
                rows += _rows(shape, who, r[k], window, section)
        section.details.append(
            f"{shape.name}: {r['dirs']:,} directories; load average {' → '.join(r['load'])}; this user's "
            f"inotify use by other programs before the run: {r['user_inotify_before']['instances']} "
            f"instances, {r['user_inotify_before']['watches']:,} watches."
        )
        f = r["fallback"]
        if "skipped" in f:
            section.details.append(f"{shape.name} fallback: skipped ({f['skipped']}).")
        else:
            rows += _fallback_rows(shape, r["dirs"], f, section)
    return rows, section
