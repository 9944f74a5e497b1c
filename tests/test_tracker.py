"""Settling and the root tracker, on a real filesystem with a controllable monotonic clock."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ckptd.config import Root
from ckptd.demo import hf_deepspeed_checkpoint, write_zip
from ckptd.model import State, Verdict
from ckptd.settle import Settler
from ckptd.tracker import HINT_DEBOUNCE, RootTracker


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


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


@pytest.fixture
def clock():
    return Clock()


def tracker(root: Path, clock: Clock, **kw) -> RootTracker:
    return RootTracker(Root(path=root, quiet_period=60, world_size=2, **kw), clock)


def states(t: RootTracker) -> dict[str, State]:
    return {c.rel: c.state for c in t.checkpoints()}


def test_a_checkpoint_completes_one_quiet_period_after_it_stops_changing(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    start = clock.t
    assert states(t) == {"run/checkpoint-10": State.SETTLING}
    assert t.next_deadline() == start + HINT_DEBOUNCE  # a second look, once its watch exists
    assert t.step(clock.advance(HINT_DEBOUNCE)).completed == []
    assert t.next_deadline() == start + 60
    assert t.step(clock.advance(59 - HINT_DEBOUNCE)).completed == []
    changes = t.step(clock.advance(1))
    assert [c.rel for c in changes.completed] == ["run/checkpoint-10"]
    assert states(t) == {"run/checkpoint-10": State.COMPLETE}


def test_a_write_moves_it_back_to_writing(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    clock.advance(30)
    write_zip(ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 5000)
    t.poll()
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    assert t.step(clock.advance(59)).completed == []
    assert t.step(clock.advance(1)).completed != []


def test_a_missing_shard_keeps_it_incomplete_then_stalled(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, skip={"zero_pp_rank_1_mp_rank_00_optim_states.pt"})
    t = tracker(tmp_path, clock, stall_after=3600)
    t.full_scan()
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.INCOMPLETE}
    clock.advance(3600)
    t.poll()
    assert states(t) == {"run/checkpoint-10": State.STALLED}


def test_polling_finds_new_runs_and_checkpoints_by_directory_mtime(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "a", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    hf_deepspeed_checkpoint(tmp_path / "team" / "b", 5, world=2)
    hf_deepspeed_checkpoint(tmp_path / "a", 20, world=2)
    t.poll()
    assert set(states(t)) == {"a/checkpoint-10", "a/checkpoint-20", "team/b/checkpoint-5"}


def test_polling_does_not_walk_complete_checkpoints(tmp_path, clock, monkeypatch):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-10": State.COMPLETE}
    walked = []
    import ckptd.evidence as evidence

    real_walk = evidence.walk
    monkeypatch.setattr(evidence, "walk", lambda p: walked.append(p) or real_walk(p))
    t.poll()
    assert walked == []
    t.full_scan()  # reconcile looks again
    assert walked == [tmp_path / "run" / "checkpoint-10"]


def test_vanished_checkpoints_are_forgotten(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    shutil.rmtree(ckpt)
    changes = t.poll()
    assert changes.vanished == ["run/checkpoint-10"]
    assert set(states(t)) == {"run/checkpoint-20"}


def test_hints_map_paths_to_checkpoints_runs_and_directories(tmp_path, clock):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "team" / "run", 10, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    deadline = t.settler.deadline("team/run/checkpoint-10")
    t.hint(str(ckpt / "global_step10" / "x.pt"), clock.advance(5))
    assert t.settler.deadline("team/run/checkpoint-10") == deadline + 5
    assert "team/run/checkpoint-10" in t.hints
    t.hint(str(tmp_path / "team" / "run" / "checkpoint-20"), clock.t)
    t.hint(str(tmp_path / "team" / "new-run"), clock.t)
    t.hint(str(tmp_path / ".ckptd-trash" / "x"), clock.t)
    t.hint("/somewhere/else", clock.t)
    assert t.dirty_dirs == {"team/run", "team"}


def test_watches_are_narrow(tmp_path, clock):
    hf_deepspeed_checkpoint(tmp_path / "team" / "run", 10, world=2)
    hf_deepspeed_checkpoint(tmp_path / "team" / "run", 20, world=2)
    t = tracker(tmp_path, clock)
    t.full_scan()
    t.step(clock.advance(60))
    hf_deepspeed_checkpoint(tmp_path / "team" / "run", 30, world=2)
    t.poll()
    assert t.wanted_watches() == {
        (str(tmp_path), False),
        (str(tmp_path / "team"), False),
        (str(tmp_path / "team" / "run"), False),
        (str(tmp_path / "team" / "run" / "checkpoint-30"), True),  # only the one in flight, deeply
    }


def test_at_start_only_checkpoints_written_lately_are_watched_deeply(tmp_path, clock):
    """Every checkpoint settles once after a start; one whose files are all older than the
    quiet period (most of a volume) is polled, not watched."""
    from ckptd.demo import age

    age(hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2), time.time() - 3600)
    hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2)  # being written as the daemon starts
    t = tracker(tmp_path, clock)
    t.full_scan()
    assert {c.name: c.state for c in t.in_flight()} == {"checkpoint-10": State.SETTLING,
                                                         "checkpoint-20": State.SETTLING}
    assert t.wanted_watches() == {(str(tmp_path), False), (str(tmp_path / "run"), False),
                                  (str(tmp_path / "run" / "checkpoint-20"), True)}
    # a write into the old one is still seen: by the next poll, as a change of its fingerprint
    (tmp_path / "run" / "checkpoint-10" / "late.txt").write_text("x")
    t.poll()
    assert {c.name: c.state for c in t.in_flight()}["checkpoint-10"] is State.WRITING
    assert (str(tmp_path / "run" / "checkpoint-10"), True) in t.wanted_watches()


@pytest.mark.parametrize("mtime", [0.0, 1_000_000_000.0])  # 1970, and 2001
def test_mtimes_far_in_the_past_do_not_complete_anything_early(tmp_path, clock, mtime):
    """A wall-clock step (NTP) or a skewed NFS server moves mtimes relative to 'now'; the daemon
    compares mtimes only with each other (in the fingerprint) and times quiet on the monotonic clock.
    (An mtime in the future holds it back: the next test.)"""
    from ckptd.demo import age

    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    age(ckpt, mtime)
    t = tracker(tmp_path, clock)
    t.full_scan()
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
    t.full_scan()
    [c] = t.checkpoints()
    assert c.state is State.WRITING and c.checks[0].detail == "newest mtime is 300.0s in the future (clock skew?)"
    t.step(clock.advance(HINT_DEBOUNCE))
    assert t.next_deadline() == pytest.approx(clock.t + ahead)  # not the quiet period's end
    wall.advance(120)
    assert t.step(clock.advance(120)).completed == []  # quiet period over, mtime still ahead
    assert states(t) == {"run/checkpoint-10": State.WRITING}
    wall.advance(ahead)
    changes = t.step(clock.advance(ahead))
    assert [c.rel for c in changes.completed] == ["run/checkpoint-10"]  # unchanged all along


def test_the_daemon_learns_a_runs_rank_count_from_its_complete_checkpoints(tmp_path, clock):
    from test_evidence import ddp_checkpoint

    run = tmp_path / "run"
    ddp_checkpoint(run, 100, 8, 1_700_000_000.0)
    t = RootTracker(Root(path=tmp_path, quiet_period=60), clock)
    t.full_scan()
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-100": State.COMPLETE}
    ddp_checkpoint(run, 200, 7, 1_700_000_100.0)  # rank 7 killed before its rng_state
    t.poll()
    t.step(clock.advance(60))
    assert states(t) == {"run/checkpoint-100": State.COMPLETE, "run/checkpoint-200": State.INCOMPLETE}
    [c] = [c for c in t.checkpoints() if c.name == "checkpoint-200"]
    assert c.checks[-1].name == "rank census" and c.checks[-1].verdict is Verdict.FAILED
