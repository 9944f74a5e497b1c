"""A Trainer re-saving in place, killed right after its weights: files from two saves.

A second job into the same output_dir (a wider model) saves checkpoint-4 over the first job's and
is SIGKILLed inside the save once save_pretrained has written config.json and model.safetensors
(tests/support/fwresave.py): the new weights lie beside the first job's optimizer, scheduler, rng
state and trainer_state.json. The Trainer cannot resume from it; it resumes from checkpoint-2. So
checkpoint-4 must be incomplete ("weights order": no DeepSpeed tag, so nothing writes weights
after trainer_state.json), `ckptd latest` must name checkpoint-2 and `keep_last=1` keep it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import fwgen
from tests.support.common import run_ckptd, shift_mtimes

pytestmark = pytest.mark.frameworks


@pytest.fixture
def fwresave(tmp_path_factory):
    """`python -m tests.support.fwresave ARGS` as a process forked from one `fwresave serve`, which
    imported torch and transformers once: (ARGS) -> its returncode, stdout and the server's stderr."""
    err = tmp_path_factory.mktemp("fwresave") / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fwresave", "serve"], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env={**os.environ, **fwgen._CHILD_ENV})

    def run(*args: str) -> SimpleNamespace:
        proc.stdin.write(json.dumps(args) + "\n")
        proc.stdin.flush()
        said = []
        while not (line := proc.stdout.readline()).startswith("rc ") and line:
            said.append(line)
        assert line, "".join(said)[-2000:] + err.read_text()[-3000:]  # the server itself died
        return SimpleNamespace(returncode=int(line.split()[1]), stdout="".join(said), stderr=err.read_text())

    with proc:  # closes its pipes and waits for it, which ends when its stdin does
        yield run
        proc.stdin.close()


def test_a_trainer_resave_killed_after_its_weights_is_incomplete_and_the_older_one_is_kept(fwresave, tmp_path):
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    out = tmp_path / "vol" / "out"
    first = fwresave("train", str(out), "16", "2", "4")
    assert first.returncode == 0 and "trained" in first.stdout, first.stdout[-2000:] + first.stderr[-3000:]
    shift_mtimes(tmp_path / "vol", 7200)  # the first job ran two hours ago
    killed = fwresave("train", str(out), "32", "4", "4", "4")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]  # SIGKILLed in the save
    ck4 = out / "checkpoint-4"
    assert (ck4 / "model.safetensors").stat().st_mtime > (ck4 / "trainer_state.json").stat().st_mtime + 3600
    shift_mtimes(tmp_path / "vol", 1800)  # killed half an hour ago: quiet since
    assert time.time() - (ck4 / "model.safetensors").stat().st_mtime > 1700

    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {Path(c["path"]).name: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert rows["checkpoint-4"]["state"] == "incomplete", rows["checkpoint-4"]
    said = "weights order failed: files from two saves: trainer_state.json is "
    assert any(said in r for r in rows["checkpoint-4"]["reasons"]), rows["checkpoint-4"]["reasons"]
    assert (rows["checkpoint-2"]["state"], rows["checkpoint-2"]["action"]) == ("complete", "keep")
    latest = run_ckptd("latest", out, env={"CKPTD_CONFIG": ""})
    assert latest.stdout == f"{out / 'checkpoint-2'}\n", latest.stdout + latest.stderr

    # the Trainer agrees: it cannot resume from checkpoint-4, and does from checkpoint-2
    assert fwresave("resume", str(tmp_path / "r4"), "16", str(ck4)).returncode != 0
    back = fwresave("resume", str(tmp_path / "r2"), "16", str(out / "checkpoint-2"))
    assert back.returncode == 0 and "resumed" in back.stdout, back.stdout[-2000:] + back.stderr[-3000:]
