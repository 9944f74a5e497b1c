"""Resume pointers as the frameworks read them: DeepSpeed's `latest` and Megatron's tracker, however they
are spelled, name the checkpoint a restart loads, and that checkpoint is kept; one that cannot be read
keeps its whole run. Through the real CLI and on a real filesystem."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, deepspeed_files, write_model_states, write_zip
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import Action
from ckptd.discover import layouts
from ckptd.frameworks import megatron
from ckptd.journal import Journal
from ckptd.judge import evidence
from ckptd.judge.evidence import resume_pointers
from ckptd.judge.verdicts import Verdicts
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import run_ckptd, wake_paused_consolidator
from tests.support.rtkit import (
    bare_deepspeed_run,
    config,
    config_file,
    no_deepspeed,
    prune,
    rename_best,
    trainer_run,
)

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- DeepSpeed's `latest`, rolled back by hand with a trailing slash or ./ ----------------------


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


# --- `latest` rolled back to a checkpoint while it is being consolidated for slimming ------------


@pytest.mark.deepspeed
@no_deepspeed
def test_latest_rolled_back_during_consolidation_stops_the_slim(zero3_bf16_bare, tmp_path):
    """Slimming re-checks a checkpoint (pins, fingerprint, anchors, the lease) again after the
    consolidation, which takes minutes on a real model, but not DeepSpeed's `latest`: an operator
    who rolls `latest` back to global_step10 meanwhile, to resume from it, gets its optimizer
    shards moved to the trash a moment later, and the resume (load_optimizer_states=True) fails.
    The plan itself already says `slim` for a checkpoint `latest` names (the first re-check
    refuses it, every pass: a near-miss of its own)."""
    from ckptd.removal.zero_to_fp32 import PAUSE_FIFO_ENV

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
        wake_paused_consolidator(child)
        out, _ = proc.communicate(timeout=180)
    finally:
        os.close(reader)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "-> failed" not in out, out  # a consolidation that failed tests nothing here
    assert sorted(p.name for p in ck.glob("*optim_states.pt")) == shards, (
        "`latest` names global_step10, and its optimizer state was slimmed away:\n" + out)


def bare_deepspeed(run: Path, step: int, *, world: int = 2, mtime: float | None = None) -> Path:
    """A bare `global_step<N>/` as DeepSpeed's save_checkpoint names its files (ckptd.cli.demo_volume's
    stand-ins: valid zips, the model states holding the world sizes ckptd reads)."""
    gs = run / f"global_step{step}"
    for name in deepspeed_files(world):
        if name.endswith("model_states.pt"):
            write_model_states(gs / name, world)
        else:
            write_zip(gs / name, 64)
    if mtime is not None:
        age(gs, mtime)
    return gs


# --- DeepSpeed's `latest` holding an absolute path as the trainer's node mounts the volume -----


def test_an_absolute_latest_through_another_mount_point_is_kept(tmp_path):
    """A user rolls a DeepSpeed run back by writing the tag's absolute path into `latest`, as the
    training node mounts the volume: /data/ckpt/run/global_step10. DeepSpeed's load_checkpoint
    does os.path.join(load_dir, tag), which is the absolute path itself: on the trainer's node it
    resumes from global_step10. ckptd's host (a sidecar, another node) mounts the volume at
    another path; pointer_target resolves the absolute path, finds it outside the run, and
    concludes the pointer names nothing here, not that it cannot tell. keep_last=1 deletes
    global_step10, the checkpoint the next resume loads. (An absolute pointer whose target ckptd
    cannot see should keep, in doubt, what it may name: at least the tag of the same name.)"""
    root = tmp_path / "vol"
    run = root / "run"
    for step in (10, 20, 30):
        bare_deepspeed(run, step, mtime=OLD + step)
    (run / "latest").write_text("/data/ckpt/run/global_step10\n")
    age(run / "latest", OLD + 40)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert (run / "global_step10").is_dir(), "`latest` names global_step10 (another mount's path), and it was deleted"


@pytest.mark.frameworks
def test_the_reapers_last_check_decides_again_from_the_files(trainer_volume, tmp_path):
    """The plan is made; then, before the reaper acts, the newest trainer_state.json is rewritten
    in place (mtime kept) to name checkpoint-4 the best. Every file the reaper re-checked (the
    target, the run's anchors) has its old fingerprint, so it deleted checkpoint-4; the decision
    made again from the files as they are now keeps it, and the reaper refuses."""
    root, run = trainer_run(trainer_volume, tmp_path)
    r = Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=1))
    scanner = Scanner(r, verdicts=Verdicts())
    plan = decide([(r, scanner.runs(now=time.time()))])
    doomed = {d.checkpoint.rel for d in plan.deletions}
    assert {"run-state/checkpoint-2", "run-state/checkpoint-4"} <= doomed
    rename_best(run / "checkpoint-8", "checkpoint-6", "checkpoint-4")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    results = {res.decision.checkpoint.rel: res for res in reaper.execute(plan.decisions)}
    assert results["run-state/checkpoint-2"].outcome is Outcome.TRASHED
    refused = results["run-state/checkpoint-4"]
    assert refused.outcome is Outcome.REFUSED, refused.detail
    assert "trainer's best_model_checkpoint" in refused.detail
    assert (run / "checkpoint-4").is_dir()


NOW = time.time()


# --- resume pointers, read as the frameworks read them -------------------------------------------


@pytest.mark.parametrize(
    "text, named",
    [
        ("global_step10", {"global_step10"}),
        ("global_step10/", {"global_step10"}),
        ("./global_step10", {"global_step10"}),
        ("global_step10//", {"global_step10"}),
        ("  global_step10\t\n", {"global_step10"}),
        ("{run}/global_step10", {"global_step10"}),  # absolute, as a user pastes it
        ("{run}/global_step10/", {"global_step10"}),
        ("../run/global_step10", {"global_step10"}),
        ("checkpoint-10/global_step10", {"checkpoint-10"}),  # below a child: the child is what loads
        ("../other/global_step10", set()),
        ("", set()),
        (".", set()),
    ],
)
def test_deepspeed_latest_names_what_deepspeed_loads(tmp_path, text, named):
    """DeepSpeed reads `latest` with .strip() and loads os.path.join(load_dir, tag)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text(text.format(run=run))
    assert set(resume_pointers(run, ["latest"])) == named


@pytest.mark.parametrize(
    "text, named",
    [
        ("{other}/global_step10", set()),  # a directory of its own elsewhere: DeepSpeed loads that
        ("/elsewhere/global_step10", {"global_step10"}),  # another host's mount path: its last component
        ("/elsewhere/global_step10/", {"global_step10"}),
        ("/elsewhere/global_step99", {"global_step10", "global_step20", "latest"}),  # cannot tell: all
    ],
)
def test_an_absolute_latest_outside_the_run_as_seen_here(tmp_path, text, named):
    """An absolute `latest` as another host mounts the volume. Not seen here, its last
    component names the run's checkpoint of that name; naming none, it cannot be told and keeps
    every checkpoint of the run (as an unreadable one); an existing directory elsewhere names nothing."""
    run = tmp_path / "run"
    for name in ("global_step10", "global_step20"):
        (run / name).mkdir(parents=True)
    (tmp_path / "other" / "global_step10").mkdir(parents=True)
    (run / "latest").write_text(text.format(other=tmp_path / "other"))
    assert set(resume_pointers(run, os.listdir(run))) == named


def test_deepspeed_latest_through_a_symlinked_spelling_of_the_run(tmp_path):
    """The volume reached as /data (a symlink) while `latest` holds the path under the real mount."""
    real = tmp_path / "mnt" / "run"
    real.mkdir(parents=True)
    (tmp_path / "data").symlink_to(tmp_path / "mnt")
    (real / "latest").write_text(f"{real}/global_step10\n")
    assert set(resume_pointers(tmp_path / "data" / "run", ["latest"])) == {"global_step10"}


def test_deepspeed_latest_naming_a_symlink_in_the_run_keeps_the_tag_it_leads_to(tmp_path):
    """`latest` holding `chosen`, a symlink in the run to global_step10: load_checkpoint joins the
    tag to the run (`os.path.join(load_dir, tag)`) and the open follows the link, so global_step10 is
    what it loads. The lexical join alone names only the link."""
    run = tmp_path / "run"
    for step in (10, 20):
        (run / f"global_step{step}").mkdir(parents=True)
    (run / "chosen").symlink_to("global_step10")
    (run / "latest").write_text("chosen\n")
    assert "global_step10" in resume_pointers(run, os.listdir(run))


@pytest.mark.parametrize(
    "text, named",
    [("100", "iter_0000100"), ("0000100\n", "iter_0000100"), (" +100 ", "iter_0000100"),
     ("1_00", "iter_0000100"), ("release", "release"), ("12345678", "iter_12345678")],
)
def test_megatron_tracker_names_what_megatron_loads(tmp_path, text, named):
    """Megatron parses its tracker with int(metastring) (checkpointing.py read_metadata)."""
    (tmp_path / layouts.MEGATRON_TRACKER).write_text(text)
    assert resume_pointers(tmp_path, [layouts.MEGATRON_TRACKER]) == {named: layouts.MEGATRON_TRACKER}


@pytest.mark.parametrize("text", ["²", "iter_0000100", "-"])
def test_a_megatron_tracker_megatron_refuses_names_nothing_and_breaks_nothing(tmp_path, text):
    """'²'.isdigit() is True and int('²') raises: the check says UNKNOWN instead of crashing."""
    run = tmp_path / "run"
    (run / "iter_0000100").mkdir(parents=True)
    write_zip(run / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt", 64)
    (run / layouts.MEGATRON_TRACKER).write_text(text)
    assert resume_pointers(run, os.listdir(run)) == {}
    cand = layouts.Candidate("iter_0000100", 100, "megatron", True)
    check = megatron._megatron_tracker(evidence.RunContext(run, frozenset(os.listdir(run))), cand)
    assert check.verdict is evidence.UNKNOWN


@pytest.mark.parametrize("kind", ["fifo", "too long", "directory"])
def test_an_unreadable_latest_keeps_every_checkpoint_of_its_run(tmp_path, kind):
    """`latest` there but unreadable may name any checkpoint: none is deleted, and each says why."""
    root = tmp_path / "vol"
    run = root / "run"
    bare_deepspeed_run(run, (10, 20, 30))
    if kind == "fifo":
        os.mkfifo(run / "latest")
    elif kind == "too long":
        (run / "latest").write_text(" " * 5000 + "global_step10\n")
    else:
        (run / "latest").mkdir()
    age(run / "latest", OLD)
    proc = run_ckptd("prune", "-c", config_file(tmp_path, root), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run.glob("global_step*")) == ["global_step10", "global_step20", "global_step30"]
    plan = run_ckptd("plan", "-c", config_file(tmp_path, root), timeout=60)
    assert "DeepSpeed's latest (unreadable" in plan.stdout, plan.stdout


@pytest.mark.parametrize("spelling", ["./global_step10", "global_step10/", "{run}/global_step10"])
def test_the_reaper_rereads_latest_with_the_same_spellings(tmp_path, spelling):
    """Rolled back after the plan, spelled as a path: the re-check before the rename refuses."""
    root = tmp_path / "vol"
    run = root / "run"
    bare_deepspeed_run(run, (10, 20, 30))
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    assert sorted(d.checkpoint.step for d in plan.decisions if d.action is Action.DELETE) == [10, 20]
    (run / "latest").write_text(spelling.format(run=run) + "\n")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (
        Outcome.REFUSED, "named by DeepSpeed's latest: the framework resumes from it")
    assert (run / "global_step10").is_dir()
