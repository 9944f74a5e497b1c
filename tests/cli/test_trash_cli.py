"""`ckptd trash list|restore|purge` as a subprocess, after a real `ckptd prune` with the default
trash_grace (the suite's CKPTD_TRASH_GRACE=0 removed for every call here)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.journal import read_journal
from tests.support.common import in_trash
from tests.support.common import run_ckptd as _run

DEFAULT = {"CKPTD_TRASH_GRACE": ""}  # unset: the config's trash_grace, default 15m


def ckptd(*args):
    return _run(*args, env=DEFAULT)


def pruned(tmp_path: Path) -> tuple[Path, Path]:
    """Four checkpoints, keep_last=1, pruned: three wait in the trash. (config, root)"""
    root = tmp_path / "vol"
    old = time.time() - 86400
    for i, step in enumerate((10, 20, 30, 40)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "quiet_period = '0s'\nallow_short_quiet_period = true\nworld_size = 2\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-40"]
    return cfg, root


def test_list_says_what_waits_from_where_why_and_until_when(tmp_path):
    cfg, root = pruned(tmp_path)
    proc = ckptd("trash", "list", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    entries = doc["entries"]
    assert sorted(e["origin"] for e in entries) == ["run/checkpoint-10", "run/checkpoint-20", "run/checkpoint-30"]
    for e in entries:
        assert e["kind"] == "checkpoint" and e["reasons"] == ["outside keep_last=1"]
        assert e["bytes"] > 0 and 14 * 60 < e["purge_after"] - time.time() <= 15 * 60
    assert doc["bytes"] == sum(e["bytes"] for e in entries)
    text = ckptd("trash", "list", "-c", cfg).stdout
    assert f"from {root}/run/checkpoint-10 (checkpoint," in text and "why: outside keep_last=1" in text
    assert "3 in the trash" in text


def test_restore_by_the_path_it_came_from_puts_it_back_pinned(tmp_path):
    cfg, root = pruned(tmp_path)
    proc = ckptd("trash", "restore", "-c", cfg, "run/checkpoint-20")
    assert proc.returncode == 0, proc.stderr
    assert f"restored {root}/run/checkpoint-20 and pinned" in proc.stdout
    assert (root / "run" / "checkpoint-20" / PIN_FILE).exists()
    assert len(in_trash(root / TRASH_DIR)) == 2
    # Pinned: the next prune keeps it; the next purge (forced) takes the other two only.
    assert ckptd("prune", "-c", cfg).returncode == 0
    proc = ckptd("trash", "purge", "--now", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert f"{root}: purged 2" in proc.stdout
    assert sorted(os.listdir(root / "run")) == ["checkpoint-20", "checkpoint-40"]
    assert os.listdir(root / TRASH_DIR) == []
    restored = [r for r in read_journal(tmp_path / "state") if r["event"] == "restored"]
    assert len(restored) == 1 and restored[0]["why"] == "restored by hand (ckptd trash restore)"


def test_restore_all_beside_what_took_the_name_and_unpinned(tmp_path):
    cfg, root = pruned(tmp_path)
    (root / "run" / "checkpoint-10").mkdir()  # the name taken since
    proc = ckptd("trash", "restore", "-c", cfg, "--all", "--no-pin")
    assert proc.returncode == 0, proc.stderr
    names = sorted(os.listdir(root / "run"))
    assert names[:1] == ["checkpoint-10"] and names[1].startswith("checkpoint-10.ckptd-restored-")
    assert names[2:] == ["checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert os.listdir(root / "run" / "checkpoint-10") == []
    assert not any((root / "run" / n / PIN_FILE).exists() for n in names)
    assert os.listdir(root / TRASH_DIR) == []


def test_restore_of_what_is_not_there_says_so(tmp_path):
    cfg, _ = pruned(tmp_path)
    proc = ckptd("trash", "restore", "-c", cfg, "run/checkpoint-40")
    assert proc.returncode == 66
    assert "nothing in the trash is 'run/checkpoint-40'" in proc.stderr
    assert ckptd("trash", "restore", "-c", cfg).returncode == 64


def test_purge_without_now_waits_for_the_grace(tmp_path):
    cfg, root = pruned(tmp_path)
    proc = ckptd("trash", "purge", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert f"{root}: purged 0 (0B), 3 wait" in proc.stdout
    assert len(in_trash(root / TRASH_DIR)) == 3


def test_status_shows_the_trash_of_a_running_daemon(tmp_path):
    """The daemon deletes with the default grace: `status` says what waits and when it goes."""
    from tests.support.daemonproc import DaemonProc

    root = tmp_path / "vol"
    old = time.time() - 86400
    for i, step in enumerate((10, 20, 30)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "quiet_period = '0s'\nallow_short_quiet_period = true\nworld_size = 2\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    daemon = DaemonProc("-c", cfg, env=DEFAULT)
    try:
        daemon.wait_message("ready", timeout=60)
        daemon.wait_message("deleted run/checkpoint-20")
        daemon.wait_message("state written", start=len(daemon.lines) - 1)
        proc = ckptd("status", "-c", cfg)
        assert proc.returncode == 0, proc.stderr
        assert "trash: 2 entries (" in proc.stdout and "next purge in 1" in proc.stdout, proc.stdout
        assert len(in_trash(root / TRASH_DIR)) == 2
    finally:
        daemon.stop()


def test_plan_says_what_waits_in_the_trash(tmp_path):
    cfg, root = pruned(tmp_path)
    proc = ckptd("plan", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert f"trash: 3 deleted earlier wait in {root}/.ckptd-trash (" in proc.stdout
    doc = json.loads(ckptd("plan", "-c", cfg, "--json").stdout)
    assert doc["trash"][str(root)]["entries"] == 3 and doc["trash"][str(root)]["bytes"] > 0
