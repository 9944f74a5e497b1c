"""The real `ckptd run` beside a real 2-process HF Trainer run with `AttestCallback` (attestgen.py):
with the default quiet period (60 s), each save counts as complete on its commit records within
seconds of the last rank's write, and keep_last=1 deletes the older save then, never the one
in flight. Also the figure for BENCHMARKS.md (printed: pytest -s)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest

from tests.support import child_pythonpath, fwgen
from tests.support.daemonproc import DaemonProc, write_config

pytestmark = pytest.mark.frameworks


def _at(line: dict) -> float:
    return datetime.datetime.fromisoformat(line["time"].replace("Z", "+00:00")).timestamp()


def test_the_daemon_counts_an_attested_save_complete_without_the_quiet_period(tmp_path):
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    root = tmp_path / "vol"
    root.mkdir()
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="max_depth = 3",
                       retention="keep_last = 1\nkeep_best = 0")
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        proc = subprocess.run([sys.executable, "-m", "tests.support.attestgen", str(root), "trainer-whole"],
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


@pytest.mark.deepspeed
def test_a_trainer_deepspeed_run_with_a_slow_rank_best_oldest_and_a_resume(tmp_path):
    """The real `ckptd run` (quiet_period 2 s, keep_last=1, keep_best=1: the Trainer's best) beside a
    real 2-process HF Trainer + DeepSpeed ZeRO-2 run with `AttestCallback` (attestgen.py trainer-ds):
    eval_loss best at checkpoint-2, the oldest; rank 1's part of checkpoint-6's save ends 5 s after
    rank 0's, longer than the quiet period. checkpoint-6 is complete within about a second of rank 1's
    record, never before it; each deletion is of a checkpoint complete and not the newest complete
    one then, never the best; and the Trainer resumes from what `ckptd latest` names."""
    pytest.importorskip("deepspeed")
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    from tests.support import attestgen

    root = tmp_path / "vol"
    root.mkdir()
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="max_depth = 3\nquiet_period = '2s'\nallow_short_quiet_period = true",
                       retention="keep_last = 1\nkeep_best = 1")
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        proc = subprocess.run([sys.executable, "-m", "tests.support.attestgen", str(root), "trainer-ds"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        made = json.loads(proc.stdout.strip().splitlines()[-1])
        daemon.wait_message("deleted trainer-ds/checkpoint-6", timeout=60)  # once checkpoint-8 is complete
        said = daemon.lines[:]
    run = root / "trainer-ds"
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-8"]  # the best (oldest) and the newest

    def complete_at(step: int) -> int:
        return next(i for i, r in enumerate(said) if r.get("checkpoint") == f"checkpoint-{step}"
                    and r.get("state") == "complete" and r.get("level") == "info")

    # the slow rank: rank 1's record came SLOW_S after rank 0's; complete on it, not on quiet before it
    rank0, rank1 = made["records"]["commit-rank0-of-2.json"], made["records"]["commit-rank1-of-2.json"]
    assert rank1 - rank0 >= attestgen.SLOW_S - 0.5, made["records"]
    lag = _at(said[complete_at(6)]) - rank1
    print(f"\ncheckpoint-6: complete {lag:.2f}s after the slow rank's record, "
          f"{rank1 - rank0:.1f}s after rank 0's (quiet_period=2s)")
    assert -0.01 <= lag < 1.5, daemon.dump()[-3000:]  # the log's time has millisecond precision
    # every deletion: a complete checkpoint, with a newer complete one said before it; never the best
    deleted = [(i, r["checkpoint"]) for i, r in enumerate(said) if str(r.get("message", "")).startswith("deleted ")]
    assert [name for _, name in deleted] == ["checkpoint-4", "checkpoint-6"], daemon.dump()[-3000:]
    for i, name in deleted:
        step = int(name.split("-")[1])
        assert complete_at(step) < i
        assert any(complete_at(newer) < i for newer in (6, 8) if newer > step), (name, daemon.dump()[-3000:])
    assert made["latest"] == str(run / "checkpoint-6"), made  # the newest attested, after the slow save
    assert made["resumed"] == {"global_step": 8, "steps_run": 2, "best": str(run / "checkpoint-2")}, made
