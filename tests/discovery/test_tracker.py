"""Settling and the root tracker, on a real filesystem with a controllable monotonic clock."""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint, write_zip
from ckptd.config import Root
from ckptd.daemon.tracker import HINT_DEBOUNCE, RootTracker
from ckptd.judge.settle import Settler
from ckptd.judge.verdicts import RACY_NS
from ckptd.model import State, Verdict
from tests.support.tracking import Clock, start, tracker
from tests.support.tracking import clock as clock

# --- the settler (pure) --------------------------------------------------------


def test_settler_needs_the_same_fingerprint_for_the_whole_quiet_period():
    s = Settler(quiet_period=60)
    assert s.observe("a", "f1", 0).verdict is Verdict.UNKNOWN  # first sight: settling
    assert s.observe("a", "f1", 59.9).verdict is Verdict.UNKNOWN
    assert s.observe("a", "f1", 60).verdict is Verdict.PASSED
    assert s.observe("a", "f2", 61).verdict is Verdict.FAILED  # changed: writing again
    assert s.deadline("a") == 121
    assert s.observe("a", "f2", 120).verdict is Verdict.UNKNOWN
    assert s.observe("a", "f2", 121).verdict is Verdict.PASSED


def test_a_hint_can_only_push_the_quiet_period_later():
    s = Settler(quiet_period=10)
    s.observe("a", "f", 0)
    s.touch("a", 5)
    assert s.deadline("a") == 15
    s.touch("a", 3)  # an old hint does not pull it earlier
    assert s.deadline("a") == 15
    assert s.observe("a", "f", 14).verdict is Verdict.UNKNOWN
    assert s.observe("a", "f", 15).verdict is Verdict.PASSED


def test_quiescence_ignores_the_wall_clock():
    """Only the monotonic times passed in count: mtimes far in the past or future change nothing."""
    s = Settler(quiet_period=60)
    s.observe("a", "fingerprint-with-mtimes-from-1970", 0)
    assert s.observe("a", "fingerprint-with-mtimes-from-1970", 30).verdict is Verdict.UNKNOWN


def test_stalled_after_stall_after():
    s = Settler(quiet_period=1, stall_after=100)
    s.observe("a", "f", 0)
    assert s.stall_check("a", 99) is None
    assert s.stall_check("a", 100).verdict is Verdict.FAILED


# --- the tracker ---------------------------------------------------------------


def states(t: RootTracker) -> dict[str, State]:
    return {c.rel: c.state for c in t.checkpoints()}


def test_a_checkpoint_completes_one_quiet_period_after_it_stops_changing(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()  # start-up: found, not looked at yet (READY comes before the looks)
    start_t = clock.t
    assert states(t) == {"run/checkpoint-10": State.SETTLING}
    assert t.next_deadline() == start_t  # the first look: at once
    assert t.step(clock.t).completed == []
    assert t.next_deadline() == start_t + 60
    assert t.step(clock.advance(59)).completed == []
    changes = t.step(clock.advance(1))
    assert [c.rel for c in changes.completed] == ["run/checkpoint-10"]
    assert states(t) == {"run/checkpoint-10": State.COMPLETE}


def test_a_checkpoint_found_after_start_up_is_looked_at_again_once_watched(tmp_path, clock):
    t = tracker(tmp_path, clock)
    start(t)
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t.poll()
    assert states(t) == {"run/checkpoint-10": State.SETTLING}
    assert t.next_deadline() == clock.t + HINT_DEBOUNCE  # a second look, once its watch exists


def test_a_write_moves_it_back_to_writing(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    clock.advance(30)
    write_zip(ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 5000)
    t.poll()
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    assert t.step(clock.advance(59)).completed == []
    assert t.step(clock.advance(1)).completed != []


def test_a_missing_shard_keeps_it_incomplete_then_stalled(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, skip={"zero_pp_rank_1_mp_rank_00_optim_states.pt"})
    t = tracker(tmp_path, clock, stall_after=3600)
    start(t)
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.INCOMPLETE}
    clock.advance(3600)
    t.poll()
    assert states(t) == {"run/checkpoint-10": State.STALLED}


def test_polling_finds_new_runs_and_checkpoints_by_directory_mtime(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "a", 10, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    hf_deepspeed_checkpoint(tmp_path / "team" / "b", 5, world=2)
    hf_deepspeed_checkpoint(tmp_path / "a", 20, world=2)
    t.poll()
    assert set(states(t)) == {"a/checkpoint-10", "a/checkpoint-20", "team/b/checkpoint-5"}


def test_polling_does_not_walk_complete_checkpoints(tmp_path, clock, monkeypatch):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.COMPLETE}
    walked = []
    import ckptd.judge.evidence as evidence

    real_walk = evidence.walk
    monkeypatch.setattr(evidence, "walk", lambda p: walked.append(p) or real_walk(p))
    t.poll()
    assert walked == []
    t.full_scan()  # a reconcile stats its directories: unchanged, so not walked
    assert walked == []
    (tmp_path / "run" / "checkpoint-10" / "global_step10" / "extra.pt").write_bytes(b"x")
    t.full_scan()  # a directory of it changed: walked, and found writing again
    assert walked == [tmp_path / "run" / "checkpoint-10"]
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    t.full_scan(deep=True)  # after a reload: every checkpoint walked
    assert walked[1:] == [tmp_path / "run" / "checkpoint-10"]


def test_vanished_checkpoints_are_forgotten(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    shutil.rmtree(ckpt)
    changes = t.poll()
    assert changes.vanished == ["run/checkpoint-10"]
    assert set(states(t)) == {"run/checkpoint-20"}


def test_hints_map_paths_to_checkpoints_runs_and_directories(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "team" / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    deadline = t.settler.deadline("team/run/checkpoint-10")
    t.hint(str(ckpt / "global_step10" / "x.pt"), clock.advance(5))
    assert t.settler.deadline("team/run/checkpoint-10") == deadline + 5
    assert "team/run/checkpoint-10" in t.hints
    t.hint(str(tmp_path / "team" / "run" / "checkpoint-20"), clock.t)
    t.hint(str(tmp_path / "team" / "new-run"), clock.t)
    t.hint(str(tmp_path / ".ckptd-trash" / "x"), clock.t)
    t.hint("/somewhere/else", clock.t)
    assert t.dirty_dirs == {"team/run", "team"}
    # the root is watched recursively: ckptd's own lease, and what is deeper than a listed
    # directory's entries (a logger's files in the run, a dataset), relist nothing
    t.dirty_dirs.clear()
    t.hint(str(tmp_path / ".ckptd"), clock.t)  # made in the root, but not a run's directory
    t.hint(str(tmp_path / ".ckptd" / "lease.json"), clock.t)
    t.hint(str(tmp_path / "team" / "run" / "wandb" / "run-1" / "events.log"), clock.t)
    t.hint(str(tmp_path / "team" / "data" / "shards" / "x.bin"), clock.t)
    assert t.dirty_dirs == set()


def test_at_start_a_write_into_an_old_checkpoint_is_seen_by_the_next_poll(tmp_path, clock):
    """Every checkpoint settles once after a start, old ones too; a poll stats their directories."""
    from ckptd.cli.demo_volume import age

    age(hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2), time.time() - 3600)
    hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2)  # being written as the daemon starts
    t = tracker(tmp_path, clock)
    start(t)
    assert {c.name: c.state for c in t.in_flight()} == {"checkpoint-10": State.SETTLING,
                                                         "checkpoint-20": State.SETTLING}
    # a write into the old one is still seen: by the next poll, which stats its directories
    (tmp_path / "run" / "checkpoint-10" / "late.txt").write_text("x")
    t.poll()
    assert {c.name: c.state for c in t.in_flight()}["checkpoint-10"] is State.WRITING


@pytest.mark.parametrize("mtime", [0.0, 1_000_000_000.0])  # 1970, and 2001
def test_mtimes_far_in_the_past_do_not_complete_anything_early(tmp_path, clock, mtime):
    """A wall-clock step (NTP) or a skewed NFS server moves mtimes relative to 'now'; the daemon
    compares mtimes only with each other (in the fingerprint) and times quiet on the monotonic clock.
    (An mtime in the future holds it back: the next test.)"""
    from ckptd.cli.demo_volume import age

    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    age(ckpt, mtime)
    t = tracker(tmp_path, clock)
    start(t)
    assert t.step(clock.advance(59.9)).completed == []
    assert [c.rel for c in t.step(clock.advance(0.1)).completed] == ["run/checkpoint-10"]


def test_a_future_mtime_is_not_quiet_for_the_daemon_either(tmp_path, clock):
    """README: 'a future mtime is not quiet'. plan said 'writing'; the daemon settled it anyway,
    on its fingerprint. Now it waits until the wall clock has passed the mtime (a writer on a
    host whose clock runs ahead), and does not look again every step meanwhile."""
    wall = Clock(1_800_000_000.0)
    ahead = 300.0
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=wall.t + ahead)
    t = RootTracker(Root(path=tmp_path, quiet_period=60, world_size=2), clock, wall=wall)
    start(t)
    [c] = t.checkpoints()
    assert c.state is State.WRITING and c.checks[0].detail == "newest mtime is 300.0s in the future (clock skew?)"
    t.step(clock.advance(HINT_DEBOUNCE))
    # not the quiet period's end (the look that set it came HINT_DEBOUNCE before, or at, this step)
    assert t.next_deadline() == pytest.approx(clock.t + ahead, abs=HINT_DEBOUNCE)
    wall.advance(120)
    assert t.step(clock.advance(120)).completed == []  # quiet period over, mtime still ahead
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    wall.advance(ahead)
    changes = t.step(clock.advance(ahead))
    assert [c.rel for c in changes.completed] == ["run/checkpoint-10"]  # unchanged all along


def test_the_daemon_learns_a_runs_rank_count_from_its_complete_checkpoints(tmp_path, clock):
    from tests.support.ddpfiles import ddp_checkpoint

    run = tmp_path / "run"
    ddp_checkpoint(run, 100, 8, 1_700_000_000.0)
    t = RootTracker(Root(path=tmp_path, quiet_period=60), clock)
    start(t)
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-100": State.COMPLETE}
    ddp_checkpoint(run, 200, 7, 1_700_000_100.0)  # rank 7 killed before its rng_state
    t.poll()
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-100": State.COMPLETE, "run/checkpoint-200": State.INCOMPLETE}
    [c] = [c for c in t.checkpoints() if c.name == "checkpoint-200"]
    assert c.checks[-1].name == "rank census" and c.checks[-1].verdict is Verdict.FAILED


# --- what a reconcile costs: O(directories) for complete checkpoints -----------------


class MetadataCounter:
    """Counts the metadata operations this process makes: stat calls (os.stat, os.lstat,
    DirEntry.stat), directory listings (os.scandir, os.listdir) and opens (os.open, open)."""

    def __init__(self, monkeypatch):
        import builtins
        from collections import Counter

        self.counts: Counter[str] = Counter()
        counts = self.counts

        def counted(kind, fn):
            def wrapper(*a, **kw):
                counts[kind] += 1
                return fn(*a, **kw)

            return wrapper

        class Entry:
            __slots__ = ("_e",)

            def __init__(self, e):
                self._e = e

            def __getattr__(self, name):
                return getattr(self._e, name)

            def __fspath__(self):
                return self._e.path

            def stat(self, *, follow_symlinks=True):
                counts["stat"] += 1
                return self._e.stat(follow_symlinks=follow_symlinks)

        class Listing:
            def __init__(self, it):
                self._it = it

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._it.close()

            def __iter__(self):
                return (Entry(e) for e in self._it)

            def close(self):
                self._it.close()

        real_scandir = os.scandir

        def scandir(path="."):
            counts["listing"] += 1
            return Listing(real_scandir(path))

        monkeypatch.setattr(os, "stat", counted("stat", os.stat))
        monkeypatch.setattr(os, "lstat", counted("stat", os.lstat))
        monkeypatch.setattr(os, "scandir", scandir)
        monkeypatch.setattr(os, "listdir", counted("listing", os.listdir))
        monkeypatch.setattr(os, "open", counted("open", os.open))
        monkeypatch.setattr(builtins, "open", counted("open", builtins.open))

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        self.counts.clear()
        return out


def complete_volume(root: Path, clock: Clock, runs: int = 3, per_run: int = 4) -> RootTracker:
    for r in range(runs):
        for i in range(per_run):
            hf_deepspeed_checkpoint(root / f"team-{r % 2}" / f"run-{r}", 10 * (i + 1), world=4)
    t = tracker(root, clock)
    start(t)
    t.step(clock.advance(60))
    assert set(states(t).values()) == {State.COMPLETE}
    return t


def test_a_reconcile_stats_the_directories_of_complete_checkpoints_and_reads_nothing(tmp_path, clock,
                                                                                    monkeypatch):
    """The metadata load a reconcile puts on a shared filesystem's metadata server: the directories
    on the way to runs are listed, each complete checkpoint's two directories stat'ed and the few
    files whose contents a decision rests on (trainer_state.json, config.json, the model states, latest: a
    rewrite in place changes no directory), no file opened, no other file stat'ed (counts are
    exact, so the bound is tight)."""
    t = complete_volume(tmp_path, clock)
    counter = MetadataCounter(monkeypatch)
    t.full_scan()
    ops = counter.take()
    dirs, ckpts = len(t.dirs), len(t.checkpoints())
    stamps = [len(r.dirs) for r in t.scanner.verdicts._records.values()]
    assert len(stamps) == ckpts and max(stamps) <= 2 + 4  # two directories, four files (and DeepSpeed's latest)
    assert ops.get("open", 0) == 0
    assert ops["listing"] <= dirs
    assert ops["stat"] <= 1 + dirs + sum(stamps)  # the root; each listed directory; each checkpoint's stamps
    files = sum(1 for _ in tmp_path.rglob("*"))
    t.full_scan(deep=True)  # what every reconcile cost before: every entry stat'ed (nothing read again)
    deep = counter.take()
    assert deep["stat"] > files and deep.get("open", 0) == 0


def test_an_idle_poll_stats_only_the_directories_on_the_way(tmp_path, clock, monkeypatch):
    t = complete_volume(tmp_path, clock)
    counter = MetadataCounter(monkeypatch)
    t.poll()
    assert counter.take() == {"stat": len(t.dirs)}


def test_a_checkpoint_rewritten_in_place_is_looked_at_when_the_reaper_refuses(tmp_path, clock):
    """A file rewritten in place changes no directory, so a reconcile does not see it; the
    reaper's re-check does (it walks every entry), and its refusal sends the tracker to look."""
    t = complete_volume(tmp_path, clock, runs=1, per_run=2)
    ckpt = tmp_path / "team-0" / "run-0" / "checkpoint-10"
    with open(ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "r+b") as f:
        f.truncate(100)  # same name, same directory entries
    t.full_scan()
    assert states(t)["team-0/run-0/checkpoint-10"] is State.COMPLETE  # not seen: no directory changed
    t.refused("team-0/run-0/checkpoint-10")
    assert states(t)["team-0/run-0/checkpoint-10"] is State.WRITING


def test_a_refusal_also_looks_at_the_runs_newest_complete_checkpoint(tmp_path, clock):
    t = complete_volume(tmp_path, clock, runs=1, per_run=3)
    newest = tmp_path / "team-0" / "run-0" / "checkpoint-30"
    (newest / "trainer_state.json").write_text("{}")  # rewritten in place: the anchor changed
    t.refused("team-0/run-0/checkpoint-10")
    assert states(t)["team-0/run-0/checkpoint-30"] is State.WRITING


def test_a_tracker_file_rewritten_beside_complete_checkpoints_is_seen_by_a_reconcile(tmp_path, clock):
    """Megatron's tracker is rewritten in place in the run directory; the evidence of every
    checkpoint of the run reads it, so a change to it (here: a job restarted from scratch)
    makes the reconcile look at them all."""
    from ckptd.cli.demo_volume import write_zip

    run = tmp_path / "run"
    for step in (1000, 2000):
        write_zip(run / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("2000")
    t = tracker(tmp_path, clock)
    start(t)
    t.step(clock.advance(60))
    assert set(states(t).values()) == {State.COMPLETE}
    (run / "latest_checkpointed_iteration.txt").write_text("1000")
    t.full_scan()
    assert states(t) == {"run/iter_0001000": State.COMPLETE, "run/iter_0002000": State.INCOMPLETE}


# --- incomplete and stalled checkpoints: backed-off looks ------------------------------


@pytest.fixture
def crashed(tmp_path, clock, monkeypatch):
    """A checkpoint whose rank 1 shard was left truncated (a crashed save), incomplete, and a
    record of every walk of it."""
    import ckptd.judge.evidence as evidence

    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    shard = ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"\0" * 100)
    t = tracker(tmp_path, clock)
    start(t)
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.INCOMPLETE}
    walks: list[Path] = []
    real_walk = evidence.walk
    monkeypatch.setattr(evidence, "walk", lambda p: walks.append(p) or real_walk(p))
    return t, ckpt, shard, walks


def polls_that_walked(t: RootTracker, clock: Clock, walks: list[Path], n: int) -> list[int]:
    out = []
    for i in range(1, n + 1):
        before = len(walks)
        clock.advance(t.root.poll_interval)
        t.poll()
        if len(walks) > before:
            out.append(i)
    return out


def test_an_unchanged_incomplete_checkpoint_is_looked_at_less_and_less(crashed, clock):
    t, _, _, walks = crashed
    looked = polls_that_walked(t, clock, walks, 800)
    assert looked[:8] == [1, 3, 7, 15, 31, 63, 127, 255]  # spans 1, 2, 4, ... 128
    # then at most every 6 reconcile intervals (6 × 300 s = 180 polls of 10 s)
    assert [b - a for a, b in itertools.pairwise(looked[7:])] == [180, 180, 180]
    assert t.backoff["run/checkpoint-10"].span == 180


def test_a_file_created_in_a_backed_off_checkpoint_is_seen_at_the_next_poll(crashed, clock):
    t, ckpt, _, walks = crashed
    polls_that_walked(t, clock, walks, 8)
    (ckpt / "global_step10" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"x")
    assert polls_that_walked(t, clock, walks, 1) == [1]
    assert states(t) == {"run/checkpoint-10": State.WRITING}


def test_the_failed_file_rewritten_in_place_is_seen_at_the_next_poll(crashed, clock):
    """A resumed rank rewrites its truncated shard under the same name: no directory changes,
    but the files that failed their check are stat'ed at every poll."""
    from ckptd.cli.demo_volume import write_zip

    t, _, shard, walks = crashed
    polls_that_walked(t, clock, walks, 8)
    write_zip(shard, 1024)
    assert polls_that_walked(t, clock, walks, 1) == [1]
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.COMPLETE}


def test_an_event_looks_at_a_backed_off_checkpoint_at_once(crashed, clock):
    t, ckpt, _, walks = crashed
    polls_that_walked(t, clock, walks, 8)
    n = len(walks)
    t.hint(str(ckpt / "global_step10" / "x"), clock.t)  # inotify
    t.step(clock.advance(HINT_DEBOUNCE))
    assert len(walks) == n + 1


def test_a_reconcile_checks_a_backed_off_checkpoint_as_a_poll_does(crashed, clock):
    """Unchanged: not walked (its directories and failed files stat'ed); changed: walked; after a
    reload (a deep reconcile): walked."""
    t, ckpt, _, walks = crashed
    polls_that_walked(t, clock, walks, 8)
    n = len(walks)
    t.full_scan()
    assert len(walks) == n
    (ckpt / "global_step10" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"x")
    t.full_scan()
    assert len(walks) == n + 1
    t.full_scan(deep=True)
    assert len(walks) == n + 2


def test_a_megatron_tracker_written_late_is_seen_at_the_next_poll(tmp_path, clock, monkeypatch):
    """The tracker is rewritten in place in the run directory: no directory of the checkpoint
    changes, but a backed-off checkpoint's run context is stat'ed at every poll."""
    from ckptd.cli.demo_volume import write_zip

    run = tmp_path / "run"
    write_zip(run / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("500")
    t = tracker(tmp_path, clock)
    start(t)
    t.step(clock.advance(60))
    assert states(t) == {"run/iter_0001000": State.INCOMPLETE}
    for _ in range(20):
        clock.advance(10)
        t.poll()
    assert t.backoff["run/iter_0001000"].span > 1
    (run / "latest_checkpointed_iteration.txt").write_text("1000")
    clock.advance(10)
    t.poll()
    assert states(t) == {"run/iter_0001000": State.COMPLETE}


def test_after_missed_events_a_rescan_finds_every_checkpoint_saved_meanwhile(tmp_path, clock):
    """An inotify queue overflow drops events; the rescan it triggers (a poll) finds every save."""
    for r in range(30):
        hf_deepspeed_checkpoint(tmp_path / f"team{r % 3}" / f"run{r}", 10, world=2)
    t = tracker(tmp_path, clock)
    start(t)
    for r in range(30):  # a storm the daemon heard nothing of
        hf_deepspeed_checkpoint(tmp_path / f"team{r % 3}" / f"run{r}", 20, world=2)
    t.rescan_in_flight()
    assert {rel for rel in states(t) if rel.endswith("checkpoint-20")} == {
        f"team{r % 3}/run{r}/checkpoint-20" for r in range(30)}


# --- start-up: READY before every file is looked at ------------------------------------------


def test_an_error_in_the_first_looks_leaves_the_checkpoint_to_look_at(tmp_path, clock, monkeypatch):
    import errno

    import ckptd.judge.evidence as evidence

    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    real_walk = evidence.walk

    def failing(path):
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(evidence, "walk", failing)
    with pytest.raises(OSError):
        t.step(clock.t)
    monkeypatch.setattr(evidence, "walk", real_walk)
    assert list(t.unseen) == ["run/checkpoint-10"]
    t.step(clock.t)
    assert not t.unseen and t.runs["run"].checkpoints["checkpoint-10"].fingerprint


def restarted(root: Path, state: Path, clock: Clock) -> RootTracker:
    t = RootTracker(Root(path=root, quiet_period=60, world_size=2), clock, state_dir=state)
    t.scanner.verdicts.clock_ns = lambda: time.time_ns() + 10 * RACY_NS
    return t


def test_a_restart_walks_nothing_before_ready_and_completes_after_one_look(tmp_path, clock, monkeypatch):
    """With what the last process saved, the start-up scan stats directories only; each checkpoint
    is settling until its quiet period ends, when it is walked in full (its files read from the
    saved verdicts: nothing opened) and found complete."""
    import ckptd.judge.evidence as evidence

    for step in (10, 20):  # saved an hour ago (a checkpoint written lately is looked at once watched)
        hf_deepspeed_checkpoint(tmp_path / "vol" / "run", step, world=2, mtime=time.time() - 3600)
    state = tmp_path / "state"
    state.mkdir()
    first = restarted(tmp_path / "vol", state, clock)
    start(first)
    first.step(clock.advance(60))
    first.full_scan()  # a reconcile saves what was proven
    walks: list[Path] = []
    real_walk = evidence.walk
    monkeypatch.setattr(evidence, "walk", lambda p: walks.append(p) or real_walk(p))
    t = restarted(tmp_path / "vol", state, clock)
    counter = MetadataCounter(monkeypatch)
    t.full_scan()
    assert walks == [] and not t.unseen
    assert set(states(t).values()) == {State.SETTLING}
    stamps = sum(len(r.dirs) for r in t.scanner.verdicts._records.values())
    assert stamps <= 2 * (2 + 4)  # two directories, four files read for their contents (latest too), per checkpoint
    assert counter.take() == {"stat": 3 + stamps, "listing": 2}  # root, run and one more; each stamp
    t.step(clock.advance(59))
    assert walks == []
    changes = t.step(clock.advance(1))
    assert sorted(c.name for c in changes.completed) == ["checkpoint-10", "checkpoint-20"]
    assert len(walks) == 2 and counter.take().get("open", 0) == 0


def test_a_restored_checkpoint_changed_in_place_is_not_complete_after_its_look(tmp_path, clock):
    """Restored by its directories' stamps, a checkpoint whose file was rewritten in place while
    no ckptd ran is settling; the look at its quiet period's end sees the change."""
    ckpt = hf_deepspeed_checkpoint(tmp_path / "vol" / "run", 10, world=2)
    state = tmp_path / "state"
    state.mkdir()
    first = restarted(tmp_path / "vol", state, clock)
    start(first)
    first.step(clock.advance(60))
    first.full_scan()
    with open(ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "r+b") as f:
        f.truncate(100)
    t = restarted(tmp_path / "vol", state, clock)
    t.full_scan()
    assert states(t) == {"run/checkpoint-10": State.SETTLING}
    assert t.step(clock.advance(60)).completed == []
    assert states(t) == {"run/checkpoint-10": State.WRITING}
