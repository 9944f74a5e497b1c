"""The README's resume line on a real Trainer job restarted seconds after it was killed.

`python train.py --resume_from_checkpoint "$(ckptd latest out/)"`: the first job (tests/support/
fwresave.py) saves checkpoint-2 and -4 and is SIGKILLed inside the save of checkpoint-6, after its
weights; the restart (tests/support/fwrestart.py) runs the README's line through a shell at once,
its checkpoints seconds old. `ckptd latest` must name checkpoint-4 (the killed checkpoint-6 passed
over, on stderr), and the Trainer must resume from step 4. Waiting out the quiet period had named
nothing: exit 1, an empty argument, and the Trainer's "Can't find a valid checkpoint".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import child_pythonpath, fwgen

pytestmark = pytest.mark.frameworks


def test_the_readme_resume_line_works_seconds_after_the_job_was_killed(tmp_path):
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    out = tmp_path / "out"
    killed = fwgen.run_module("fwresave", "train", str(out), "16", "2", "6", "6")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]  # SIGKILLed in the save
    assert not (out / "checkpoint-6" / "trainer_state.json").exists()
    assert time.time() - (out / "checkpoint-4" / "trainer_state.json").stat().st_mtime < 60  # no ageing

    env = {k: v for k, v in os.environ.items() if k != "CKPTD_CONFIG"}
    env.update(fwgen._CHILD_ENV, PYTHONPATH=child_pythonpath(), OUT=str(out), PY=sys.executable)
    line = ('"$PY" -m tests.support.fwrestart "$OUT" 16 2 6 '
            '--resume_from_checkpoint "$("$PY" -m ckptd latest "$OUT/")"')
    proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ckptd: passed over checkpoint-6: incomplete" in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"started_at": 4, "ended_at": 6}
    assert (out / "checkpoint-6" / "trainer_state.json").exists()  # the restart saved it again, whole

