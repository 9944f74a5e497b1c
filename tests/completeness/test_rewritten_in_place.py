"""Saves rewritten in place: a checkpoint re-saved into the same directory is in flight until its save
ends, and a file rewritten in an old checkpoint (eval output, trainer_state.json) neither unprotects
the newest save nor is taken from a stale cache."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.judge.verdicts import RACY_NS
from tests.support import dsgen
from tests.support.common import run_ckptd
from tests.support.rtkit import actions, config, no_deepspeed, prune, rename_best, trainer_run
from tests.support.volcache import _shift_mtimes

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- A checkpoint rewritten in place (re-used output directory) --------------------------------


@pytest.mark.deepspeed
@no_deepspeed
def test_a_checkpoint_rewritten_in_place_is_in_flight_until_its_save_ends(zero2_hf, tmp_path):
    """A job resumed into the same output directory re-saves checkpoint-10 and checkpoint-20,
    which the first job left there (the Trainer and DeepSpeed write into an existing directory:
    makedirs(exist_ok=True)). Rank 1 is slow on step 20's shard; its *old* shard from the first
    job is still there, and so are the old trainer_state.json and rng files, so the census
    passes and checkpoint-20 is 'complete' and 'written last' while it is in flight. keep_last=1
    then deletes checkpoint-10: the new job's newest complete checkpoint, while the only other
    one of its lineage is still being written (if the job dies now, nothing of it is left)."""
    root = tmp_path / "vol"
    run = root / "run"
    shutil.copytree(zero2_hf, run)  # the first job: steps 10..40, a day old
    age(root, OLD)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    with dsgen.start(run, world_size=2, stage=2, layout="hf", steps=(10, 20), slow_rank=1, slow_step=20,
                     slow_seconds=120) as job:
        job.wait_for("slow_rank_waiting", timeout=180)
        out = prune(cfg)
        job.release()
        job.wait(timeout=180)
    assert (run / "checkpoint-10").is_dir(), (
        "the re-run's newest complete checkpoint was deleted while checkpoint-20 was in flight:\n" + out)


# --- The run's newest by time loses its protection when a file lands in an old one -------------


def test_eval_output_in_an_old_checkpoint_does_not_unprotect_the_newest_save(tmp_path):
    """A run resumed from checkpoint-3000 (after 4000 and 5000 diverged) saves checkpoint-3500:
    'written last', so kept. Then an evaluation script writes its results into checkpoint-5000
    (lm-eval's --output_path beside the model, say). A checkpoint's time is the newest mtime of
    its files, so checkpoint-5000 is now 'written last' too, and checkpoint-3500, the resumed
    job's only save, is deleted by keep_last=2."""
    root = tmp_path / "vol"
    run = root / "run"
    for step in (3000, 4000, 5000):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    hf_deepspeed_checkpoint(run, 3500, world=2, mtime=OLD + 20_000)  # the resumed job's save
    results = run / "checkpoint-5000" / "eval" / "results.json"
    results.parent.mkdir()
    results.write_text('{"acc": 0.51}\n')
    age(results.parent, OLD + 30_000)
    cfg = config(tmp_path, root, keep_last=2, keep_best=0)
    prune(cfg)
    assert (run / "checkpoint-3500").is_dir(), "the resumed job's newest save was deleted"


# --- Rewriting trainer_state.json in every checkpoint moves every save time ---------------------


def test_trainer_state_rewritten_in_place_does_not_unprotect_the_newest_save(tmp_path):
    """A file landing in an old checkpoint, as above, with a file the Trainer does save. A run
    resumed from checkpoint-3000 (4000 and 5000 diverged) saved checkpoint-3500: 'written last',
    kept. Then the run is moved (`mv out /vol/archive/out`) and, as the Trainer's
    `best_model_checkpoint` holds the old path, the paths are fixed with `sed -i` over
    `*/trainer_state.json` (shell order: 3000, 3500, 4000, 5000). sed -i writes a new file and
    renames it over the old one: every trainer_state.json now has the time of the fix, in name
    order, so checkpoint-5000 is both the newest by step and 'written last'; `one_save` is content
    (trainer_state.json is newest in each). keep_last=2 keeps 5000 and 4000 and deletes
    checkpoint-3500, the resumed job's only save. The mtimes of the files written before
    trainer_state.json (global_step*/, rng states) still tell the saves' order."""
    root = tmp_path / "vol"
    run = root / "out"
    for step in (3000, 4000, 5000):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    hf_deepspeed_checkpoint(run, 3500, world=2, mtime=OLD + 20_000)  # the resumed job's save
    for i, step in enumerate((3000, 3500, 4000, 5000)):  # sed -i, in the shell's order
        ts = run / f"checkpoint-{step}" / "trainer_state.json"
        fixed = ts.parent / ".sedXYZ"
        fixed.write_text(ts.read_text().replace(str(run), "/vol/archive/out"))
        os.replace(fixed, ts)
        os.utime(ts, (OLD + 30_000 + i, OLD + 30_000 + i))
        os.utime(ts.parent, (OLD + 30_000 + i, OLD + 30_000 + i))
    cfg = config(tmp_path, root, keep_last=2, keep_best=0)
    prune(cfg)
    assert (run / "checkpoint-3500").is_dir(), "the resumed job's newest save was deleted"


@pytest.mark.frameworks
def test_a_trainer_state_rewritten_in_place_is_read_again_after_a_plan(trainer_volume, tmp_path):
    """After a `plan` (the verdict cache written in state_dir), the newest trainer_state.json is
    fixed in place to name checkpoint-4 its best, size and mtime kept. The cache restored the old
    trainer state (best checkpoint-6) because no directory changed, and `prune` deleted
    checkpoint-4, the best the file names now; without a state_dir the same prune keeps it."""
    root, run = trainer_run(trainer_volume, tmp_path)
    # The first plan's look must be saved for the second to restore it: a look that met a racily
    # clean file (changed within a timestamp tick of it, ctime included, which the copy just set and
    # no utime can set back) is not saved (`Verdicts.save`), and the second plan would then read
    # everything afresh whether or not a restore stats the rewritten file. So: the files an hour
    # old (their order kept), and the copy's ctimes a tick in the past (a bounded wait on the
    # kernel's timestamps, not on another process).
    _shift_mtimes(root, -3600)
    newest_ctime = max(os.lstat(os.path.join(d, n)).st_ctime_ns for d, ds, fs in os.walk(root) for n in ds + fs)
    time.sleep(max(0.0, (newest_ctime + RACY_NS - time.time_ns()) / 1e9 + 0.05))
    (tmp_path / "state").mkdir()
    cfg = config(tmp_path, root, keep_last=1, keep_best=1)
    first = run_ckptd("plan", "-c", cfg, "--json")
    assert first.returncode == 0, first.stderr
    before = actions(first.stdout)
    assert before["run-state/checkpoint-6"] == "keep" and before["run-state/checkpoint-4"] == "delete"
    rename_best(run / "checkpoint-8", "checkpoint-6", "checkpoint-4")
    again = run_ckptd("plan", "-c", cfg, "--json")
    now = actions(again.stdout)
    assert now["run-state/checkpoint-4"] == "keep" and now["run-state/checkpoint-6"] == "delete"  # the disk
    prune(cfg)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
