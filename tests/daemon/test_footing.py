"""A deleter that loses its footing stops: the root's lock unlinked or replaced, the state_dir and
journal removed under a live daemon. It stops deleting there (the rename it was about to make is
refused by its fence), says so in the log, `status` and `health`, takes them again when it safely
can, and keeps a second deleter (`ckptd prune` with another state_dir) out throughout.

The real daemon and CLI as subprocesses; the pass held between two deletions by the reaper's seam
(tests/support/passhold.py); every wait on a log line or an event, with a timeout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.discover.layouts import LEASE_DIR
from ckptd.journal import JOURNAL_NAME, read_journal
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc, write_config
from tests.support.passhold import PassHold

EXTRA = "quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.3s'"
RETENTION = "keep_last = 1\nkeep_best = 0"


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith("."))


def trashed_by(state: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in read_journal(state):
        if r["event"] == "trashed":
            out.setdefault(r["pid"], []).append(Path(r["path"]).name)
    return out


def volume(tmp_path: Path, steps=(1, 2, 3, 4, 5, 6)) -> Path:
    root = tmp_path / "vol"
    for step in steps:
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    return root


def second_prune(tmp_path: Path, root: Path):
    """`ckptd prune` with a state_dir of its own: another deleter, as a user's cron would run it."""
    cfg = write_config(tmp_path / "other.toml", root, tmp_path / "other-state", root_extra=EXTRA, retention=RETENTION)
    return run_ckptd("prune", "-c", cfg)


def test_the_roots_lock_removed_mid_pass_keeps_a_second_deleter_out_and_the_daemon_retakes_it(tmp_path):
    root = volume(tmp_path)
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state, root_extra=EXTRA, retention=RETENTION)
    with PassHold(tmp_path / "hold.sock", hold_at=2) as hold, DaemonProc("-c", cfg, env=hold.env) as daemon:
        assert hold.wait_held() == "job/checkpoint-2"
        shutil.rmtree(root / LEASE_DIR)
        other = second_prune(tmp_path, root)
        assert other.returncode == 75, (other.returncode, other.stdout, other.stderr)
        assert "another ckptd is deleting in" in other.stderr
        mark = daemon.mark()
        hold.release()
        [refused] = daemon.wait_message("not deleting job/checkpoint-2", start=mark)
        # removed, and then made again by the prune that was kept out: another file
        assert "lost its footing" in refused["message"] and "local.lock, the lock this ckptd holds, was" in refused["message"]
        daemon.wait_message("stopped deleting here", start=mark)
        daemon.wait_message("took its lock and journal again", start=mark)
        daemon.wait_message("deleted job/checkpoint-5", start=mark)
        assert daemon.stop() == 0
    assert trashed_by(state) == {daemon.proc.pid: [f"checkpoint-{s}" for s in (1, 2, 3, 4, 5)]}
    assert trashed_by(tmp_path / "other-state") == {}
    assert listing(root / "job") == ["checkpoint-6"]


@pytest.mark.parametrize("removed", ["state_dir", "journal"])
def test_the_state_dir_removed_mid_pass_stops_deleting_until_a_new_journal_records_it(tmp_path, removed):
    root = volume(tmp_path)
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state, root_extra=EXTRA, retention=RETENTION)
    with PassHold(tmp_path / "hold.sock", hold_at=2) as hold, DaemonProc("-c", cfg, env=hold.env) as daemon:
        hold.wait_held()
        if removed == "state_dir":
            shutil.rmtree(state)
        else:  # the journal alone: its lock and the state file stay
            (state / JOURNAL_NAME).unlink()
        other = second_prune(tmp_path, root)
        assert other.returncode == 75, (other.returncode, other.stdout, other.stderr)
        mark = daemon.mark()
        hold.release()
        [refused] = daemon.wait_message("not deleting job/checkpoint-2", start=mark)
        assert "lost its footing" in refused["message"]
        [stopped] = daemon.wait_message("stopped deleting here", start=mark)
        gone = state if removed == "state_dir" else state / JOURNAL_NAME
        assert str(gone) in stopped["message"] and "was removed" in stopped["message"]
        daemon.wait_message("took its lock and journal again", start=mark)
        done = daemon.wait_message("deleted job/checkpoint-5", start=mark)[0]
        daemon.wait_message("state written", start=daemon.lines.index(done))
        status = run_ckptd("status", "-c", cfg, "--json")  # the daemon is seen again
        assert status.returncode == 0 and json.loads(status.stdout)[0]["pid"] == daemon.proc.pid
        assert daemon.stop() == 0
    # Every deletion after the loss is in the new journal, which says the old one was lost.
    records = read_journal(state)
    assert records[0]["event"] == "journal-reopened" and str(gone) in records[0]["why"]
    assert trashed_by(state) == {daemon.proc.pid: [f"checkpoint-{s}" for s in (2, 3, 4, 5)]}
    assert listing(root / "job") == ["checkpoint-6"]


def test_a_lock_it_cannot_take_again_keeps_it_stopped_and_unhealthy_until_it_can(tmp_path):
    root = volume(tmp_path, steps=(1, 2))
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state, root_extra=EXTRA, retention=RETENTION)
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("deleted job/checkpoint-1")
        mark = daemon.mark()
        shutil.rmtree(root / LEASE_DIR)
        (root / LEASE_DIR).write_text("not a directory")  # local.lock cannot be made again
        [stopped] = daemon.wait_message("stopped deleting here", start=mark)
        assert f"{root / LEASE_DIR / 'local.lock'}, the lock this ckptd holds, was removed" in stopped["message"]
        blocked = daemon.wait_message("still deleting nothing: cannot take its lock and journal again", start=mark)[0]
        hf_deepspeed_checkpoint(root / "job", 3, world=2)  # checkpoint-2 is now outside keep_last=1
        daemon.wait_message("state written", start=daemon.lines.index(blocked) + 1)
        [doc] = json.loads(run_ckptd("status", "-c", cfg, "--json").stdout)
        assert doc["roots"][0]["role"] == "stopped" and "was removed" in doc["roots"][0]["lost_footing"]
        health = run_ckptd("health", "-c", cfg)
        assert health.returncode == 1 and f"stopped deleting in {root}: " in health.stdout, health.stdout
        assert "stopped: leads but deletes nothing" in run_ckptd("status", "-c", cfg).stdout
        other = second_prune(tmp_path, root)  # the root directory's own lock still keeps it out
        assert other.returncode == 75, (other.returncode, other.stdout, other.stderr)
        assert listing(root / "job") == ["checkpoint-2", "checkpoint-3"]

        mark = daemon.mark()
        (root / LEASE_DIR).unlink()
        daemon.wait_message("took its lock and journal again", start=mark)
        done = daemon.wait_message("deleted job/checkpoint-2", start=mark)[0]
        daemon.wait_message("state written", start=daemon.lines.index(done))
        health = run_ckptd("health", "-c", cfg)
        assert health.returncode == 0, health.stdout
        assert daemon.stop() == 0
    assert listing(root / "job") == ["checkpoint-3"]
    assert trashed_by(state) == {daemon.proc.pid: ["checkpoint-1", "checkpoint-2"]}
