"""A purge killed in the middle of removing a checkpoint whose archive is required: what is left,
`<entry>%purging` with part of its files gone, is no checkpoint any more, and cannot go back into
its run whole. The next purge judges the archive again: finished only where the archive is whole,
verified, and what is left is what was archived; else held for review (`%review`). The real
`ckptd trash purge --now` SIGKILLed by strace at its second unlinkat (its first file removed),
against moto's S3 API server on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ckptd.discover.layouts import TRASH_DIR
from ckptd.removal.decision import RECORD
from tests.archive.test_archive_attack import GRACE, pruned
from tests.archive.test_archive_cli import ckptd
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)


def killed_mid_removal(cfg, root) -> str:
    """`ckptd trash purge --now`, SIGKILLed by strace as it removes its second file: the first
    entry it claimed, `%purging`, part removed. Its name in the trash, without the suffix."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    r = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=unlinkat:signal=KILL:when=2",
                        sys.executable, "-m", "ckptd", "trash", "purge", "--now", "-c", str(cfg)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **GRACE})
    assert r.returncode != 0, r.stdout + r.stderr
    [claimed] = [n for n in os.listdir(root / TRASH_DIR) if n.endswith("%purging")]
    name = claimed.removesuffix("%purging")
    whole = sum(len(f) for _, _, f in os.walk(root / "run" / "checkpoint-30"))  # as many files as each
    left = sum(len(f) for _, _, f in os.walk(root / TRASH_DIR / claimed))
    assert 0 < left < whole, (left, whole)  # part of it removed, not all
    return name


def ckpt_of(name: str) -> str:
    return "checkpoint-10" if name.endswith("checkpoint-10") else "checkpoint-20"


def test_a_part_removed_entry_whose_archive_verifies_is_finished(tmp_path, s3):  # noqa: F811
    """Its archive is whole and verified, and what is left is what was archived: nothing is lost by
    finishing the removal (restore gives the checkpoint back whole)."""
    root, cfg, _bucket = pruned(tmp_path, s3)
    name = killed_mid_removal(cfg, root)
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert not [n for n in os.listdir(root / TRASH_DIR) if name in n], r.stdout + r.stderr
    back = ckptd("restore", f"run/{ckpt_of(name)}", "-c", str(cfg), "--to", str(tmp_path / "back"))
    assert "every file verified" in back.stdout


def test_a_part_removed_entry_whose_manifest_is_gone_is_held_for_review(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = pruned(tmp_path, s3)
    name = killed_mid_removal(cfg, root)
    s3.client().delete_object(Bucket=bucket, Key=f"archive/run/{ckpt_of(name)}.ckptd-manifest.json")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert f"{name}%review" in os.listdir(root / TRASH_DIR), r.stdout + r.stderr
    assert "held for review" in r.stderr and "not archived to" in r.stderr, r.stderr


def test_a_part_removed_entry_with_no_decision_record_and_no_manifest_is_held(tmp_path, s3):  # noqa: F811
    """No decision record beside it (an older ckptd's entry, or no room to write one): nothing
    says whether it is whole, and its archive is gone. Was finished without asking the archive."""
    root, cfg, bucket = pruned(tmp_path, s3)
    name = killed_mid_removal(cfg, root)
    (root / TRASH_DIR / f"{name}{RECORD}").unlink()
    s3.client().delete_object(Bucket=bucket, Key=f"archive/run/{ckpt_of(name)}.ckptd-manifest.json")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert f"{name}%review" in os.listdir(root / TRASH_DIR), r.stdout + r.stderr


def test_a_part_removed_entry_holding_what_was_not_archived_is_held(tmp_path, s3):  # noqa: F811
    """A file added to what is left: it is no longer what was archived (ckptd never replaces an
    archive), though the archive itself verifies."""
    root, cfg, _bucket = pruned(tmp_path, s3)
    name = killed_mid_removal(cfg, root)
    (root / TRASH_DIR / f"{name}%purging" / "notes.txt").write_text("written after it was archived")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert f"{name}%review" in os.listdir(root / TRASH_DIR), r.stdout + r.stderr
    assert (root / TRASH_DIR / f"{name}%review" / "notes.txt").exists()
