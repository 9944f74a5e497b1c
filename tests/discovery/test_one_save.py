"""Which save a checkpoint's files belong to, and when it was saved.

1. A checkpoint re-saved in place (a job resumed into the same output directory) holds files from
   two saves until the new one ends; every file a census counts is there, the old save's among
   them. The order the framework writes its files in tells: a file written last (trainer_state.json)
   or after another (a rank's shard after its model states) that is older than it. Such a
   checkpoint is not complete, so it is neither deleted nor an anchor.
2. Files added to an old checkpoint after its save (an evaluation's results, zero_to_fp32's
   weights) do not move when it was saved: the "written last" anchor is the newest *save*, and the
   one touched last is kept as well, in doubt.

Hand-made Trainer/DeepSpeed look-alikes (ckptd.cli.demo_volume) where a test needs a file order no single
real run leaves; the real DeepSpeed job's files (dsgen, `zero2_hf`) where one does; real Orbax
steps (fwgen) for another layout's save time. mtimes are set with os.utime.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_model_states, write_zip
from ckptd.config import Retention, Root
from ckptd.daemon.tracker import HINT_DEBOUNCE
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import decide_run
from ckptd.decide.rules import anchors
from ckptd.discover import layouts
from ckptd.frameworks import orbax
from ckptd.judge import evidence
from ckptd.model import Action, State, Verdict
from tests.support.common import run_ckptd
from tests.support.fwdcp_one import put_dcp
from tests.support.fwfixtures import copy_volume
from tests.support.tracking import Clock, start, tracker

NOW = 1_800_000_000.0
OLD = NOW - 86400  # the first job's save: a day ago


def scan(root: Path, **root_kw) -> dict[str, object]:
    runs = Scanner(Root(path=root, **root_kw)).runs(now=NOW)
    return {c.rel: c for run in runs for c in run.checkpoints}


def one_save(c) -> tuple[Verdict, str] | None:
    return next(((k.verdict, k.detail) for k in c.checks if k.name == evidence.ONE_SAVE), None)


def resave(ckpt: Path, rels: list[str], when: float = NOW - 600) -> None:
    """Rewrite `rels` in place, as a new save does, at `when` (the rest keep the old save's mtimes)."""
    for rel in rels:
        path = ckpt / rel
        data = path.read_bytes()
        path.write_bytes(data)
        os.utime(path, (when, when))


# --- 1. files from two saves -------------------------------------------------------------------


@pytest.mark.parametrize("newer", [
    "global_step10/mp_rank_00_model_states.pt",  # the new save has begun: DeepSpeed's model states
    "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt",  # rank 0's shard; rank 1's is the old one
    "latest",  # DeepSpeed's last file, before its barrier
    "rng_state_0.pth",  # process 0's, written just before trainer_state.json
])
def test_a_trainer_state_older_than_a_file_written_before_it_is_a_mixed_save(tmp_path, newer):
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    resave(ck, [newer])
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert c.state is State.INCOMPLETE
    verdict, detail = one_save(c)
    assert verdict is Verdict.FAILED
    assert detail.startswith("files from two saves: trainer_state.json is 23h50m older than") and newer in detail


def test_a_plain_trainer_re_save_is_mixed_until_its_trainer_state_is_written(tmp_path):
    """DDP, no DeepSpeed: optimizer.pt and scheduler.pt rewritten, trainer_state.json still the old one."""
    ck = tmp_path / "run" / "checkpoint-5"
    ck.mkdir(parents=True)
    for name in ("pytorch_model.bin", "optimizer.pt", "scheduler.pt", "training_args.bin", "rng_state.pth"):
        write_zip(ck / name, 64)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    age(ck, OLD)
    resave(ck, ["optimizer.pt", "scheduler.pt"])
    assert scan(tmp_path)["run/checkpoint-5"].state is State.INCOMPLETE
    resave(ck, ["rng_state.pth", "trainer_state.json"], when=NOW - 300)  # the save ends
    c = scan(tmp_path)["run/checkpoint-5"]
    assert c.state is State.COMPLETE, c.checks
    assert one_save(c) == (Verdict.PASSED, "its files are in the order one save writes them")


@pytest.mark.parametrize("later", [
    "eval/results.json",  # lm-eval's --output_path beside the model
    "pytorch_model.bin",  # `python zero_to_fp32.py . pytorch_model.bin`, in the checkpoint, a day later
    "rng_state_1.pth",  # rank 1's has no barrier: it may land after rank 0's trainer_state.json
    "trainer_state.json",  # rewritten by hand (a fixed best_model_checkpoint)
])
def test_a_file_newer_than_the_save_is_not_a_mixed_save(tmp_path, later):
    """Only 'older than a file written before it' counts: what is added later is newer."""
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    (ck / later).parent.mkdir(exist_ok=True)
    write_zip(ck / later, 32) if later.endswith((".bin", ".pth")) else (ck / later).write_text("{}")
    os.utime(ck / later, (NOW - 60, NOW - 60))
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert c.state is State.COMPLETE, c.checks
    assert one_save(c)[0] is Verdict.PASSED


def test_clock_skew_within_the_slack_is_one_save(tmp_path):
    """Rank 1's node sets mtimes a few seconds ahead (Lustre clients set their own): still one save."""
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    skewed = OLD + evidence.MTIME_SLACK - 1
    os.utime(ck / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", (skewed, skewed))
    assert scan(tmp_path, world_size=2)["run/checkpoint-10"].state is State.COMPLETE
    beyond = OLD + evidence.MTIME_SLACK + 1
    os.utime(ck / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", (beyond, beyond))
    assert scan(tmp_path, world_size=2)["run/checkpoint-10"].state is State.INCOMPLETE


def bare(run: Path, step: int, *, stage: int, mtime: float) -> Path:
    """Bare DeepSpeed global_step<N>/ with 2 ranks (hand-made: the file order is the point)."""
    gs = run / f"global_step{step}"
    gs.mkdir(parents=True)
    if stage == 3:
        for r in (0, 1):
            write_model_states(gs / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", 2, stage=3)
    else:
        write_model_states(gs / "mp_rank_00_model_states.pt", 2, stage=stage)
    for r in (0, 1):
        write_zip(gs / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 256)
    age(gs, mtime)
    return gs


@pytest.mark.parametrize(("stage", "rewritten", "gap", "state"), [
    # ZeRO-3: rank 1 writes its model states, then its shard; the shard is the old save's
    (3, ["zero_pp_rank_1_mp_rank_00_model_states.pt"], 86400, State.INCOMPLETE),
    # ... and 20 minutes apart is two saves as well: one process writes both, one after the other
    (3, ["zero_pp_rank_1_mp_rank_00_model_states.pt"], 1200, State.INCOMPLETE),
    # ZeRO-2, rank 0 re-saved (model states, its shard), rank 1 slow: its shard is a day old
    (2, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 86400, State.INCOMPLETE),
    # ZeRO-2, one save: rank 1 finished its shard seconds before rank 0 finished the model
    # states (no barrier between them): within the slack
    (2, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 8, State.COMPLETE),
    # ... but 20 minutes before model states of a few KB: writing them cannot have taken that
    # long (`base.write_span`), so the shard is an earlier save's
    (2, ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 1200, State.INCOMPLETE),
    # ZeRO-3, one save with a slow rank 1: its model states and shard both two hours after rank 0's
    (3, ["zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"], 7200,
     State.COMPLETE),
    # one save with a slow rank 1: its shard is the newest by hours, which says nothing
    (2, ["zero_pp_rank_1_mp_rank_00_optim_states.pt"], 7200, State.COMPLETE),
])
def test_deepspeed_shards_from_two_saves(tmp_path, stage, rewritten, gap, state):
    gs = bare(tmp_path / "run", 20, stage=stage, mtime=NOW - 600 - gap)
    resave(gs, rewritten)
    c = scan(tmp_path, world_size=2)["run/global_step20"]
    assert c.state is state, c.checks
    if state is State.INCOMPLETE:
        assert "files from two saves: rank 1's shard zero_pp_rank_1_mp_rank_00_optim_states.pt is" in one_save(c)[1]


@pytest.mark.deepspeed
def test_a_real_deepspeed_run_is_one_save_and_its_re_save_is_not(zero2_hf, tmp_path):
    """The real job's files (dsgen, 2 ranks, ZeRO-2, mtimes as the job left them) pass; its
    checkpoint-20 with DeepSpeed's files rewritten by a second job, and the Trainer's not yet, fails."""
    run = tmp_path / "run"
    shutil.copytree(zero2_hf, run)  # copy2: the job's own mtimes, in its order
    found = scan(tmp_path, world_size=2)
    assert {c.state for c in found.values()} == {State.COMPLETE}
    assert {one_save(c)[0] for c in found.values()} == {Verdict.PASSED}
    age(run / "checkpoint-20", OLD)
    resave(run / "checkpoint-20", ["global_step20/mp_rank_00_model_states.pt",
                                   "global_step20/zero_pp_rank_0_mp_rank_00_optim_states.pt", "latest"])
    c = scan(tmp_path, world_size=2)["run/checkpoint-20"]
    assert c.state is State.INCOMPLETE
    assert "trainer_state.json is 23h50m older than" in one_save(c)[1]


@pytest.mark.frameworks
def test_a_dcp_step_re_saved_in_place_is_mixed_until_its_metadata_is_written(dcp_volume, tmp_path):
    """Real torchtitan/DCP steps (fwgen, 2 ranks): DCP overwrites a directory it saves into, and its
    coordinator writes .metadata after every rank's data. The job's own files pass; step-20 with
    rank 0's data rewritten and the old .metadata still there fails, until .metadata is rewritten."""
    run = tmp_path / "vol" / "titan-a"
    shutil.copytree(dcp_volume["out_dir"] / "titan-a", run)  # copy2: the job's own mtimes
    found = scan(tmp_path / "vol")
    assert found["titan-a/checkpoint/step-20"].state is State.COMPLETE
    assert one_save(found["titan-a/checkpoint/step-20"])[0] is Verdict.PASSED
    step = run / "checkpoint" / "step-20"
    age(step, OLD)
    resave(step, ["__0_0.distcp"])
    c = scan(tmp_path / "vol")["titan-a/checkpoint/step-20"]
    assert c.state is State.INCOMPLETE
    assert one_save(c)[1].startswith("files from two saves: .metadata is 23h50m older than __0_0.distcp")
    resave(step, ["__1_0.distcp", ".metadata"], when=NOW - 300)
    assert scan(tmp_path / "vol")["titan-a/checkpoint/step-20"].state is State.COMPLETE


@pytest.mark.frameworks
def test_an_accelerate_state_re_saved_in_place_is_mixed_until_its_random_states_are_written(
        accelerate_volume, tmp_path):
    """Real accelerate save_state() directories (fwgen, 2 processes): save_state(output_dir) into an
    existing directory overwrites it; process 0 writes random_states_0.pkl after the optimizer,
    scheduler and samplers, which come after the models. Without a DeepSpeed tag nothing writes the
    weights later (zero_to_fp32 writes them under DeepSpeed only): new weights beside the old
    random states are a re-save not finished too (hfweights.weights_order)."""
    run = tmp_path / "vol" / "steps"
    shutil.copytree(accelerate_volume["out_dir"] / "steps", run)  # copy2: the job's own mtimes
    assert scan(tmp_path / "vol")["steps/step_20"].state is State.COMPLETE
    step = run / "step_20"
    age(step, OLD)
    resave(step, ["model.safetensors"])
    c = scan(tmp_path / "vol")["steps/step_20"]
    assert c.state is State.INCOMPLETE
    [order] = [k for k in c.checks if k.name == "weights order"]
    assert order.detail.startswith("files from two saves: random_states_0.pkl is "), order
    resave(step, ["optimizer.bin"])
    c = scan(tmp_path / "vol")["steps/step_20"]
    assert c.state is State.INCOMPLETE
    assert one_save(c)[1].startswith(
        "files from two saves: random_states_0.pkl is 23h50m older than optimizer.bin, which accelerate")
    resave(step, ["scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"], when=NOW - 300)
    c = scan(tmp_path / "vol")["steps/step_20"]
    assert c.state is State.COMPLETE and one_save(c)[0] is Verdict.PASSED


def test_plan_says_when_more_than_one_checkpoint_is_a_mixed_save(tmp_path):
    """One re-save in flight is normal; two at once look like a copy that lost its mtimes, and the
    run would never be pruned: plan says so."""
    run = tmp_path / "run"
    for step in (10, 20, 30):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    resave(run / "checkpoint-10", ["latest"])
    root = Root(path=tmp_path, world_size=2)
    plan = decide([(root, Scanner(root).runs(now=NOW))])
    assert not [w for w in plan.warnings if "two saves" in w]
    resave(run / "checkpoint-20", ["latest"])
    plan = decide([(root, Scanner(root).runs(now=NOW))])
    [warning] = [w for w in plan.warnings if "two saves" in w]
    assert "2 checkpoints hold files from two saves (checkpoint-10, checkpoint-20)" in warning
    assert {d.checkpoint.name for d in plan.decisions if d.action is Action.KEEP} >= {"checkpoint-10", "checkpoint-20"}


def test_the_tracker_takes_a_settled_checkpoint_re_saved_in_place_back_to_in_flight(tmp_path):
    """The tracker walks complete checkpoints again only at reconcile, or when told (an event, or
    the reaper refusing one that changed): then a re-save in place is in flight until it ends."""
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=time.time() - 86400)
    clock = Clock()
    t = tracker(tmp_path, clock)
    start(t)  # the first scan, then the first looks (after READY)
    t.step(clock.advance(60))
    assert [c.state for c in t.checkpoints()] == [State.COMPLETE]
    resave(ck, ["global_step10/mp_rank_00_model_states.pt", "latest"], when=time.time() - 1)
    t.refused("run/checkpoint-10")  # what the daemon does when the reaper refuses it
    assert [c.state for c in t.checkpoints()] == [State.WRITING]
    t.step(clock.advance(60))
    assert [c.state for c in t.checkpoints()] == [State.INCOMPLETE]  # quiet, but two saves
    assert t.in_flight() != []
    resave(ck, [f"global_step10/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], when=time.time())
    resave(ck, ["trainer_state.json"], when=time.time())  # the save ends
    t.hint(str(ck / "trainer_state.json"), clock.t)
    t.step(clock.advance(HINT_DEBOUNCE))
    assert [c.state for c in t.checkpoints()] == [State.WRITING]
    assert [c.rel for c in t.step(clock.advance(60)).completed] == ["run/checkpoint-10"]
    t.full_scan()  # and reconcile agrees
    assert [c.state for c in t.checkpoints()] == [State.COMPLETE]


# --- 2. when a checkpoint was saved --------------------------------------------------------------


def test_files_added_after_the_save_do_not_move_its_save_time(tmp_path):
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    (ck / "eval").mkdir()
    (ck / "eval" / "results.json").write_text("{}")
    write_zip(ck / "pytorch_model.bin", 32)
    os.utime(ck / "eval" / "results.json", (NOW - 100, NOW - 100))
    os.utime(ck / "pytorch_model.bin", (NOW - 50, NOW - 50))
    os.utime(ck / "eval", (NOW - 40, NOW - 40))  # directories say nothing of a save, nor of a file added
    (ck / layouts.PIN_FILE).write_text("")  # nor does ckptd's own pin
    os.utime(ck / layouts.PIN_FILE, (NOW - 30, NOW - 30))
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert (c.saved_at, c.written_at, c.touched_at) == (OLD, OLD, NOW - 50)


def test_the_newest_save_and_the_one_touched_last_are_both_anchors(tmp_path):
    run = tmp_path / "run"
    for step in (3000, 4000, 5000):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    hf_deepspeed_checkpoint(run, 3500, world=2, mtime=OLD + 20_000)
    (run / "checkpoint-4000" / "results.json").write_text("{}")
    os.utime(run / "checkpoint-4000" / "results.json", (OLD + 30_000, OLD + 30_000))
    [r] = Scanner(Root(path=tmp_path, world_size=2)).runs(now=NOW)
    assert [(c.name, why) for c, why in anchors(r.checkpoints)] == [
        ("checkpoint-5000", "newest complete"),
        ("checkpoint-3500", "written last (newest complete by time)"),
        ("checkpoint-4000", "written last counting files added after its save (kept in doubt)"),
    ]
    kept = {d.checkpoint.name for d in decide_run(r, Retention(keep_last=1, keep_best=0))
            if d.action is Action.KEEP}
    assert kept == {"checkpoint-5000", "checkpoint-3500", "checkpoint-4000"}


def test_keep_within_and_keep_total_order_by_the_save_not_by_later_files(tmp_path):
    """keep_within measures from each checkpoint's save, keep_total orders as the Trainer does by
    its save: an evaluation's output in an old checkpoint brings it into neither."""
    run = tmp_path / "run"
    for i, step in enumerate((100, 200, 300)):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + i * 3600)
    (run / "checkpoint-100" / "results.json").write_text("{}")
    os.utime(run / "checkpoint-100" / "results.json", (OLD + 3 * 3600, OLD + 3 * 3600))
    [r] = Scanner(Root(path=tmp_path, world_size=2)).runs(now=NOW)
    within = decide_run(r, Retention(keep_last=1, keep_best=0, keep_within=3600))
    reasons = {d.checkpoint.name: d.reasons for d in within}
    assert not any("keep_within" in why for why in reasons["checkpoint-100"])
    assert any("keep_within" in why for why in reasons["checkpoint-200"])
    total = {d.checkpoint.name: d.reasons for d in decide_run(r, Retention(keep_total=2))}
    assert "keep_total=2 (#2 newest)" in total["checkpoint-200"]
    assert not any(why.startswith("keep_total") for why in total["checkpoint-100"])


def sed_i(path: Path, when: float) -> None:
    """Rewrite `path` as `sed -i` does (a new file renamed over the old one), at `when`."""
    fixed = path.parent / ".sedXYZ"
    fixed.write_bytes(path.read_bytes())
    os.replace(fixed, path)
    os.utime(path, (when, when))


def test_trainer_state_rewritten_after_the_save_does_not_move_its_save_time(tmp_path):
    """The Trainer writes trainer_state.json right after the rest of its save
    (rng states, `latest`, the global_step shards). Within `SAVE_SPAN` of them it is the save's
    end; much newer (paths fixed with sed -i after a move), it was rewritten later and only
    `touched_at` counts it. A checkpoint with none of the files written before it: it counts."""
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    sed_i(ck / "trainer_state.json", OLD + evidence.SAVE_SPAN)  # a slow save: still this save's end
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert (c.written_at, c.touched_at) == (OLD + evidence.SAVE_SPAN, OLD + evidence.SAVE_SPAN)
    sed_i(ck / "trainer_state.json", NOW - 100)
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert (c.saved_at, c.written_at, c.touched_at) == (OLD, OLD, NOW - 100)
    assert c.state is State.COMPLETE
    bare_ck = tmp_path / "run" / "checkpoint-20"  # the weights and trainer_state.json only: no order
    bare_ck.mkdir()
    write_zip(bare_ck / "pytorch_model.bin", 32)
    (bare_ck / "trainer_state.json").write_text((ck / "trainer_state.json").read_text())
    age(bare_ck, OLD)
    sed_i(bare_ck / "trainer_state.json", NOW - 100)
    assert scan(tmp_path, world_size=2)["run/checkpoint-20"].written_at == NOW - 100


@pytest.mark.frameworks
def test_megatron_metadata_json_rewritten_after_the_save_does_not_move_its_save_time(dcp_one, tmp_path):
    """Hand-made (megatron-core cannot save on a CPU torch), its DCP files real (`dcp_one`):
    megatron-core writes metadata.json after common.pt and the shards; a path or backend fixed in it
    later is not a save. Likewise DCP's .metadata beside them."""
    d = tmp_path / "gpt" / "iter_0000100"
    write_zip(d / "common.pt")
    put_dcp(dcp_one, d)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "gpt" / "latest_checkpointed_iteration.txt").write_text("100")
    age(tmp_path, OLD)
    sed_i(d / "metadata.json", NOW - 100)
    c = scan(tmp_path)["gpt/iter_0000100"]
    assert c.state is State.COMPLETE
    assert (c.written_at, c.touched_at) == (OLD, NOW - 100)
    sed_i(d / ".metadata", NOW - 50)
    c = scan(tmp_path)["gpt/iter_0000100"]
    assert (c.written_at, c.touched_at) == (OLD, NOW - 50)


@pytest.mark.frameworks
def test_a_dcp_metadata_rewritten_after_the_save_does_not_move_its_save_time(dcp_volume, tmp_path):
    """Real torchtitan/DCP steps (fwgen, 2 ranks): the coordinator writes .metadata after every
    rank's data; rewritten a day later, it does not make step-10 the newest save."""
    run = tmp_path / "vol" / "titan-a"
    shutil.copytree(dcp_volume["out_dir"] / "titan-a", run)
    step = run / "checkpoint" / "step-10"
    age(step, OLD)
    age(run / "checkpoint" / "step-20", OLD + 60)
    sed_i(step / ".metadata", NOW - 100)
    found = scan(tmp_path / "vol")
    c = found["titan-a/checkpoint/step-10"]
    assert c.state is State.COMPLETE
    assert (c.written_at, c.touched_at) == (OLD, NOW - 100)
    assert found["titan-a/checkpoint/step-20"].written_at == OLD + 60


@pytest.mark.frameworks
def test_accelerate_random_states_rewritten_after_the_save_do_not_move_its_save_time(
        accelerate_volume, tmp_path):
    """Real accelerate save_state() directories (fwgen, 2 processes): each process writes its
    random_states_<i>.pkl last; rewritten later (a script re-pickling them), they are no save."""
    run = tmp_path / "vol" / "steps"
    shutil.copytree(accelerate_volume["out_dir"] / "steps", run)
    step = run / "step_20"
    age(step, OLD)
    sed_i(step / "random_states_0.pkl", NOW - 100)
    sed_i(step / "random_states_1.pkl", NOW - 90)
    c = scan(tmp_path / "vol")["steps/step_20"]
    assert c.state is State.COMPLETE
    assert (c.written_at, c.touched_at) == (OLD, NOW - 90)


@pytest.mark.frameworks
def test_an_orbax_commit_file_rewritten_after_the_save_does_not_move_its_save_time(orbax_volume, tmp_path):
    """Real Orbax steps (fwgen): Orbax writes commit_success.txt right after it updates
    _CHECKPOINT_METADATA with the commit time; a commit file written again later is no save."""
    root = copy_volume(orbax_volume, tmp_path / "vol")
    step = root / "default" / "1"
    assert (step / orbax.COMMIT).is_file()
    age(step, OLD)
    sed_i(step / orbax.COMMIT, NOW - 100)
    c = scan(root)["default/1"]
    assert c.state is State.COMPLETE
    assert (c.written_at, c.touched_at) == (OLD, NOW - 100)


@pytest.mark.frameworks
def test_an_orbax_step_given_a_file_later_keeps_its_save_time(orbax_volume, tmp_path, state_env):
    """Real Orbax steps (fwgen): a results file written into step 1 after step 2 was saved. Orbax's
    own commit files say when each was saved; the newest save, step 2, stays written last."""
    root = copy_volume(orbax_volume, tmp_path / "vol")
    steps = root / "default"
    old = time.time() - 7200
    age(steps / "1", old)
    age(steps / "2", old + 60)
    (steps / "1" / "results.json").write_text("{}")
    os.utime(steps / "1" / "results.json", (old + 120, old + 120))
    os.utime(steps / "1", (old + 120, old + 120))  # a quiet period ago
    found = scan(root)
    one, two = found["default/1"], found["default/2"]
    assert one.written_at == pytest.approx(old) and one.touched_at > two.written_at
    assert two.written_at == pytest.approx(old + 60)
    [r] = [r for r in Scanner(Root(path=root)).runs(now=time.time()) if r.rel == "default"]
    why = {c.name: w for c, w in anchors(r.checkpoints)}
    assert why["2"] == "newest complete"  # and the newest save: Orbax's own files say so
    assert why["1"] == "written last counting files added after its save (kept in doubt)"
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json", env=state_env)
    assert proc.returncode == 0, proc.stderr
    rows = {c["path"].split("/vol/")[1]: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert rows["default/2"]["action"] == "keep"


@pytest.mark.asyncio
async def test_a_deletion_refused_because_it_changed_takes_the_checkpoint_back_to_in_flight(tmp_path):
    """The daemon plans on what its tracker last saw, and the tracker does not walk a complete
    checkpoint again until reconcile. A re-save in place of one it planned to delete is refused by
    the reaper's re-check, and the daemon then has the tracker look again: in flight, not deleted,
    not an anchor, until its save ends."""
    from ckptd.config import load_config
    from ckptd.daemon import Daemon

    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "job", step, world=2, mtime=time.time() - 86400 + step)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "quiet_period = '1s'\nallow_short_quiet_period = true\nworld_size = 2\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    now = [1000.0]
    daemon = Daemon(load_config(cfg), config_path=cfg, dry_run=True, clock=lambda: now[0], install_signals=False)
    daemon.watcher = None
    rt = daemon.keeper.runtime(daemon.config.roots[0], daemon.config)
    daemon.roots.append(rt)
    daemon.tick.first_scan()
    while rt.tracker.unseen:  # the first looks, after READY
        rt.tracker.step(now[0])
    now[0] += 2
    rt.tracker.step(now[0])

    def seen() -> dict[str, tuple[str, str]]:
        rows = daemon.state()["roots"][0]["runs"][0]["checkpoints"]
        return {r["name"]: (r["state"], r["action"]) for r in rows}

    daemon.retention.run()
    assert seen()["checkpoint-2"] == ("complete", "delete")
    resave(root / "job" / "checkpoint-2", ["global_step2/mp_rank_00_model_states.pt", "latest"],
           when=time.time() - 30)  # a second job re-saves it; its trainer_state.json is still the old one
    daemon.retention.run()  # the reaper's re-check refuses it (dry run: it would have trashed it)
    assert seen()["checkpoint-2"][0] in ("writing", "settling")
    now[0] += 2
    rt.tracker.step(now[0])
    assert seen()["checkpoint-2"][0] == "incomplete"  # quiet, and two saves
    daemon.retention.run()
    assert seen()["checkpoint-2"][1] == "keep"


def test_a_shard_may_end_before_the_model_states_by_as_long_as_they_take_to_write():
    """`write_span`: the slack for a small file, the file's size at the slowest write allowed for a
    large one, never more than SAVE_SPAN."""
    from ckptd.frameworks.base import MTIME_SLACK, SAVE_SPAN, SLOWEST_WRITE, write_span

    assert write_span(4096) == pytest.approx(MTIME_SLACK, abs=0.01)
    assert write_span(2**30) == pytest.approx(MTIME_SLACK + 2**30 / SLOWEST_WRITE)
    assert 200 < write_span(2**30) < 300  # a 1 GiB file: about four minutes at 4 MiB/s
    assert write_span(100 * 2**30) == SAVE_SPAN
