"""The reaper: re-checks before acting, crash-safe trash, journal. Real filesystem."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import Action
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.fleet.locks import LockHeld, RootLock
from ckptd.journal import Journal, read_journal
from ckptd.removal import fs
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import in_trash
from tests.support.volumes import NOW, OLD, make, names
from tests.support.volumes import volume as volume


def test_deletes_what_the_plan_says_via_the_trash(volume, tmp_path):
    reaper, plan, journal = make(volume, tmp_path)
    assert [d.checkpoint.step for d in plan.deletions] == [10, 20, 30]
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3
    assert names(volume) == ["checkpoint-40"]
    assert len(in_trash(volume / TRASH_DIR)) == 3
    count, freed = reaper.purge()
    assert count == 3 and freed == sum(d.checkpoint.size_bytes for d in plan.deletions)
    assert os.listdir(volume / TRASH_DIR) == []
    journal.close()
    events = [(r["event"], Path(r.get("path", r.get("trash", ""))).name) for r in read_journal(tmp_path / "state")]
    assert [e for e, _ in events] == ["trashing", "trashed"] * 3 + ["purging", "purged"] * 3
    assert events[0] == ("trashing", "checkpoint-10")
    first = read_journal(tmp_path / "state")[0]
    assert first["step"] == 10 and first["reasons"] == ["outside keep_last=1"] and first["bytes"] > 0


def test_dry_run_reaches_the_reaper_and_moves_nothing(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path, dry_run=True)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.DRY_RUN] * 3
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert not (volume / TRASH_DIR).exists()
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        # a resumed job re-saving the same step: size changes, mtime put back
        (lambda ck: (ck / "config.json").write_text('{"changed": true}') or age(ck, OLD), "changed since the plan was made"),
        (lambda ck: (ck / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
         or age(ck, OLD), "no longer complete (incomplete)"),
        (lambda ck: os.utime(ck / "config.json", (NOW - 1, NOW - 1)), "no longer complete (writing)"),
        (lambda ck: (ck / PIN_FILE).write_text("") or age(ck, OLD), "pinned"),
        (lambda ck: os.rename(ck, ck.with_name("moved")), "no longer exists"),
    ],
)
def test_recheck_refuses_what_changed_after_the_plan(volume, tmp_path, tamper, why):
    reaper, plan, _ = make(volume, tmp_path)
    tamper(volume / "run" / "checkpoint-10")
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (Outcome.REFUSED, why)
    assert results[20].outcome is Outcome.TRASHED  # the others are unaffected


def test_recheck_refuses_when_the_runs_newest_complete_is_gone(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path)
    os.rename(volume / "run" / "checkpoint-40", tmp_path / "elsewhere")
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert "newest complete checkpoint checkpoint-40 is gone" in results[0].detail
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]


def test_recheck_refuses_a_checkpoint_swapped_for_a_symlink(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path)
    ck = volume / "run" / "checkpoint-10"
    os.rename(ck, tmp_path / "real-10")
    ck.symlink_to(tmp_path / "real-10")
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (Outcome.REFUSED, "is a symlink")
    assert (tmp_path / "real-10" / "trainer_state.json").exists()


def test_recheck_refuses_a_run_directory_swapped_for_a_symlink(volume, tmp_path):
    """Time of check to time of use: the run directory becomes a link to outside the root."""
    reaper, plan, _ = make(volume, tmp_path)
    outside = tmp_path / "outside-run"
    os.rename(volume / "run", outside)
    (volume / "run").symlink_to(outside)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert results[0].detail.startswith("reached through a symlink")
    assert sorted(os.listdir(outside)) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]


def test_purge_does_not_follow_symlinks_inside_a_checkpoint(volume, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    write_zip(precious / "weights.pt")
    ck = volume / "run" / "checkpoint-10"
    (ck / "link-to-outside").symlink_to(precious)
    (ck / "file-link").symlink_to(precious / "weights.pt")
    age(ck, OLD)
    reaper, plan, _ = make(volume, tmp_path)
    assert plan.deletions[0].checkpoint.step == 10
    reaper.execute(plan.decisions)
    reaper.purge()
    assert (precious / "weights.pt").is_file()
    assert names(volume) == ["checkpoint-40"]


def test_rename_failure_is_reported_and_leaves_the_checkpoint(volume, tmp_path):
    (volume / TRASH_DIR).write_text("not a directory")  # stands in for EXDEV/EROFS: rename cannot happen
    reaper, plan, _ = make(volume, tmp_path)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.FAILED}
    assert "is not a directory" in results[0].detail
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]


def test_the_newest_complete_is_never_a_deletion(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path)
    newest = next(d for d in plan.decisions if d.checkpoint.step == 40)
    forged = type(newest)(newest.checkpoint, Action.DELETE, ("forged",))
    [result] = reaper.execute([forged])
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "it is its run's newest complete checkpoint")


def test_a_decision_for_another_root_is_ignored(volume, tmp_path):
    other = tmp_path / "other"
    hf_deepspeed_checkpoint(other / "run", 1, world=2, mtime=OLD)
    hf_deepspeed_checkpoint(other / "run", 2, world=2, mtime=OLD)
    reaper, _, _ = make(volume, tmp_path)
    _, other_plan, _ = make(other, tmp_path)
    assert reaper.execute(other_plan.decisions) == []
    assert sorted(os.listdir(other / "run")) == ["checkpoint-1", "checkpoint-2"]


def test_one_lock_holder_per_root(tmp_path):
    (tmp_path / "vol").mkdir()  # a root that is not there cannot be locked (RootLockUnavailable)
    a = RootLock(tmp_path / "state", tmp_path / "vol")
    b = RootLock(tmp_path / "state", tmp_path / "vol")
    a.acquire()
    with pytest.raises(LockHeld):
        b.acquire()
    a.release()
    b.acquire()
    b.release()


def test_purge_stops_between_entries_when_asked(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path)
    reaper.execute(plan.decisions)
    asked = []
    count, _ = reaper.purge(stop=lambda: asked.append(1) or len(asked) > 1)
    assert count == 1 and len(in_trash(volume / TRASH_DIR)) == 2  # the rest waits for the next purge
    assert reaper.purge()[0] == 2


def test_a_run_directory_swapped_during_the_recheck_is_refused(volume, tmp_path, monkeypatch):
    """The swap lands after the run directory was opened and while the checkpoint is being
    re-checked: the window a path-based delete would lose."""
    reaper, plan, _ = make(volume, tmp_path)
    outside = tmp_path / "outside-run"
    real_recheck = reaper.rechecks.recheck

    def recheck_then_swap(decision, anchor):
        why = real_recheck(decision, anchor)
        if not (volume / "run").is_symlink():
            os.rename(volume / "run", outside)
            (volume / "run").symlink_to(outside)
        return why

    monkeypatch.setattr(reaper.rechecks, "recheck", recheck_then_swap)
    results = reaper.execute(plan.decisions)
    assert results[0].outcome is Outcome.REFUSED
    assert results[0].detail == "moved or replaced while it was being checked"
    assert all(r.detail.startswith("reached through a symlink") for r in results[1:])
    assert sorted(os.listdir(outside)) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert not (volume / TRASH_DIR).exists() or os.listdir(volume / TRASH_DIR) == []


def test_a_checkpoint_replaced_by_another_directory_during_the_recheck_is_refused(volume, tmp_path, monkeypatch):
    """Same run directory, a different inode under the checkpoint's name: the rename would take
    the newcomer, which nobody checked."""
    reaper, plan, _ = make(volume, tmp_path)
    real_recheck = reaper.rechecks.recheck
    ck = volume / "run" / "checkpoint-10"

    def recheck_then_replace(decision, anchor):
        why = real_recheck(decision, anchor)
        if decision.checkpoint.step == 10:
            os.rename(ck, tmp_path / "old-10")
            ck.mkdir()
            (ck / "precious").write_text("written after the check")
        return why

    monkeypatch.setattr(reaper.rechecks, "recheck", recheck_then_replace)
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (Outcome.REFUSED, "moved or replaced while it was being checked")
    assert (ck / "precious").read_text() == "written after the check"
    assert results[20].outcome is Outcome.TRASHED


def test_a_checkpoint_replaced_by_a_file_is_no_longer_recognised(volume, tmp_path):
    reaper, plan, _ = make(volume, tmp_path)
    ck = volume / "run" / "checkpoint-10"
    shutil.rmtree(ck)
    ck.write_text("not a checkpoint any more")
    age(ck, OLD)
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (Outcome.REFUSED, "no longer recognised as a checkpoint")
    assert ck.read_text() == "not a checkpoint any more"


def test_an_anchor_that_changed_but_is_still_complete_stops_the_deletions(volume, tmp_path):
    """The newest complete checkpoint was re-saved after the plan: the plan is stale."""
    reaper, plan, _ = make(volume, tmp_path)
    newest = volume / "run" / "checkpoint-40"
    (newest / "config.json").write_text('{"re-saved": true}')
    age(newest, OLD + 3)
    assert make(volume, tmp_path)[1].deletions  # still complete: a fresh plan would delete the same
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert results[0].detail == "the run's newest complete checkpoint checkpoint-40 is gone, changed or no longer complete"
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]


def test_an_anchor_no_longer_complete_with_its_files_unchanged_stops_the_deletions(tmp_path):
    """Megatron: the tracker, outside the checkpoint, goes back (a restarted job); the newest
    iteration is then in flight again though not one of its own files changed."""
    root = tmp_path / "vol"
    run = root / "run"
    for i, step in enumerate((1000, 2000, 3000)):
        write_zip(run / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt")
        age(run / f"iter_{step:07d}", OLD + i)
    (run / "latest_checkpointed_iteration.txt").write_text("3000\n")
    scanner = Scanner(Root(path=root, retention=Retention(keep_last=1, keep_best=0)))
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    assert [d.checkpoint.step for d in plan.deletions] == [1000, 2000]
    (run / "latest_checkpointed_iteration.txt").write_text("2000\n")
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.REFUSED] * 2
    assert "iter_0003000 is gone, changed or no longer complete" in results[0].detail
    assert sorted(os.listdir(run))[:3] == ["iter_0001000", "iter_0002000", "iter_0003000"]


def test_recheck_names_a_decision_for_another_root(volume, tmp_path):
    other = tmp_path / "other"
    hf_deepspeed_checkpoint(other / "run", 1, world=2, mtime=OLD)
    hf_deepspeed_checkpoint(other / "run", 2, world=2, mtime=OLD + 1)
    reaper, _, _ = make(volume, tmp_path)
    _, other_plan, _ = make(other, tmp_path)
    assert reaper.recheck(other_plan.deletions[0], None) == f"belongs to root {other}, not {volume}"


def test_recheck_refuses_a_path_that_leaves_the_root(volume, tmp_path):
    """The path check alone (trash_one's descriptors would refuse it too)."""
    reaper, plan, _ = make(volume, tmp_path)
    outside = tmp_path / "outside-run"
    os.rename(volume / "run", outside)
    (volume / "run").symlink_to(outside)
    why = reaper.recheck(plan.deletions[0], None)
    assert why == (f"reached through a symlink or outside {volume} "
                   f"(resolves to {outside / 'checkpoint-10'})")


def test_purge_keeps_working_on_the_trash_it_opened_when_the_trash_is_swapped(volume, tmp_path):
    """The trash renamed away mid-purge and a symlink to outside put in its place: purging by
    path would now delete outside the root."""
    reaper, plan, _ = make(volume, tmp_path)
    reaper.execute(plan.decisions)
    entries = sorted(os.listdir(volume / TRASH_DIR))
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in entries:  # the same names, outside the root
        (outside / entry).mkdir()
        (outside / entry / "precious").write_text("keep me")
    asked = []

    def swap_after_the_first():
        asked.append(1)
        if len(asked) == 2:
            os.rename(volume / TRASH_DIR, tmp_path / "moved-trash")
            (volume / TRASH_DIR).symlink_to(outside)
        return False

    count, _ = reaper.purge(stop=swap_after_the_first)
    assert count == 3
    assert all((outside / e / "precious").read_text() == "keep me" for e in entries)
    assert os.listdir(tmp_path / "moved-trash") == []


def test_purge_removes_a_symlink_in_the_trash_not_what_it_points_to(volume, tmp_path):
    """Named as a slim's work (purged without a judgement): the link goes, not its target. Named
    as nothing ckptd gives, with no record: held for review, never purged."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (volume / TRASH_DIR).mkdir(mode=0o700)
    (volume / TRASH_DIR / "1-aaaa-run%2Fcheckpoint-10%slim").symlink_to(outside)
    (volume / TRASH_DIR / "planted").symlink_to(outside)
    reaper, _, _ = make(volume, tmp_path)
    assert reaper.purge()[0] == 1
    assert os.listdir(volume / TRASH_DIR) == ["planted%review"]
    assert (volume / TRASH_DIR / "planted%review").is_symlink()
    assert (outside / "precious").read_text() == "keep me"


def test_a_purge_is_journaled_before_the_removal(volume, tmp_path, monkeypatch):
    """A kill between removing a trash entry and recording it must still leave the journal
    saying the entry was being purged (found by the crash test: its journal could not agree)."""
    reaper, plan, _ = make(volume, tmp_path)
    reaper.execute(plan.decisions)
    real_remove, seen = fs._remove_tree, []

    def remove_tree(entry, parent_fd, dev, depth=0):
        if depth == 0:  # a trash entry, not a directory inside one
            last = read_journal(tmp_path / "state")[-1]
            # the entry is renamed `<name>%purging` as its removal begins (removal/purge.py)
            seen.append((last["event"], f"{Path(last['trash']).name}%purging" == entry))
        return real_remove(entry, parent_fd, dev, depth)

    monkeypatch.setattr(fs, "_remove_tree", remove_tree)
    assert reaper.purge()[0] == 3
    assert seen == [("purging", True)] * 3


# --- a run's anchors and resume pointers, re-read before each deletion -------------------


def test_the_anchor_is_re_checked_before_every_deletion_not_once_per_pass(volume, tmp_path, monkeypatch):
    """The trainer's own rotation (or an operator's mv) takes the newest checkpoint away while a
    pass is deleting: the next deletion would leave the run with nothing to resume from. Before,
    the anchor was looked at once per pass and the reaper went on (37 deletions in the trial)."""
    reaper, plan, _ = make(volume, tmp_path)
    real_rename = os.rename

    def rename_then_lose_the_newest(src, dst, **kw):
        real_rename(src, dst, **kw)
        if (volume / "run" / "checkpoint-40").exists():
            real_rename(volume / "run" / "checkpoint-40", tmp_path / "moved-away-40")

    monkeypatch.setattr(os, "rename", rename_then_lose_the_newest)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED, Outcome.REFUSED, Outcome.REFUSED]
    assert results[1].detail == "the run's newest complete checkpoint checkpoint-40 is gone, changed or no longer complete"
    assert names(volume) == ["checkpoint-20", "checkpoint-30"]


def test_a_checkpoint_written_last_with_a_lower_step_is_an_anchor_too(volume, tmp_path):
    """A new job writing checkpoint-5 into this output dir: it is the one written last, and the
    reaper re-checks it before deleting anything of the run."""
    hf_deepspeed_checkpoint(volume / "run", 5, world=2, mtime=OLD + 100)
    reaper, plan, _ = make(volume, tmp_path)
    kept = {d.checkpoint.step: d.reasons for d in plan.decisions if d.action is Action.KEEP}
    assert kept == {5: ("written last (newest complete by time)",), 40: ("newest complete",)}
    shutil.rmtree(volume / "run" / "checkpoint-5")  # gone (a crash-restart cleaned it?) before the pass
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert results[0].detail == (
        "the run's written last (newest complete by time) checkpoint checkpoint-5 is gone, changed or no longer complete"
    )


def test_a_resume_pointer_rolled_back_after_the_plan_is_honoured(tmp_path):
    """DeepSpeed's `latest` names the tag the next resume loads; a user rolls it back to an older
    one (hand-written, as a user does). The plan keeps it; rolled back after the plan, the re-check
    reads it again and refuses."""
    root = tmp_path / "vol"
    run = root / "run"
    for i, step in enumerate((10, 20, 30, 40)):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + i)
        os.rename(run / f"checkpoint-{step}" / f"global_step{step}", run / f"global_step{step}")
        shutil.rmtree(run / f"checkpoint-{step}")
    (run / "latest").write_text("global_step20")
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    by_step = {d.checkpoint.step: d for d in plan.decisions}
    assert [s for s, d in by_step.items() if d.action is Action.DELETE] == [10, 30]
    assert by_step[20].reasons == ("named by DeepSpeed's latest: the framework resumes from it",)
    (run / "latest").write_text("global_step10")  # rolled back again, after the plan
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (
        Outcome.REFUSED, "named by DeepSpeed's latest: the framework resumes from it")
    assert results[30].outcome is Outcome.TRASHED
    assert sorted(os.listdir(run)) == ["global_step10", "global_step20", "global_step40", "latest"]


def test_a_last_link_made_after_the_plan_is_honoured(volume, tmp_path):
    """A `*last*` symlink names what a resume from 'last' loads (Lightning's last.ckpt with
    save_last="link", NeMo's -last links): pointed at a planned deletion after the plan, the
    re-check reads it and refuses. A hand-made link to the demo's Trainer checkpoints: the
    re-check reads links by name, whatever wrote them."""
    reaper, plan, _ = make(volume, tmp_path)
    os.symlink("checkpoint-20", volume / "run" / "model-last")
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[20].outcome, results[20].detail) == (
        Outcome.REFUSED, "named by model-last (a symlink to it): the framework resumes from it")
    assert results[10].outcome is Outcome.TRASHED and results[30].outcome is Outcome.TRASHED


@pytest.mark.parametrize("mark", [".ckptd/local.lock", ".ckptd-trash"])
def test_recheck_refuses_a_checkpoint_inside_a_root_of_another_ckptd_made_after_the_plan(
        volume, tmp_path, mark):
    """A ckptd started on `vol/run` after this plan was made (its root lock, or its trash, is
    there now): the run is its territory, with its pins and trash, and nothing of it is deleted here."""
    reaper, plan, _ = make(volume, tmp_path)
    if mark.endswith(".lock"):
        (volume / "run" / ".ckptd").mkdir()
        (volume / "run" / mark).touch()
    else:
        (volume / "run" / mark).mkdir()
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.REFUSED] * 3
    why = f"inside another ckptd's root ({volume / 'run'} holds {mark}): not ours to delete"
    assert results[0].detail == why
    top = mark.partition("/")[0]
    assert names(volume) == sorted([top, "checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"])


def test_a_checkpoints_own_commit_records_are_no_other_ckptds_root(volume, tmp_path):
    """A `.ckptd/` alone (a checkpoint's commit records, attest.RECORD_DIR) marks no root: the
    plan's deletions go ahead."""
    reaper, plan, _ = make(volume, tmp_path)
    (volume / "run" / ".ckptd").mkdir()
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3
