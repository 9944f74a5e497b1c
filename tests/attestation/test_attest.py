"""Commit records: the writer (ckptd.attest) on a real tmp filesystem, and the judge
(ckptd.judge.attestation) with `now` passed in. The engine's use of them on real framework saves is in
test_attest_frameworks.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from ckptd import attest
from ckptd.judge import attestation
from ckptd.judge.evidence import walk
from ckptd.model import (
    ATTESTED,
    COMMIT_RECORDS,
    QUIET,
    SAVE_LEASE,
    Check,
    State,
    Verdict,
    classify,
    deciding_check,
)
from tests.support.common import REPO

NOW = 1_800_000_000.0


def files_of(path: Path):
    return {e.rel: e for e in walk(path)}


def judged(path: Path, now: float) -> list[Check]:
    files = files_of(path)
    records, leases, problems = attestation.read(path, files)
    return attestation.judge(records, leases, problems, files, now=now)


def write(path: Path, data: bytes = b"x" * 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# --- the writer ---------------------------------------------------------------------------------


def test_commit_writes_the_record_atomically_with_files_sizes_and_identity(tmp_path):
    ck = tmp_path / "checkpoint-10"
    write(ck / "model.safetensors", b"w" * 1000)
    write(ck / "rng_state_1.pth", b"r" * 10)
    path = attest.commit(ck, 1, 2, ["rng_state_1.pth"], step=10, hash_files=True, job="J1")
    assert path == ck / ".ckptd" / "commit-rank1-of-2.json"
    doc = json.loads(path.read_text())
    assert doc["rank"] == 1 and doc["world_size"] == 2 and doc["step"] == 10 and doc["job_id"] == "J1"
    assert doc["pid"] == os.getpid() and doc["host"]
    assert [(f["path"], f["size"]) for f in doc["files"]] == [("rng_state_1.pth", 10)]
    assert doc["files"][0]["blake2b_sample"] == attest.fast_hash(ck / "rng_state_1.pth", 10)
    assert sorted(p.name for p in (ck / ".ckptd").iterdir()) == ["commit-rank1-of-2.json"]  # no temp left


def test_commit_refuses_a_rank_outside_the_world_and_a_file_that_is_not_there(tmp_path):
    with pytest.raises(ValueError, match=r"rank 2 is not in 0\.\.world_size-1"):
        attest.commit(tmp_path, 2, 2)
    with pytest.raises(FileNotFoundError):
        attest.commit(tmp_path, 0, 1, ["missing.pt"])
    assert not (tmp_path / ".ckptd" / "commit-rank0-of-1.json").exists()


def _lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckptd-lease-")]


def test_saving_holds_a_live_lease_then_records_what_changed_since_entry(tmp_path):
    ck = tmp_path / "checkpoint-20"
    write(ck / "old.bin", b"o" * 5)  # there before the save: not this save's
    with attest.saving(ck, 0, 1, step=20, heartbeat=0.01) as save:
        lease = ck / ".ckptd" / "lease-rank0-of-1.json"
        assert json.loads(lease.read_text())["token"] == save.token
        os.utime(lease, (1, 1))  # the heartbeat thread moves it on again
        deadline = time.monotonic() + 10
        while os.stat(lease).st_mtime == 1 and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # a bounded wait on the heartbeat thread
        assert os.stat(lease).st_mtime > 1, "no heartbeat within 10 s"
        assert classify(tuple(judged(ck, time.time()))) is State.WRITING
        write(ck / "model.safetensors", b"w" * 300)
    assert not _lease_threads()
    assert not lease.exists()
    doc = json.loads((ck / ".ckptd" / "commit-rank0-of-1.json").read_text())
    assert [(f["path"], f["size"]) for f in doc["files"]] == [("model.safetensors", 300)]
    assert doc["token"] == save.token and doc["started_at"] <= doc["committed_at"]


def test_saving_writes_no_record_on_an_exception_and_its_lease_goes_stale(tmp_path):
    ck = tmp_path / "checkpoint-30"
    with pytest.raises(RuntimeError), attest.saving(ck, 3, 4, heartbeat=0.01):
        write(ck / "shard3.pt")
        raise RuntimeError("disk full")
    assert not _lease_threads()
    assert not list((ck / ".ckptd").glob("commit-*"))
    lease = ck / ".ckptd" / "lease-rank3-of-4.json"
    beat = os.stat(lease).st_mtime
    checks = judged(ck, beat + attestation.STALE_AFTER + 1)
    assert [c.name for c in checks] == [COMMIT_RECORDS]
    assert checks[0].detail.startswith("abandoned: rank 3's save stopped at ")


def test_a_resave_in_place_drops_the_ranks_old_record_behind_its_lease(tmp_path):
    ck = tmp_path / "checkpoint-40"
    with attest.saving(ck, 0, 1):
        write(ck / "a.pt")
    with attest.saving(ck, 0, 1):
        assert not (ck / ".ckptd" / "commit-rank0-of-1.json").exists()
        assert (ck / ".ckptd" / "lease-rank0-of-1.json").exists()
        write(ck / "a.pt", b"y" * 7)
    assert json.loads((ck / ".ckptd" / "commit-rank0-of-1.json").read_text())["files"][0]["size"] == 7


# --- the judge ----------------------------------------------------------------------------------


def two_ranks(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    write(ck / "model.safetensors", b"w" * 1000)
    write(ck / "rng_state_0.pth", b"0" * 10)
    write(ck / "rng_state_1.pth", b"1" * 10)
    old = time.time() - 5
    for f in ck.iterdir():
        os.utime(f, (old, old))
    attest.commit(ck, 0, 2, ["model.safetensors", "rng_state_0.pth"], step=5, started_at=old - 1)
    attest.commit(ck, 1, 2, ["rng_state_1.pth"], step=5, started_at=old - 1)
    return ck


def test_every_rank_committed_and_the_disk_agreeing_stands_in_for_quiet(tmp_path):
    ck = two_ranks(tmp_path)
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(ATTESTED, Verdict.PASSED)]
    assert checks[0].detail.startswith("committed by 2/2 ranks at ")
    settling = Check(QUIET, Verdict.UNKNOWN, "settling")
    assert classify((settling, *checks)) is State.COMPLETE
    # ...and only for quiet: any other unpassed check still stands
    assert classify((settling, Check("census", Verdict.FAILED, "x"), *checks)) is State.INCOMPLETE
    assert classify((settling,)) is State.SETTLING


def test_the_check_said_to_hold_a_checkpoint_is_the_one_classify_decided_on():
    """The line that says why a checkpoint is not complete (plan's reasons, `latest`'s passed over,
    the daemon's) names the check `classify` decided on: where records stand in for the quiet period,
    the quiet check (first in the list) is no obstacle, and the census appended last is."""
    attested = Check(ATTESTED, Verdict.PASSED, "committed by 1/1 ranks")
    quiet = Check(QUIET, Verdict.FAILED, "last change 2s ago")
    census = Check("rank census", Verdict.FAILED, "1 ranks' files")
    lease = Check(SAVE_LEASE, Verdict.FAILED, "rank 0's save in progress")
    other = Check("trainer_state.json", Verdict.FAILED, "missing")
    assert classify((quiet, attested, census)) is State.INCOMPLETE
    assert deciding_check((quiet, attested, census)) == census
    assert deciding_check((quiet, attested)) is None and classify((quiet, attested)) is State.COMPLETE
    assert deciding_check((other, quiet, census)) == quiet  # no records: the quiet period is the obstacle
    assert deciding_check((quiet, other, lease)) == lease  # a live lease before any
    assert deciding_check((Check(QUIET, Verdict.PASSED, "quiet"), other, census)) == other


def test_some_ranks_records_but_not_all_is_incomplete_even_when_quiet(tmp_path):
    ck = two_ranks(tmp_path)
    (ck / ".ckptd" / "commit-rank1-of-2.json").unlink()
    checks = judged(ck, time.time())
    assert checks == [Check(COMMIT_RECORDS, Verdict.FAILED, "committed by 1/2 ranks; no record from rank 1")]
    assert classify((Check(QUIET, Verdict.PASSED, "quiet"), *checks)) is State.INCOMPLETE


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda ck: (ck / "model.safetensors").unlink(), "rank 0's record lists model.safetensors, which is not there"),
        (lambda ck: write(ck / "model.safetensors", b"w" * 999), "at 1000 bytes, the disk has 999"),
    ],
    ids=["copy-in without its weights", "size changed"],
)
def test_records_disagreeing_with_the_disk_make_it_incomplete_naming_why(tmp_path, damage, why):
    ck = two_ranks(tmp_path)
    damage(ck)
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(COMMIT_RECORDS, Verdict.FAILED)]
    assert why in checks[0].detail


def test_a_listed_file_at_another_mtime_only_leaves_the_records_vouching_for_nothing(tmp_path):
    """Every file at its listed size, one at another mtime (a copy without -p, a rewrite in place):
    the records no longer describe it, so they stand in for nothing, and veto nothing either: the
    quiet period and the framework's checks judge it, as without records."""
    ck = two_ranks(tmp_path)
    os.utime(ck / "rng_state_1.pth", (NOW, NOW))
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(COMMIT_RECORDS, Verdict.PASSED)]
    assert "rng_state_1.pth changed after rank 1's record (its mtime differs)" in checks[0].detail
    assert checks[0].detail.endswith("judged on quiet too")
    assert classify((Check(QUIET, Verdict.UNKNOWN, "settling"), *checks)) is State.SETTLING
    assert classify((Check(QUIET, Verdict.PASSED, "quiet"), *checks)) is State.COMPLETE


def _lease(ck: Path, rank: int, world: int, beat: float) -> None:
    lease = ck / ".ckptd" / f"lease-rank{rank}-of-{world}.json"
    lease.write_text(json.dumps({"ckptd_lease": 1, "token": f"old{rank}", "host": "h", "pid": 7, "heartbeat": 10}))
    os.utime(lease, (beat, beat))


def test_a_whole_later_save_of_another_world_size_supersedes_an_abandoned_one(tmp_path):
    """A 2-rank save killed mid-way (its leases' heartbeat stopped long before), then a 1-rank job
    saving there again, whole: the dead save's leases are no save in progress any more."""
    ck = tmp_path / "ck"
    write(ck / "model.safetensors")
    (ck / ".ckptd").mkdir()
    now = time.time()
    for r in (0, 1):
        _lease(ck, r, 2, now - 3600)
    attest.commit(ck, 0, 1, ["model.safetensors"], started_at=now - 5)
    assert [c.name for c in judged(ck, now)] == [ATTESTED]
    # ...but a lease of the other world size still beating is a save in progress, even one whose
    # last beat came before the later save began
    _lease(ck, 1, 2, now - 30)
    assert [c.name for c in judged(ck, now)] == [SAVE_LEASE]


def test_an_incomplete_later_save_supersedes_nothing(tmp_path):
    """The later save of another world size has not every rank's record: the dead save's leases
    still say abandoned, and an earlier save's record still disagrees on the world size."""
    ck = tmp_path / "ck"
    write(ck / "model.safetensors")
    (ck / ".ckptd").mkdir()
    now = time.time()
    _lease(ck, 1, 2, now - 3600)
    attest.commit(ck, 0, 4, ["model.safetensors"], started_at=now - 5)
    [check] = judged(ck, time.time())
    assert check.verdict is Verdict.FAILED and check.detail.startswith("abandoned: rank 1's save stopped")
    (ck / ".ckptd" / "lease-rank1-of-2.json").unlink()
    attest.commit(ck, 1, 2, ["model.safetensors"], started_at=now - 3700)
    [check] = judged(ck, time.time())
    assert check.detail.startswith("records disagree on the world size (2, 4)")


def test_a_live_lease_blocks_judgement_a_stale_one_is_abandoned(tmp_path):
    ck = two_ranks(tmp_path)
    lease = ck / ".ckptd" / "lease-rank1-of-2.json"
    lease.write_text(json.dumps({"ckptd_lease": 1, "token": "new", "host": "h", "pid": 7, "heartbeat": 10}))
    os.utime(lease, (NOW, NOW))
    live = judged(ck, NOW + 30)
    assert [(c.name, c.verdict) for c in live] == [(SAVE_LEASE, Verdict.FAILED)]
    assert "rank 1's save (h, pid 7) in progress" in live[0].detail
    assert classify((Check(QUIET, Verdict.PASSED, "q"), *live)) is State.WRITING
    assert judged(ck, NOW - 600)[0].name == SAVE_LEASE  # a heartbeat from a clock ahead: still live
    stale = judged(ck, NOW + attestation.STALE_AFTER + 1)
    assert stale[0].name == COMMIT_RECORDS and stale[0].verdict is Verdict.FAILED
    assert stale[0].detail.startswith("abandoned: rank 1's save stopped at 2027-01-15T08:00:00Z")


def test_a_lease_left_by_a_save_that_committed_is_not_a_save_in_progress(tmp_path):
    """Killed between writing its record and removing its lease: the record's token is the lease's."""
    ck = tmp_path / "ck"
    with attest.saving(ck, 0, 1) as save:
        write(ck / "a.pt")
        lease_doc = (ck / ".ckptd" / "lease-rank0-of-1.json").read_text()
    (ck / ".ckptd" / "lease-rank0-of-1.json").write_text(lease_doc)
    assert json.loads(lease_doc)["token"] == save.token
    assert [c.name for c in judged(ck, time.time())] == [ATTESTED]


@pytest.mark.parametrize(
    "doc, why",
    [
        ({"ckptd_commit": 1, "rank": 0, "world_size": 1, "files": [{"path": "../x", "size": 1, "mtime_ns": 1}],
          "committed_at": 1.0}, "outside the checkpoint"),
        ({"ckptd_commit": 1, "rank": 1, "world_size": 1, "files": [], "committed_at": 1.0}, "its name says rank 0 of 1"),
        ({"ckptd_commit": 2}, "not a version 1 commit record"),
    ],
)
def test_a_forged_or_malformed_record_fails_naming_why(tmp_path, doc, why):
    ck = tmp_path / "ck"
    write(ck / ".ckptd" / "commit-rank0-of-1.json", json.dumps(doc).encode())
    checks = judged(ck, NOW)
    assert checks[0].name == COMMIT_RECORDS and checks[0].verdict is Verdict.FAILED
    assert why in checks[0].detail


def test_files_no_record_lists_newer_than_the_save_leave_the_quiet_period_in_force(tmp_path):
    ck = two_ranks(tmp_path)
    write(ck / "eval_results.json")  # another writer, after the save began
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(COMMIT_RECORDS, Verdict.PASSED)]
    assert "no record lists eval_results.json: judged on quiet too" in checks[0].detail
    assert classify((Check(QUIET, Verdict.UNKNOWN, "settling"), *checks)) is State.SETTLING


def test_a_file_listed_by_two_ranks_passes_on_the_listing_the_disk_agrees_with(tmp_path):
    """On a shared filesystem rank 1's record may list rank 0's file as it was mid-write."""
    ck = tmp_path / "ck"
    write(ck / "trainer_state.json", b"{")
    attest.commit(ck, 1, 2, ["trainer_state.json"])
    write(ck / "trainer_state.json", b"{}")
    attest.commit(ck, 0, 2, ["trainer_state.json"])
    assert [c.name for c in judged(ck, time.time())] == [ATTESTED]


def test_without_records_nothing_is_added(tmp_path):
    write(tmp_path / "ck" / "model.safetensors")
    assert attestation.checks(tmp_path / "ck", files_of(tmp_path / "ck")) == []


def test_a_saved_look_is_not_restored_for_a_checkpoint_with_records(tmp_path):
    """Planning may restore a checkpoint as a look saved it while its directories are unchanged; a
    lease's heartbeat changes no directory, and its verdict hangs on the clock: looked at again."""
    from ckptd.config import Root
    from ckptd.decide.planner import Scanner
    from ckptd.judge.verdicts import Verdicts

    root = tmp_path / "vol"
    ck = root / "run" / "checkpoint-5"
    write(ck / "model.safetensors")
    lease = ck / ".ckptd" / "lease-rank0-of-1.json"
    write(lease, b"{}")
    beat = os.stat(lease).st_mtime
    later = Verdicts(clock_ns=lambda: time.time_ns() + 10**12)  # every file long clean to the cache
    scanner = Scanner(Root(path=root, patterns=[{"name": "checkpoint-{step}"}]), verdicts=later)
    [run] = scanner.runs(now=beat + 3600)
    assert run.checkpoints[0].state is State.WRITING
    os.utime(lease, (beat - 3600, beat - 3600))  # its heartbeat stopped an hour before
    [run] = scanner.runs(now=beat + 3600)
    assert run.checkpoints[0].state is State.INCOMPLETE
    assert "abandoned: rank 0's save stopped at" in run.checkpoints[0].checks[-1].detail


def test_a_saved_look_is_not_restored_when_only_time_passed(tmp_path, monkeypatch):
    """Nothing on disk changes, not even the lease: its heartbeat simply stops, and an hour later the
    save is abandoned, not still being written. Only the clock tells (attestation's wall clock,
    driven here), so a saved look of a checkpoint with records is never restored."""
    from types import SimpleNamespace

    from ckptd.config import Root
    from ckptd.decide.planner import Scanner
    from ckptd.judge.verdicts import Verdicts

    root = tmp_path / "vol"
    ck = root / "run" / "checkpoint-5"
    write(ck / "model.safetensors")
    lease = ck / ".ckptd" / "lease-rank0-of-1.json"
    write(lease, b"{}")
    beat = os.stat(lease).st_mtime
    wall = [beat + 1]
    monkeypatch.setattr(attestation, "time", SimpleNamespace(time=lambda: wall[0]))
    later = Verdicts(clock_ns=lambda: time.time_ns() + 10**12)  # every file long clean to the cache
    scanner = Scanner(Root(path=root, patterns=[{"name": "checkpoint-{step}"}]), verdicts=later)
    [run] = scanner.runs(now=beat + 3600)
    assert run.checkpoints[0].state is State.WRITING
    wall[0] = beat + 3600  # the heartbeat stopped an hour ago; no file changed
    [run] = scanner.runs(now=beat + 3600)
    assert run.checkpoints[0].state is State.INCOMPLETE
    assert "abandoned: rank 0's save stopped at" in run.checkpoints[0].checks[-1].detail


def test_records_disagreeing_on_the_world_size_fail(tmp_path):
    """A single-process save's record left beside a 2-rank save's rank 0: not every rank of either."""
    ck = tmp_path / "ck"
    write(ck / "a.pt")
    attest.commit(ck, 0, 1, ["a.pt"])
    attest.commit(ck, 0, 2, ["a.pt"])
    checks = judged(ck, time.time())
    assert checks == [Check(COMMIT_RECORDS, Verdict.FAILED, "records disagree on the world size (1, 2)")]


def test_a_record_claiming_its_save_began_later_hides_no_file_being_written(tmp_path):
    """A forged started_at (and committed_at) in the future would make every unlisted file look
    older than the save; the listed files' own mtimes bound the save's start instead."""
    ck = tmp_path / "ck"
    write(ck / "model.safetensors")
    path = attest.commit(ck, 0, 1, ["model.safetensors"])
    doc = json.loads(path.read_text())
    doc["started_at"] = doc["committed_at"] = NOW + 10**6
    path.write_text(json.dumps(doc))
    write(ck / "shard_of_another_writer.pt")  # being written now
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(COMMIT_RECORDS, Verdict.PASSED)]
    assert "no record lists shard_of_another_writer.pt" in checks[0].detail


def test_records_that_list_no_file_do_not_stand_in_for_quiet(tmp_path):
    """`commit(..., files=[])` from every rank, its times forged ahead: nothing on disk is vouched for,
    so a checkpoint being written beside it (complete on quiet alone, say) still waits its quiet period."""
    ck = tmp_path / "ck"
    ck.mkdir()
    path = attest.commit(ck, 0, 1, [])
    doc = json.loads(path.read_text())
    doc["started_at"] = doc["committed_at"] = NOW + 10**6
    path.write_text(json.dumps(doc))
    write(ck / "weights.bin")  # being written
    checks = judged(ck, time.time())
    assert [(c.name, c.verdict) for c in checks] == [(COMMIT_RECORDS, Verdict.PASSED)]
    assert classify((Check(QUIET, Verdict.FAILED, "writing"), *checks)) is State.WRITING


def test_a_record_claiming_a_huge_world_is_judged_at_once(tmp_path):
    ck = tmp_path / "ck"
    write(ck / "a.pt")
    world = 10**12
    attest.commit(ck, 3, world, ["a.pt"])
    t0 = time.monotonic()
    checks = judged(ck, time.time())
    assert time.monotonic() - t0 < 5
    assert checks[0].detail == f"committed by 1/{world} ranks; no record from rank 0, 1, 2, 4, 5, 6, 7, 8 ..."


def test_a_record_for_a_rank_outside_its_world_is_refused(tmp_path):
    ck = tmp_path / "ck"
    doc = {"ckptd_commit": 1, "rank": 2, "world_size": 2, "files": [], "committed_at": 1.0}
    write(ck / ".ckptd" / "commit-rank2-of-2.json", json.dumps(doc).encode())
    assert "rank 2 is not one of a world of 2" in judged(ck, NOW)[0].detail


def test_a_fifo_swapped_in_for_a_record_after_the_walk_blocks_nothing(tmp_path):
    ck = tmp_path / "ck"
    write(ck / ".ckptd" / "commit-rank0-of-1.json", b"{}")
    files = files_of(ck)  # the walk saw a regular file
    (ck / ".ckptd" / "commit-rank0-of-1.json").unlink()
    os.mkfifo(ck / ".ckptd" / "commit-rank0-of-1.json")
    records, _leases, problems = attestation.read(ck, files)
    assert records == [] and "unreadable" in problems[0]


def test_files_ckptd_slimmed_away_are_not_demanded_by_the_records(tmp_path):
    """A slim removes the optimizer shards a rank listed; its marker records that. Were they demanded,
    every slimmed checkpoint with records would turn incomplete, and retention never deletes those."""
    ck = two_ranks(tmp_path)
    (ck / "rng_state_1.pth").unlink()  # standing in for an optimizer shard the slim removed
    files = files_of(ck)
    records, leases, problems = attestation.read(ck, files)
    slimmed = attestation.judge(records, leases, problems, files, now=time.time(), removed={"rng_state_1.pth"})
    assert [(c.name, c.verdict) for c in slimmed] == [(ATTESTED, Verdict.PASSED)]
    assert judged(ck, time.time())[0].verdict is Verdict.FAILED  # removed by anything else: failed


def test_the_writer_and_the_integrations_import_no_framework_and_no_ckptd_dependency():
    """A training script pays nothing for `import ckptd.attest` or an integration until it is used."""
    import subprocess
    import sys

    code = (
        "import sys, ckptd.attest, ckptd.integrations.hf, ckptd.integrations.accelerate, "
        "ckptd.integrations.deepspeed, ckptd.integrations.lightning\n"
        "heavy = ('pydantic', 'transformers', 'torch', 'accelerate', 'deepspeed', 'lightning', 'watchdog')\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
