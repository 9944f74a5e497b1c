"""The real `ckptd run` beside a real 2-process HF Trainer run with `AttestCallback` (attestgen.py):
with the default quiet period (60 s), each save counts as complete on its commit records within
seconds of the last rank's write, and keep_last=1 deletes the older save then, never the one
in flight. Also the figure for BENCHMARKS.md (printed: pytest -s)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fwgen
from daemonproc import DaemonProc, write_config

pytestmark = pytest.mark.frameworks
HERE = Path(__file__).parent


def _at(line: dict) -> float:
    return datetime.datetime.fromisoformat(line["time"].replace("Z", "+00:00")).timestamp()


def test_the_daemon_counts_an_attested_save_complete_without_the_quiet_period(tmp_path):
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    root = tmp_path / "vol"
    root.mkdir()
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="max_depth = 3",
                       retention="keep_last = 1\nkeep_best = 0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        proc = subprocess.run([sys.executable, str(HERE / "attestgen.py"), str(root), "trainer-whole"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run = root / "trainer-whole"
        def complete(step: int) -> dict:
            return daemon.wait_for(lambda r: r.get("checkpoint") == f"checkpoint-{step}"
                                   and r.get("state") == "complete", timeout=30)[0]  # the first time

        complete(2)
        line = complete(4)
        ck = run / "checkpoint-4"
        last_write = max(p.stat().st_mtime for p in ck.rglob("*") if p.is_file() and ".ckptd" not in p.parts)
        last_record = max(p.stat().st_mtime for p in (ck / ".ckptd").glob("commit-*"))
        lag = _at(line) - last_record
        print(f"\ncheckpoint-4: complete {_at(line) - last_write:.2f}s after the last rank's write, "
              f"{lag:.2f}s after its last record (quiet_period=60s)")
        assert lag < 10, daemon.dump()[-3000:]
        daemon.wait_message("deleted trainer-whole/checkpoint-2", timeout=30)
    assert sorted(os.listdir(run)) == ["checkpoint-4"]
