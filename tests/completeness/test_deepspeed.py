"""Real DeepSpeed checkpoints, written on the CPU by real multi-process DeepSpeed runs.

`dsgen.py` runs each job in a subprocess (2 ranks, gloo, ZeRO 2 or 3); the
session-scoped volumes are generated once and copied per test. The test
process itself never imports torch or deepspeed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from tests.support import dsgen, volcache
from tests.support.common import LOSSES, run_ckptd, shift_mtimes
from tests.support.daemonproc import DaemonProc

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None,
        reason="needs ckptd[deepspeed] (torch==2.13.0, deepspeed)",
    ),
]

# The session-scoped volumes (zero2_hf, zero3_bf16_bare) live in conftest.py:
# the slimming tests use them too.


def copy_run(src: Path, tmp_path: Path) -> Path:
    """A private, aged copy of a generated run under `<tmp>/vol/run`."""
    root = tmp_path / "vol"
    shutil.copytree(src, root / "run")
    age(root, time.time() - 3600)
    return root


def remove(root: Path, rel: str) -> None:
    """Delete one file, then age the volume again: only the census can notice."""
    (root / rel).unlink()
    age(root, time.time() - 3600)


def config(tmp_path: Path, root: Path, **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'", f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true",
             "[roots.retention]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in retention.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def verify(path: Path, *args: str) -> tuple[int, dict]:
    proc = run_ckptd("verify", path, "--json", *args)
    return proc.returncode, json.loads(proc.stdout)


def census(doc: dict) -> list[dict]:
    return [c for c in doc["checks"] if c["name"].startswith("deepspeed shards")]


def test_real_zero2_checkpoint_is_complete_with_world_size_from_its_metadata(zero2_hf, tmp_path):
    root = copy_run(zero2_hf, tmp_path)
    code, doc = verify(root / "run" / "checkpoint-40")
    assert code == 0, doc
    assert census(doc) == [{
        "name": "deepspeed shards (global_step40)",
        "verdict": "passed",
        "detail": "3/3 files present, ZeRO-2 (dp_world_size=2, mp_world_size=1 from mp_rank_00_model_states.pt)",
    }]
    rng = next(c for c in doc["checks"] if c["name"] == "rng states")
    assert rng["detail"] == "2/2 ranks"


def test_real_checkpoint_missing_a_shard_is_incomplete(zero2_hf, tmp_path):
    root = copy_run(zero2_hf, tmp_path)
    remove(root, "run/checkpoint-30/global_step30/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code, doc = verify(root / "run" / "checkpoint-30")
    assert code == 1 and doc["state"] == "incomplete"
    assert census(doc)[0]["detail"] == (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt missing "
        "(dp_world_size=2, mp_world_size=1 from mp_rank_00_model_states.pt)"
    )


def test_real_zero3_bf16_census(zero3_bf16_bare, tmp_path):
    root = copy_run(zero3_bf16_bare, tmp_path)
    code, doc = verify(root / "run" / "global_step20")
    assert code == 0, doc
    assert census(doc)[0]["detail"].startswith("4/4 files present, ZeRO-3 (dp_world_size=2")
    remove(root, "run/global_step20/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code, doc = verify(root / "run" / "global_step20")
    assert code == 1
    assert census(doc)[0]["detail"].startswith("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt missing")
    remove(root, "run/global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt")
    code, doc = verify(root / "run" / "global_step10")
    assert code == 1 and census(doc)[0]["detail"].startswith("zero_pp_rank_1_mp_rank_00_model_states.pt missing")


def test_real_plan_and_prune_keep_newest_and_best_and_what_is_kept_loads(zero2_hf, tmp_path):
    root = copy_run(zero2_hf, tmp_path)
    remove(root, "run/checkpoint-40/global_step40/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    cfg = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_loss")
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    actions = {Path(c["path"]).name: (c["state"], c["action"]) for c in plan["checkpoints"]}
    assert actions == {
        "checkpoint-10": ("complete", "keep"),  # best, and oldest
        "checkpoint-20": ("complete", "delete"),
        "checkpoint-30": ("complete", "keep"),  # newest *complete*: 40 lacks a shard
        "checkpoint-40": ("incomplete", "keep"),
    }
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (root / "run").iterdir()) == ["checkpoint-10", "checkpoint-30", "checkpoint-40"]
    # what was kept and complete still loads with DeepSpeed's own zero_to_fp32
    for step in (10, 30):
        _zero_to_fp32(root / "run" / f"checkpoint-{step}", f"global_step{step}")


def _zero_to_fp32(ckpt: Path, tag: str) -> None:
    code = (
        "import sys; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g;"
        "sd = g(sys.argv[1], tag=sys.argv[2]); assert sd and all(t.numel() for t in sd.values()), sd"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt), tag], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_slow_rank_in_flight_is_never_deleted_nor_counted_as_newest(tmp_path):
    """The seed's race, with a real DeepSpeed job: rank 1 is still writing step 20's shard
    after rank 0 wrote `latest`. Even with no quiet period at all, the census holds it."""
    root = tmp_path / "vol"
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    with dsgen.start(root / "run", world_size=2, stage=2, layout="hf", steps=(10, 20), slow_rank=1,
                     slow_seconds=120) as job:
        job.wait_for("slow_rank_waiting", timeout=180)
        assert (root / "run" / "checkpoint-20" / "latest").read_text() == "global_step20"
        code, doc = verify(root / "run" / "checkpoint-20", "-c", str(cfg))
        assert code == 1 and doc["state"] == "incomplete"
        assert census(doc)[0]["detail"].startswith("zero_pp_rank_1_mp_rank_00_optim_states.pt missing")
        proc = run_ckptd("prune", "-c", cfg)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1].startswith("prune: 0 deleted")
        assert sorted(p.name for p in (root / "run").iterdir() if not p.name.startswith(".")) == [
            "checkpoint-10", "checkpoint-20"]
        job.release()
        job.wait(timeout=180)
    code, doc = verify(root / "run" / "checkpoint-20", "-c", str(cfg))
    assert code == 0, doc
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("prune: 1 deleted"), proc.stdout
    assert sorted(p.name for p in (root / "run").iterdir() if not p.name.startswith(".")) == ["checkpoint-20"]


def test_a_malicious_pickle_is_never_executed(zero2_hf, tmp_path):
    """mp_rank_00_model_states.pt replaced by a pickle that would run code if loaded unsafely."""
    root = copy_run(zero2_hf, tmp_path)
    canary = tmp_path / "pwned"
    target = root / "run" / "checkpoint-30" / "global_step30" / "mp_rank_00_model_states.pt"
    code = (
        "import os, sys, torch\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        "        return (os.system, ('touch ' + sys.argv[2],))\n"
        "torch.save({'dp_world_size': 2, 'mp_world_size': 1, 'x': Evil()}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(target), str(canary)], check=True, timeout=120)
    age(target, time.time() - 3600)
    # ckptd's own reader: the payload's class becomes an inert placeholder; the world sizes still read
    _, doc = verify(root / "run" / "checkpoint-30")
    assert not canary.exists()
    assert census(doc)[0]["detail"].endswith("(dp_world_size=2, mp_world_size=1 from mp_rank_00_model_states.pt)")
    # and torch's reader, ckptd's fallback, refuses it outright under weights_only=True
    probe = (
        "import sys; from pathlib import Path; from ckptd.frameworks.dsmeta import MetadataUnavailable, load_safely\n"
        "try:\n    load_safely(Path(sys.argv[1]))\nexcept MetadataUnavailable as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, timeout=120)
    assert "weights_only=True" in out.stdout, out.stdout + out.stderr
    assert not canary.exists()


def test_real_deepspeed_job_saving_under_the_daemon(tmp_path):
    """A real 2-rank job saves four times under `ckptd run`; rank 1 is held back on step 30's
    shard after rank 0 wrote `latest`. The daemon sees step 30 incomplete and touches nothing
    in flight (DeepSpeed's own save would fail if its directory vanished); afterwards exactly
    the best (oldest) and the newest remain, and both load with zero_to_fp32."""
    root = tmp_path / "vol"
    run = root / "run"
    root.mkdir()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0.5s'\nallow_short_quiet_period = true\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 1\nmetric = 'eval_loss'\n"
    )
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        with dsgen.start(run, world_size=2, stage=2, layout="hf", steps=tuple(LOSSES), eval_losses=LOSSES,
                         slow_rank=1, slow_step=30, slow_seconds=120) as job:
            job.wait_for("slow_rank_waiting", timeout=180)
            daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-30"
                            and line.get("state") == "incomplete", timeout=60)
            assert (run / "checkpoint-20").is_dir()  # the newest complete: kept while 30 is in flight
            job.release()
            job.wait(timeout=180)
        daemon.wait_for(lambda line: line.get("message", "").startswith("deleted "), count=2, timeout=60)
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-40" and line.get("state") == "complete")
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-10", "checkpoint-40"]
    for step in (10, 40):
        _zero_to_fp32(run / f"checkpoint-{step}", f"global_step{step}")


def test_a_bf16_save_killed_before_any_shard_is_incomplete_whatever_its_ds_config_says(zero1_bf16_bare, tmp_path):
    """The census must not hang on reading the ZeRO stage from a ds_config dict. A
    save killed after rank 0's model states and before any rank's optimizer shard (the shards are
    removed from a real checkpoint: what such a kill leaves) is incomplete, with the ds_config as
    saved, and with it saved as a path string, which a checkpoint may hold (rewritten here:
    DeepSpeed 0.19.8 always records the dict). The model states' own structure says shards
    were written (`param_shapes`), whatever the ds_config says."""
    root = copy_run(zero1_bf16_bare, tmp_path)
    tag = root / "run" / "global_step10"
    code, doc = verify(tag)
    assert code == 0 and census(doc)[0]["detail"].startswith("3/3 files present, ZeRO-1"), doc
    for shard in tag.glob("bf16_zero_pp_rank_*_optim_states.pt"):
        shard.unlink()
    age(root, time.time() - 3600)
    code, doc = verify(tag)
    assert code == 1 and census(doc)[0]["detail"].startswith(
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt missing"
    ), doc
    states = tag / "mp_rank_00_model_states.pt"
    rewrite = (
        "import sys, torch; p = sys.argv[1]; sd = torch.load(p, weights_only=False);"
        "sd['ds_config'] = 'ds_config.json'; torch.save(sd, p)"
    )
    subprocess.run([sys.executable, "-c", rewrite, str(states)], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    age(root, time.time() - 3600)
    code, doc = verify(tag)
    assert code == 1 and census(doc)[0]["verdict"] == "failed", doc
    assert "optim_states.pt missing" in census(doc)[0]["detail"]


def _first_job(run: Path, stage: int) -> None:
    """The first job of a re-save in place: global_step5 and global_step10, 2 ranks, bare layout. The
    same run for every re-save test of a stage, so it is written once a session and copied after
    (tests/support/volcache.py, the key conftest's DeepSpeed volumes use)."""
    kw = dict(world_size=2, stage=stage, layout="bare", steps=(5, 10))
    volcache.generated("dsgen", kw, ("dsgen.py",), run, lambda out: dsgen.generate(out, **kw))


def _the_older_tag_is_kept(cfg: Path, run: Path) -> None:
    """`plan` keeps global_step5, complete, and `ckptd latest` names it: what DeepSpeed resumes from."""
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {Path(c["path"]).name: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert (rows["global_step5"]["state"], rows["global_step5"]["action"]) == ("complete", "keep"), rows
    latest = run_ckptd("latest", run, env={"CKPTD_CONFIG": ""})
    assert latest.stdout == f"{run / 'global_step5'}\n", latest.stdout + latest.stderr


def test_a_resave_in_place_whose_rank_1_died_before_its_shard_is_incomplete(tmp_path):
    """A real DeepSpeed job (ZeRO-2, 2 ranks) saves global_step5 and global_step10; ten minutes
    later a second job (a wider model) into the same directory saves global_step10 again and is
    SIGKILLed while rank 1 is held before its optimizer shard, after rank 0 wrote its model states,
    its shard and `latest`. global_step10 holds the new model states beside the first job's rank-1
    shard, ten minutes older: DeepSpeed cannot resume from it (the outside attack's
    reproduction, kept until 0be4982 as tools/attack29, loaded it with both widths). DeepSpeed 0.19 has no barrier between
    the model states and the shards, so the one-save check allows a shard to end before them only by
    as long as they can have taken to write (`base.write_span`), seconds for this model."""
    run = tmp_path / "vol" / "run"
    _first_job(run, 2)
    shift_mtimes(tmp_path / "vol", 600)
    with dsgen.start(run, world_size=2, stage=2, layout="bare", steps=(10,), hidden=64, slow_rank=1,
                     slow_seconds=600) as job:
        job.wait_for("slow_rank_waiting", timeout=240)
        job.kill()
    (run / dsgen.SLOW_MARKER).unlink(missing_ok=True)  # the generator's hold marker, not DeepSpeed's
    tag = run / "global_step10"
    states, shard1 = tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert states.stat().st_mtime - shard1.stat().st_mtime > 550  # the old job's shard beside the new states
    assert (run / "latest").read_text() == "global_step10"
    shift_mtimes(tmp_path / "vol", 1800)  # killed half an hour ago: quiet since

    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    code, doc = verify(tag, "-c", str(cfg))
    assert code == 1 and doc["state"] == "incomplete", doc
    said = "rank 1's shard zero_pp_rank_1_mp_rank_00_optim_states.pt is "
    order = next(c for c in doc["checks"] if c["name"] == "one save")
    assert order["verdict"] == "failed" and said in order["detail"], doc["checks"]
    assert "older than mp_rank_00_model_states.pt" in order["detail"], order
    _the_older_tag_is_kept(cfg, run)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resave_in_place_whose_rank_0_died_before_its_model_states_is_incomplete(tmp_path, stage):
    """The same re-save, with rank 0 held before its model states (engine._save_checkpoint) until
    rank 1 has written all of its files, then the job SIGKILLed: rank 0's old model states and shard
    (ten minutes old) beside rank 1's new shard (and, under ZeRO-3, its new model states). The new
    files are newer, so no order tells; their size does: every rank's partition of one save is the
    same size, and the wider model's are larger (`deepspeed._partitions_differ`, from each shard's
    zip directory). DeepSpeed cannot resume from it (the outside attack's reproduction, kept until
    0be4982 as tools/attack30, loaded it with both widths)."""
    run = tmp_path / "vol" / "run"
    _first_job(run, stage)
    shift_mtimes(tmp_path / "vol", 600)
    with dsgen.start(run, world_size=2, stage=stage, layout="bare", steps=(10,), hidden=64, slow_rank=0,
                     slow_seconds=600, env={"DSGEN_HOLD": "states"}) as job:
        job.wait_for("slow_rank_waiting", timeout=240)
        job.kill()
    (run / dsgen.SLOW_MARKER).unlink(missing_ok=True)  # the generator's hold marker, not DeepSpeed's
    tag = run / "global_step10"
    shard0, shard1 = (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    assert shard1.stat().st_mtime - shard0.stat().st_mtime > 550  # rank 1's new shard beside rank 0's old
    shift_mtimes(tmp_path / "vol", 1800)

    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    code, doc = verify(tag, "-c", str(cfg))
    assert code == 1 and doc["state"] == "incomplete", doc
    [shards] = census(doc)
    assert shards["verdict"] == "failed" and shards["detail"].startswith("files from two saves: "), shards
    assert "every rank's partition of one save is the same size" in shards["detail"], shards
    _the_older_tag_is_kept(cfg, run)
