"""Measurements that must run in a process of their own: `python -m bench.probe KIND ...`.

Each prints one JSON document on stdout.

- `scan CONFIG --reps N`: import ckptd, then N times scan every root afresh and
  plan (what `ckptd plan` does, minus printing). Reports each scan's time, the
  RSS after the first (start-up: imports + one full scan + plan) and at the end,
  where the time went (walk, integrity check), and whether torch got loaded.
- `watchdog ROOT --cycles N`: what one cycle of watchdog's `PollingObserver`
  costs: a fresh `DirectorySnapshot` of the whole tree and a `DirectorySnapshotDiff`
  against the previous one, in CPU seconds, stat calls and directory listings.
- `tick CONFIG --ticks N`: where an idle `ckptd run` spends a tick: the daemon
  runs in this process (its loop on a thread); once every checkpoint is complete,
  its filesystem thread is handed N poll ticks (`Tick.run` (daemon/tick.py) with a poll and a
  state-file write due) and one reconcile tick, and the parts of a tick are timed
  on their own: the poll, the state document, its JSON encoding. Thread CPU time.
- `tracker CONFIG --cycles N --in-flight K`: what one cycle of ckptd's targeted
  poller costs (`RootTracker.poll()`, what `ckptd run` does every poll_interval)
  once every checkpoint is complete, then with K checkpoints in flight (written
  into K runs of the volume for the measurement, removed afterwards); also one
  reconcile (`full_scan`, every checkpoint looked at again).

CPU is timed with plain `os` calls; one more cycle, with counting wrappers
around them, counts the calls (the wrappers would inflate the CPU figure).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.measure import median, proc_status_kib


def _timed(module: object, name: str, acc: dict[str, float]) -> None:
    """Wrap `module.name` to add its run time to `acc[name]`."""
    fn = getattr(module, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    setattr(module, name, wrapper)


def scan(config_path: Path, reps: int) -> dict:
    t0 = time.perf_counter()
    from ckptd.config import load_config
    from ckptd.decide import planner
    from ckptd.decide.policy import summarise
    from ckptd.judge import evidence

    import_s = time.perf_counter() - t0
    rss_imported = proc_status_kib("VmRSS")
    config = load_config(config_path)
    acc: dict[str, float] = Counter()
    _timed(evidence, "walk", acc)
    _timed(evidence, "_integrity", acc)
    scans, breakdown = [], []
    rss_first = 0
    states: Counter[str] = Counter()
    summary: dict[str, int] = {}
    history = 0
    for i in range(reps):
        acc.clear()
        t = time.perf_counter()
        scanners = {root.path: planner.Scanner(root) for root in config.roots}
        roots = [(root, scanners[root.path].runs(now=time.time())) for root in config.roots]
        plan = planner.decide(roots)
        scans.append(time.perf_counter() - t)
        breakdown.append(dict(acc))
        if i == 0:
            rss_first = proc_status_kib("VmRSS")
            states = Counter(str(d.checkpoint.state) for d in plan.decisions)
            summary = summarise(plan.decisions)
            history = sum(
                len(d.checkpoint.trainer_state.history) for d in plan.decisions if d.checkpoint.trainer_state
            )
    torch = sys.modules.get("torch")
    return {
        "import_s": import_s,
        "scan_s": scans,
        "breakdown": breakdown,
        "rss_imported_kib": rss_imported,
        "rss_first_kib": rss_first,
        "rss_end_kib": proc_status_kib("VmRSS"),
        "hwm_kib": proc_status_kib("VmHWM"),
        "torch_loaded": torch is not None,
        "states": dict(states),
        "summary": summary,
        "history_steps": history,  # log_history steps held, summed over every checkpoint's trainer state
    }


class _CountedEntry:
    """An `os.DirEntry` whose `stat()` is counted: each is an lstat/stat system call."""

    __slots__ = ("_count", "_entry")

    def __init__(self, entry: os.DirEntry[str], count: Callable[[str, object], None]):
        self._entry = entry
        self._count = count

    def __getattr__(self, name: str) -> object:
        return getattr(self._entry, name)

    def __fspath__(self) -> str:
        return self._entry.path

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        self._count("stat", self._entry.path)
        return self._entry.stat(follow_symlinks=follow_symlinks)


class _CountedScandir:
    def __init__(self, it: Iterator[os.DirEntry[str]], count: Callable[[str, object], None]):
        self._it = it
        self._count = count

    def __enter__(self) -> _CountedScandir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[_CountedEntry]:
        return (_CountedEntry(e, self._count) for e in self._it)

    def close(self) -> None:
        self._it.close()  # type: ignore[attr-defined]


@contextlib.contextmanager
def counting_io(counts: Counter[str], root: Path | None = None) -> Iterator[None]:
    """Count metadata operations in `counts`: stat calls (os.stat, os.lstat, DirEntry.stat),
    directory listings (os.scandir, os.listdir) and opens (os.open, open). With `root`, only
    those on paths below it (the volume); the rest under "other:<kind>" (the state file...).

    Python-level: what ckptd asks for, call by call. `strace` (the metadata benchmark checks
    one against the other) sees the system calls themselves.
    """
    real = {"stat": os.stat, "lstat": os.lstat, "scandir": os.scandir, "listdir": os.listdir,
            "os.open": os.open, "open": builtins.open}  # fmt: skip
    prefix = None if root is None else str(root).rstrip("/") + "/"

    def count(kind: str, path: object) -> None:
        if prefix is None or isinstance(path, int):
            counts[kind] += 1
            return
        p = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
        p = os.fsdecode(p)
        counts[kind if (p + "/").startswith(prefix) else f"other:{kind}"] += 1

    def counted(kind: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(path: object = ".", *args: object, **kwargs: object) -> object:
            count(kind, path)
            return fn(path, *args, **kwargs)

        return wrapper

    def scandir(path: object = ".") -> _CountedScandir:
        count("listing", path)
        return _CountedScandir(real["scandir"](path), count)  # type: ignore[arg-type]

    os.stat = counted("stat", real["stat"])  # type: ignore[assignment]
    os.lstat = counted("stat", real["lstat"])  # type: ignore[assignment]
    os.scandir = scandir  # type: ignore[assignment]
    os.listdir = counted("listing", real["listdir"])  # type: ignore[assignment]
    os.open = counted("open", real["os.open"])  # type: ignore[assignment]
    builtins.open = io.open = counted("open", real["open"])  # type: ignore[assignment]  # (pathlib, zipfile: io.open)
    try:
        yield
    finally:
        os.stat, os.lstat = real["stat"], real["lstat"]  # type: ignore[assignment]
        os.scandir, os.listdir = real["scandir"], real["listdir"]  # type: ignore[assignment]
        os.open, builtins.open, io.open = real["os.open"], real["open"], real["open"]  # type: ignore[assignment]


def start(tracker: object) -> None:
    """What `ckptd run` does at start-up, all at once: the first scan (runs and checkpoints found,
    READY), then the first look at each checkpoint (the daemon's first steps, a few at a time)."""
    tracker.full_scan()  # type: ignore[attr-defined]
    while tracker.unseen:  # type: ignore[attr-defined]
        tracker.step(tracker.clock())  # type: ignore[attr-defined]


def tracker_cycles(config_path: Path, cycles: int, in_flight: int) -> dict:
    from bench.volume import STEP, write_checkpoint
    from ckptd.config import load_config
    from ckptd.daemon.tracker import RootTracker
    from ckptd.model import State

    root = load_config(config_path).roots[0]
    clock = [1000.0]  # a fake monotonic clock: settling is moved on by hand, never by sleeping
    tracker = RootTracker(root, lambda: clock[0])

    def cpu(fn: Callable[[], object]) -> float:
        c = time.process_time()
        fn()
        return time.process_time() - c

    first_scan = cpu(lambda: start(tracker))  # every checkpoint seen once: settling
    clock[0] += root.quiet_period + 1
    quiet_looks = cpu(lambda: tracker.step(clock[0]))  # seen again, unchanged for quiet_period: complete
    states = Counter(str(c.state) for c in tracker.checkpoints())
    assert set(states) == {str(State.COMPLETE)}, states
    reconcile = cpu(tracker.full_scan)  # a reconcile: each complete checkpoint's directories stat'ed

    def measure() -> tuple[list[float], dict[str, int], int]:
        times = [cpu(tracker.poll) for _ in range(cycles)]
        counts: Counter[str] = Counter()
        with counting_io(counts):
            changes = tracker.poll()
        return times, dict(counts), changes.transitions

    idle_cpu, idle_counts, idle_transitions = measure()
    # Where an idle cycle goes when it stats so little: picking out the in-flight checkpoints.
    in_flight_query = [cpu(tracker.in_flight) for _ in range(cycles)]
    rss = proc_status_kib("VmRSS")

    # K checkpoints in flight, each the next save of one run: written now, so not quiet yet.
    written = []
    try:
        for i, (run_rel, rs) in enumerate(sorted(tracker.runs.items())[:in_flight]):
            step = max(c.step for c in rs.checkpoints.values()) + STEP
            world = root.world_size or 1
            written.append(write_checkpoint(root.path / run_rel, step, world=world, run=i, mtime=time.time()))
        files = sum(1 for p in written for _ in p.rglob("*"))
        first_look = cpu(tracker.poll)  # their run directories moved: re-listed, the new ones inspected
        flying = [c.rel for c in tracker.in_flight()]
        busy_cpu, busy_counts, _ = measure()
    finally:
        for path in written:
            shutil.rmtree(path, ignore_errors=True)
    tracker.poll()
    return {
        "checkpoints": sum(states.values()),
        "dirs_polled": len(tracker.dirs),
        "first_scan_cpu_s": first_scan,
        "quiet_looks_cpu_s": quiet_looks,
        "reconcile_cpu_s": reconcile,
        "cycle_cpu_s": idle_cpu,
        "calls_per_cycle": idle_counts,
        "transitions_while_idle": idle_transitions,
        "in_flight_query_cpu_s": in_flight_query,
        "rss_kib": rss,
        "in_flight": flying,
        "in_flight_files": files,
        "first_look_cpu_s": first_look,
        "in_flight_cycle_cpu_s": busy_cpu,
        "in_flight_calls_per_cycle": busy_counts,
    }


def daemon_ticks(config_path: Path, ticks: int) -> dict:
    import asyncio
    import threading

    from ckptd.config import load_config
    from ckptd.daemon import Daemon
    from ckptd.model import State

    config = load_config(config_path)
    daemon = Daemon(config, install_signals=False)
    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_until_complete, args=(daemon.serve(),), daemon=True)
    serving.start()

    def on_fs(fn: Callable[[], object]) -> object:
        return daemon._fs.submit(fn).result()  # the daemon's own filesystem thread: no races

    def incomplete() -> int:
        return sum(c.state is not State.COMPLETE for rt in daemon.roots for c in rt.tracker.checkpoints())

    deadline = time.monotonic() + 600
    while not daemon.ready.is_set() or on_fs(incomplete):
        if time.monotonic() > deadline or not serving.is_alive():
            raise RuntimeError("the daemon did not get every checkpoint complete")
        time.sleep(0.2)
    rt = daemon.roots[0]

    def thread_cpu(fn: Callable[[], object]) -> Callable[[], float]:
        def timed() -> float:
            c = time.thread_time()
            fn()
            return time.thread_time() - c

        return timed

    def poll_tick() -> None:
        rt.next_poll = 0.0
        daemon.state_file.written = -1e9  # the state file is due too, as at every poll
        daemon.tick.run()

    def reconcile_tick() -> None:
        rt.next_reconcile = 0.0
        daemon.state_file.written = -1e9
        daemon.tick.run()

    doc = daemon.state()
    out = {
        "checkpoints": len(rt.tracker.checkpoints()),
        "tick_s": [on_fs(thread_cpu(poll_tick)) for _ in range(ticks)],
        "poll_s": [on_fs(thread_cpu(rt.tracker.poll)) for _ in range(ticks)],
        "in_flight_s": [on_fs(thread_cpu(rt.tracker.in_flight)) for _ in range(ticks)],
        "state_doc_s": [on_fs(thread_cpu(daemon.state)) for _ in range(ticks)],
        "dumps_indent_s": [on_fs(thread_cpu(lambda: json.dumps(doc, indent=1))) for _ in range(ticks)],
        "dumps_compact_s": [on_fs(thread_cpu(lambda: json.dumps(doc, separators=(",", ":"))))
                            for _ in range(ticks)],
        "state_bytes": len(json.dumps(doc, separators=(",", ":"))),  # as the daemon writes it
        # The first reconcile after start-up also writes the verdict cache of every checkpoint looked
        # at (`Scanner.save_verdicts`, once: later ones write it only when something changed); the
        # idle cost is the ones after it.
        "reconcile_first_s": on_fs(thread_cpu(reconcile_tick)),
        "reconcile_tick_s": median([on_fs(thread_cpu(reconcile_tick)) for _ in range(3)]),
        "rss_kib": proc_status_kib("VmRSS"),
    }
    loop.call_soon_threadsafe(daemon.request_stop, "probe done")
    serving.join(30)
    return out


def idle_hours(config_path: Path, *, warmup: float, hours: float, count: bool, backoff: bool) -> dict:
    """The daemon's filesystem thread through idle hours, on a fake monotonic clock.

    `Tick.run` (daemon/tick.py) is driven as `main_loop` would drive it (the clock jumps to the next
    deadline instead of sleeping): polls every poll_interval, reconciles every
    reconcile_interval, the state file at every poll. After `warmup` hours (caches warm,
    back-offs settled), `hours` more are measured: thread CPU, or (with `count`) the metadata
    operations on each root, and the CPU each root's tracker took (poll, reconcile, step).
    `backoff=False` looks at incomplete checkpoints at every poll, as before back-off existed.
    """
    from ckptd.config import load_config
    from ckptd.daemon import Daemon
    from ckptd.daemon.tracker import RootTracker

    if not backoff:
        RootTracker._max_span = lambda self: 1  # type: ignore[method-assign]
    config = load_config(config_path)
    config.daemon.state_dir.mkdir(parents=True, exist_ok=True)
    clock = [1000.0]
    daemon = Daemon(config, dry_run=True, clock=lambda: clock[0], install_signals=False)
    daemon.watcher = None
    for root in config.roots:
        daemon.roots.append(daemon.keeper.runtime(root, config))
    c0 = time.thread_time()
    daemon.tick.first_scan()
    first_scan_s = time.thread_time() - c0
    per_root: dict[str, float] = Counter()
    for rt in daemon.roots:
        tracker, key = rt.tracker, str(rt.root.path)
        for name in ("poll", "full_scan", "step"):
            fn = getattr(tracker, name)

            def timed(*a: object, _fn: Callable[..., object] = fn, _key: str = key, **kw: object) -> object:
                t = time.thread_time()
                try:
                    return _fn(*a, **kw)
                finally:
                    per_root[_key] += time.thread_time() - t

            setattr(tracker, name, timed)

    def run(seconds: float) -> dict[str, int]:
        ticks = polls = reconciles = 0
        end = clock[0] + seconds
        while True:
            clock[0] += daemon._next_timeout()
            if clock[0] > end:
                clock[0] = end
                return {"ticks": ticks, "polls": polls, "reconciles": reconciles}
            polls += sum(clock[0] >= rt.next_poll for rt in daemon.roots)
            reconciles += sum(clock[0] >= rt.next_reconcile for rt in daemon.roots)
            daemon.tick.run()
            ticks += 1

    run(warmup * 3600)
    per_root.clear()
    counts: dict[str, Counter[str]] = {str(rt.root.path): Counter() for rt in daemon.roots}
    c0 = time.thread_time()
    with contextlib.ExitStack() as stack:
        if count:
            for rt in daemon.roots:
                stack.enter_context(counting_io(counts[str(rt.root.path)], rt.root.path))
        done = run(hours * 3600)
    cpu = time.thread_time() - c0
    states = Counter(str(c.state) for rt in daemon.roots for c in rt.tracker.checkpoints())
    return {
        "hours": hours,
        "cpu_s": cpu,
        "first_scan_cpu_s": first_scan_s,
        "per_root_cpu_s": dict(per_root),
        "ops": {k: dict(v) for k, v in counts.items()},
        "states": dict(states),
        "rss_kib": proc_status_kib("VmRSS"),
        **done,
    }


MARKER = "/ckptd-bench-marker"  # stat'ed (it does not exist) between phases, for strace to see


def mark(name: str) -> None:
    with contextlib.suppress(OSError):
        os.stat(f"{MARKER}-{name}")


def one_reconcile(config_path: Path, *, deep: bool = True) -> dict:
    """The metadata operations of one reconcile (once every checkpoint is complete), of an idle
    poll, and of a reconcile that walks every checkpoint (what each one cost before). Each phase
    runs once plain between two markers (`mark`: for `strace` to count the system calls), once
    timed, once through the counting wrappers."""
    from ckptd.config import load_config
    from ckptd.daemon.tracker import RootTracker

    root = load_config(config_path).roots[0]
    clock = [1000.0]
    tracker = RootTracker(root, lambda: clock[0])
    start(tracker)
    clock[0] += root.quiet_period + 1
    tracker.step(clock[0])  # each one's quiet period over: complete
    out: dict[str, object] = {"checkpoints": len(tracker.checkpoints()), "dirs": len(tracker.dirs)}
    phases: list[tuple[str, Callable[[], object]]] = [
        ("reconcile", tracker.full_scan),
        ("poll", tracker.poll),
    ]
    if deep:
        phases.append(("deep_reconcile", lambda: tracker.full_scan(deep=True)))
    for name, fn in phases:
        mark(f"{name}-begin")
        fn()
        mark(f"{name}-end")
        counts: Counter[str] = Counter()
        with counting_io(counts, root.path):
            fn()
        c0 = time.thread_time()
        fn()
        out[name] = {"ops": dict(counts), "cpu_s": time.thread_time() - c0}
    return out


def watchdog_cycles(root: Path, cycles: int) -> dict:
    from watchdog.utils.dirsnapshot import DirectorySnapshot, DirectorySnapshotDiff

    calls = 0
    listings = 0

    def counting_stat(path: str) -> os.stat_result:
        nonlocal calls
        calls += 1
        return os.stat(path)

    def counting_listdir(path: str) -> Iterator[os.DirEntry[str]]:
        nonlocal listings
        listings += 1
        return os.scandir(path)

    def one(
        prev: DirectorySnapshot | None, stat=os.stat, listdir=os.scandir
    ) -> tuple[DirectorySnapshot, float, float]:
        c, w = time.process_time(), time.perf_counter()
        snap = DirectorySnapshot(str(root), recursive=True, stat=stat, listdir=listdir)
        if prev is not None:
            DirectorySnapshotDiff(prev, snap)
        return snap, time.process_time() - c, time.perf_counter() - w

    snap, first_cpu, first_wall = one(None)
    cpu, wall = [], []
    for _ in range(cycles):  # plain os.stat: the wrapper would inflate the CPU figure
        snap, c, w = one(snap)
        cpu.append(c)
        wall.append(w)
    rss = proc_status_kib("VmRSS")
    snap, _, _ = one(snap, stat=counting_stat, listdir=counting_listdir)  # one more cycle, counting
    return {
        "first_cpu_s": first_cpu,
        "first_wall_s": first_wall,
        "cycle_cpu_s": cpu,
        "cycle_wall_s": wall,
        "stat_calls_per_cycle": calls,
        "listings_per_cycle": listings,
        "entries": len(snap.paths),
        "rss_kib": rss,
    }


def io_floor(root: Path, reps: int) -> dict:
    """The I/O a cold `ckptd plan` cannot do without, in the least Python that does it: lstat every
    entry (scandir), and open every torch file (`.pt`, `.pth`, `.bin`) to read its first four bytes
    and its last 8 KiB (the zip's local header and end records), as `wholefile.file_problem` does.
    No verdict, no parse: what separates this from `find` is the reads; what separates `ckptd plan`
    from this is Python's work per entry."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

    def once() -> tuple[int, int]:
        entries = opened = 0
        stack = [os.fspath(root)]
        while stack:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    entries += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.name.endswith((".pt", ".pth", ".bin")):
                        fd = os.open(e.path, flags)
                        try:
                            os.fstat(fd)
                            os.pread(fd, 4, 0)
                            os.pread(fd, 8192, max(0, st.st_size - 8192))
                        finally:
                            os.close(fd)
                        opened += 1
        return entries, opened

    once()  # warm-up, as every cold-start figure has
    times, counts = [], (0, 0)
    for _ in range(reps):
        t = time.perf_counter()
        counts = once()
        times.append(time.perf_counter() - t)
    return {"floor_s": times, "entries": counts[0], "opened": counts[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe")
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("scan")
    s.add_argument("config", type=Path)
    s.add_argument("--reps", type=int, default=1)
    w = sub.add_parser("watchdog")
    w.add_argument("root", type=Path)
    w.add_argument("--cycles", type=int, default=3)
    t = sub.add_parser("tracker")
    t.add_argument("config", type=Path)
    t.add_argument("--cycles", type=int, default=20)
    t.add_argument("--in-flight", type=int, default=4)
    k = sub.add_parser("tick")
    k.add_argument("config", type=Path)
    k.add_argument("--ticks", type=int, default=5)
    h = sub.add_parser("hours")
    h.add_argument("config", type=Path)
    h.add_argument("--warmup", type=float, default=1.0)
    h.add_argument("--hours", type=float, default=1.0)
    h.add_argument("--count", action="store_true")
    h.add_argument("--no-backoff", action="store_true")
    f = sub.add_parser("floor")
    f.add_argument("root", type=Path)
    f.add_argument("--reps", type=int, default=3)
    r = sub.add_parser("reconcile")
    r.add_argument("config", type=Path)
    r.add_argument("--no-deep", action="store_true")
    args = p.parse_args(argv)
    if args.kind == "hours":
        doc = idle_hours(args.config, warmup=args.warmup, hours=args.hours, count=args.count,
                         backoff=not args.no_backoff)  # fmt: skip
    elif args.kind == "reconcile":
        doc = one_reconcile(args.config, deep=not args.no_deep)
    elif args.kind == "tick":
        doc = daemon_ticks(args.config, args.ticks)
    elif args.kind == "floor":
        doc = io_floor(args.root, args.reps)
    elif args.kind == "scan":
        doc = scan(args.config, args.reps)
    elif args.kind == "watchdog":
        doc = watchdog_cycles(args.root, args.cycles)
    else:
        doc = tracker_cycles(args.config, args.cycles, args.in_flight)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
