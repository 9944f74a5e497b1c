"""The benchmark harness, run tiny (`python -m bench --quick`), so that it does not rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import REPO

sys.path.insert(0, str(REPO))  # bench/ is not installed: it is run from a checkout

from bench import results

BENCHMARKS = (
    "1. cold start",
    "2. polling cycle",
    "3. detection latency",
    "4. idle cost",
    "5. memory",
    "6. planning",
    "7. deletion",
    "8. training-loop stall",
    "9. metadata load",
    "10. stalled checkpoints",
    "11. save storm",
    "13. commit records",
    "14. standing by",
)


# benchmark 13 (bench/attest.py) runs a real 2-rank DeepSpeed job (tests/support/dsgen.py)
@pytest.mark.deepspeed
def test_quick_run_prints_every_benchmark_and_writes_the_report(tmp_path: Path):
    out = tmp_path / "BENCHMARKS.md"
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,  # 13. runs two real DeepSpeed jobs (2 ranks each), about a minute
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    header = table.splitlines()[0].split()
    assert header == ["benchmark", "case", "ckptd", "baseline", "ratio", "target", "met?"]
    for name in BENCHMARKS:
        assert name in table, f"no row for {name}:\n{table}"
    # The daemon's benchmarks measure a real `ckptd run`: no placeholder is left.
    assert "needs `ckptd run`" not in table
    for case in (
        "T: CPU and calls per cycle, all complete",
        "inotify: p50 / p99 overhead beyond quiet_period",
        "polling every 0.3 s: p50 / p99 overhead beyond quiet_period",
        "T: CPU % over 1 s, inotify",
        "T: CPU % over 1 s, polling every 1 s",
        "T: `ckptd run` RSS after start-up, no torch",
    ):
        assert case in table, f"no row {case!r}:\n{table}"

    text = out.read_text()
    for section in ("## Results", "## Sections"):
        assert section in text
    assert "python -m bench --quick" in text
    for name in BENCHMARKS:
        assert f"| {name} |" in text
    # The report is the rendering of the recorded results, which name each section's run.
    recorded = json.loads(out.with_suffix(".json").read_text())
    assert results.render(recorded) == text
    for section in recorded["sections"].values():
        assert section["run"]["command"].startswith("python -m bench --quick")
        assert section["run"]["tree"] and section["run"]["date"]
    assert not any((tmp_path / "work").iterdir()), "the work directory was not cleaned up"
