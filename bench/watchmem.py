"""`python -m bench.watchmem ROOT`: what ckptd's watcher costs in memory and threads on a tree, alone.

In a fresh process (torch hidden, ckptd's daemon modules imported first, as in `ckptd run`):
RSS (VmRSS) after importing watchdog's observer modules (first), then the daemon's; after `Watcher.start()`
(the observer's thread, nothing scheduled); after one recursive watch on ROOT (`Watcher.reconcile`,
as the daemon asks for it: watchdog's reader, dispatcher and the root's emitter, a kernel watch per
directory); and after `Watcher.stop()`. Python's own allocations for the schedule are traced
(`tracemalloc`) and grouped by the module and line that made them, so the RSS the watch adds can
be told apart into watchdog's bookkeeping (per directory), what `os.walk` leaves behind, and the
rest (thread stacks, allocator slack). Prints one JSON document.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


def main() -> int:
    root = os.path.abspath(sys.argv[1])
    out: dict[str, object] = {"root": root}
    rss: dict[str, int] = {"python": _rss_kib()}
    import watchdog.events  # noqa: F401  first: what importing watchdog adds (and its own imports)
    import watchdog.observers  # noqa: F401

    rss["watchdog_imported"] = _rss_kib()
    import ckptd.daemon.core  # noqa: F401  the daemon's modules

    mods = [m for m in sys.modules if m.startswith("watchdog")]
    rss["ckptd_daemon_imported"] = _rss_kib()
    out["watchdog_modules"] = len(mods)
    from ckptd.daemon.watch import Watcher

    hints: list[str] = []
    # First without tracemalloc (its own records cost memory): the RSS the schedule adds.
    watcher = Watcher(asyncio.new_event_loop(), hints.append, lambda: None)
    watcher.start()
    time.sleep(0.2)
    gc.collect()
    r0 = rss["observer_started"] = _rss_kib()
    watcher.reconcile({(root, True)})
    time.sleep(0.5)
    gc.collect()
    out["rss_added_by_schedule_kib"] = (r1 := _rss_kib()) - r0
    rss["root_scheduled"] = r1
    watcher.stop()
    rss["stopped_untraced"] = _rss_kib()
    loop = asyncio.new_event_loop()
    watcher = Watcher(loop, hints.append, lambda: None)
    gc.collect()
    base_threads = threading.active_count()
    watcher.start()
    time.sleep(0.2)
    gc.collect()
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    t0 = time.perf_counter()
    watcher.reconcile({(root, True)})
    out["schedule_s"] = round(time.perf_counter() - t0, 2)
    time.sleep(0.5)  # watchdog's reader starts its dispatcher on its own thread
    gc.collect()
    after = tracemalloc.take_snapshot()
    traced_kib = sum(s.size_diff for s in after.compare_to(before, "filename")) / 1024
    tracemalloc.stop()
    rss["root_scheduled_traced"] = _rss_kib()
    by_line = after.compare_to(before, "lineno")
    out["traced_kib"] = round(traced_kib)
    out["traced_top"] = [
        {"where": f"{s.traceback[0].filename.rsplit('/', 2)[-2:]!s}:{s.traceback[0].lineno}",
         "kib": round(s.size_diff / 1024), "blocks": s.count_diff}
        for s in by_line[:12]
    ]  # fmt: skip
    by_pkg: Counter[str] = Counter()
    for s in after.compare_to(before, "filename"):
        name = s.traceback[0].filename
        pkg = "watchdog" if "/watchdog/" in name else "ckptd" if "/ckptd/" in name else os.path.basename(name)
        by_pkg[pkg] += s.size_diff
    out["traced_by_module_kib"] = {k: round(v / 1024) for k, v in by_pkg.most_common(8)}
    out["kernel_watches"] = watcher.kernel_watches()
    out["threads_added"] = threading.active_count() - base_threads
    out["threads"] = sorted(t.name for t in threading.enumerate())
    watcher.stop()
    gc.collect()
    rss["stopped"] = _rss_kib()
    loop.close()
    out["rss_kib"] = rss
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
