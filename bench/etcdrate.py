"""What etcd leadership costs etcd: requests per minute from a leader and from a standby.

`python -m bench.etcdrate [--duration 30] [--window 60]` starts a real 3-member etcd on 127.0.0.1
ports (bench/etcdcluster.py) and two `ckptd run` on a small volume with their own state_dirs (two
hosts), `leadership = "etcd"`; the leader's endpoints list member 0 first, the standby's member 1
(each asks the first that answers, `etcdlease.Endpoints`), so each member's counters are one
daemon's. Once one leads and the other stands by, it reads each member's `/metrics`
(`grpc_server_started_total`: one per unary call or stream the HTTP gateway opens, by method)
before and after a window in which nothing on the volume changes, and prints one JSON object:
per role, each method's calls per minute and their sum. Raft's own traffic between members is not
counted there. Not in `python -m bench`: it takes a window.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.daemon import DaemonProc
from bench.etcdcluster import Cluster
from ckptd.cli.demo_volume import hf_deepspeed_checkpoint

_STARTED = re.compile(r'^grpc_server_started_total\{grpc_method="([^"]+)".*\}\s+([0-9.e+]+)$')


def started(url: str) -> dict[str, float]:
    """A member's `grpc_server_started_total` by method."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if (m := _STARTED.match(line)) is not None:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def config(path: Path, root: Path, state_dir: Path, endpoints: list[str], duration: float) -> Path:
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\nleadership = 'etcd'\nlease_duration = '{duration}s'\n"
        "[daemon.etcd]\nendpoints = [" + ", ".join(f"'{e}'" for e in endpoints) + "]\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\n"
        "world_size = 2\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n"
    )
    return path


def measure(work: Path, duration: float, window: float) -> dict[str, object]:
    (work / "etcd").mkdir(parents=True)
    cluster = Cluster(work / "etcd")
    cluster.start()
    root = work / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    m = cluster.members
    a = b = None
    try:
        a = DaemonProc(config(work / "a.toml", root, work / "a", [m[0].url, m[1].url, m[2].url], duration),
                       foreground=True)
        a.wait_message("this ckptd deletes here", timeout=60)
        b = DaemonProc(config(work / "b.toml", root, work / "b", [m[1].url, m[0].url, m[2].url], duration),
                       foreground=True)
        b.wait_message("standby, observing only", timeout=60)
        b.wait_message("state written", timeout=60, start=b.mark())
        before = [started(x.url) for x in m[:2]]
        t0 = time.monotonic()
        threading.Event().wait(window)  # the window itself: nothing to wait for but time
        after = [started(x.url) for x in m[:2]]
        minutes = (time.monotonic() - t0) / 60
    finally:
        for d in (b, a):
            if d is not None:
                d.stop()
        cluster.stop()
    out: dict[str, object] = {"lease_duration_s": duration, "window_s": round(minutes * 60, 1)}
    for role, was, now in (("leader", before[0], after[0]), ("standby", before[1], after[1])):
        per = {k: round((now.get(k, 0) - was.get(k, 0)) / minutes, 1) for k in now}
        per = {k: v for k, v in per.items() if v}
        out[role] = {"per_minute": per, "total_per_minute": round(sum(per.values()), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.etcdrate")
    p.add_argument("--duration", type=float, default=30.0, help="lease_duration (the etcd TTL), seconds")
    p.add_argument("--window", type=float, default=60.0, help="seconds counted")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-bench-etcdrate-"))
    print(json.dumps(measure(work, args.duration, args.window)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
