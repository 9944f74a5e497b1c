"""accelerate writes one file per prepared model and per registered object: a copy missing any of
them is not complete.

The saves are accelerate's own (tests/support/fwaccel_multi.py: two prepared models and optimizers,
two objects given to `register_for_checkpointing`, `save_state` twice). A copier that died before one
file of the newer save leaves every other file whole and old (the file removed by hand, the
directory's mtime kept). accelerate's `load_state` then fails (FileNotFoundError for a model's
weights; "Number of custom checkpoints ... does not match" for a registered object's pickle), so
the newer one must be incomplete, naming the file, and `keep_last=1` must keep the older one, which
loads. The first model's weights are the weights check's (test_copy_in); an optimizer's file is
the file census's (test_copy_in's user-pattern case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import fwgen
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume

pytestmark = pytest.mark.frameworks


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    return fwgen.run_module("fwaccel_multi", *args)


@pytest.fixture(scope="module")
def _loader(tmp_path_factory):
    """One `fwaccel_multi serve` for the module: each `_loads` is the `load` that ran as a process of its
    own, forked from one that imported torch and accelerate once."""
    err = tmp_path_factory.mktemp("accel-loader") / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fwaccel_multi", "serve"], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env={**os.environ, **fwgen._CHILD_ENV})
    with proc:  # closes its pipes and waits for it, which ends when its stdin does
        yield proc, err
        proc.stdin.close()


@pytest.fixture
def _load(_loader) -> Callable[[Path], int]:
    proc, err = _loader

    def load(path: Path) -> int:
        """accelerate's load_state(path) into the job's objects (fwaccel_multi.load): its exit code."""
        proc.stdin.write(f"{path}\n")
        proc.stdin.flush()
        said = []
        while not (line := proc.stdout.readline()).startswith("rc ") and line:
            said.append(line)
        assert line, "".join(said)[-2000:] + err.read_text()[-3000:]  # the loader itself died
        return int(line.split()[1])
    return load


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    if (why := fwgen.missing("accelerate")) is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("accel-multi")
    proc = _child("save", str(out / "gan"), "10,20")
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(("missing", "said"), [
    ("model_1.safetensors", "model_1 weights missing, which every complete checkpoint of the run before it has"),
    ("custom_checkpoint_1.pkl",
     "custom_checkpoint_1.pkl missing, which every complete checkpoint of the run before it has"),
    ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl present, custom_checkpoint_0.pkl missing"),
])
def test_a_save_missing_a_second_models_or_a_registered_objects_file_is_incomplete(saves, _load, tmp_path,
                                                                                  missing, said):
    root = copy_volume({"out_dir": saves}, tmp_path / "vol")
    run, older, newest = root / "gan", root / "gan" / "step_10", root / "gan" / "step_20"
    assert {"model_1.safetensors", "custom_checkpoint_1.pkl", "optimizer_1.bin"} <= set(os.listdir(newest))
    st = newest.stat()
    (newest / missing).unlink()
    os.utime(newest, ns=(st.st_atime_ns, st.st_mtime_ns))  # the copier's directory: the source's mtime
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {Path(c["path"]).name: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert rows["step_20"]["state"] == "incomplete", rows["step_20"]
    assert any(said in r for r in rows["step_20"]["reasons"]), rows["step_20"]["reasons"]
    assert (rows["step_10"]["state"], rows["step_10"]["action"]) == ("complete", "keep"), rows["step_10"]
    latest = run_ckptd("latest", run, env={"CKPTD_CONFIG": ""})
    assert latest.stdout == f"{older}\n", latest.stdout + latest.stderr
    assert _load(newest) == 1  # accelerate agrees: it cannot restore it
    assert _load(older) == 0
