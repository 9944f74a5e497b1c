"""Red team: ways found to make ckptd delete what its promise protects, through the real CLI.

Each test is a reproduction that failed on the code it was written against (a6066a9); each was
marked `xfail(strict=True)` until its hole was fixed, and now keeps the fix (the other members
of each class are in test_redteam_classes.py, test_held_runs.py and test_one_save.py). Real files, real processes (`ckptd plan`/`prune`, real DeepSpeed
jobs from dsgen.py, real Orbax steps from fwgen.py, real mounts); hand-made look-alikes only
where the framework is not installed here, and the test says so.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.demo import age, hf_deepspeed_checkpoint, write_zip
from tests.support import dsgen
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume
from tests.support.rtkit import config, no_deepspeed, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over



def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


# --- 1. DeepSpeed's `latest`, rolled back by hand with a trailing slash or ./ -------------------


@pytest.mark.deepspeed
@no_deepspeed
@pytest.mark.parametrize("spelling", ["global_step10/", "./global_step10"])
def test_latest_rolled_back_with_a_trailing_slash_is_still_the_resume_pointer(zero3_bf16_bare, tmp_path,
                                                                               spelling):
    """`echo global_step1<TAB> > latest` writes `global_step10/`: DeepSpeed's load_checkpoint and
    zero_to_fp32 read `latest` with .strip() and os.path.join it, so they resume from global_step10.
    ckptd's resume_pointers drops any tag containing '/', so global_step10 is deleted."""
    root = tmp_path / "vol"
    shutil.copytree(zero3_bf16_bare, root / "run")
    (root / "run" / "latest").write_text(spelling + "\n")
    age(root, OLD)
    # DeepSpeed's own reader follows the pointer (tag=None reads `latest`).
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g;"
         "g(sys.argv[1])", root / "run"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert probe.returncode == 0 and "global_step10" in probe.stdout, probe.stdout + probe.stderr
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert (root / "run" / "global_step10").is_dir(), f"`latest` says {spelling!r}, and global_step10 was deleted"


# --- 2. A directory holding checkpoints taken for one checkpoint --------------------------------


def test_a_run_written_inside_a_checkpoint_directory_is_not_deleted_with_it(tmp_path):
    """A fine-tuning job given `--output_dir out/checkpoint-500` (the checkpoint it starts from)
    writes its own checkpoint-100, -200 inside. A strictly named directory (checkpoint-N,
    global_stepN, iter_N) is never looked into for checkpoints, so out/checkpoint-500 is one
    old checkpoint of `out`, and keep_last deletes it: the nested run's newest complete
    checkpoint goes with it, even pinned with .ckptd-keep. `plan` never lists the nested run."""
    root = tmp_path / "vol"
    out = root / "out"
    for step in (500, 1000, 1500, 2000):
        hf_deepspeed_checkpoint(out, step, world=2, mtime=OLD + step)
    nested = out / "checkpoint-500"
    for step in (100, 200):
        hf_deepspeed_checkpoint(nested, step, world=2, mtime=OLD + 1000 + step)
    (nested / "checkpoint-200" / ".ckptd-keep").touch()
    age(nested, OLD + 1000)
    age(out / "checkpoint-2000", OLD + 5000)  # the outer job saved last
    cfg = config(tmp_path, root, keep_last=2, keep_best=0)
    prune(cfg)
    assert (nested / "checkpoint-200").is_dir(), "the nested run's newest (and pinned) checkpoint was deleted"


def test_a_pattern_named_directory_holding_orbax_steps_is_a_run(orbax_volume, tmp_path):
    """patterns = ['ckpt_{step}'] for one team's own checkpoints; another team's Orbax
    CheckpointManager directory is called ckpt_1 and ckpt_2. recognise() keeps a loosely named
    directory that holds checkpoints as a run, but only checks its children by *name*: Orbax
    steps (numbered directories recognised by their contents) do not count, so each Orbax run
    is one 'checkpoint' complete on quiet alone, and ckpt_1 is deleted with all its steps,
    its newest and its best included."""
    root = tmp_path / "vol"
    (root / "jax").mkdir(parents=True)
    copy_volume(orbax_volume, tmp_path / "orbax")
    for name in ("ckpt_1", "ckpt_2"):
        shutil.copytree(tmp_path / "orbax" / "best_fn", root / "jax" / name, symlinks=True)
    age(root, OLD)
    cfg = config(tmp_path, root, root_extra="patterns = ['ckpt_{step}']", keep_last=1, keep_best=0)
    prune(cfg)
    assert (root / "jax" / "ckpt_1").is_dir(), "an Orbax run (steps 1-4, its newest and best) was deleted whole"
    assert names(root / "jax" / "ckpt_1") == ["1", "2", "3", "4"]


# --- 3. Pins spelled as a user writes paths ----------------------------------------------------


@pytest.mark.parametrize("spelling", ["trailing slash", "dot slash", "absolute", "brackets in the run's name"])
def test_a_pin_spelled_as_a_path_pins_or_is_refused(tmp_path, spelling):
    """`pins` are fnmatch globs on the path relative to the root. A pin written the way paths are
    written (tab completion's trailing slash, ./, the absolute path, or a run whose name holds
    [brackets], which fnmatch reads as a character class) matches nothing, silently: no warning
    from plan, prune or check-config, and the checkpoint the user pinned is deleted.
    Either it pins, or the config is refused (exit 78) naming the key."""
    root = tmp_path / "vol"
    run = "exp[ablation]" if spelling == "brackets in the run's name" else "run"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / run, step, world=2, mtime=OLD + step)
    pin = {
        "trailing slash": f"{run}/checkpoint-1/",
        "dot slash": f"./{run}/checkpoint-1",
        "absolute": str(root / run / "checkpoint-1"),
        "brackets in the run's name": f"{run}/checkpoint-1",
    }[spelling]
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, pins=[pin])
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode in (0, 78), proc.stderr
    if proc.returncode == 78:
        assert "pins" in proc.stderr
    assert (root / run / "checkpoint-1").is_dir(), f"pinned as {pin!r}, and deleted"


# --- 4. The trash directory itself a mount point ------------------------------------------------




def test_a_mount_at_the_trash_is_never_purged(tmp_path, mount):
    """Purging opens <root>/.ckptd-trash without following a symlink, and checks each entry for
    mounts *below* it, but not whether the trash directory itself is a mount point: another
    filesystem (or a bind mount of a directory outside the root) mounted there is emptied by
    the purge every prune and every daemon start does first."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 1, world=2, mtime=OLD)
    outside = tmp_path / "datasets"
    (outside / "imagenet").mkdir(parents=True)
    (outside / "imagenet" / "train.tar").write_bytes(b"x" * 4096)
    (outside / "README").write_text("not ckptd's\n")
    (root / ".ckptd-trash").mkdir()
    mount("--bind", outside, root / ".ckptd-trash")
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert sorted(os.listdir(outside)) == ["README", "imagenet"], "data outside the root was purged"


# --- 5. A checkpoint rewritten in place (re-used output directory) -----------------------------


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


# --- 6. NeMo's model-parallel layout: one checkpoint in several directories ----------------------


def test_nemo_model_parallel_ranks_are_one_checkpoint(tmp_path):
    """NeMo 1 with tensor parallelism (no distributed checkpoint) saves each step as
    checkpoints/mp_rank_00/<name>.ckpt and checkpoints/mp_rank_01/<name>.ckpt
    (inject_model_parallel_rank), with ONE unfinished marker, checkpoints/<name>-unfinished
    (format_checkpoint_unfinished_marker_path uninjects the rank), NVIDIA/NeMo
    nemo/utils/callbacks/nemo_model_checkpoint.py. ckptd takes each mp_rank_XX as a run of its
    own and looks for the marker beside the file: rank 0's step=300 (whose save is unfinished,
    by NeMo's own marker) is its 'newest complete', and its step=200, the last step every
    rank has, is deleted. Nothing resumable is left. NeMo is not installed here: hand-made files
    in NeMo's names (zip archives, as torch.save writes), and the marker as NeMo places it."""
    ck = tmp_path / "vol" / "gpt" / "checkpoints"
    name = "megatron_gpt--val_loss=2.50-step={s}-consumed_samples={c}.0"
    for rank in (0, 1):
        for s in (100, 200, 300):
            if rank == 1 and s == 300:
                continue  # rank 1 has not written step 300 yet
            write_zip(ck / f"mp_rank_{rank:02d}" / (name.format(s=s, c=s * 8) + ".ckpt"), 64)
    (ck / (name.format(s=300, c=2400) + "-unfinished")).touch()
    age(ck.parent, OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    prune(cfg)
    step200 = name.format(s=200, c=1600) + ".ckpt"
    assert (ck / "mp_rank_00" / step200).is_file(), "rank 0's part of the last whole step was deleted"


# --- 7. The run's newest by time loses its protection when a file lands in an old one ----------


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


# --- near-miss: a FIFO where ckptd reads a file hangs it for good --------------------------------


@pytest.mark.parametrize("where", ["run/latest_checkpointed_iteration.txt",
                                   "run2/checkpoint-5/global_step5/mp_rank_00_model_states.pt"])
def test_a_fifo_where_ckptd_reads_does_not_hang_it(tmp_path, where):
    """The Megatron tracker is read with read_text() and a model-states file with
    zipfile.is_zipfile(), neither with O_NONBLOCK nor a regular-file check: a FIFO there
    blocks the open forever (plan, prune, and the daemon's one filesystem thread, which the
    systemd watchdog then restarts into the same hang)."""
    root = tmp_path / "vol"
    (root / "run" / "iter_0000100").mkdir(parents=True)
    (root / "run" / "iter_0000100" / "model_optim_rng.pt").write_bytes(b"x")
    hf_deepspeed_checkpoint(root / "run2", 5, world=1, skip=["mp_rank_00_model_states.pt"])
    os.mkfifo(root / where)
    age(root, OLD)
    try:
        proc = run_ckptd("plan", root, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptd plan hung on a FIFO at {where}")
    assert proc.returncode == 0, proc.stderr


# --- 8. An empty ROOT argument (an unset "$VAR") is the current directory -----------------------


def test_an_empty_root_argument_is_refused(tmp_path):
    """`ckptd prune "$CKPT_ROOT"` from cron or a unit's ExecStart, with the variable unset, passes
    an empty argument. Path("") is ".", so ckptd prunes its working directory (for a service,
    often /) with the built-in defaults, up to max_depth below it: checkpoints outside every root
    the operator meant, and none of the config's pins. rm, ls and cd refuse an empty path;
    ckptd must too (exit 64), deleting nothing."""
    work = tmp_path / "home"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(work / "someone" / "exp", step, world=2, mtime=OLD + step)
    proc = run_ckptd("prune", "", env={"XDG_STATE_HOME": str(tmp_path / "state")}, cwd=work)
    assert names(work / "someone" / "exp") == [f"checkpoint-{s}" for s in (1, 2, 3, 4)], proc.stdout
    assert proc.returncode == 64, proc.stdout + proc.stderr


# --- 9. `latest` rolled back to a checkpoint while it is being consolidated for slimming ---------


@pytest.mark.deepspeed
@no_deepspeed
def test_latest_rolled_back_during_consolidation_stops_the_slim(zero3_bf16_bare, tmp_path):
    """Slimming re-checks a checkpoint (pins, fingerprint, anchors, the lease) again after the
    consolidation, which takes minutes on a real model, but not DeepSpeed's `latest`: an operator
    who rolls `latest` back to global_step10 meanwhile, to resume from it, gets its optimizer
    shards moved to the trash a moment later, and the resume (load_optimizer_states=True) fails.
    The plan itself already says `slim` for a checkpoint `latest` names (the first re-check
    refuses it, every pass: a near-miss of its own)."""
    from ckptd.consolidate import PAUSE_FIFO_ENV

    root = tmp_path / "vol"
    shutil.copytree(zero3_bf16_bare, root / "run")
    age(root, OLD)
    ck = root / "run" / "global_step10"
    shards = sorted(p.name for p in ck.glob("*optim_states.pt"))
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the consolidator writes its pid here, then waits
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_CONFIG"}
    env[PAUSE_FIFO_ENV] = str(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import select
        ready, _, _ = select.select([reader, proc.stdout], [], [], 180)
        assert reader in ready, "the consolidator never paused"
        child = int(os.read(reader, 64).decode().strip())
        (root / "run" / "latest").write_text("global_step10")  # the operator rolls back
        # To the main thread only (tgkill): it alone blocks SIGUSR1, and a process-directed signal
        # may land on one of torch's threads, whose default action kills the child.
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.tgkill(child, child, signal.SIGUSR1) == 0, os.strerror(ctypes.get_errno())
        out, _ = proc.communicate(timeout=180)
    finally:
        os.close(reader)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "-> failed" not in out, out  # a consolidation that failed tests nothing here
    assert sorted(p.name for p in ck.glob("*optim_states.pt")) == shards, (
        "`latest` names global_step10, and its optimizer state was slimmed away:\n" + out)
