"""A reload stops the retention pass in progress between two deletions: what is left is decided
again under the new config. The real daemon, a real SIGHUP, the pass held between two deletions by
the reaper's seam (tests/support/passhold.py); every wait is on a log line or an event, with a timeout."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.journal import read_journal
from tests.support.daemonproc import DaemonProc, write_config
from tests.support.passhold import PassHold

EXTRA = "quiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2"
STEPS = (1, 2, 3, 4, 5, 6)


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith("."))


def trashed(state: Path) -> list[str]:
    return [Path(r["path"]).name for r in read_journal(state) if r["event"] == "trashed"]


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "vol"
    for step in STEPS:
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    return root


def _held_reload(tmp_path: Path, root: Path, change) -> tuple[DaemonProc, str, list[str]]:
    """Start the daemon (keep_last=1: five to delete), hold its pass before the second deletion,
    change the config with `change(text) -> text`, send SIGHUP, and let the pass go on."""
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state", root_extra=EXTRA,
                       retention="keep_last = 1\nkeep_best = 0")
    with PassHold(tmp_path / "hold.sock", hold_at=2) as hold, DaemonProc("-c", cfg, env=hold.env) as daemon:
        before = hold.wait_held()
        cfg.write_text(change(cfg.read_text()))
        mark = daemon.mark()
        daemon.signal(signal.SIGHUP)
        daemon.wait_message("SIGHUP: reloading", start=mark)
        hold.release()
        daemon.wait_message("reloaded", start=mark)
        stopped = daemon.wait_message("retention pass stopped before", start=mark)
        assert before in stopped[0]["message"]
        lines = [line.get("message", "") for line in daemon.lines]
        daemon.stop()
    return daemon, before, lines


def left(run: Path) -> list[str]:
    """What the pass left, whatever became of checkpoint-1, trashed before the hold: purged, or (where
    the purge came after the reload, whose new reaper re-checks it as not its own) moved back
    because the new pins cover it. Either is right; what the stopped pass had left must all be there."""
    return [name for name in listing(run) if name != "checkpoint-1"]


def test_a_pin_added_by_a_reload_mid_pass_keeps_what_the_pass_had_left(tmp_path, volume):
    _, before, lines = _held_reload(
        tmp_path, volume, lambda text: text.replace("keep_best = 0", "keep_best = 0\npins = ['job/*']"))
    # One deletion before the hold; the pass stopped there; the pinned rest is decided again and kept.
    assert trashed(tmp_path / "state") == ["checkpoint-1"]
    assert before == "job/checkpoint-2"
    assert left(volume / "job") == [f"checkpoint-{s}" for s in STEPS[1:]]
    assert not any(m.startswith("deleted job/checkpoint-") and "checkpoint-1 " not in m for m in lines), lines


def test_a_root_dropped_by_a_reload_mid_pass_loses_nothing_more(tmp_path, volume):
    other = tmp_path / "other"
    other.mkdir()
    _held_reload(tmp_path, volume, lambda text: text.replace(f"path = '{volume}'", f"path = '{other}'"))
    assert trashed(tmp_path / "state") == ["checkpoint-1"]
    assert left(volume / "job") == [f"checkpoint-{s}" for s in STEPS[1:]]
