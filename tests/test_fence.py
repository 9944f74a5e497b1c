"""Fencing: the reaper asks, immediately before each rename, whether this ckptd still leads.

Reaper-level tests give it fences that say no after a given number of questions; the daemon
test shows the fence it hands the reaper is the volume lease's, bound to the epoch held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest
import pytest_asyncio
from test_daemon_async import LogWatch
from test_reaper import make, names
from test_reaper import volume as volume
from test_slim import fake_consolidator, reaper_for
from test_slim import unconsolidated as unconsolidated

from ckptd import slim
from ckptd.journal import read_journal
from ckptd.layouts import LEASE_DIR, TRASH_DIR
from ckptd.lease import RECORD, Holder, Record, RecordIO
from ckptd.policy import Action
from ckptd.reaper import Outcome


class Fence:
    """Says yes `allow` times, then why not."""

    def __init__(self, allow: int, why: str = "the lease ran out"):
        self.allow, self.why, self.asked = allow, why, 0

    def __call__(self) -> str | None:
        self.asked += 1
        return None if self.asked <= self.allow else self.why


def test_no_deletion_once_the_fence_says_no(volume, tmp_path):
    reaper, plan, journal = make(volume, tmp_path)
    reaper.fence = Fence(allow=1)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED, Outcome.REFUSED, Outcome.REFUSED]
    assert results[1].detail == "not the leader: the lease ran out"
    assert names(volume) == ["checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert reaper.fence.asked == 3  # asked before every rename, not once per pass
    journal.close()
    assert [r["event"] for r in read_journal(tmp_path / "state")] == ["trashing", "trashed", "refused", "refused"]


def test_a_fence_that_cannot_answer_is_a_no(volume, tmp_path):
    reaper, plan, journal = make(volume, tmp_path)

    def broken() -> str | None:
        raise OSError(5, "Input/output error")

    reaper.fence = broken
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert "cannot tell whether this ckptd still leads" in results[0].detail
    assert len(names(volume)) == 4 and not (volume / TRASH_DIR).exists()
    journal.close()


def test_the_dry_run_never_asks(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path, dry_run=True)
    reaper.fence = Fence(allow=0)
    assert {r.outcome for r in reaper.execute(plan.decisions)} == {Outcome.DRY_RUN}
    assert reaper.fence.asked == 0


@pytest.mark.parametrize(
    ("allow", "detail", "marker"),
    [
        (0, "not the leader: the lease ran out", None),  # before the consolidated weights go into place
        (1, "not the leader: the lease ran out", None),  # before the marker and the journal
        (2, "moved 0 of 2 files, then: not the leader: the lease ran out", "removing"),
        (3, "moved 1 of 2 files, then: not the leader: the lease ran out", "removing"),
        (4, None, "done"),
    ],
)
def test_a_slim_asks_before_each_rename(unconsolidated, tmp_path, monkeypatch, allow, detail, marker):
    fake_consolidator(monkeypatch)
    reaper, plan, journal = reaper_for(unconsolidated, tmp_path, keep_last=3, keep_full_last=1)
    reaper.fence = Fence(allow)
    [result] = reaper.execute([plan.slims[0]] + [d for d in plan.decisions if d.action is Action.KEEP])
    ck = unconsolidated / "run" / "checkpoint-10"
    if detail is None:
        assert result.outcome is Outcome.SLIMMED
    else:
        assert (result.outcome, result.detail) == (Outcome.REFUSED, detail)
    assert (ck / slim.WEIGHTS_DIR).exists() == (allow >= 1)
    got = json.loads((ck / slim.MARKER).read_text())["state"] if (ck / slim.MARKER).exists() else None
    assert got == marker  # "removing": the next leader finishes what this one began
    shards = sorted(p.name for p in (ck / "global_step10").glob("*optim_states.pt"))
    assert len(shards) == {0: 2, 1: 2, 2: 2, 3: 1, 4: 0}[allow]
    journal.close()


# --- the daemon hands the reaper its lease's fence ----------------------------------------------

@pytest_asyncio.fixture
async def logs():
    watch = LogWatch(asyncio.get_running_loop())
    logger = logging.getLogger("ckptd")
    old_level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    yield watch
    logger.removeHandler(watch)
    logger.setLevel(old_level)


@pytest.mark.asyncio
async def test_the_daemon_fences_its_deletions_with_the_volume_lease(tmp_path, logs):
    """The lease record is rewritten under a leader that has not renewed yet (an operator, a host
    configured with a shorter lease): its next deletion is refused at the fence."""
    from ckptd.config import load_config
    from ckptd.daemon import Daemon
    from ckptd.demo import hf_deepspeed_checkpoint

    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 's'}'\nleadership = 'volume'\nlease_duration = '1h'\n"
                   f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.1s'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        await logs.wait("deleted job/checkpoint-1")
        mine = Record.parse((root / LEASE_DIR / RECORD).read_bytes())
        RecordIO(root).write(Record(mine.epoch, Holder("other", 1, 0.0, "other"), mine.expires + 60, mine.renewed,
                                    0, 60.0, 10.0, since=mine.renewed))
        assert daemon.roots[0].lead.held()  # it does not know yet: no renewal for 20 minutes
        hf_deepspeed_checkpoint(root / "job", 3, world=2)
        await logs.wait("not deleting job/checkpoint-2: not the leader: the lease record no longer names")
    finally:
        daemon.request_stop("test")
        await asyncio.wait_for(task, 30)
    assert sorted(os.listdir(root / "job")) == ["checkpoint-2", "checkpoint-3"]
    assert Record.parse((root / LEASE_DIR / RECORD).read_bytes()).holder.host == "other"  # not "released" over it
    assert Path(tmp_path / "s").exists()
