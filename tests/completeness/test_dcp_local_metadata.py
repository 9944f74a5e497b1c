"""DCP saved with `use_collectives=False`: each rank's own `__<rank>.metadata`, no global `.metadata`.

DCP loads such a save (each rank reads its own metadata), so it is complete once every rank's
metadata is there; before, ckptd demanded the global `.metadata` and called it incomplete forever
(`ckptd latest` named none). A rank killed before its metadata leaves the rest: incomplete, said why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import fwgen
from tests.support.common import run_ckptd

pytestmark = pytest.mark.frameworks


@pytest.fixture(scope="session")
def dcp_local(tmp_path_factory) -> Path:
    if (why := fwgen.missing("dcp")) is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("dcp-local")
    env = {**os.environ, **fwgen._CHILD_ENV}
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwdcp_local", str(out)], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def copy_aged(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    old = os.stat(dest).st_mtime - 3600
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), (old, old))
    return dest


def test_a_save_without_collectives_is_complete_by_every_ranks_metadata(dcp_local, tmp_path):
    root = copy_aged(dcp_local, tmp_path / "vol")
    assert sorted(os.listdir(root / "run" / "step_20")) == ["__0.metadata", "__0_0.distcp", "__1.metadata",
                                                             "__1_0.distcp"]
    proc = run_ckptd("verify", root / "run" / "step_20", env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "__0.metadata..__1.metadata" in proc.stdout
    proc = run_ckptd("latest", root / "run", env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0 and proc.stdout == f"{root / 'run' / 'step_20'}\n", proc.stderr


def test_a_rank_killed_before_its_metadata_is_incomplete(dcp_local, tmp_path):
    """Rank 1 killed between its data and its metadata: its `__1.metadata` is not there (removed from
    the real save, the directory's mtime kept: what that kill leaves; DCP then fails to load rank 1)."""
    root = copy_aged(dcp_local, tmp_path / "vol")
    ck = root / "run" / "step_20"
    st = ck.stat()
    (ck / "__1.metadata").unlink()
    os.utime(ck, (st.st_atime, st.st_mtime))
    proc = run_ckptd("verify", ck, env={"CKPTD_CONFIG": ""})
    assert proc.returncode != 0
    assert "rank 1 wrote its __1_*.distcp, not yet its __1.metadata" in proc.stdout, proc.stdout
    proc = run_ckptd("latest", root / "run", env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0 and proc.stdout == f"{root / 'run' / 'step_10'}\n", proc.stderr
    assert "passed over step_20: incomplete" in proc.stderr


def test_a_rank_that_wrote_nothing_is_missed(dcp_local, tmp_path):
    """Rank 0 killed before it wrote anything, rank 1 done (its files alone: removed from the real
    save, the directory's mtime kept): rank 0's metadata is missing."""
    root = copy_aged(dcp_local, tmp_path / "vol")
    ck = root / "run" / "step_10"
    st = ck.stat()
    for name in ("__0.metadata", "__0_0.distcp"):
        (ck / name).unlink()
    os.utime(ck, (st.st_atime, st.st_mtime))
    proc = run_ckptd("verify", ck, env={"CKPTD_CONFIG": ""})
    assert proc.returncode != 0 and "__0.metadata missing" in proc.stdout, proc.stdout
