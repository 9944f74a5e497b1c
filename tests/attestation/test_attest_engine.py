"""The engine's use of commit records, on saves the HF Trainer wrote itself (fwgen.py, 2-process DDP:
checkpoint-2..-8 whole, checkpoint-10 of run-rng with rank 1 killed before its rng_state_1.pth).

The records are written with `ckptd.attest.commit` the way each rank would (rank 0: everything
but rng_state_1.pth; rank 1: its rng_state_1.pth), without touching the Trainer's files."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ckptd import attest
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner
from ckptd.decide.policy import decide_run
from ckptd.model import ATTESTED, COMMIT_RECORDS, QUIET, State, Verdict
from tests.support import fwgen

pytestmark = pytest.mark.frameworks


@pytest.fixture(scope="module")
def trainer_saves(tmp_path_factory) -> Path:
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    return Path(fwgen.generate_trainer(tmp_path_factory.mktemp("attest-trainer"))["out_dir"])


def volume(src: Path, dest: Path) -> Path:
    """A copy keeping the Trainer's own mtimes (copy2): its save order stays as it wrote it."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


LATER = time.time() + 3600  # every quiet period over, by the wall clock `plan` uses


def attest_like_the_ranks(ck: Path, world: int = 2, ranks=(0, 1)) -> None:
    step = int(ck.name.rpartition("-")[2])
    theirs = {r: f"rng_state_{r}.pth" for r in range(1, world)}
    for r in ranks:
        if r == 0:
            files = [p.name for p in ck.iterdir() if p.is_file() and p.name not in theirs.values()]
        else:
            files = [theirs[r]] if (ck / theirs[r]).exists() else []
        began = min(p.stat().st_mtime for p in ck.iterdir() if p.is_file()) - 1
        attest.commit(ck, r, world, files, step=step, started_at=began)


def scan(root: Path, now: float):
    runs = Scanner(Root(path=root)).runs(now=now)
    return {c.rel: c for run in runs for c in run.checkpoints}, runs


def test_a_checkpoint_with_records_is_judged_no_worse_for_having_them(trainer_saves, tmp_path):
    """Same state, save times, holds, one-save and integrity checks and plan, and the record's
    `.ckptd/` is ckptd's metadata: not a run held inside, not a file that moves written_at."""
    plain = volume(trainer_saves, tmp_path / "plain")
    recorded = volume(trainer_saves, tmp_path / "recorded")
    for ck in sorted((recorded / "run-rng").iterdir()):
        attest_like_the_ranks(ck)
    before, runs_before = scan(plain, LATER)
    after, runs_after = scan(recorded, LATER)
    assert sorted(before) == sorted(after)
    for rel, b in before.items():
        a = after[rel]
        # the quiet check's detail counts the records' own mtimes (written after the save): its verdict
        assert [(k.name, k.verdict) for k in a.checks if k.name == QUIET] == [(QUIET, Verdict.PASSED)]
        theirs = [k for k in a.checks if k.name not in (QUIET, ATTESTED, COMMIT_RECORDS)]
        assert theirs == [k for k in b.checks if k.name != QUIET], rel
        for field in ("state", "saved_at", "written_at", "touched_at", "holds", "mounts", "ranks", "step"):
            assert getattr(a, field) == getattr(b, field), (rel, field)
    assert after["run-rng/checkpoint-8"].state is State.COMPLETE
    assert [k.name for k in after["run-rng/checkpoint-8"].checks if k.name == ATTESTED] == [ATTESTED]
    # rank 1 was killed before rng_state_1.pth: its record lists nothing; the census still refuses
    assert after["run-rng/checkpoint-10"].state is State.INCOMPLETE
    r = Retention(keep_last=1, keep_best=0)
    for rb, ra in zip(runs_before, runs_after, strict=True):
        got = [(d.checkpoint.name, d.action, d.reasons) for d in decide_run(ra, r)]
        assert got == [(d.checkpoint.name, d.action, d.reasons) for d in decide_run(rb, r)]


def test_records_from_every_rank_make_a_fresh_save_complete_without_the_quiet_period(trainer_saves, tmp_path):
    root = volume(trainer_saves, tmp_path / "vol")
    ck = root / "run-rng" / "checkpoint-8"
    now = max(p.stat().st_mtime for p in ck.iterdir()) + 1  # a second after the save: inside quiet_period
    seen, _ = scan(root, now)
    assert seen["run-rng/checkpoint-8"].state is State.WRITING
    attest_like_the_ranks(ck)
    seen, _ = scan(root, now)
    c = seen["run-rng/checkpoint-8"]
    assert c.state is State.COMPLETE, [str(k) for k in c.checks]


def test_a_rank_whose_record_never_came_keeps_the_checkpoint_incomplete_on_quiet(trainer_saves, tmp_path):
    root = volume(trainer_saves, tmp_path / "vol")
    ck = root / "run-rng" / "checkpoint-8"
    attest_like_the_ranks(ck, ranks=(0,))
    c = scan(root, LATER)[0]["run-rng/checkpoint-8"]
    assert c.state is State.INCOMPLETE
    assert "committed by 1/2 ranks; no record from rank 1" in [k.detail for k in c.checks]


def test_a_copy_in_without_its_weights_cannot_pass_on_its_records(trainer_saves, tmp_path):
    root = volume(trainer_saves, tmp_path / "vol")
    ck = root / "run-rng" / "checkpoint-8"
    attest_like_the_ranks(ck)
    copy = root / "run-rng" / "checkpoint-12"
    shutil.copytree(ck, copy, copy_function=shutil.copy)  # cp -r: new mtimes, and the weights left out
    (copy / "model.safetensors").unlink()
    c = scan(root, LATER)[0]["run-rng/checkpoint-12"]
    assert c.state is State.INCOMPLETE
    why = next(k.detail for k in c.checks if k.name == COMMIT_RECORDS)
    assert "model.safetensors, which is not there" in why


def test_a_live_lease_keeps_even_a_quiet_complete_save_in_flight(trainer_saves, tmp_path):
    root = volume(trainer_saves, tmp_path / "vol")
    ck = root / "run-rng" / "checkpoint-8"
    with attest.saving(ck, 1, 2):
        c = scan(root, LATER)[0]["run-rng/checkpoint-8"]
        assert c.state is State.WRITING
    assert not (ck / ".ckptd" / "lease-rank1-of-2.json").exists()
