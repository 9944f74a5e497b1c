"""Many runs saving at once under the daemon: no completion missed, nothing deleted early,
memory bounded. The default is a short variant; --run-slow runs 50 runs of 8 ranks for minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import REPO
from tests.support.daemonproc import DaemonProc, write_config

SIMTRAIN = REPO / "tests" / "support" / "simtrain.py"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    ("runs", "world", "saves", "mode"),
    [
        (6, 4, 3, "inotify"),
        (6, 4, 3, "polling"),
        pytest.param(50, 8, 12, "inotify", marks=pytest.mark.slow),
        pytest.param(50, 8, 12, "polling", marks=pytest.mark.slow),
    ],
)
def test_many_runs_saving_concurrently(tmp_path, runs, world, saves, mode):
    root = tmp_path / "vol"
    root.mkdir()
    observer = "observer = 'inotify'\npoll_interval = '5s'" if mode == "inotify" else (
        "observer = 'polling'\npoll_interval = '0.5s'")
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra=f"quiet_period = '1s'\nallow_short_quiet_period = true\nworld_size = {world}\n{observer}",
                       retention="keep_last = 1\nkeep_best = 1\nmetric = 'eval_loss'")
    steps = [10 * (i + 1) for i in range(saves)]
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        jobs = [
            subprocess.Popen(
                [sys.executable, str(SIMTRAIN), str(root / f"team{r % 5}" / f"run{r}"), "--world", str(world),
                 "--steps", *map(str, steps), "--slow-rank", str(world - 1), "--slow-delay", "1.5",
                 "--chunks", "4", "--chunk-size", "16384", "--train-time", "0.3"],
                stdout=subprocess.PIPE, text=True)
            for r in range(runs)
        ]
        results = [json.loads(job.communicate(timeout=900)[0]) for job in jobs]
        assert [job.returncode for job in jobs] == [0] * runs
        assert [v for res in results for v in res["violations"]] == []
        # every run ends with its best (the first) and its newest; the rest were deleted
        deletions = runs * (saves - 2)
        daemon.wait_for(lambda line: line.get("message", "").startswith("deleted "), count=deletions, timeout=300)
        last = f"checkpoint-{steps[-1]}"
        daemon.wait_for(lambda line: line.get("checkpoint") == last and line.get("state") == "complete",
                        count=runs, timeout=120)
        rss = rss_mib(daemon.proc.pid)
    for r in range(runs):
        run = root / f"team{r % 5}" / f"run{r}"
        assert sorted(p.name for p in run.iterdir()) == [f"checkpoint-{steps[0]}", last]
    assert rss < 200, f"daemon RSS {rss:.0f} MiB"


def test_a_save_storm_every_checkpoint_completes(tmp_path):
    """A synchronized sweep: every run saves at the same moment (one barrier), with inotify; every
    checkpoint is declared complete, none lost to an overflow or a watch not yet in place."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint

    runs, world = 24, 2
    root = tmp_path / "vol"
    for r in range(runs):
        hf_deepspeed_checkpoint(root / f"team{r % 3}" / f"run{r}", 10, world=world, mtime=time.time() - 3600)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra=f"quiet_period = '0.5s'\nallow_short_quiet_period = true\nworld_size = {world}\nobserver = 'inotify'",
                       retention="keep_last = 100")

    def complete(step):
        return lambda line: line.get("checkpoint") == f"checkpoint-{step}" and line.get("state") == "complete"

    barrier = threading.Barrier(runs)

    def save(r: int) -> None:
        barrier.wait()
        hf_deepspeed_checkpoint(root / f"team{r % 3}" / f"run{r}", 20, world=world)

    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        # found at start: each one's "complete" is a debug line (the totals line says them all)
        daemon.wait_for(complete(10), count=runs, timeout=60)
        start = daemon.mark()
        with ThreadPoolExecutor(runs) as pool:
            list(pool.map(save, range(runs)))
        daemon.wait_for(lambda line: complete(20)(line) and line.get("level") == "info", count=runs,
                        timeout=60, start=start)
        seen = {line["run"] for line in daemon.lines[start:] if complete(20)(line)}
        warnings = [line["message"] for line in daemon.lines if line.get("level") in ("warning", "error")]
    assert seen == {f"team{r % 3}/run{r}" for r in range(runs)}
    assert warnings == []
