"""What the daemon's log says of each checkpoint's state, once per change (`Narrator`): new, complete,
in flight again (was ...), gone (not by ckptd); nothing for writing <-> settling, nor a "gone"
for what ckptd itself moved to the trash.

Driven tick by tick on a controllable clock (a dry-run Daemon, not served), and one served
daemon that deletes, waiting on its log lines with timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.model import State
from tests.support.daemonproc import write_config
from tests.support.logwatch import logs as logs


def ticked(cfg: Path, clock) -> tuple[Daemon, object]:
    """A dry-run Daemon for one root, first scan and first looks done; the test drives `tick.run`."""
    daemon = Daemon(load_config(cfg), config_path=cfg, dry_run=True, clock=clock, install_signals=False)
    daemon.watcher = None
    rt = daemon.keeper.runtime(daemon.config.roots[0], daemon.config)
    daemon.roots.append(rt)
    daemon.tick.first_scan()
    while rt.tracker.unseen:
        rt.tracker.step(clock())
    return daemon, rt


def said(caplog, rel: str) -> list[tuple[str, str]]:
    """(level, message) of the state lines about `rel`."""
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "ckptd.daemon" and r.getMessage().startswith(f"{rel}: ")]


def test_each_state_change_is_said_once_in_order(tmp_path, caplog):
    root = tmp_path / "vol"
    old = hf_deepspeed_checkpoint(root / "job", 1, world=2)
    for p in old.rglob("*"):
        os.utime(p, (1, 1))  # saved long ago
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra=(
        "quiet_period = '1s'\nallow_short_quiet_period = true\npoll_interval = '1s'\nreconcile_interval = '30s'"))
    now = [1000.0]
    caplog.set_level(logging.DEBUG, logger="ckptd")
    daemon, rt = ticked(cfg, lambda: now[0])

    def ticks(n: int = 3) -> None:
        for _ in range(n):
            now[0] += 1.5
            daemon.tick.run()

    ticks()
    # found at start: its completion is a debug line (the totals line says it)
    assert [(lvl, m.split(" (")[0]) for lvl, m in said(caplog, "job/checkpoint-1")] == [
        ("DEBUG", "job/checkpoint-1: complete")]
    hf_deepspeed_checkpoint(root / "job", 2, world=2)
    ticks()
    lines = said(caplog, "job/checkpoint-2")
    assert [m.split(" (")[0] for _, m in lines] == ["job/checkpoint-2: new, settling", "job/checkpoint-2: complete"]
    assert {lvl for lvl, _ in lines} == {"INFO"}
    # Written in two goes: settling, writing, settling again, complete; the log says new and complete.
    hf_deepspeed_checkpoint(root / "job", 3, world=2, skip={"trainer_state.json"})
    ticks(1)
    hf_deepspeed_checkpoint(root / "job", 3, world=2)
    rt.tracker.poll()  # a look between two ticks' (a tick looks again at once: settling by its end)
    assert rt.tracker.runs["job"].checkpoints["checkpoint-3"].state is State.WRITING
    daemon.narrator.state_changes()
    ticks()
    assert [m.split(" (")[0] for _, m in said(caplog, "job/checkpoint-3")] == [
        "job/checkpoint-3: new, settling", "job/checkpoint-3: complete"]
    # A torn file added to a complete checkpoint (seen at the next reconcile): in flight again,
    # said against what was said last; then incomplete, and why; complete again once it is gone.
    (root / "job" / "checkpoint-2" / "extra.bin").write_bytes(b"x")
    now[0] += 30
    ticks()
    again = [m for _, m in said(caplog, "job/checkpoint-2")[len(lines):]]
    assert again == ["job/checkpoint-2: writing again (was complete)", "job/checkpoint-2: incomplete: file "
                     "integrity failed: extra.bin is not a complete zip archive (truncated?)"]
    (root / "job" / "checkpoint-2" / "extra.bin").unlink()
    ticks()
    assert said(caplog, "job/checkpoint-2")[-1][1].startswith("job/checkpoint-2: complete (")
    shutil.rmtree(root / "job" / "checkpoint-1")
    ticks()
    assert said(caplog, "job/checkpoint-1")[-1] == ("INFO", "job/checkpoint-1: gone (not by ckptd)")
    ticks()
    # once each: nothing said again while nothing changes
    assert [m for _, m in said(caplog, "job/checkpoint-1")].count("job/checkpoint-1: gone (not by ckptd)") == 1
    assert sum(m.startswith("job/checkpoint-2: complete") for _, m in said(caplog, "job/checkpoint-2")) == 2


@pytest.mark.asyncio
async def test_what_ckptd_moved_to_the_trash_is_not_said_gone(tmp_path, logs):
    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", retention="keep_last = 1",
                       root_extra="quiet_period = '0.2s'\nallow_short_quiet_period = true\npoll_interval = '0.05s'")
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await logs.wait("deleted job/checkpoint-1")
        hf_deepspeed_checkpoint(root / "job", 3, world=2)  # a change after the deletion: said, and
        await logs.wait("job/checkpoint-3: complete")  # the narrator looks at every state then
        await logs.wait("deleted job/checkpoint-2")
        hf_deepspeed_checkpoint(root / "job", 4, world=2)
        await logs.wait("job/checkpoint-4: complete")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)
    assert logs.messages("job/checkpoint-1: gone (") == [] and logs.messages("job/checkpoint-2: gone (") == []
    assert len(logs.messages("job/checkpoint-3: new, ")) == 1
