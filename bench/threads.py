"""`python -m bench.threads [--after S] [--sighup-at S] -- RUN-ARGS...`: whose is each thread of `ckptd run`.

Runs `ckptd run RUN-ARGS` in this process (the CLI's own `main`), and S seconds in (12 by default) prints
one JSON document on stdout: every thread's name, class and target and where it waits, from
`threading.enumerate()` and `sys._current_frames()`, and the kernel's count (/proc/self/task), less
the thread that looks. Then SIGTERM. With `--sighup-at`, a SIGHUP first (a reload). Python 3.11 names
no thread for the kernel, so /proc alone cannot tell them apart.

    python -m bench.threads -- --foreground -c ckptd.toml
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback


def look(after: float, sighup_at: float | None) -> None:
    if sighup_at is not None:
        time.sleep(sighup_at)
        os.kill(os.getpid(), signal.SIGHUP)
        after -= sighup_at
    time.sleep(after)
    me = threading.current_thread()
    frames = sys._current_frames()
    rows = []
    for t in threading.enumerate():
        if t is me:
            continue
        frame = frames.get(t.ident or 0)
        stack = traceback.extract_stack(frame)[-1:] if frame else []
        target = getattr(getattr(t, "_target", None), "__qualname__", None)
        rows.append({
            "name": t.name, "class": f"{type(t).__module__}.{type(t).__qualname__}", "target": target,
            "waits_in": [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack],
        })  # fmt: skip
    doc = {"threads": rows, "kernel_tasks": len(os.listdir("/proc/self/task")) - 1}
    print(json.dumps(doc, indent=1), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.threads")
    p.add_argument("--after", type=float, default=12.0, help="seconds after the start to look")
    p.add_argument("--sighup-at", type=float, default=None, help="send SIGHUP this many seconds in")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then `ckptd run`'s arguments")
    args = p.parse_args()
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    threading.Thread(target=look, args=(args.after, args.sighup_at), name="bench-look", daemon=True).start()
    from ckptd.cli import main as ckptd_main

    sys.argv = ["ckptd", "run", *run_args]
    return ckptd_main()


if __name__ == "__main__":
    raise SystemExit(main())
