"""Fencing: the reaper asks, immediately before each rename, whether this ckptd still leads.

Reaper-level tests give it fences that say no after a given number of questions; the daemon
test shows the fence it hands the reaper is the volume lease's, bound to the epoch held.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from ckptd.decide.policy import Action
from ckptd.discover.layouts import LEASE_DIR, TRASH_DIR
from ckptd.fleet.leaserecord import RECORD, Holder, Record, RecordIO
from ckptd.journal import read_journal
from ckptd.judge import slim
from ckptd.removal.outcome import Outcome
from tests.support.common import in_trash
from tests.support.logwatch import logs  # noqa: F401 - the fixture
from tests.support.slimkit import fake_consolidator, reaper_for
from tests.support.slimkit import unconsolidated as unconsolidated
from tests.support.volumes import make, names
from tests.support.volumes import volume as volume


class Fence:
    """Says yes `allow` times, then why not."""

    def __init__(self, allow: int, why: str = "the lease ran out"):
        self.allow, self.why, self.asked = allow, why, 0

    def __call__(self) -> str | None:
        self.asked += 1
        return None if self.asked <= self.allow else self.why


def test_no_deletion_once_the_fence_says_no(volume, tmp_path):
    reaper, plan, journal = make(volume, tmp_path)
    reaper.fence = Fence(allow=2)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED, Outcome.REFUSED, Outcome.REFUSED]
    assert results[1].detail == "not the leader: the lease ran out"
    assert names(volume) == ["checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert reaper.fence.asked == 4  # asked before and after every rename, not once per pass
    journal.close()
    assert [r["event"] for r in read_journal(tmp_path / "state")] == ["trashing", "trashed", "refused", "refused"]


def test_a_rename_the_fence_disowns_just_after_is_moved_back(volume, tmp_path):
    """Yes before the rename, no just after it: the process was stopped between the two (the
    daemon-level test below stops a real one there); what it moved goes back where it was."""
    reaper, plan, journal = make(volume, tmp_path)
    reaper.fence = Fence(allow=1)
    first = reaper.execute(plan.decisions)[0]
    assert first.outcome is Outcome.REFUSED
    assert first.detail == "not the leader: the lease ran out; moved back"
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert os.listdir(volume / TRASH_DIR) == []
    journal.close()
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert events == ["trashing", "restored", "refused", "refused", "refused"]


def test_a_late_rename_whose_name_was_taken_meanwhile_stays_in_the_trash_for_review(volume, tmp_path, monkeypatch):
    """The name is taken again by the time it would go back (a trainer saved that step anew): it
    is neither put over the new one nor purged."""
    reaper, plan, journal = make(volume, tmp_path)
    real, taken = reaper.fencing.why_not, volume / "run" / "checkpoint-10"

    def fenced(*, after: bool = False) -> str | None:
        if after and not taken.exists():
            taken.mkdir()  # the name taken again, just then
            return "the lease ran out"
        return real(after=after)

    monkeypatch.setattr(reaper.fencing, "why_not", fenced)
    first, *_ = reaper.execute(plan.decisions)
    for ck in ("checkpoint-20", "checkpoint-30"):
        shutil.move(volume / TRASH_DIR / next(n for n in in_trash(volume / TRASH_DIR) if ck in n),
                    volume / "run" / ck)  # the two trashed after it: only the first is looked at
    [entry] = in_trash(volume / TRASH_DIR)  # the two moved back by hand leave their records
    assert entry.endswith("%review") and "checkpoint-10" in entry
    assert f"left in {TRASH_DIR}/{entry} for review" in first.detail
    assert os.listdir(volume / "run" / "checkpoint-10") == []  # the new one, untouched
    assert reaper.purge() == (0, 0) and os.listdir(volume / TRASH_DIR) == [entry]  # orphan records dropped
    journal.close()


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
        (3, "moved 0 of 2 files, then: not the leader: the lease ran out; moved back", "removing"),
        (4, "moved 1 of 2 files, then: not the leader: the lease ran out", "removing"),
        (5, "moved 1 of 2 files, then: not the leader: the lease ran out; moved back", "removing"),
        (6, None, "done"),
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
    assert len(shards) == {0: 2, 1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 0}[allow]
    journal.close()


# --- the daemon hands the reaper its lease's fence ----------------------------------------------



@pytest.mark.asyncio
async def test_the_daemon_fences_its_deletions_with_the_volume_lease(tmp_path, logs):  # noqa: F811
    """The lease record is rewritten under a leader that has not renewed yet (an operator, a host
    configured with a shorter lease): its next deletion is refused at the fence."""
    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
    from ckptd.config import load_config
    from ckptd.daemon import Daemon

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


def test_a_pin_seen_only_under_its_name_in_the_trash_sends_it_back(volume, tmp_path, monkeypatch):
    """The re-check passed on a stale look (a FUSE client that caches listings showed the
    checkpoint's listing from before a pin written on another host: tests/fleet/test_hosts_behind_caches.py shows it
    on a real one): the look under its new name in the trash, which no cache has seen, finds the
    pin, and it goes back."""
    from ckptd.discover.layouts import PIN_FILE

    reaper, plan, journal = make(volume, tmp_path)
    (volume / "run" / "checkpoint-10" / PIN_FILE).touch()
    monkeypatch.setattr(reaper.rechecks, "recheck", lambda decision, anchors: None)  # what the stale look said
    first, *_ = reaper.execute(plan.decisions)
    assert first.outcome is Outcome.REFUSED
    assert first.detail.startswith("pinned (its pin seen only under its name in the trash") and \
        first.detail.endswith("; moved back")
    assert (volume / "run" / "checkpoint-10" / PIN_FILE).exists()
    assert not any("checkpoint-10" in n for n in os.listdir(volume / TRASH_DIR))
    journal.close()
    assert ("restored", "checkpoint-10") in [(r["event"], Path(r.get("path", "")).name)
                                             for r in read_journal(tmp_path / "state")]
