"""The real `ckptd` command line, end to end, as a subprocess."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from ckptd.discover.layouts import TRASH_DIR
from ckptd.errors import EX_NOINPUT, EX_USAGE
from ckptd.fleet.locks import RootLock
from ckptd.journal import read_journal
from ckptd.removal.outcome import DRY_RUN_NOTE
from tests.support.common import run_ckptd

LOSSES = {100: 0.31, 200: 0.52, 300: 0.47, 400: 0.44, 500: 0.40, 600: 0.45}


@pytest.fixture
def volume(tmp_path: Path) -> tuple[Path, Path]:
    """The seed's situation, in a volume of Trainer + DeepSpeed checkpoints.

    Best (100) is the oldest; 500 lacks rank 3's shard; 600 is still being written.
    Returns (config, root).
    """
    root = tmp_path / "experiments"
    run = root / "roberta"
    now = time.time()
    for i, step in enumerate((100, 200, 300, 400)):
        hf_deepspeed_checkpoint(run, step, world=4, losses=LOSSES, best=100, mtime=now - 7200 + i * 60)
    hf_deepspeed_checkpoint(run, 500, world=4, losses=LOSSES, best=100, mtime=now - 3600,
                            skip={"zero_pp_rank_3_mp_rank_00_optim_states.pt"})
    hf_deepspeed_checkpoint(run, 600, world=4, losses=LOSSES, best=100, mtime=now - 1,
                            skip={"zero_pp_rank_2_mp_rank_00_optim_states.pt"})
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '10m'\nworld_size = 4\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 1\nmetric = 'eval_loss'\n"
    )
    return config, root


def plan_json(config: Path) -> dict:
    proc = run_ckptd("plan", "-c", config, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_shows_states_and_keeps_newest_and_best(volume):
    config, _ = volume
    doc = plan_json(config)
    rows = {Path(c["path"]).name: c for c in doc["checkpoints"]}
    assert {k: (v["state"], v["action"]) for k, v in rows.items()} == {
        "checkpoint-100": ("complete", "keep"),
        "checkpoint-200": ("complete", "delete"),
        "checkpoint-300": ("complete", "delete"),
        "checkpoint-400": ("complete", "keep"),
        "checkpoint-500": ("incomplete", "keep"),
        "checkpoint-600": ("writing", "keep"),
    }
    assert rows["checkpoint-100"]["reasons"] == ["best eval_loss=0.31 (min)"]
    assert rows["checkpoint-400"]["reasons"] == ["newest complete"]
    assert rows["checkpoint-500"]["reasons"][0].startswith(
        "incomplete, never deleted: deepspeed shards (global_step500) failed: "
        "zero_pp_rank_3_mp_rank_00_optim_states.pt missing")
    assert rows["checkpoint-200"]["reasons"] == ["outside keep_last=1 and keep_best=1 (eval_loss, min)"]
    assert rows["checkpoint-200"]["metric"] == 0.52 and rows["checkpoint-200"]["size_bytes"] > 0
    assert set(rows["checkpoint-200"]) >= {"run", "path", "step", "state", "size_bytes", "metric", "action",
                                           "reasons"}


def test_plan_table_is_readable(volume):
    config, _ = volume
    proc = run_ckptd("plan", "-c", config)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["RUN", "CHECKPOINT", "STEP", "STATE", "SIZE", "METRIC", "ACTION", "FREES", "REASONS"]
    assert any(line.split()[1:4] == ["checkpoint-600", "600", "writing"] for line in lines[1:7])
    assert lines[-1].startswith("4 keep, 2 delete")


def test_prune_deletes_exactly_what_plan_said(volume):
    config, root = volume
    planned = {Path(c["path"]).name for c in plan_json(config)["checkpoints"] if c["action"] == "delete"}
    before = set(os.listdir(root / "roberta"))
    proc = run_ckptd("prune", "-c", config)
    assert proc.returncode == 0, proc.stderr
    assert before - set(os.listdir(root / "roberta")) == planned == {"checkpoint-200", "checkpoint-300"}
    assert os.listdir(root / TRASH_DIR) == []  # purged
    assert proc.stdout.splitlines()[-1].startswith("prune: 2 deleted (")
    events = [r["event"] for r in read_journal(config.parent / "state")]
    assert events.count("trashed") == 2 and events.count("purged") == 2
    # a second prune finds nothing more to do
    again = run_ckptd("prune", "-c", config)
    assert again.returncode == 0 and again.stdout.splitlines()[-1].startswith("prune: 0 deleted")


def test_prune_dry_run_says_so_on_every_line_and_deletes_nothing(volume):
    config, root = volume
    before = sorted(os.listdir(root / "roberta"))
    proc = run_ckptd("prune", "-c", config, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all(line.endswith(DRY_RUN_NOTE) for line in lines)
    assert lines[-1].startswith("prune: 2 would be deleted")
    assert sorted(os.listdir(root / "roberta")) == before
    assert not (config.parent / "state").exists()


def test_an_interrupted_purge_is_finished_by_the_next_run(volume):
    config, root = volume
    # what a crash in the middle of a purge leaves behind: half-removed trash, renamed %purging
    # before its first removal (removal/purge.py `_purge_one`), under the name ckptd gave it
    leftover = root / TRASH_DIR / "1700000000-abcd1234-roberta%2Fcheckpoint-7%purging"
    (leftover / "global_step7").mkdir(parents=True)
    (leftover / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    proc = run_ckptd("prune", "-c", config)
    assert proc.returncode == 0, proc.stderr
    assert "purged 1 leftover trash entries" in proc.stdout
    assert os.listdir(root / TRASH_DIR) == []


def test_prune_skips_a_root_another_ckptd_holds(volume):
    config, root = volume
    with RootLock(config.parent / "state", root):
        proc = run_ckptd("prune", "-c", config)
    assert proc.returncode == 75
    assert "another ckptd is deleting in" in proc.stderr
    assert len(os.listdir(root / "roberta")) == 6


def test_verify_shows_each_check(volume):
    _, root = volume
    ok = run_ckptd("verify", root / "roberta" / "checkpoint-400")  # no config needed
    assert ok.returncode == 0 and "from mp_rank_00_model_states.pt" in ok.stdout, ok.stdout
    config = volume[0]
    ok = run_ckptd("verify", "-c", config, root / "roberta" / "checkpoint-400")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ": complete (hf layout, step 400, " in ok.stdout.splitlines()[0]
    bad = run_ckptd("verify", "-c", config, root / "roberta" / "checkpoint-500", "--json")
    assert bad.returncode == 1
    doc = json.loads(bad.stdout)
    assert doc["state"] == "incomplete"
    census = next(c for c in doc["checks"] if c["name"].startswith("deepspeed shards"))
    assert census == {
        "name": "deepspeed shards (global_step500)",
        "verdict": "failed",
        "detail": "zero_pp_rank_3_mp_rank_00_optim_states.pt missing "
        "(dp_world_size=4, mp_world_size=1 from mp_rank_00_model_states.pt)",
    }


def test_verify_refuses_what_it_does_not_recognise(tmp_path):
    (tmp_path / "notes").mkdir()
    proc = run_ckptd("verify", tmp_path / "notes")
    # not 1, which says "not complete": this is not a checkpoint at all
    assert proc.returncode == EX_USAGE and "not a checkpoint ckptd recognises" in proc.stderr
    assert run_ckptd("verify", tmp_path / "missing").returncode == EX_NOINPUT


def test_roots_on_the_command_line_use_builtin_defaults(tmp_path, state_env):
    run = tmp_path / "vol" / "run"
    old = time.time() - 3600
    for step in (1, 2, 3, 4):
        ck = run / f"ckpt-step={step}.ckpt"  # a Lightning-style file checkpoint
        run.mkdir(parents=True, exist_ok=True)
        write_zip(ck)
        age(ck, old + step)
    proc = run_ckptd("plan", tmp_path / "vol", "--json", env=state_env)
    assert proc.returncode == 0, proc.stderr
    actions = [c["action"] for c in json.loads(proc.stdout)["checkpoints"]]
    assert actions == ["delete", "delete", "keep", "keep"]  # keep_last = 2


@pytest.mark.parametrize(
    ("args", "code"),
    [(["plan", "/definitely/not/here"], EX_NOINPUT), (["plan"], EX_USAGE), (["plan", "--nope"], EX_USAGE),
     (["frobnicate"], EX_USAGE), ([], EX_USAGE)],
)
def test_exit_codes(args, code, state_env):
    proc = run_ckptd(*args, env=state_env)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_help():
    assert run_ckptd("--version").stdout.startswith("ckptd ")
    top = run_ckptd("--help")
    assert top.returncode == 0 and "exit codes:" in top.stdout and "CKPTD_ROOTS" in top.stdout
    for command in ("run", "status", "health", "plan", "prune", "verify", "check-config", "demo"):
        proc = run_ckptd(command, "--help")
        assert proc.returncode == 0
        # one line pointing at the whole story, not the global epilog again
        assert proc.stdout.rstrip().splitlines()[-1].endswith("CKPTD_* variables: ckptd --help")
        assert "exit codes:" not in proc.stdout and "CKPTD_ROOTS" not in proc.stdout
    assert "exit 0: complete, 1: not complete, 64: not a checkpoint" in run_ckptd("verify", "--help").stdout


def test_demo_volume_plans(tmp_path, state_env):
    proc = run_ckptd("demo", tmp_path / "demo", env=state_env)
    assert proc.returncode == 0, proc.stderr
    plan = run_ckptd("plan", "-c", tmp_path / "demo" / "ckptd.toml", "--json", env=state_env)
    rows = {c["path"].split("experiments/")[1]: c for c in json.loads(plan.stdout)["checkpoints"]}
    assert rows["roberta-mlm/checkpoint-500"]["action"] == "keep"  # best, and oldest
    assert rows["roberta-mlm/checkpoint-1000"]["action"] == "delete"
    assert rows["roberta-mlm/checkpoint-2500"]["state"] == "incomplete"
    assert rows["roberta-mlm/checkpoint-3000"]["state"] == "writing"


def test_a_metric_logged_nowhere_is_said_by_plan_and_prune(volume):
    config, root = volume
    config.write_text(config.read_text().replace("metric = 'eval_loss'", "metric = 'val_loss'"))
    warning = f"warning: {root / 'roberta'}: metric 'val_loss' (eval_val_loss in trainer_state.json"
    plan = run_ckptd("plan", "-c", config)
    assert plan.returncode == 0 and warning in plan.stdout, plan.stdout
    assert warning in run_ckptd("prune", "--dry-run", "-c", config).stdout
    assert warning[len("warning: "):] in json.dumps(plan_json(config)["warnings"])
