"""The purge as the second phase (removal/purge.py): a deleted checkpoint waits `trash_grace` in the
trash (sooner where min_free needs the space), then is judged again, afresh and under the config in
force then, and goes back to its run where it must: a pin since (the config's, or a `.ckptd-keep`
at any depth), contents other than its decision saw (a writer that still held a file open), its
run's newest gone meanwhile; held for review where its run was replaced; beside its origin where
that name is taken. Real files, real processes; the clock of the grace is the reaper's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.journal import Journal, read_journal
from ckptd.removal import purge as purge_module
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import in_trash, run_ckptd
from tests.support.volumes import NOW, names
from tests.support.volumes import volume as volume

MiB = 1024 * 1024


def graced(root: Path, tmp_path: Path, grace: float, clock: list[float], **retention: object):
    """A reaper of `root` (keep_last=1 unless said) whose trash_grace is `grace`, on `clock`."""
    kept = {"keep_last": 1, "keep_best": 0, **retention}
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(**kept)))
    journal = Journal(tmp_path / "state")
    reaper = Reaper(scanner, journal, dry_run=False, clock=lambda: clock[0], trash_grace=grace)
    plan = decide([(scanner.root, scanner.runs(now=clock[0]))])
    return reaper, plan, journal


def test_a_deleted_checkpoint_waits_trash_grace_then_is_purged(volume, tmp_path):
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 600, clock)
    assert [r.outcome for r in reaper.execute(plan.decisions)] == [Outcome.TRASHED] * 3
    assert reaper.purge() == (0, 0) and reaper.waiting == 3
    assert not reaper.trash_pending()  # the daemon's poll: nothing due yet
    clock[0] += 599
    assert reaper.purge() == (0, 0) and len(in_trash(volume / TRASH_DIR)) == 3
    clock[0] += 2
    assert reaper.trash_pending()
    assert reaper.purge()[0] == 3 and os.listdir(volume / TRASH_DIR) == []
    assert names(volume) == ["checkpoint-40"]
    journal.close()


def test_a_restarted_ckptd_waits_the_grace_from_when_the_entry_came_in(tmp_path):
    """Another process (or this one before a restart) put it there: the grace counts from the
    rename (its ctime), not from this process's start."""
    root = tmp_path / "vol"
    _volume(root)
    reaper, plan, journal = graced(root, tmp_path, 600, [time.time()])
    assert [r.outcome for r in reaper.execute(plan.decisions)] == [Outcome.TRASHED] * 3
    later, _, _ = graced(root, tmp_path, 600, [time.time() + 10])
    assert later.purge() == (0, 0) and later.waiting == 3
    after, _, _ = graced(root, tmp_path, 600, [time.time() + 601])
    assert after.purge()[0] == 3
    journal.close()


def test_a_pin_written_deep_inside_while_it_waits_brings_it_back(volume, tmp_path):
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 60, clock)
    reaper.execute(plan.decisions)
    [entry] = [n for n in in_trash(volume / TRASH_DIR) if "checkpoint-20" in n]
    subprocess.run(["touch", volume / TRASH_DIR / entry / "global_step20" / PIN_FILE], check=True)
    clock[0] += 61
    assert reaper.purge()[0] == 2
    assert names(volume) == ["checkpoint-20", "checkpoint-40"]
    assert (volume / "run" / "checkpoint-20" / "global_step20" / PIN_FILE).exists()
    journal.close()
    [restored] = [r for r in read_journal(tmp_path / "state") if r["event"] == "restored"]
    assert restored["path"].endswith("checkpoint-20") and "pinned" in restored["why"]


def test_a_pin_added_to_the_config_before_the_purge_brings_it_back(volume, tmp_path):
    """The operator pins run/checkpoint-10 and reloads while it waits: the purge judges it under
    the config in force then (the daemon's reload makes a new reaper from the new config)."""
    reaper, plan, journal = graced(volume, tmp_path, 60, [NOW])
    reaper.execute(plan.decisions)
    reloaded, _, _ = graced(volume, tmp_path, 60, [NOW + 61], pins=("run/checkpoint-10",))
    assert reloaded.purge()[0] == 2
    assert names(volume) == ["checkpoint-10", "checkpoint-40"]
    journal.close()


def test_what_a_writer_wrote_into_it_after_the_rename_brings_it_back(volume, tmp_path):
    """A resumed job that opened its file before the rename writes on through its descriptor: the
    checkpoint in the trash is not what the decision saw, and it goes back, with the write."""
    victim = volume / "run" / "checkpoint-30" / "trainer_state.json"
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'a'); print('open', flush=True); "
         "sys.stdin.readline(); f.write(' '); f.close()", str(victim)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        clock = [NOW]
        reaper, plan, journal = graced(volume, tmp_path, 60, clock)
        assert [r.outcome for r in reaper.execute(plan.decisions)] == [Outcome.TRASHED] * 3
        writer.communicate("go\n", timeout=60)
    finally:
        writer.kill()
    clock[0] += 61
    assert reaper.purge()[0] == 2
    assert names(volume) == ["checkpoint-30", "checkpoint-40"]
    assert victim.read_text().endswith(" ")
    journal.close()
    [restored] = [r for r in read_journal(tmp_path / "state") if r["event"] == "restored"]
    assert "changed since it was trashed (written trainer_state.json)" in restored["why"]


def test_the_runs_newest_gone_meanwhile_brings_them_back(volume, tmp_path):
    """checkpoint-40 removed by hand while the others wait: purging them would leave the run with
    nothing to resume from. They go back (the next pass decides again)."""
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 60, clock)
    reaper.execute(plan.decisions)
    shutil.rmtree(volume / "run" / "checkpoint-40")
    clock[0] += 61
    count, _ = reaper.purge()
    # Judged one by one, in the trash's order: checkpoint-30 goes back (nothing newer left); 10 and
    # 20 are purged if judged after it, or went back if judged before it.
    assert "checkpoint-30" in names(volume)
    assert len(names(volume)) == 3 - count
    journal.close()


def test_a_run_replaced_meanwhile_is_never_given_another_runs_checkpoint(volume, tmp_path):
    """The run moved away and a new one made under its name: the entry's record names another
    directory. Neither purged (it may be wanted) nor put into a run it did not come from: held."""
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 60, clock)
    reaper.execute(plan.decisions)
    os.rename(volume / "run", tmp_path / "old-run")
    (volume / "run").mkdir()
    subprocess.run(["touch", volume / "run" / f"checkpoint-20{PIN_FILE}"], check=True)  # a reason to go back
    clock[0] += 61
    assert reaper.purge() == (0, 0)
    assert sorted(os.listdir(volume / "run")) == [f"checkpoint-20{PIN_FILE}"]
    held = [n for n in os.listdir(volume / TRASH_DIR) if n.endswith("%review")]
    assert len(held) == 3  # none put into the new run
    journal.close()


def test_restored_beside_its_origin_when_that_name_is_taken(volume, tmp_path):
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 60, clock)
    reaper.execute(plan.decisions)
    [entry] = [n for n in in_trash(volume / TRASH_DIR) if "checkpoint-10" in n]
    (volume / TRASH_DIR / entry / PIN_FILE).touch()
    (volume / "run" / "checkpoint-10").mkdir()  # a new save of that step
    clock[0] += 61
    reaper.purge()
    beside = [n for n in names(volume) if n.startswith("checkpoint-10.ckptd-restored-")]
    assert len(beside) == 1 and (volume / "run" / beside[0] / PIN_FILE).exists()
    assert os.listdir(volume / "run" / "checkpoint-10") == []
    journal.close()


def test_a_purge_killed_halfway_is_finished_not_restored(volume, tmp_path, monkeypatch):
    """What a purge removed of an entry is not a change to undo: the entry is renamed
    `%purging` before its removal begins, and a later purge finishes it."""
    clock = [NOW]
    reaper, plan, journal = graced(volume, tmp_path, 0, clock)
    reaper.execute(plan.decisions)
    real = purge_module._remove_at

    def dies_halfway(name: str, dir_fd: int) -> None:
        os.unlink(f"{name}/config.json", dir_fd=dir_fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(purge_module, "_remove_at", dies_halfway)
    assert reaper.purge() == (0, 0)
    assert all(n.endswith("%purging") for n in in_trash(volume / TRASH_DIR))
    monkeypatch.setattr(purge_module, "_remove_at", real)
    again, _, _ = graced(volume, tmp_path, 0, clock)
    assert again.purge()[0] == 3
    assert names(volume) == ["checkpoint-40"] and os.listdir(volume / TRASH_DIR) == []
    journal.close()


# --- The CLI, with the default grace (the suite's CKPTD_TRASH_GRACE=0 removed) -------------------


def _volume(root: Path) -> None:
    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint

    old = time.time() - 86400
    for i, step in enumerate((10, 20, 30, 40)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i, shard_size=4 * MiB)


def _config(tmp_path: Path, root: Path, retention: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                    f"quiet_period = '0s'\nallow_short_quiet_period = true\nworld_size = 2\n"
                    f"[roots.retention]\n{retention}\n")
    return path


def test_prune_leaves_what_it_deleted_in_the_trash_for_the_grace(tmp_path):
    root = tmp_path / "vol"
    _volume(root)
    cfg = _config(tmp_path, root, "keep_last = 1\nkeep_best = 0")
    proc = run_ckptd("prune", "-c", cfg, env={"CKPTD_TRASH_GRACE": ""})
    assert proc.returncode == 0, proc.stderr
    assert names(root) == ["checkpoint-40"]
    assert len(in_trash(root / TRASH_DIR)) == 3
    assert "3 deleted" in proc.stdout and "in the trash for 15m" in proc.stdout, proc.stdout


@pytest.mark.mounts
def test_min_free_takes_the_space_at_once_whatever_the_grace(tmp_path, mount):
    """A tmpfs below its min_free: what prune deleted for it is purged at once, judged again
    first; the grace would leave the disk as full as before."""
    vol = tmp_path / "vol"
    vol.mkdir()
    mount("-t", "tmpfs", "-o", "size=96m", "tmpfs", vol)
    _volume(vol)
    st = os.statvfs(vol)
    fd = os.open(vol / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - 8 * MiB)
    finally:
        os.close(fd)
    cfg = _config(tmp_path, vol, "keep_last = 5\nkeep_best = 0\nmin_free = '24MiB'")
    proc = run_ckptd("prune", "-c", cfg, env={"CKPTD_TRASH_GRACE": ""})
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint-40" in names(vol) and len(names(vol)) < 4
    assert in_trash(vol / TRASH_DIR) == []
    assert os.statvfs(vol).f_bavail * os.statvfs(vol).f_frsize >= 24 * MiB


def test_the_daemon_purges_once_the_grace_is_over_without_another_pass(tmp_path):
    """Nothing else happens in the root after the deletions: the daemon's poll sees the grace over
    (`Purging.trash_pending`) and purges, judged again first."""
    from tests.support.daemonproc import DaemonProc

    root = tmp_path / "vol"
    _volume(root)
    cfg = _config(tmp_path, root, "keep_last = 1\nkeep_best = 0").read_text()
    cfg = cfg.replace("world_size = 2\n", "world_size = 2\npoll_interval = '0.5s'\ntrash_grace = '5s'\n")
    (tmp_path / "ckptd.toml").write_text(cfg)
    daemon = DaemonProc("-c", tmp_path / "ckptd.toml", env={"CKPTD_TRASH_GRACE": ""})
    try:
        daemon.wait_message("ready", timeout=60)
        [deleted] = daemon.wait_message("deleted run/checkpoint-30")
        assert len(in_trash(root / TRASH_DIR)) >= 1  # waiting: the grace is 5 s
        [purged] = daemon.wait_message("trash entries", start=daemon.lines.index(deleted), timeout=60)
        assert purged["message"].startswith(f"{root}: purged ")
    finally:
        daemon.stop()
    assert names(root) == ["checkpoint-40"] and os.listdir(root / TRASH_DIR) == []
