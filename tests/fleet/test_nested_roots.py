"""Nested roots: a ckptd whose root is a parent (or a child) of a live ckptd's root does not delete in
that ckptd's territory. The daemon and `ckptd prune` are real subprocesses, on a real filesystem."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc

OLD = time.time() - 86400  # a day ago: every quiet period is over
PATTERN = "patterns = [{name = 'ckpt_{step}', require = ['DONE']}]"


def _checkpoints(run: Path, steps=(1, 2, 3, 4)) -> None:
    for step in steps:
        c = run / f"ckpt_{step}"
        c.mkdir(parents=True)
        (c / "w.txt").write_bytes(os.urandom(1000))
        (c / "DONE").write_text("ok")
        for p in (c / "w.txt", c / "DONE", c):
            os.utime(p, (OLD + step, OLD + step))


def _config(path: Path, root: Path, state_dir: Path, *, keep_last: int, retention: str = "") -> Path:
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '5s'\nallow_short_quiet_period = true\n{PATTERN}\n"
        f"[roots.retention]\nkeep_last = {keep_last}\nkeep_best = 0\n{retention}\n"
    )
    return path


def test_a_prune_of_the_parent_directory_leaves_a_live_daemons_root_alone(tmp_path):
    """A daemon leads X/root and pins run/ckpt_2 in its own config. A `ckptd prune` rooted at X (the
    parent, its own state_dir) took no lock of the daemon's (one lock per root path): it trashed
    root/run/ckpt_1..3, the pinned one among them, into X/.ckptd-trash, which the daemon's `trash
    list` does not show. Now X/root, holding `.ckptd/`, is another ckptd's root: the prune says so,
    and prunes only what is its own (X/mine)."""
    parent = tmp_path / "X"
    _checkpoints(parent / "root" / "run")
    _checkpoints(parent / "mine", steps=(1, 2, 3))
    daemon_cfg = _config(tmp_path / "daemon.toml", parent / "root", tmp_path / "state-daemon", keep_last=10,
                         retention="pins = ['run/ckpt_2']")
    prune_cfg = _config(tmp_path / "parent.toml", parent, tmp_path / "state-parent", keep_last=1)
    with DaemonProc("-c", daemon_cfg) as daemon:
        daemon.wait_message("this ckptd deletes here", timeout=60)
        proc = run_ckptd("prune", "-c", prune_cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sorted(os.listdir(parent / "root" / "run")) == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"], out
    assert f"{parent / 'root'} is another ckptd's root" in proc.stderr, out
    assert sorted(os.listdir(parent / "mine")) == ["ckpt_3"], out  # its own territory is pruned as before


def test_a_prune_of_a_directory_inside_a_live_daemons_root_waits_for_it(tmp_path):
    """The other way round: the daemon leads X/root (pinning run/ckpt_2) and a `ckptd prune` is rooted
    at X/root/run, its own state_dir. Each lock is per root path, so the prune went ahead and
    deleted ckpt_1..3, the daemon's pin among them. It is the daemon's territory: exit 75."""
    root = tmp_path / "X" / "root"
    _checkpoints(root / "run")
    daemon_cfg = _config(tmp_path / "daemon.toml", root, tmp_path / "state-daemon", keep_last=10,
                         retention="pins = ['run/ckpt_2']")
    prune_cfg = _config(tmp_path / "child.toml", root / "run", tmp_path / "state-child", keep_last=1)
    with DaemonProc("-c", daemon_cfg) as daemon:
        daemon.wait_message("this ckptd deletes here", timeout=60)
        proc = run_ckptd("prune", "-c", prune_cfg)
        daemon.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out
    assert f"{root / 'run'} is inside {root}, the root of a live ckptd" in proc.stderr, out
    assert sorted(n for n in os.listdir(root / "run") if not n.startswith(".")) == [
        "ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"], out
    assert not (root / "run" / ".ckptd").exists()  # refused before it marked the directory a root of its own
    # With the daemon gone, X/root/run is this config's to prune (the daemon, started again, finds its
    # .ckptd/ and leaves it alone).
    proc = run_ckptd("prune", "-c", prune_cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(n for n in os.listdir(root / "run") if not n.startswith(".")) == ["ckpt_4"]


def test_a_daemon_rooted_inside_a_live_daemons_root_stands_by(tmp_path):
    """`ckptd run` the same way: a second daemon rooted at X/root/run, its own state_dir, beside the daemon
    leading X/root, observes only and deletes nothing, naming the root it is inside."""
    root = tmp_path / "X" / "root"
    _checkpoints(root / "run")
    outer_cfg = _config(tmp_path / "outer.toml", root, tmp_path / "state-outer", keep_last=10)
    inner_cfg = _config(tmp_path / "inner.toml", root / "run", tmp_path / "state-inner", keep_last=1)
    with DaemonProc("-c", outer_cfg) as outer:
        outer.wait_message("this ckptd deletes here", timeout=60)
        with DaemonProc("-c", inner_cfg) as inner:
            inner.wait_message(f"{root / 'run'}: standby, observing only: {root / 'run'} is inside {root}, "
                               "the root of a live ckptd", timeout=60)
            inner.stop()
        outer.stop()
    assert f"{root / 'run'} is another ckptd's root" not in outer.dump()  # the outer one still walks it
    assert sorted(n for n in os.listdir(root / "run") if not n.startswith(".")) == [
        "ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"]
