"""The window between the last re-check and the rename into the trash, held open (the reaper's seam,
`Trashing._before_rename`, which a hung NFS server or a reload holds open for seconds), and what
lands in it done by real processes: `mv` of the run out of the root, a writer re-saving in place,
a pin written deep inside. Each is seen just after the rename, through the descriptors it used,
and undone. And what every trash entry carries of its decision (removal/decision.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.journal import read_journal
from ckptd.removal.decision import RECORD, changed, snapshot
from ckptd.removal.outcome import Outcome
from tests.support.common import in_trash
from tests.support.volumes import make, names
from tests.support.volumes import volume as volume

WRITER = (  # a resumed job saving its optimizer state again in place, as the Trainer does (torch.save)
    "import sys, torch; torch.save({'step': 10, 'state': torch.zeros(64)}, sys.argv[1])"
)


def hold(reaper, monkeypatch, act, name: str = "checkpoint-10") -> list[str]:
    """Run `act` (once) in the window before the rename of `name`; what it was held for."""
    held: list[str] = []

    def before_rename(c) -> None:
        if c.name == name and not held:
            held.append(c.name)
            act()

    monkeypatch.setattr(reaper.trashing, "_before_rename", before_rename)
    return held


def test_a_run_moved_out_of_the_root_in_the_window_gets_its_checkpoint_back_where_it_went(
    volume, tmp_path, monkeypatch, caplog
):
    """`mv /vol/run /archive/run` between the re-check and the rename: the rename follows the run's
    descriptor out of the root, and took /archive/run/checkpoint-10 into the trash; ckptd purged it,
    outside every root. Now it is seen at once (the run is no longer where the root says) and moved
    back, through the same descriptor: wherever the run went."""
    archive = tmp_path / "archive"
    archive.mkdir()
    reaper, plan, journal = make(volume, tmp_path)
    before = snapshot("checkpoint-10", os.open(volume / "run", os.O_RDONLY))
    held = hold(reaper, monkeypatch, lambda: subprocess.run(["mv", volume / "run", archive / "run"], check=True))
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        results = reaper.execute(plan.decisions)
    assert held == ["checkpoint-10"]
    first = results[0]
    assert first.outcome is Outcome.REFUSED, first.line()
    assert "its run run was moved or replaced in the meantime; moved back" == first.detail
    assert sorted(os.listdir(archive / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert changed(before, snapshot("checkpoint-10", os.open(archive / "run", os.O_RDONLY))) is None
    assert any("moved or replaced while checkpoint-10 was being deleted" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert [r.outcome for r in results[1:]] == [Outcome.REFUSED] * 2  # no run under the root now
    assert reaper.purge() == (0, 0)
    assert os.listdir(volume / TRASH_DIR) == []  # nor a record left behind
    journal.close()
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert events[:3] == ["trashing", "restored", "refused"]


def test_a_resumed_writer_re_saving_in_place_in_the_window_gets_its_checkpoint_back(volume, tmp_path, monkeypatch):
    """A resumed job writes checkpoint-10 again after the re-check: its new files went into the
    trash and were purged, counted as freed. Now what the rename moved is compared with what was
    seen before the re-check, and it goes back."""
    target = volume / "run" / "checkpoint-10" / "global_step10" / "optimizer_resaved.pt"
    reaper, plan, journal = make(volume, tmp_path)
    hold(reaper, monkeypatch, lambda: subprocess.run([sys.executable, "-c", WRITER, str(target)], check=True))
    first, *rest = reaper.execute(plan.decisions)
    assert first.outcome is Outcome.REFUSED
    assert first.detail == "changed since it was re-checked (added global_step10/optimizer_resaved.pt); moved back"
    assert target.exists() and names(volume) == ["checkpoint-10", "checkpoint-40"]
    assert [r.outcome for r in rest] == [Outcome.TRASHED] * 2
    journal.close()


def test_a_file_rewritten_in_place_with_its_mtime_kept_in_the_window_is_seen(volume, tmp_path, monkeypatch):
    """Same size, same mtime, same inode: only the ctime tells (a rename does not change it)."""
    victim = volume / "run" / "checkpoint-10" / "trainer_state.json"

    def rewrite() -> None:
        st = victim.stat()
        text = victim.read_text()
        subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'r+').write(sys.argv[2])",
                        victim, text.replace("1", "2", 1)], check=True)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))

    reaper, plan, journal = make(volume, tmp_path)
    hold(reaper, monkeypatch, rewrite)
    first = reaper.execute(plan.decisions)[0]
    assert first.detail == "changed since it was re-checked (written trainer_state.json); moved back"
    assert victim.exists()
    journal.close()


def test_a_pin_written_deep_inside_in_the_window_keeps_the_checkpoint(volume, tmp_path, monkeypatch):
    """A `.ckptd-keep` in checkpoint-10/global_step10/ written after the re-check went with the
    checkpoint (one at its top was found). Now a pin at any depth brings it back."""
    pin = volume / "run" / "checkpoint-10" / "global_step10" / PIN_FILE
    reaper, plan, journal = make(volume, tmp_path)
    hold(reaper, monkeypatch, lambda: subprocess.run(["touch", pin], check=True))
    first = reaper.execute(plan.decisions)[0]
    assert first.outcome is Outcome.REFUSED
    assert first.detail == f"pinned (global_step10/{PIN_FILE} inside it); moved back"
    assert pin.exists()
    journal.close()


def test_a_pin_beside_it_written_in_the_window_keeps_the_checkpoint(volume, tmp_path, monkeypatch):
    pin = volume / "run" / f"checkpoint-10{PIN_FILE}"
    reaper, plan, journal = make(volume, tmp_path)
    hold(reaper, monkeypatch, lambda: subprocess.run(["touch", pin], check=True))
    first = reaper.execute(plan.decisions)[0]
    assert first.detail == f"pinned (checkpoint-10{PIN_FILE} beside it); moved back"
    assert (volume / "run" / "checkpoint-10").is_dir()
    journal.close()


def test_the_name_taken_in_the_window_puts_it_back_beside_under_a_name_that_says_so(volume, tmp_path, monkeypatch):
    """The writer re-creates checkpoint-10 after the rename (its save began in the old one): the
    old one goes back beside it, never over it, and no framework resumes from that name."""
    reaper, plan, journal = make(volume, tmp_path)
    ckpt = volume / "run" / "checkpoint-10"
    real = reaper.trashing._arrived_otherwise

    def arrived(c, target, trash_fd, run_fd, seen):
        if c.name == "checkpoint-10":
            ckpt.mkdir()
            (ckpt / "new.txt").write_text("a new save")  # the old one's file is changed too:
            os.utime(volume / TRASH_DIR / target / "config.json")  # written after the re-check
        return real(c, target, trash_fd, run_fd, seen)

    monkeypatch.setattr(reaper.trashing, "_arrived_otherwise", arrived)
    first = reaper.execute(plan.decisions)[0]
    assert first.outcome is Outcome.REFUSED
    beside = [n for n in names(volume) if n.startswith("checkpoint-10.ckptd-restored-")]
    assert len(beside) == 1 and first.detail.endswith(f"moved back beside it as {beside[0]} (its name is taken)")
    assert os.listdir(ckpt) == ["new.txt"]
    assert (volume / "run" / beside[0] / "config.json").exists()
    journal.close()


def test_each_trash_entry_carries_its_decision(volume, tmp_path):
    """Beside each entry, written before the rename: root, run, name, the run directory's identity,
    why, when, and every entry's identity; the journal's intent has the identity's digest."""
    reaper, plan, journal = make(volume, tmp_path)
    run_st = os.stat(volume / "run")
    before = snapshot("checkpoint-10", os.open(volume / "run", os.O_RDONLY))
    reaper.execute(plan.decisions)
    [entry] = [n for n in in_trash(volume / TRASH_DIR) if "checkpoint-10" in n]
    record = json.loads((volume / TRASH_DIR / f"{entry}{RECORD}").read_text())
    assert record["root"] == str(volume) and record["run"] == "run" and record["name"] == "checkpoint-10"
    assert record["run_id"] == [run_st.st_dev, run_st.st_ino]
    assert record["reasons"] == list(plan.decisions[0].reasons) and record["reasons"]
    assert changed(before, record["contents"]) is None and len(record["contents"]) == len(before)
    journal.close()
    [intent] = [r for r in read_journal(tmp_path / "state")
                if r["event"] == "trashing" and r["path"].endswith("checkpoint-10")]
    assert intent["run_id"] == record["run_id"] and intent["entries"] == len(before)
    assert len(intent["contents"]) == 32
    assert reaper.purge()[0] == 3 and os.listdir(volume / TRASH_DIR) == []  # the records go with them


def test_no_room_for_the_record_still_deletes_for_space(volume, tmp_path, monkeypatch):
    """ENOSPC writing the record, on the very occasion min_free exists for: the rename goes ahead
    (the journal holds the decision) and the purge judges the entry without it."""
    import errno

    from ckptd.removal import trash

    def full(name, trash_fd, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trash, "write_record", full)
    reaper, plan, journal = make(volume, tmp_path)
    assert [r.outcome for r in reaper.execute(plan.decisions)] == [Outcome.TRASHED] * 3
    assert not any(n.endswith(RECORD) for n in os.listdir(volume / TRASH_DIR))
    assert reaper.purge()[0] == 3
    journal.close()


def test_a_record_that_cannot_be_written_for_another_reason_moves_nothing(volume, tmp_path, monkeypatch):
    import errno

    from ckptd.removal import trash

    def broken(name, trash_fd, record):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(trash, "write_record", broken)
    reaper, plan, journal = make(volume, tmp_path)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 3
    assert "its record in .ckptd-trash/ cannot be written" in results[0].detail
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    journal.close()



@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_the_real_cli_held_at_its_rename_gives_a_run_moved_out_of_the_root_its_checkpoint_back(tmp_path):
    """As the attack did it: `ckptd prune` under strace, its first renameat (the move into the
    trash) delayed 4 s; the run `mv`ed out of the root once the journal says the move is under way."""
    root, archive, state = tmp_path / "vol", tmp_path / "archive", tmp_path / "state"
    archive.mkdir()
    old = time.time() - 86400
    for i, step in enumerate((10, 20, 30)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{state}'\n[[roots]]\npath = '{root}'\nquiet_period = '0s'\n"
                   "allow_short_quiet_period = true\nworld_size = 2\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    state.mkdir()
    journal = state / "journal.jsonl"
    moving = threading.Event()

    class Intent(FileSystemEventHandler):
        def on_modified(self, event) -> None:  # the journal's "trashing" line: the rename is next
            if Path(event.src_path) == journal and '"trashing"' in journal.read_text():
                moving.set()

    observer = Observer()
    observer.schedule(Intent(), str(state))
    observer.start()
    try:
        proc = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=renameat",
             "-e", "inject=renameat:delay_enter=4000000:when=1", sys.executable, "-m", "ckptd", "prune", "-c", cfg],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert moving.wait(60), "prune never journalled a move"
        subprocess.run(["mv", root / "run", archive / "run"], check=True)
        out, err = proc.communicate(timeout=120)
    finally:
        observer.stop()
        observer.join()
    assert proc.returncode == 0, err
    assert "-> refused: its run run was moved or replaced in the meantime; moved back" in out, out
    assert sorted(os.listdir(archive / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert in_trash(root / TRASH_DIR) == []
