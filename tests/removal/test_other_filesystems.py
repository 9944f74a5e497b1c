"""Never into another filesystem, with real bind and tmpfs mounts.

A directory bind-mounted (or any mount point) inside an old checkpoint was emptied by the purge:
the walk, the rename and the purge crossed st_dev. A checkpoint holding a mount point is never
trashed, and nothing ever descends into another filesystem. Each test runs as on this kernel and
as on one without statx (where a bind mount shares st_dev and only the mount table shows it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import Action
from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import Journal
from ckptd.judge.evidence import walk
from ckptd.removal import fs
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from ckptd.volume import mounts as mounts_module
from ckptd.volume.mounts import is_mount_root
from tests.support.common import run_ckptd

OLD = 1_700_000_000.0




@pytest.fixture
def volume(tmp_path, mount):
    """Three old Trainer checkpoints; the oldest holds a bind mount of a dataset outside the root
    (same filesystem, same st_dev) and a tmpfs (another device)."""
    root, dataset = tmp_path / "vol", tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "shard-0.bin").write_text("precious")
    for i, step in enumerate((10, 20, 30)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + i)
    ck = root / "run" / "checkpoint-10"
    (ck / "data").mkdir()
    (ck / "scratch").mkdir()
    mount("--bind", dataset, ck / "data")
    mount("-t", "tmpfs", "tmpfs", ck / "scratch")
    (ck / "scratch" / "cache").write_text("also precious")
    age(ck, OLD)
    return root


@pytest.fixture(params=["statx", "no statx"])
def statx(request, monkeypatch):
    """Each test twice: as on this kernel, and as on one before Linux 5.8 (or a libc without
    statx), where only st_dev and the mount table can tell (mounts.is_mount_root says None).
    The seam is the one function that asks the kernel; an old kernel cannot be run here."""
    if request.param == "no statx":
        monkeypatch.setattr(mounts_module, "_statx", lambda: None)
    return request.param


def plan_for(root: Path, **retention):
    scanner = Scanner(Root(path=root, retention=Retention(keep_best=0, **retention)))
    return scanner, decide([(scanner.root, scanner.runs(now=OLD + 3600))])


def test_the_walk_sees_mount_points_and_never_enters_them(volume, statx):
    ck = volume / "run" / "checkpoint-10"
    entries = {e.rel: e.kind for e in walk(ck)}
    assert entries["scratch"] == "m" and not any(rel.startswith("scratch/") for rel in entries)
    if statx == "statx":
        assert is_mount_root(ck / "data") is True and is_mount_root(ck) is False
        assert entries["data"] == "m" and not any(rel.startswith("data/") for rel in entries)
    else:  # a bind mount keeps st_dev: without statx the walk cannot tell (the re-check's mount table does)
        assert is_mount_root(ck / "data") is None and entries["data"] == "d"


def test_a_checkpoint_holding_a_mount_point_is_kept_and_says_why(volume, statx):
    _, plan = plan_for(volume, keep_last=1)
    by_name = {d.checkpoint.name: d for d in plan.decisions}
    d = by_name["checkpoint-10"]
    assert d.action is Action.KEEP and d.protected
    where = "data, scratch" if statx == "statx" else "scratch"
    assert d.reasons[0] == f"holds a mount point ({where}): another filesystem is never deleted"
    assert by_name["checkpoint-20"].action is Action.DELETE


def test_prune_never_empties_a_mount_inside_an_old_checkpoint(volume, tmp_path):
    """End to end: the bug emptied the bind-mounted dataset through the purge."""
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{volume}'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert "delete run/checkpoint-20" in proc.stdout and "checkpoint-10" not in proc.stdout
    ck = volume / "run" / "checkpoint-10"
    assert (tmp_path / "dataset" / "shard-0.bin").read_text() == "precious"
    assert (ck / "data" / "shard-0.bin").read_text() == "precious"
    assert (ck / "scratch" / "cache").read_text() == "also precious"
    assert not (volume / "run" / "checkpoint-20").exists()


def test_a_mount_made_after_the_plan_is_refused_at_the_re_check(tmp_path, mount, statx):
    root, dataset = tmp_path / "vol", tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "x").write_text("precious")
    for i, step in enumerate((10, 20)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + i)
    scanner, plan = plan_for(root, keep_last=1)
    [deletion] = plan.deletions
    mount("--bind", dataset, root / "run" / "checkpoint-10" / "global_step10")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: OLD + 3600)
    [result] = reaper.execute(plan.decisions)
    assert deletion.checkpoint.name == "checkpoint-10"
    assert result.outcome is Outcome.REFUSED and result.detail == "holds a mount point (global_step10)"
    assert (dataset / "x").read_text() == "precious"


def test_the_purge_never_crosses_into_a_mount_inside_the_trash(tmp_path, mount, statx):
    """A bind mount attached inside a trash entry (after it was trashed): the purge leaves the
    entry and never touches the mounted files; the rest of the trash goes. Slims' work, which
    goes without a judgement (an entry whose origin nothing says is held for review, never purged)."""
    root, dataset = tmp_path / "vol", tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "x").write_text("precious")
    trash = root / TRASH_DIR
    (trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "data").mkdir(parents=True)
    (trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "optimizer.pt").write_text("junk")
    (trash / "2-bbbb-run%2Fcheckpoint-20%slim").mkdir()
    mount("--bind", dataset, trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "data")
    reaper = Reaper(Scanner(Root(path=root)), Journal(tmp_path / "state"), dry_run=False)
    assert reaper.purge()[0] == 1
    assert os.listdir(trash) == ["1-aaaa-run%2Fcheckpoint-10%slim"]
    assert (dataset / "x").read_text() == "precious"
    # and the remover itself, asked directly (the mount table check comes first in purge): a
    # bind mount is refused by statx, a tmpfs by its device number whatever the kernel
    (trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "tmp").mkdir()
    mount("-t", "tmpfs", "tmpfs", trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "tmp")
    (trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "tmp" / "y").write_text("precious too")
    if statx == "no statx":
        subprocess.run(["umount", str(trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "data")], check=True)
    fd = os.open(trash, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError, match=r"mount point|another filesystem"):
            fs._remove_tree("1-aaaa-run%2Fcheckpoint-10%slim", fd, os.fstat(fd).st_dev)
    finally:
        os.close(fd)
    assert (dataset / "x").read_text() == "precious"
    assert (trash / "1-aaaa-run%2Fcheckpoint-10%slim" / "tmp" / "y").read_text() == "precious too"


def test_the_remover_never_enters_a_bind_mount(tmp_path, mount):
    """The remover alone, a bind mount (same st_dev) its only way into another tree: statx says."""
    trash, dataset = tmp_path / "trash", tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "x").write_text("precious")
    (trash / "entry" / "data").mkdir(parents=True)
    mount("--bind", dataset, trash / "entry" / "data")
    fd = os.open(trash, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError, match="mount point"):
            fs._remove_tree("entry", fd, os.fstat(fd).st_dev)
    finally:
        os.close(fd)
    assert (dataset / "x").read_text() == "precious"
