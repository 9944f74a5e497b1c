"""How long a standby takes to take over: a leader SIGKILLed, or SIGSTOPped (frozen: its locks held).

`python -m bench.takeover [--backend volume|etcd|kubernetes|both|all] [--rounds 5] [--duration 5]
[--margin 2]` starts, per round, two `ckptd run --log-format json -v` on a small volume with their own
state_dirs (two hosts), `leadership` the backend's (etcd: a real 3-member cluster on 127.0.0.1
ports, bench/etcdcluster.py; kubernetes: the FAKE Lease API server of the tests,
tests/support/fakekube.py, as no real one can run here: its figures time ckptd's election, not
a real API server's latency), waits for one to lead and the other to stand by, then signals the
leader and times, on this process's monotonic clock, from the signal to the standby's "this ckptd
deletes here" line (as its reader thread received it). A stopped leader is killed after.

Prints one JSON object: per backend and signal, each round's seconds, min, median, max, and the
target (`lease_duration + lease_margin + 2 s`). In `python -m bench` as an opt-in section
(`--only takeover`: 3 rounds of each backend and signal, a few minutes), as its rounds take a lease
period each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemon import DaemonProc
from bench.report import Row, Section
from ckptd.cli.demo_volume import hf_deepspeed_checkpoint


def config(
    path: Path,
    root: Path,
    state_dir: Path,
    backend: str,
    duration: float,
    margin: float,
    endpoints: list[str],
) -> Path:
    etcd = ""
    if backend == "etcd":
        etcd = "[daemon.etcd]\nendpoints = [" + ", ".join(f"'{e}'" for e in endpoints) + "]\n"
    elif backend == "kubernetes":  # endpoints: the kubeconfig naming the fake API server
        etcd = f"[daemon.kubernetes]\nkubeconfig = '{endpoints[0]}'\n"
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\nleadership = '{backend}'\n"
        f"lease_duration = '{duration}s'\nlease_margin = '{margin}s'\n{etcd}"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\n"
        "world_size = 2\npoll_interval = '0.3s'\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n"
    )
    return path


def one_round(
    work: Path, backend: str, sig: int, duration: float, margin: float, endpoints: list[str]
) -> float:
    root = work / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    a = DaemonProc(
        config(work / "a.toml", root, work / "a", backend, duration, margin, endpoints), foreground=True
    )
    b = None
    try:
        a.wait_message("this ckptd deletes here", timeout=60)
        b = DaemonProc(
            config(work / "b.toml", root, work / "b", backend, duration, margin, endpoints), foreground=True
        )
        b.wait_message("standby, observing only", timeout=60)
        b.wait_message("state written", timeout=60, start=b.mark())
        start = b.mark()
        sent = time.monotonic()
        a.proc.send_signal(sig)
        [took] = b.wait_message("this ckptd deletes here", timeout=120, start=start)
        return took.received - sent
    finally:
        if a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(30)
        if b is not None:
            b.stop()


def measure(backend: str, rounds: int, duration: float, margin: float, work: Path) -> dict[str, object]:
    cluster: Any = None
    endpoints: list[str] = []
    if backend == "kubernetes":
        from tests.support.fakekube import FakeKube

        (work / "kube").mkdir(parents=True)
        cluster = FakeKube(work / "kube")
        cluster.start()
        endpoints = [str(cluster.kubeconfig)]
    elif backend == "etcd":
        from bench.etcdcluster import Cluster

        (work / "etcd").mkdir(parents=True)
        cluster = Cluster(work / "etcd")
        cluster.start()
        endpoints = cluster.endpoints
    out: dict[str, object] = {}
    try:
        for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
            times = []
            for i in range(rounds):
                place = work / f"{backend}-{name}-{i}"
                place.mkdir(parents=True)
                times.append(round(one_round(place, backend, sig, duration, margin, endpoints), 2))
                shutil.rmtree(place, ignore_errors=True)
            out[name] = {
                "seconds": times,
                "min": min(times),
                "median": statistics.median(times),
                "max": max(times),
                "target": duration + margin + 2,
            }
    finally:
        if cluster is not None:
            cluster.stop()
    return out


NAME = "16. takeover"
DURATION, MARGIN = 5.0, 2.0


def run(ctx: Any) -> tuple[list[Row], Section]:  # (Context): bench.context imports the daemon's modules
    """The opt-in section: each backend, SIGKILL and SIGSTOP, the median of a few rounds."""
    rounds = 1 if ctx.quick else 3
    backends = ["volume", "kubernetes"] + (["etcd"] if shutil.which("etcd") else [])
    section = Section(
        NAME,
        f"`python -m bench.takeover --backend all --rounds {rounds} --duration {DURATION:g} "
        f"--margin {MARGIN:g}` "
        "(this module's docstring): a leader SIGKILLed or SIGSTOPped, the time to the standby's first "
        '"this ckptd deletes here"; kubernetes against the tests\' fake Lease API server.',
    )
    rows: list[Row] = []
    target = DURATION + MARGIN + 2
    for backend in backends:
        ctx.log(f"takeover: {backend}, {rounds} round(s) of each signal")
        got = measure(backend, rounds, DURATION, MARGIN, ctx.scratch(f"takeover-{backend}"))
        for sig, r in got.items():
            assert isinstance(r, dict)
            med = float(r["median"])
            shown = "kubernetes (fake API server)" if backend == "kubernetes" else backend
            rows.append(
                Row(
                    NAME,
                    f"{shown} lease, leader {sig}: standby deletes after",
                    f"{med:.2f} s",
                    target=f"≤ {target:g} s",
                    met=med <= target,
                    note=""
                    if med <= target
                    else f"rounds {', '.join(f'{x:g}' for x in r['seconds'])} s: the standby waits "
                    "lease_duration + lease_margin from the last renewal it saw, on its own clock, "
                    "and looks every third of the duration; a loaded machine adds its queue.",
                )
            )
            section.details.append(f"{backend} {sig}: rounds {r['seconds']} s (duration {DURATION:g} s, "
                                   f"margin {MARGIN:g} s)")  # fmt: skip
    return rows, section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.takeover")
    p.add_argument("--backend", default="both", choices=["volume", "etcd", "kubernetes", "both", "all"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--margin", type=float, default=2.0)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-bench-takeover-"))
    sets = {"both": ["volume", "etcd"], "all": ["volume", "etcd", "kubernetes"]}
    backends = sets.get(args.backend, [args.backend])
    result = {"duration_s": args.duration, "margin_s": args.margin, "rounds": args.rounds}
    for backend in backends:
        result[backend] = measure(backend, args.rounds, args.duration, args.margin, work / backend)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
