"""`ckptd latest` and `ckptd.latest()`: the checkpoint a restart should load.

Synthetic Trainer checkpoints on a real filesystem (ckptd.cli.demo_volume's writers), ages set with os.utime;
the frameworks' own volumes, and their own loaders' verdicts, are in test_frameworks.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from ckptd.errors import RootMissingError, UsageError
from ckptd.judge import slim
from ckptd.resume import NothingToResumeError, find_latest, latest
from tests.support.common import run_ckptd

NOW = time.time()
OLD = NOW - 3600


def trainer_run(run: Path, steps, *, world: int = 2, mtimes: dict[int, float] | None = None, **kw) -> Path:
    for s in steps:
        hf_deepspeed_checkpoint(run, s, world=world, mtime=(mtimes or {}).get(s, OLD + s), **kw)
    return run


def test_the_highest_complete_step_is_named_and_a_killed_newer_save_passed_over(tmp_path):
    run = trainer_run(tmp_path / "out", [10, 20])
    hf_deepspeed_checkpoint(run, 30, world=2, skip=["zero_pp_rank_1_mp_rank_00_optim_states.pt"], mtime=OLD + 40)
    hf_deepspeed_checkpoint(run, 40, world=2, skip=["trainer_state.json"], mtime=OLD + 50)
    proc = run_ckptd("latest", run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{run / 'checkpoint-20'}\n"  # nothing else on stdout: $(ckptd latest out/)
    assert "passed over checkpoint-40: incomplete: trainer_state.json failed: missing" in proc.stderr
    assert "passed over checkpoint-30: incomplete: deepspeed shards (global_step30) failed" in proc.stderr
    assert latest(run) == run / "checkpoint-20"


def test_nothing_to_resume_from_is_exit_1_with_the_reason(tmp_path):
    run = tmp_path / "out"
    run.mkdir()
    proc = run_ckptd("latest", run)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert "nothing to resume from: no checkpoints in" in proc.stderr
    hf_deepspeed_checkpoint(run, 10, world=2, skip=["trainer_state.json"], mtime=OLD)
    proc = run_ckptd("latest", run, "--json")
    doc = json.loads(proc.stdout)
    assert (proc.returncode, doc["path"]) == (1, None)
    assert doc["why_none"].startswith("none of its 1 checkpoints is complete and full: checkpoint-10: incomplete")
    assert latest(run) is None


def test_a_save_seconds_old_is_named_and_an_observer_can_still_wait_out_a_quiet_period(tmp_path, caplog):
    """At a restart the job that wrote the run is the one being restarted: no quiet period is waited
    out by default (it had named checkpoint-10, and a job restarted at once found nothing). An
    observer choosing while training runs asks for one: a save seconds old is then passed over."""
    run = trainer_run(tmp_path / "out", [10])
    hf_deepspeed_checkpoint(run, 20, world=2, mtime=time.time() - 5)  # every file there, 5 s old
    assert run_ckptd("latest", run).stdout == f"{run / 'checkpoint-20'}\n"
    assert latest(run) == run / "checkpoint-20"
    watched = run_ckptd("latest", run, "--quiet-period", "60s")
    assert watched.stdout == f"{run / 'checkpoint-10'}\n"
    assert "passed over checkpoint-20: writing: quiet failed: last change" in watched.stderr, watched.stderr
    with caplog.at_level(logging.WARNING, logger="ckptd.resume"):
        assert latest(run, quiet_period=60) == run / "checkpoint-10"
    assert "passed over checkpoint-20: writing: quiet failed" in caplog.text


def test_checkpoints_none_of_which_qualifies_are_logged_or_raised_never_a_silent_none(tmp_path, caplog):
    """`ckptd.latest()` returning None restarts training from step 0: where the run holds
    checkpoints and none can be resumed from, each is logged at WARNING with why, and `strict=True`
    raises. An empty run is a first start: None, at INFO."""
    run = tmp_path / "out"
    run.mkdir()
    with caplog.at_level(logging.INFO, logger="ckptd.resume"):
        assert latest(run, strict=True) is None
    assert [r.levelname for r in caplog.records] == ["INFO"]
    caplog.clear()
    hf_deepspeed_checkpoint(run, 10, world=2, skip=["trainer_state.json"], mtime=OLD)
    with caplog.at_level(logging.WARNING, logger="ckptd.resume"):
        assert latest(run) is None
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0] == ("WARNING", "ckptd.latest: passed over checkpoint-10: incomplete: trainer_state.json "
                       "failed: missing (the Trainer writes it last)"), said
    assert said[1][0] == "WARNING" and "nothing to resume from: none of its 1 checkpoints" in said[1][1]
    with pytest.raises(NothingToResumeError, match="checkpoint-10: incomplete: trainer_state.json failed"):
        latest(run, strict=True)


def test_a_slimmed_checkpoint_is_not_resumable(tmp_path):
    run = trainer_run(tmp_path / "out", [10, 20])
    ckpt = run / "checkpoint-20"
    write_zip(ckpt / "model.safetensors.dat")
    (ckpt / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    removed = [(f"global_step20/zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 1) for r in range(2)]
    for rel, _ in removed:
        (ckpt / rel).unlink()
    doc = slim.marker_document(state="done", time=OLD, removed=removed, reasons=["test"],
                               weights={"path": "model.safetensors", "bytes": 10})
    (ckpt / slim.MARKER).write_text(json.dumps(doc))
    age(ckpt, OLD + 30)
    found = find_latest(run)
    assert found.path == run / "checkpoint-10"
    assert [(c.name, why) for c, why in found.passed_over] == [
        ("checkpoint-20", "slimmed by ckptd (weights only: its optimizer state is gone)")]


def test_steps_that_go_backwards_name_the_highest_step_and_say_so(tmp_path):
    """A day-old checkpoint-5000 beside a new job's checkpoint-300: the highest step is named (as the
    frameworks' own resume would, once the incomplete ones are passed over), with a note; --by time
    names the one written last."""
    run = trainer_run(tmp_path / "out", [5000], mtimes={5000: NOW - 86400})
    trainer_run(run, [100, 200, 300], mtimes={100: OLD, 200: OLD + 10, 300: OLD + 20})
    proc = run_ckptd("latest", run)
    assert proc.stdout.strip() == str(run / "checkpoint-5000")
    assert "note: checkpoint-300 (step 300) was written after checkpoint-5000" in proc.stderr
    proc = run_ckptd("latest", run, "--by", "time")
    assert proc.stdout.strip() == str(run / "checkpoint-300")
    assert latest(run, by="time") == run / "checkpoint-300"


def test_the_config_decides_what_is_complete(tmp_path):
    """A pattern with evidence and a world size from the config: `latest` judges as retention does."""
    root = tmp_path / "vol"
    run = root / "exp"
    for step, files in ((1, ["COMMITTED", "shard_0.pt", "shard_1.pt", "shard_2.pt"]),
                        (2, ["shard_0.pt", "shard_1.pt", "shard_2.pt"]),  # not committed
                        (3, ["COMMITTED", "shard_0.pt", "shard_1.pt"])):  # a rank short of world_size=3
        for f in files:
            write_zip(run / f"snap_{step}" / f)
    age(root, OLD)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\nworld_size = 3\n"
                   "patterns = [{name = 'snap_{step}', require = ['COMMITTED'], ranks = 'shard_{rank}.pt'}]\n")
    proc = run_ckptd("latest", run, "-c", cfg)
    assert proc.stdout.strip() == str(run / "snap_1"), proc.stderr
    assert "passed over snap_3: incomplete: ranks (shard_{rank}.pt) failed: shard_2.pt missing (2/3 ranks)" in (
        proc.stderr)
    assert latest(run, config=cfg) == run / "snap_1"
    assert run_ckptd("latest", run).returncode == 1  # without the config: not a checkpoint ckptd knows


def test_launches_of_one_run_are_one_run_and_several_runs_are_refused(tmp_path):
    """Lightning writes a resumed fit into lightning_logs/version_<N+1>/: `latest` of the run takes
    every version's checkpoints together. Two different runs below RUN_DIR: name one (64)."""
    base = tmp_path / "exp" / "lightning_logs"
    for version, steps in (("version_0", (2, 4)), ("version_1", (6, 8))):
        for s in steps:
            write_zip(base / version / "checkpoints" / f"epoch={s // 2 - 1}-step={s}.ckpt")
    write_zip(base / "version_1" / "checkpoints" / "last.ckpt")
    age(tmp_path, OLD)
    assert latest(tmp_path / "exp") == base / "version_1" / "checkpoints" / "epoch=3-step=8.ckpt"
    trainer_run(tmp_path / "other", [10])
    proc = run_ckptd("latest", tmp_path)
    assert proc.returncode == 64 and "holds 2 runs" in proc.stderr
    with pytest.raises(UsageError, match="name one of them"):
        latest(tmp_path)


def test_a_checkpoint_or_a_missing_directory_is_not_a_run(tmp_path):
    run = trainer_run(tmp_path / "out", [10])
    proc = run_ckptd("latest", run / "checkpoint-10")
    assert proc.returncode == 64 and "is a checkpoint (hf): name the run directory" in proc.stderr
    assert run_ckptd("latest", tmp_path / "nope").returncode == 66
    with pytest.raises(RootMissingError):
        latest(tmp_path / "nope")


def test_ckptd_latest_is_importable_cheaply_and_imports_no_torch(tmp_path):
    """`import ckptd` stays light (latest is loaded on first use), and naming a Trainer
    checkpoint needs no torch."""
    run = trainer_run(tmp_path / "out", [10, 20])
    code = ("import sys, ckptd; light = 'ckptd.decide.planner' not in sys.modules\n"
            "print(ckptd.latest(sys.argv[1]), light, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CKPTD_CONFIG": ""})
    assert out.stdout.split() == [str(run / "checkpoint-20"), "True", "False"], out.stderr


def test_verify_says_what_a_last_copy_is(tmp_path):
    write_zip(tmp_path / "run" / "last.ckpt")
    proc = run_ckptd("verify", tmp_path / "run" / "last.ckpt")
    assert proc.returncode == 64 and "not a step: ckptd never counts it and never deletes it" in proc.stderr
