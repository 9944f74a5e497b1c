"""What a user sees while ckptd works: `status` ages computed when asked, the daemon's totals
lines, progress on a terminal, and the per-run metrics. Real `ckptd` processes throughout."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc, write_config


def test_status_says_how_long_a_checkpoint_has_been_settling_when_it_is_asked(tmp_path, state_env):
    """The state file is written at the daemon's looks (here: once, polls are an hour apart); the
    age `status` shows grows between two asks all the same. Before, it said "unchanged for 0.0s
    of 1m" twenty seconds later. (A configured pattern's file: settling is the daemon's own
    timing, the same for every layout.)"""
    root = tmp_path / "vol"
    (root / "run").mkdir(parents=True)
    (root / "run" / "ckpt_1").write_text("weights")
    state = tmp_path / "state"
    cfg = write_config(tmp_path / "c.toml", root, state,
                       root_extra="patterns = ['ckpt_{step}']\nquiet_period = '1h'\npoll_interval = '1h'\n"
                                  "reconcile_interval = '1h'\nobserver = 'polling'")
    with DaemonProc("-c", cfg, env=state_env) as daemon:
        # found at start-up, it settles from the daemon's first look, just after READY
        daemon.wait_message("settling: unchanged for 0.0s of 1h", timeout=60)
        start = daemon.mark()
        daemon.wait_message("state written", timeout=60, start=start)
        state_file = state / f"daemon.{daemon.proc.pid}.json"
        written = state_file.stat().st_mtime_ns
        [c] = json.loads(state_file.read_text())["roots"][0]["runs"][0]["checkpoints"]
        assert c["state"] == "settling" and c["unchanged_since"] <= time.time()
        ages = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not ages or ages[-1] < 2):
            proc = run_ckptd("status", "-c", cfg, env=state_env)
            assert proc.returncode == 0, proc.stderr
            m = re.search(r"settling, never deleted: unchanged for (\d+)s of 1h0m", proc.stdout)
            assert m, proc.stdout
            ages.append(int(m[1]))
        assert ages[-1] >= 2 and ages == sorted(ages), ages
        assert state_file.stat().st_mtime_ns == written  # the file did not change: status computed it
        assert daemon.stop() == 0


def run_on_a_terminal(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`ckptd ARGS` with stderr on a pseudo-terminal (stdout a pipe): (status, stdout, what the
    terminal got)."""
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    full_env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", *args], stdout=subprocess.PIPE, stderr=follower,
                            stdin=subprocess.DEVNULL, env={**full_env, **env}, text=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not data:
            break
        chunks.append(data)
    with proc.stdout:
        out = proc.stdout.read()
    status = proc.wait(timeout=120)
    os.close(leader)
    return status, out, b"".join(chunks).decode(errors="replace")


def many_checkpoints(tmp_path: Path, n: int = 240) -> Path:
    """`n` checkpoints of a configured pattern (plain files: what is tested is the progress line,
    which counts checkpoints whatever their layout), saved an hour ago."""
    root = tmp_path / "vol"
    for r in range(4):
        run = root / f"run-{r}"
        run.mkdir(parents=True)
        for step in range(n // 4):
            (run / f"ckpt_{step}").write_text("w")
    from ckptd.cli.demo_volume import age

    age(root, time.time() - 3600)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "patterns = ['ckpt_{step}']\n[roots.retention]\nkeep_last = 1000\nkeep_best = 0\n")
    return cfg


def test_plan_and_prune_show_progress_on_a_terminal_only(tmp_path, state_env):
    cfg = many_checkpoints(tmp_path)
    root = tmp_path / "vol"
    for command in ("plan", "prune"):
        status, out, tty = run_on_a_terminal(command, "-c", str(cfg), env=state_env)
        assert status == 0, tty
        assert f"\r{command} {root}: 240/240 checkpoints looked at (100%)" in tty
        assert tty.endswith("\r") and tty.rsplit("\r", 2)[-2].strip() == ""  # cleared, not left behind
        assert "looked at" not in out  # stdout stays the report
        status, _, tty = run_on_a_terminal(command, "-c", str(cfg), "--quiet", env=state_env)
        assert status == 0 and "looked at" not in tty
        proc = run_ckptd(command, "-c", cfg, env=state_env)  # stderr a pipe: nothing
        assert proc.returncode == 0 and "looked at" not in proc.stderr
    # a small volume is not worth a line
    small = many_checkpoints(tmp_path / "small", n=8)
    status, _, tty = run_on_a_terminal("plan", "-c", str(small), env=state_env)
    assert status == 0 and "looked at" not in tty


def test_the_looks_at_what_a_first_scan_found_say_how_far_they_have_got(tmp_path, caplog):
    """After READY the checkpoints found at start are looked at a few at a time (minutes on a big
    volume): a line every 10 s, on the daemon's own clock, until they are done. The daemon is
    driven tick by tick in the test's process (no event loop), with a hand-driven clock."""
    import logging

    from ckptd.config import load_config
    from ckptd.daemon import Daemon
    from ckptd.daemon.narration import SCAN_PROGRESS_EVERY

    cfg = many_checkpoints(tmp_path, n=40)
    now = [1000.0]
    daemon = Daemon(load_config(cfg), config_path=cfg, dry_run=True, clock=lambda: now[0], install_signals=False)
    daemon.watcher = None
    rt = daemon.keeper.runtime(daemon.config.roots[0], daemon.config)
    daemon.roots.append(rt)
    daemon.tick.first_scan()
    assert len(rt.tracker.unseen) == 40
    caplog.set_level(logging.INFO, logger="ckptd")
    for _ in range(30):  # what the daemon's ticks would look at, ten at a time
        rt.tracker.unseen.popleft()
    daemon.narrator.first_looks(now[0] + SCAN_PROGRESS_EVERY - 1)
    assert "found at start" not in caplog.text  # not yet: 10 s between lines
    daemon.narrator.first_looks(now[0] + SCAN_PROGRESS_EVERY)
    assert f"{tmp_path / 'vol'}: looked at 30 of the 40 checkpoints found at start (75%)" in caplog.messages
    rt.tracker.unseen.clear()
    daemon.narrator.first_looks(now[0] + 3 * SCAN_PROGRESS_EVERY)
    assert sum("found at start" in m for m in caplog.messages) == 1  # done: nothing more to say
    assert daemon.narrator.looks_due == {}


def test_a_slow_step_of_prune_says_what_it_waits_for_on_a_terminal():
    """prune's Ticker: nothing for a quick step; for one past 2 s (a consolidation before a slim),
    what and for how long, redrawn in place; cleared before prune prints its next line. Driven by
    hand (draw) on a hand-driven clock; the thread only calls draw once a second."""
    import io

    from ckptd.cli.progress import Ticker

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    now = [0.0]
    term = Terminal()
    ticker = Ticker("prune /vol", stream=term, clock=lambda: now[0])
    ticker.working("0 of 3 deletions and slims done")
    now[0] = 1.5
    ticker.draw()
    assert term.getvalue() == ""  # quick: nothing
    now[0] = 75.0
    ticker.draw()
    assert term.getvalue() == "\rprune /vol: 0 of 3 deletions and slims done, 1m15s"
    ticker.clear()
    assert term.getvalue().endswith("\r" + " " * len("prune /vol: 0 of 3 deletions and slims done, 1m15s") + "\r")
    piped = io.StringIO()  # not a terminal: never a line
    quiet = Ticker("prune /vol", stream=piped, clock=lambda: now[0])
    quiet.working("x")
    now[0] = 1000.0
    quiet.draw()
    with quiet:
        pass
    assert piped.getvalue() == ""
