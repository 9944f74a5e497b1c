"""Space as the disk counts it: max_size and min_free count a hard-linked file once, weigh what a
deletion really frees (reflinks, what waits in the trash), and a prune still frees a full disk, or says
why it cannot and moves nothing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.journal import Journal
from ckptd.judge.verdicts import Verdicts
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import run_ckptd
from tests.support.rtkit import config, prune

# --- Bytes as the filesystem counts them: hard links, blocks -------------------------------------

MiB = 1024 * 1024


def _linked_run(trainer_volume, root: Path, into: tuple[int, ...]) -> tuple[Path, Path]:
    """The Trainer's run-state under `root`, and one 8 MiB file hard-linked into the checkpoints
    `into` (a dedup pass, `cp -al`, `rsync --link-dest` make such links; a file added after the
    save, which no check reads)."""
    import shutil

    shutil.copytree(Path(trainer_volume["out_dir"]) / "run-state", root / "run-state", symlinks=True)
    run = root / "run-state"
    first = run / f"checkpoint-{into[0]}" / "eval_predictions.npy"
    first.write_bytes(os.urandom(8 * MiB))
    for step in into[1:]:
        os.link(first, run / f"checkpoint-{step}" / "eval_predictions.npy")
    from ckptd.cli.demo_volume import age

    age(root, time.time() - 3600)
    return root, run


def _plan(cfg: Path) -> dict:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _du(path: Path) -> int:
    """Allocated bytes under `path`, each inode once (what `du` says)."""
    seen, total = set(), 0
    for p in [path, *path.rglob("*")]:
        st = p.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


@pytest.mark.frameworks
def test_max_size_counts_a_hard_linked_file_once(trainer_volume, tmp_path):
    """One 8 MiB file linked into all five checkpoints of a run: `du` says ~8.5 MiB, ckptd summed
    42 MiB and `max_size = "20MiB"` deleted the three oldest. Now the run fits: nothing deleted."""
    root, run = _linked_run(trainer_volume, tmp_path / "vol", (2, 4, 6, 8, 10))
    assert _du(run) < 20 * MiB
    cfg = config(tmp_path, root, keep_last=5, keep_best=0, max_size="20MiB")
    plan = _plan(cfg)
    assert plan["totals"]["delete"] == 0
    assert not [w for w in plan["warnings"] if "max_size" in w], plan["warnings"]  # it fits: nothing to say
    out = prune(cfg)
    assert "0 deleted" in out
    assert sorted(p.name for p in run.iterdir()) == [f"checkpoint-{s}" for s in (10, 2, 4, 6, 8)]


@pytest.mark.frameworks
def test_what_is_freed_counts_what_the_disk_frees(trainer_volume, tmp_path):
    """keep_last=1 deletes checkpoint-2, -4 and -6, each of which links the 8 MiB file the kept
    checkpoint-8 links too: deleting them frees their own files, not the 8 MiB each (ckptd said
    24 MiB). plan's bytes_to_free and prune's 'freed' say what the filesystem freed."""
    root, run = _linked_run(trainer_volume, tmp_path / "vol", (2, 4, 6, 8))
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    own = sum(_du(run / f"checkpoint-{s}") - 8 * MiB for s in (2, 4, 6))
    plan = _plan(cfg)
    assert plan["totals"]["delete"] == 3
    assert plan["totals"]["bytes_to_free"] == own
    out = prune(cfg)
    assert "3 deleted" in out
    freed = out.split("3 deleted (", 1)[1].split(" freed", 1)[0]
    assert freed.endswith(("KiB", "B")) and not freed.endswith("MiB"), out
    assert (run / "checkpoint-8" / "eval_predictions.npy").stat().st_nlink == 1


def _small_volume(mount, where: Path, size_mib: int) -> Path:
    where.mkdir()
    mount("-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", where)
    return where


def _fill_to(root: Path, free: int) -> None:
    """A ballast file that leaves `free` bytes free on root's filesystem."""
    st = os.statvfs(root)
    fd = os.open(root / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - free)
    finally:
        os.close(fd)


@pytest.mark.frameworks
@pytest.mark.parametrize(("into", "deleted"), [((2, 4, 6, 8), ()), ((2, 4), (2, 4))])
def test_min_free_weighs_what_deleting_frees_hard_links_considered(trainer_volume, tmp_path, mount, into, deleted):
    """A 48 MiB tmpfs with 8 MiB free, min_free = 16 MiB. With the 8 MiB file linked from the
    newest checkpoint too (protected), deleting every unprotected checkpoint frees well under the
    8 MiB needed: ckptd counted 8 MiB for each and deleted checkpoints for nothing; now it deletes
    none and says min_free cannot be met. Linked only from checkpoint-2 and -4, deleting both
    frees it: both go (one alone frees nothing of it)."""
    vol = _small_volume(mount, tmp_path / "vol", 48)
    root, run = _linked_run(trainer_volume, vol, into)
    _fill_to(root, 8 * MiB)
    cfg = config(tmp_path, root, keep_last=5, keep_best=0, min_free="16MiB")
    plan = _plan(cfg)
    doomed = sorted(c["path"].rsplit("-", 1)[1] for c in plan["checkpoints"] if c["action"] == "delete")
    assert doomed == sorted(str(s) for s in deleted)
    if not deleted:
        assert any("min_free=16MiB cannot be met" in w for w in plan["warnings"]), plan["warnings"]
    prune(cfg)
    assert sorted(p.name for p in run.iterdir()) == sorted(
        f"checkpoint-{s}" for s in (2, 4, 6, 8, 10) if s not in deleted
    )
    if deleted:
        assert os.statvfs(root).f_bavail * os.statvfs(root).f_frsize >= 16 * MiB


# --- Deleting on a full disk ---------------------------------------------------------------------


def _full_ext4(mount, tmp_path: Path) -> Path:
    """A 64 MiB ext4 loop mount with no blocks reserved for root (`mkfs -m 0`: the tests run as
    root, and root may use the reserve), to be filled by the caller."""
    import shutil
    import subprocess

    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 for a real full filesystem")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)], check=True, capture_output=True)
    vol = tmp_path / "vol"
    vol.mkdir()
    mount("-o", "loop", image, vol)
    return vol


def _fill(root: Path) -> None:
    """Every block taken: a ballast file of all but 1 MiB (its extent tree takes blocks too), then
    small files until ENOSPC."""
    _fill_to(root, MiB)
    i = 0
    while True:
        try:
            (root / f"ballast-{i}").write_bytes(b"x" * 4096)
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
            break
        i += 1
    with pytest.raises(OSError) as exc:
        os.mkdir(root / "probe")
    assert exc.value.errno == 28, "the filesystem is not full: mkdir still works"


@pytest.mark.frameworks
def test_prune_deletes_on_a_full_disk_with_no_trash_yet(trainer_volume, tmp_path, mount):
    """A 100 % full volume with no .ckptd-trash/ yet: `prune` could not make it (ENOSPC), deleted
    nothing and exited 74, on exactly the occasion min_free exists for. Now each checkpoint is
    renamed into the root under a hidden name (a rename needs no new block), purged at once, and
    the trash is made once there is room."""
    vol = _full_ext4(mount, tmp_path)
    root, run = _linked_run(trainer_volume, vol, (2,))
    assert not (root / ".ckptd-trash").exists()
    _fill(root)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, min_free="1MiB")
    out = prune(cfg)
    assert "3 deleted" in out and "0 failed" in out, out
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-10", "checkpoint-8"]
    assert not [n for n in os.listdir(root) if n.startswith(".ckptd-trash.")]
    assert (root / ".ckptd-trash").is_dir()  # made after the purge, while there is room


@pytest.mark.frameworks
def test_a_checkpoint_renamed_aside_on_a_full_disk_is_purged_by_the_next_start(trainer_volume, tmp_path, mount):
    """Crash-safe as the trash: a checkpoint renamed into the root under a hidden name (no room for
    the trash), then no purge (the process killed), is neither a run nor a checkpoint to the next
    `plan`, and the next `prune` purges it as leftover trash."""
    vol = _full_ext4(mount, tmp_path)
    root, _run = _linked_run(trainer_volume, vol, (2,))
    _fill(root)
    r = Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=0))
    scanner = Scanner(r, verdicts=Verdicts())
    plan = decide([(r, scanner.runs(now=time.time()))])
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    results = reaper.execute(plan.decisions)
    assert sorted(res.outcome for res in results) == [Outcome.TRASHED] * 3, [res.detail for res in results]
    aside = sorted(n for n in os.listdir(root) if n.startswith(".ckptd-trash."))
    assert len(aside) == 3 and not (root / ".ckptd-trash").exists()
    journal = (tmp_path / "state" / "journal.jsonl").read_text()
    assert all(str(root / n) in journal for n in aside)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    listed = _plan(cfg)
    assert sorted(c["path"].rsplit("/", 1)[1] for c in listed["checkpoints"]) == ["checkpoint-10", "checkpoint-8"]
    out = prune(cfg)
    assert "purged 3 leftover trash entries" in out, out
    assert not [n for n in os.listdir(root) if n.startswith(".ckptd-trash.")]
