"""What a killed `ckptd restore` leaves: its hidden directory beside the target, with part of the
checkpoint in it. The next restore into that directory removes it, and only it: not one a running
restore holds, not a symlink or a file under such a name, not what a symlink points to. The real
`ckptd restore` killed with SIGKILL by strace at its first fsync (the first file downloaded),
against moto's S3 API server on 127.0.0.1."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from tests.archive.test_archive_attack import GRACE, pruned
from tests.archive.test_archive_cli import ckptd
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)


def killed_restore(cfg, to) -> None:
    """`ckptd restore run/checkpoint-10 --to TO`, SIGKILLed as it fsyncs its first file."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    r = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=fsync:signal=KILL",
                        sys.executable, "-m", "ckptd", "restore", "run/checkpoint-10", "-c", str(cfg),
                        "--to", str(to)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **GRACE})
    assert r.returncode != 0, r.stdout + r.stderr


def test_a_killed_restores_directory_is_removed_by_the_next_restore_and_nothing_else(tmp_path, s3):  # noqa: F811
    _root, cfg, _bucket = pruned(tmp_path, s3)
    to = tmp_path / "to"
    killed_restore(cfg, to)
    [left] = os.listdir(to)
    assert left.startswith(".ckptd-restore-checkpoint-10-")
    assert sum(len(f) for _, _, f in os.walk(to / left)) >= 1  # part of it downloaded
    # Beside it: a link and a file under such names, a link's target outside, a restore running
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.symlink(outside, to / ".ckptd-restore-link-abc")
    (to / ".ckptd-restore-file-abc").write_text("not a directory")
    (to / "mine").mkdir()  # a directory of the user's, not named as a restore's
    (to / "mine" / "notes.txt").write_text("mine")
    running = to / ".ckptd-restore-checkpoint-20-running"
    (running / "checkpoint-20").mkdir(parents=True)
    held = os.open(running, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the running restore holds its own
        r = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(to))
    finally:
        os.close(held)
    assert "left by a restore that did not finish" in r.stderr, r.stderr
    assert sorted(os.listdir(to)) == [".ckptd-restore-checkpoint-20-running", ".ckptd-restore-file-abc",
                                      ".ckptd-restore-link-abc", "checkpoint-10", "mine"]
    assert (to / "mine" / "notes.txt").read_text() == "mine"
    assert (outside / "keep.txt").read_text() == "mine" and os.path.islink(to / ".ckptd-restore-link-abc")
    assert os.listdir(running) == ["checkpoint-20"]
    assert (to / "checkpoint-10" / "latest").read_text() == "global_step10"


def test_a_failed_restore_leaves_nothing_behind(tmp_path, s3):  # noqa: F811
    """A restore that fails (an object missing from the bucket) removes its own directory."""
    _root, cfg, bucket = pruned(tmp_path, s3)
    s3.client().delete_object(Bucket=bucket, Key="archive/run/checkpoint-10/latest")
    to = tmp_path / "to"
    r = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(to), check=False)
    assert r.returncode == 74, r.stdout + r.stderr
    assert os.listdir(to) == []
