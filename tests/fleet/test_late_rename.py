"""A leader stopped between its last look at the lease and its rename, resumed after a takeover.

Real `ckptd run` processes, two "hosts" on one volume, short leases as in test_multinode: each
its own state_dir, and the second sees the volume through a FUSE mount of it (bindfs), so that,
as between two hosts, the stopped leader's POSIX lock does not keep it from taking over. The stop lands exactly in the window through tests/support/stopfault.py (its docstring
says why a seam). Meanwhile the checkpoint the stopped leader is about to delete is pinned, and
the other daemon takes the lease. Without the checks after each rename, the stopped leader's
rename moved the pinned checkpoint into the trash and the new leader's purge deleted it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.journal import Journal, read_journal
from ckptd.judge.settle import Settler
from ckptd.removal import trash
from ckptd.removal.reaper import Reaper
from tests.support.daemonproc import DaemonProc
from tests.support.nodes import D, M, ckpts, listing, node_config, wait_stopped
from tests.support.volumes import names
from tests.support.volumes import volume as volume


def leader_that_waits(tmp_path: Path, root: Path, *where: str) -> DaemonProc:
    """`ckptd run` on `root` that waits at its fence, `where` (tests/support/stopfault.py)."""
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    for w in where:
        os.mkfifo(fifos / w)
    return DaemonProc("-c", node_config(tmp_path, "a", root), command=[sys.executable, "-m", "tests.support.stopfault"],
                      env={"CKPTD_TEST_FENCE_FIFOS": str(fifos)})


def go_on(tmp_path: Path, where: str) -> None:
    """Let the waiting leader past its fence `where`."""
    with open(tmp_path / "fifos" / where, "wb") as fifo:
        fifo.write(b"go\n")


def stopped_at_the_fence_while_another_node_takes_over(tmp_path: Path, a: DaemonProc, root: Path,
                                                         bindfs) -> DaemonProc:
    """a waits between its fence and its rename of checkpoint-1; it is stopped (SIGSTOP, as a paused
    VM) and checkpoint-1 pinned meanwhile; b, another host (a FUSE mount of the volume), takes the
    lease; a runs again, still before its rename. Returns b."""
    a.wait_message("waiting at the fence before a rename")  # checkpoint-1 passed every check
    a.signal(signal.SIGSTOP)
    wait_stopped(a.proc.pid)
    (root / "job" / "checkpoint-1" / PIN_FILE).touch()
    b = DaemonProc("-c", node_config(tmp_path, "b", bindfs(root, tmp_path / "vol-b")))
    b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
    b.wait_message("decide keep job/checkpoint-1: pinned")
    a.signal(signal.SIGCONT)
    a.wait_message("volume lease lost")
    return b


def events(state_dir: Path) -> list[tuple[str, str]]:
    return [(r["event"], Path(r.get("path") or r.get("trash", "")).name) for r in read_journal(state_dir)]


def test_a_rename_made_after_the_lease_was_lost_is_moved_back(tmp_path, bindfs):
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = leader_that_waits(tmp_path, root, "before")
    b = None
    try:
        b = stopped_at_the_fence_while_another_node_takes_over(tmp_path, a, root, bindfs)
        go_on(tmp_path, "before")  # the late rename
        [back] = a.wait_message("without the lease")
        assert back["message"].startswith("job/checkpoint-1 was renamed into .ckptd-trash/ without the lease")
        assert back["message"].endswith(": moved back")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2"]
    assert (root / "job" / "checkpoint-1" / PIN_FILE).exists()
    assert os.listdir(root / TRASH_DIR) == []
    assert ("restored", "checkpoint-1") in events(tmp_path / "a")
    assert not any(e in ("trashed", "purged") for e, _ in events(tmp_path / "b"))


def test_a_late_rename_the_renamer_cannot_undo_is_re_checked_by_the_new_leader_and_moved_back(tmp_path, bindfs):
    """Held again just after the rename, before it could look at the lease: the entry sits in the
    trash, not the new leader's own. It waits the lease's duration + margin, is re-checked
    (pinned now) and goes back to its run instead of being purged."""
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = leader_that_waits(tmp_path, root, "before", "after")
    b = None
    try:
        b = stopped_at_the_fence_while_another_node_takes_over(tmp_path, a, root, bindfs)
        go_on(tmp_path, "before")
        a.wait_message("waiting at the fence after a rename")
        assert listing(root / "job") == ["checkpoint-2"]  # in the trash now, by a's late rename
        [back] = b.wait_message("(found in the trash pinned): moved back", timeout=60)
        assert back["message"].startswith("job/checkpoint-1 was renamed into .ckptd-trash/ without the lease")
        go_on(tmp_path, "after")
        a.wait_message("is no longer there: the leader that holds it now restored or purged it")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2"]
    assert (root / "job" / "checkpoint-1" / PIN_FILE).exists()
    assert os.listdir(root / TRASH_DIR) == []
    assert ("restored", "checkpoint-1") in events(tmp_path / "b")
    assert not any(e == "purged" for e, _ in events(tmp_path / "b"))
    # Not before it had been in the trash the lease's duration + margin: the late renamer's time.
    [trashing] = [r["time"] for r in read_journal(tmp_path / "a") if r["event"] == "trashing"]
    [restored] = [r["time"] for r in read_journal(tmp_path / "b") if r["event"] == "restored"]
    assert restored >= trashing + D + M


# --- the purge's rules, on the reaper itself ---------------------------------------------------

def foreign(volume: Path, reaper, plan, step: int) -> str:
    """Checkpoint-`step` moved into the trash as another process's reaper names it, not by this one."""
    c = next(d.checkpoint for d in plan.decisions if d.checkpoint.step == step)
    (volume / TRASH_DIR).mkdir(mode=0o700, exist_ok=True)
    name = trash._trash_name(c, reaper.clock())
    os.rename(c.path, volume / TRASH_DIR / name)
    return name


@pytest.fixture
def live(volume, tmp_path):
    """A reaper on the real clock (a trash entry's age is its ctime's), and its plan: the
    checkpoints saved an hour ago by that clock."""
    for i, step in enumerate((10, 20, 30, 40)):
        age(volume / "run" / f"checkpoint-{step}", time.time() - 3600 + i)
    scanner = Scanner(Root(path=volume, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    journal = Journal(tmp_path / "state")
    reaper = Reaper(scanner, journal, dry_run=False)
    yield reaper, decide([(scanner.root, scanner.runs(now=time.time()))])
    journal.close()


def test_another_process_s_entry_waits_before_it_is_purged(volume, live):
    reaper, plan = live
    entry = foreign(volume, reaper, plan, 10)
    reaper.foreign_wait = 3600
    assert reaper.purge() == (0, 0) and reaper.waiting == 1
    assert os.listdir(volume / TRASH_DIR) == [entry] and reaper.trash_pending()
    reaper.foreign_wait = 0
    assert reaper.purge()[0] == 1 and reaper.waiting == 0
    assert os.listdir(volume / TRASH_DIR) == [] and not reaper.trash_pending()


def test_its_own_entry_is_purged_at_once(volume, live):
    reaper, plan = live
    reaper.foreign_wait = 3600
    reaper.execute(plan.decisions)
    assert reaper.purge()[0] == 3 and os.listdir(volume / TRASH_DIR) == []


@pytest.mark.parametrize(("step", "protect", "why"), [
    (10, lambda ck: (ck / PIN_FILE).touch(), "pinned"),
    (40, lambda ck: None, "newer than every complete checkpoint left in its run (by step or by time)"),
])
def test_another_process_s_entry_that_is_protected_now_goes_back(volume, live, step, protect, why):
    reaper, plan = live
    ck = volume / "run" / f"checkpoint-{step}"
    protect(ck)
    entry = foreign(volume, reaper, plan, step)
    assert reaper.purge() == (0, 0)
    assert f"checkpoint-{step}" in names(volume) and os.listdir(volume / TRASH_DIR) == []
    assert entry not in os.listdir(volume / "run")
    last = read_journal(Path(reaper.journal.path).parent)[-1]
    assert last["event"] == "restored" and last["why"] == f"found in the trash {why}"


def test_an_entry_waits_while_the_newer_checkpoint_is_still_settling_here(volume, live):
    """A leader that has just taken over (its settler has not yet seen checkpoint-40 unchanged for
    the quiet period) finds checkpoint-30 in the trash, left by the previous leader stopped before
    its purge. Checkpoint-40 is not known complete yet, nor known not to be: the entry waits in the
    trash, neither moved back (a false "without the lease", and the new leader trashing it again)
    nor purged; once checkpoint-40 has settled, it is purged."""
    reaper, plan = live
    entry = foreign(volume, reaper, plan, 30)
    now = [0.0]
    settler = Settler(quiet_period=5.0)
    reaper.scanner = Scanner(reaper.scanner.root, quiet=lambda rel, fp, _ns: settler.observe(rel, fp, now[0]))
    reaper.foreign_wait = 0
    assert reaper.purge() == (0, 0) and reaper.waiting == 1
    assert os.listdir(volume / TRASH_DIR) == [entry] and "checkpoint-30" not in os.listdir(volume / "run")
    assert [r["event"] for r in read_journal(Path(reaper.journal.path).parent)] == []
    now[0] = 10.0  # checkpoint-40 unchanged for longer than the quiet period, by this settler
    assert reaper.purge()[0] == 1 and reaper.waiting == 0
    assert os.listdir(volume / TRASH_DIR) == [] and "checkpoint-30" not in os.listdir(volume / "run")
    assert [r["event"] for r in read_journal(Path(reaper.journal.path).parent)] == ["purging", "purged"]


def test_a_trash_name_says_where_it_came_from(volume, live):
    _reaper, plan = live
    c = plan.decisions[0].checkpoint
    name = trash._trash_name(c, 1.0)
    assert trash._trash_origin(name) == ("run/checkpoint-10", "")
    assert trash._trash_origin(f"{name}%slim") == ("run/checkpoint-10", "%slim")
    assert trash._trash_origin("1-aaaa-run%checkpoint-10") is None  # an older ckptd's: unknown
    assert trash._trash_origin("planted") is None
