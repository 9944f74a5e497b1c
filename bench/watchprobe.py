"""`python -m bench.watchprobe DIR ROOT`: a `ckptd run --foreground --dry-run` of the `ckptd` package
in DIR (a checkout's root, or the `src/` of one from before the package left it) on ROOT
(quiet_period 1 s), sampled from /proc/<pid> at READY and 2 s after the totals line: threads,
inotify instances, kernel watches (fdinfo), RSS. Run it with two trees on one volume to compare
their watchers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """\
[daemon]
state_dir = '{state}'
[[roots]]
path = '{root}'
observer = 'inotify'
quiet_period = '1s'
allow_short_quiet_period = true
[roots.retention]
keep_last = 1000
"""


def sample(pid: int) -> dict[str, int]:
    instances = watches = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            instances += 1
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                watches += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) // 1024
    threads = len(os.listdir(f"/proc/{pid}/task"))
    return {"threads": threads, "inotify_instances": instances, "kernel_watches": watches, "rss_mib": rss}


def main() -> int:
    src, root = sys.argv[1], sys.argv[2]
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-watchprobe-"))
    cfg = tmp / "c.toml"
    cfg.write_text(CONFIG.format(state=tmp / "state", root=root))
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "ckptd", "run", "--foreground", "--dry-run", "--log-format", "json"]
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen(
        [*argv, "-c", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    out: dict[str, object] = {}
    warnings: list[str] = []
    for raw in proc.stdout:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        message = str(line.get("message", ""))
        if line.get("level") in ("WARNING", "ERROR"):
            warnings.append(message[:200])
        if message.startswith("ready: "):
            out["ready_s"] = round(time.monotonic() - t0, 2)
            time.sleep(1)  # the watches are scheduled by then
            out["at_ready+1s"] = sample(proc.pid)
        if message.startswith("retention: "):  # every checkpoint found at start has settled
            out["all_settled_s"] = round(time.monotonic() - t0, 2)
            time.sleep(2)
            out["all_settled+2s"] = sample(proc.pid)
            break
    proc.terminate()
    proc.wait(60)
    out["warnings"] = warnings
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
