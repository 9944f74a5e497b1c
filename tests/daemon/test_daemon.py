"""`ckptd run` end to end: the real daemon process, real inotify, real files.

Every wait is on the daemon's own log lines (JSON, parsed) or on a writer
process's exit, each with a timeout; nothing waits by sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import format_size
from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import read_journal
from tests.support.common import REPO, run_ckptd
from tests.support.daemonproc import DaemonProc, write_config

SIMTRAIN = REPO / "tests" / "support" / "simtrain.py"
MODES = {
    "inotify": "observer = 'inotify'\npoll_interval = '10s'",
    # polling only: no inotify at all, so every completion is found by the targeted poller
    "polling": "observer = 'polling'\npoll_interval = '0.3s'",
}


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith("."))


def simtrain(run: Path, steps: list[int], **kw) -> subprocess.Popen[str]:
    args = [sys.executable, str(SIMTRAIN), str(run), "--steps", *map(str, steps)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("mode", ["inotify", "polling"])
def test_the_seeds_race_under_the_daemon(tmp_path, mode):
    """Ranks write shards in place, staggered, `latest` and trainer_state.json first, a slow
    rank seconds after the rest; the best checkpoint is the oldest; keep_last=1, keep_best=1.
    Nothing is removed under a writer, and the end state is exactly the policy's."""
    root = tmp_path / "vol"
    run = root / "job"
    run.mkdir(parents=True)
    cfg = write_config(
        tmp_path / "c.toml", root, tmp_path / "state",
        root_extra=f"quiet_period = '0.6s'\nallow_short_quiet_period = true\nworld_size = 4\n{MODES[mode]}",
        retention="keep_last = 1\nkeep_best = 1\nmetric = 'eval_loss'",
    )
    steps = [10, 20, 30, 40, 50, 60]
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        job = simtrain(run, steps, world=4, slow_rank=3, slow_delay=1.5, train_time=0.2)
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0
        result = json.loads(out)
        assert result["violations"] == []
        # every checkpoint but the best (10) and the newest (60) goes, once the last one completes
        daemon.wait_for(lambda line: line.get("message", "").startswith("deleted "), count=len(steps) - 2,
                        timeout=60)
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-60" and line.get("state") == "complete")
        assert listing(run) == ["checkpoint-10", "checkpoint-60"]
    trashed = [r for r in read_journal(tmp_path / "state") if r["event"] == "trashed"]
    assert sorted(Path(r["path"]).name for r in trashed) == ["checkpoint-20", "checkpoint-30", "checkpoint-40",
                                                             "checkpoint-50"]
    # never the newest complete: each deletion happened after a newer checkpoint had completed
    done_at = {s["step"]: s["done_at"] for s in result["saves"]}
    for r in trashed:
        assert any(done_at[s] < r["time"] for s in steps if s > r["step"]), r


def test_polling_notices_a_checkpoint_written_with_no_inotify(tmp_path):
    root = tmp_path / "vol"
    (root / "job").mkdir(parents=True)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra=f"quiet_period = '0.3s'\nallow_short_quiet_period = true\nworld_size = 2\n{MODES['polling']}",
                       retention="keep_last = 1\nkeep_best = 0")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        assert any("observer=polling (configured)" in line["message"] for line in daemon.lines)
        job = simtrain(root / "job", [1, 2], world=2, train_time=0)
        job.communicate(timeout=60)
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-2" and line.get("state") == "complete")
        daemon.wait_message("deleted job/checkpoint-1")
    assert listing(root / "job") == ["checkpoint-2"]


def test_dry_run_decides_and_deletes_nothing(tmp_path):
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2", retention="keep_last = 1\nkeep_best = 0")
    with DaemonProc("-c", cfg, "--dry-run") as daemon:
        lines = daemon.wait_message("decide delete", count=2)
        assert all(line["message"].endswith("(dry run; not actually removing anything)") for line in lines)
    assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not (root / TRASH_DIR).exists()


def test_reload_applies_a_valid_config_and_keeps_the_old_on_an_invalid_one(tmp_path):
    root = tmp_path / "vol"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    extra = "quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2"
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra=extra,
                       retention="keep_last = 3\nkeep_best = 0")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("deleted job/checkpoint-1")
        cfg.write_text(cfg.read_text().replace("keep_last = 3", "keep_last = 1"))
        daemon.signal(signal.SIGHUP)
        daemon.wait_message("reloaded")
        daemon.wait_message("deleted job/checkpoint-3")
        assert listing(root / "job") == ["checkpoint-4"]
        mark = daemon.mark()
        cfg.write_text(cfg.read_text().replace("keep_last = 1", "keep_last = -1"))
        daemon.signal(signal.SIGHUP)
        [line] = daemon.wait_message("reload failed", start=mark)
        assert "roots[0].retention.keep_last: must be >= 0 (got -1)" in line["message"]
        hf_deepspeed_checkpoint(root / "job", 5, world=2)  # still working, with the old config
        daemon.wait_message("deleted job/checkpoint-4", start=mark)
        assert daemon.proc.poll() is None
    assert listing(root / "job") == ["checkpoint-5"]


def test_a_reload_leaves_no_thread_behind(tmp_path):
    """The config is read again on the filesystem thread: a SIGHUP starts no thread that stays (asyncio's
    default executor would, for the daemon's life). Counted once a save's events went through every one
    of watchdog's threads, and again after two reloads."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    extra = "quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2"
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra=extra,
                       retention="keep_last = 5\nkeep_best = 0")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        hf_deepspeed_checkpoint(root / "job", 2, world=2)
        complete = {"checkpoint": "checkpoint-2", "state": "complete"}
        daemon.wait_for(lambda line: complete.items() <= line.items())  # through every watchdog thread
        threads = len(os.listdir(f"/proc/{daemon.proc.pid}/task"))
        for count in (1, 2):
            daemon.signal(signal.SIGHUP)
            daemon.wait_message("reloaded", count=count)
        assert len(os.listdir(f"/proc/{daemon.proc.pid}/task")) == threads


def test_sigterm_during_a_purge_then_restart_finishes_it(tmp_path):
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    trash = root / TRASH_DIR
    entries = 300
    for i in range(entries):  # what a crash left behind: many entries, each with many files
        d = trash / f"1700000000-{i:04d}-job%2Fcheckpoint-x{i}%purging"  # a purge's, begun: removed
        d.mkdir(parents=True)
        for j in range(50):
            (d / f"f{j}").write_bytes(b"x")
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="world_size = 2")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("purged ", timeout=60)  # the first trash entry is gone: a purge is under way
        assert daemon.stop() == 0
    # Purging stops between entries (the stop flag is unit-tested in test_reaper.py); how far it
    # got before SIGTERM arrived depends on the machine, so `left` may be 0 on a fast one.
    left = len(os.listdir(trash))
    assert left < entries
    with DaemonProc("-c", cfg) as daemon:
        if left:
            daemon.wait_message("trash entries", timeout=60)
    assert os.listdir(trash) == []
    purged = [r for r in read_journal(tmp_path / "state") if r["event"] == "purged"]
    assert len(purged) == entries


def test_two_daemons_on_one_root_only_one_deletes_and_the_other_takes_over(tmp_path):
    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.3s'",
                       retention="keep_last = 1\nkeep_best = 0")
    first = DaemonProc("-c", cfg)
    second = None
    try:
        first.wait_message("this ckptd deletes here")
        first.wait_message("deleted job/checkpoint-1")
        second = DaemonProc("-c", cfg)
        second.wait_message("standby, observing only")
        hf_deepspeed_checkpoint(root / "job", 3, world=2)
        first.wait_message("deleted job/checkpoint-2")
        assert first.stop() == 0
        second.wait_message("this ckptd deletes here")
        hf_deepspeed_checkpoint(root / "job", 4, world=2)
        second.wait_message("deleted job/checkpoint-3")
    finally:
        first.stop()
        if second is not None:
            second.stop()
    by_pid: dict[int, list[str]] = {}
    for r in read_journal(tmp_path / "state"):
        if r["event"] == "trashed":
            by_pid.setdefault(r["pid"], []).append(Path(r["path"]).name)
    assert by_pid == {first.proc.pid: ["checkpoint-1", "checkpoint-2"], second.proc.pid: ["checkpoint-3"]}
    assert listing(root / "job") == ["checkpoint-4"]


def test_systemd_notify_protocol(tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra="world_size = 2")

    def expect(field: str) -> str:
        while True:
            msg = sock.recv(4096).decode()
            if field in msg.split("\n"):
                return msg

    try:
        with DaemonProc("-c", cfg, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"}) as daemon:
            ready = expect("READY=1")
            assert "STATUS=1 runs; checkpoints: 1 settling" in ready
            expect("WATCHDOG=1")
            expect("WATCHDOG=1")
            daemon.signal(signal.SIGHUP)
            expect("RELOADING=1")
            expect("READY=1")
            daemon.signal(signal.SIGTERM)
            expect("STOPPING=1")
            assert daemon.proc.wait(timeout=30) == 0
    finally:
        sock.close()


def test_status_shows_what_the_daemon_sees(tmp_path):
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "job", 1, world=2)
    hf_deepspeed_checkpoint(root / "job", 2, world=2, skip={"zero_pp_rank_1_mp_rank_00_optim_states.pt"})
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-2" and "incomplete" in line["message"])
        done = daemon.wait_for(
            lambda line: line.get("checkpoint") == "checkpoint-1" and line.get("state") == "complete"
        )[-1]
        daemon.wait_message("state written", start=daemon.lines.index(done))
        proc = run_ckptd("status", "-c", cfg, "--json")
        assert proc.returncode == 0, proc.stderr
        [doc] = json.loads(proc.stdout)
        assert doc["pid"] == daemon.proc.pid
        [r] = doc["roots"]
        assert r["leader"] and r["observer"] in ("inotify", "polling")
        states = {c["name"]: c["state"] for c in r["runs"][0]["checkpoints"]}
        assert states == {"checkpoint-1": "complete", "checkpoint-2": "incomplete"}
        text = run_ckptd("status", "-c", cfg)
        rows = [line.split()[:5] for line in text.stdout.splitlines()]
        # The size as the disk counts it (space.py: allocated blocks, each inode once), as `du` would
        ckpt = root / "job" / "checkpoint-2"
        inodes = {(s.st_dev, s.st_ino): s.st_blocks * 512 for s in map(os.lstat, [ckpt, *ckpt.rglob("*")])}
        size = format_size(sum(inodes.values()))
        assert ["job", "checkpoint-2", "incomplete", size, "keep"] in rows, text.stdout
    assert run_ckptd("status", "-c", cfg).returncode == 1  # the state file goes with the daemon


@pytest.mark.parametrize(
    ("config_text", "code"),
    [("[[roots]]\npath = 'relative'\n", 78), ("[[roots]]\npath = '/definitely/not/here'\n", 66)],
)
def test_the_daemon_refuses_to_start_on_a_bad_config_or_missing_root(tmp_path, config_text, code):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n{config_text}")
    proc = run_ckptd("run", "-c", cfg, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_with_a_future_mtime_does_not_complete_under_the_daemon(tmp_path):
    """`plan` called a future mtime 'writing', but the daemon settled it anyway (its
    fingerprint did not change). A writer whose clock runs an hour ahead saves checkpoint-20:
    with keep_last=1 the daemon deleted checkpoint-10, the last one written on a sane clock, and
    kept one it cannot yet tell is finished. Now it waits for the clock, and deletes nothing."""
    import time

    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 10, world=2, mtime=time.time() - 3600)
    cfg = write_config(
        tmp_path / "c.toml", root, tmp_path / "state",
        root_extra="quiet_period = '0s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.2s'",
        retention="keep_last = 1\nkeep_best = 0",
    )
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        mark = daemon.mark()
        hf_deepspeed_checkpoint(root / "run", 20, world=2, mtime=time.time() + 3600)
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-20" and line.get("state") == "writing",
                        start=mark)
        hf_deepspeed_checkpoint(root / "run", 30, world=2)  # a sane one after it: retention runs
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-30" and line.get("state") == "complete",
                        start=mark)
        deleted = daemon.wait_message("deleted run/checkpoint-10", start=mark)[-1]
        # A state file written after the deletion: the one before it may predate checkpoint-20.
        daemon.wait_message("state written", start=daemon.lines.index(deleted))
        status = json.loads(run_ckptd("status", "--json", "-c", cfg).stdout)
    states = {c["name"]: c["state"] for c in status[0]["roots"][0]["runs"][0]["checkpoints"]}
    assert states["checkpoint-20"] == "writing"
    assert listing(root / "run") == ["checkpoint-20", "checkpoint-30"]


def test_a_reload_that_adds_a_checkpoint_as_a_root_is_refused_and_the_old_config_kept(tmp_path):
    """`ckptd run` refuses at start a root that is a checkpoint (cli preflight); a reload that adds
    one is refused the same way, the old config kept and nothing inside the checkpoint touched."""
    root, other = tmp_path / "vol", tmp_path / "vol2"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    hf_deepspeed_checkpoint(other / "job", 7, world=2)
    inside = other / "job" / "checkpoint-7"
    before = sorted(str(p.relative_to(inside)) for p in inside.rglob("*"))
    extra = "quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2"
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra=extra,
                       retention="keep_last = 1\nkeep_best = 0")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("deleted job/checkpoint-1")
        mark = daemon.mark()
        with cfg.open("a") as f:
            f.write(f"\n[[roots]]\npath = '{inside}'\n{extra}\n[roots.retention]\nkeep_last = 1\n")
        daemon.signal(signal.SIGHUP)
        [line] = daemon.wait_message("reload failed", start=mark)
        assert f"{inside} is a checkpoint: name its run or a directory above it" in line["message"], line
        hf_deepspeed_checkpoint(root / "job", 3, world=2)  # still working, with the old config
        daemon.wait_message("deleted job/checkpoint-2", start=mark)
        assert daemon.proc.poll() is None
    assert sorted(str(p.relative_to(inside)) for p in inside.rglob("*")) == before
