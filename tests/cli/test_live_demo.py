"""The README's first command: `ckptd demo --live DIR`, the real daemon on a simulated job for ~30 s."""

from __future__ import annotations

import re

from tests.support.common import run_ckptd
from tests.support.readme import readme_block_after


def test_the_readmes_first_command_runs_the_live_demo_and_ckptd_never_deletes_what_is_written(tmp_path, state_env):
    """Run as the README writes it (after its `pip install .`: this checkout is what the tests
    import), in a directory of the test's own instead of /tmp/ckptd-live. The slow rank writes
    through an open file: a deletion under it would fail its write, and the summary would say so."""
    command = readme_block_after("Watch the daemon at work")
    assert command == "pip install . && ckptd demo --live /tmp/ckptd-live"
    argv = command.split("&& ckptd ", 1)[1].split()
    argv[-1] = str(tmp_path / "live")
    proc = run_ckptd(*argv, env=state_env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    summary = out[out.index("\nsummary: "):]
    assert "    deleted while a rank was writing it: 0\n" in summary
    assert "    kept: checkpoint-500 checkpoint-2500 checkpoint-3000\n" in summary  # the best (oldest), 2 newest
    assert "FAILED" not in out  # no write of the slow rank failed under a deletion
    deleted = re.findall(r"^ +[\d.]+s  deleted (checkpoint-\d+) \(its last shard done at ([\d.]+)s\)$", summary, re.M)
    assert [name for name, _ in deleted] == ["checkpoint-1000", "checkpoint-1500", "checkpoint-2000"]
    trainer = re.findall(r"would delete (checkpoint-\d+)  <- rank 5 still writing it", summary)
    assert trainer and "would have deleted while a rank was writing it: 0" not in summary
    assert sorted(p.name for p in (tmp_path / "live" / "experiments" / "roberta-mlm").iterdir()) == [
        "checkpoint-2500", "checkpoint-3000", "checkpoint-500"]
