"""What ckptd takes to be one checkpoint: a checkpoint directory that holds checkpoints (a run of
its own, or a pin) is never deleted as one, and NeMo's model-parallel rank directories are judged
together (test_runs_inside_checkpoints.py holds one case of each class; here, the other
members of each class). Real files, the real CLI; real Orbax and DCP files from fwgen.py where
the shape exists; hand-made where no installed framework makes it, and the test says so.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.discover import layouts
from ckptd.journal import Journal
from ckptd.model import Action
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume

OLD = time.time() - 86400


def config(tmp_path: Path, root: Path, *, root_extra: str = "", **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'",
             f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n{root_extra}", "[roots.retention]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in retention.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(cfg: Path) -> dict:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def decision(doc: dict, rel: str) -> dict:
    return next(d for d in doc["checkpoints"] if d["path"].endswith("/" + rel))


# --- layouts.held: what a checkpoint directory holds that is not its own ------------------------


def tree(*rels: str) -> tuple[list[str], list[str]]:
    """Everything in a checkpoint and its directories, as evidence has them from its walk: a
    trailing '/' marks a directory."""
    return ["", *(r.rstrip("/") for r in rels)], ["", *(r.rstrip("/") for r in rels if r.endswith("/"))]


@pytest.mark.parametrize(
    ("layout", "entries", "held"),
    [
        # its own parts
        ("hf", tree("global_step500/", "global_step500/mp_rank_00_model_states.pt", "trainer_state.json"), []),
        ("hf", tree("pytorch_model_fsdp_0/", "pytorch_model_fsdp_0/.metadata",
                          "pytorch_model_fsdp_0/__0_0.distcp"), []),  # FSDP's DCP directory
        ("hf", tree("pytorch_model_fsdp_0/", "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_1/",
                          "pytorch_model_fsdp_1/.metadata", "optimizer_0/", "optimizer_0/.metadata", "optimizer_1/",
                          "optimizer_1/.metadata"), []),  # accelerate's FSDP: one per model and optimizer
        ("orbax", tree("default/", "default/commit_success.txt", "params_1/", "params_1/commit_success.txt",
                             "_CHECKPOINT_METADATA"), []),  # items, commit-file mode
        ("megatron", tree("mp_rank_00/", "mp_rank_00/model_optim_rng.pt"), []),
        ("hf", tree(".ckptd-keep"), []),  # its own pin
        # a run of its own
        ("hf", tree("checkpoint-100/", "checkpoint-100/global_step100/", "checkpoint-1000/",
                          "checkpoint-100/x/", "checkpoint-100/x/checkpoint-5/"), ["checkpoint-100", "checkpoint-1000"]),
        ("pattern", tree("1/", "1/_CHECKPOINT_METADATA", "2/", "2/commit_success.txt"), ["1", "2"]),
        ("hf", tree("orbax/", "orbax/7.orbax-checkpoint-tmp-1234/"), ["orbax/7.orbax-checkpoint-tmp-1234"]),
        ("hf", tree("eval/", "eval/epoch=1-step=100.ckpt", "eval/last.ckpt"),
         ["eval/epoch=1-step=100.ckpt", "eval/last.ckpt"]),
        ("deepspeed", tree("global_step5/"), ["global_step5"]),
        ("hf", tree("sub/", "sub/iter_0000100/"), ["sub/iter_0000100"]),
        ("hf", tree("sub/", "sub/step_3/", "sub/step_3/optimizer.bin"), ["sub/step_3"]),  # accelerate
        ("hf", tree("step_10/", "step_10/.metadata", "step_10/__0_0.distcp"), ["step_10"]),  # dcp.save's run
        ("hf", tree("save_1/", "save_1/.metadata", "save_2/", "save_2/.metadata", "eval/", "eval/.metadata"),
         ["save_1", "save_2"]),  # DCP saves numbered alike: a run; `eval/` alone: a part
        # pins below its top
        ("hf", tree("global_step500/", "global_step500/.ckptd-keep"), ["global_step500/.ckptd-keep"]),
        ("hf", tree("model.ckpt.ckptd-keep"), ["model.ckpt.ckptd-keep"]),
    ],
)
def test_what_a_checkpoint_directory_holds_that_is_not_its_own(layout, entries, held):
    assert layouts.held(layout, *entries) == held


# --- a checkpoint holding a run of its own, through the CLI -------------------------------------


def outer_run(root: Path) -> Path:
    out = root / "out"
    for step in (500, 1000, 1500, 2000):
        hf_deepspeed_checkpoint(out, step, world=2, mtime=OLD + step)
    return out / "checkpoint-500"


def nested_trainer_run(ck: Path) -> None:
    for step in (100, 200):
        hf_deepspeed_checkpoint(ck, step, world=2, mtime=OLD + step)


def nested_pin(ck: Path) -> None:
    (ck / "global_step500" / ".ckptd-keep").touch()  # pinned as the user saw it: the DeepSpeed tag


def nested_lightning_files(ck: Path) -> None:
    # Hand-made in Lightning's names (the real Lightning files are tested in test_fwlayouts.py).
    for step in (10, 20):
        write_zip(ck / "finetune" / f"epoch=0-step={step}.ckpt", 64)


@pytest.mark.parametrize(
    ("inside", "shown"),
    [
        (nested_trainer_run, "checkpoint-100, checkpoint-200"),
        (nested_pin, "a pin (global_step500/.ckptd-keep)"),
        (nested_lightning_files, "finetune/epoch=0-step=10.ckpt, finetune/epoch=0-step=20.ckpt"),
    ],
    ids=["trainer run", "pin below", "lightning files"],
)
def test_a_checkpoint_holding_a_run_is_kept_and_plan_says_why(tmp_path, inside, shown):
    root = tmp_path / "vol"
    ck = outer_run(root)
    inside(ck)
    age(ck, OLD + 500)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    doc = plan(cfg)
    d = decision(doc, "out/checkpoint-500")
    assert (d["action"], d["protected"]) == ("keep", True), d
    assert f"holds a run of its own: {shown}: never deleted as one checkpoint" in d["reasons"]
    assert any(w.startswith(f"{ck}: holds a run of its own") and "nothing inside it is managed" in w
               for w in doc["warnings"]), doc["warnings"]
    assert [decision(doc, f"out/checkpoint-{s}")["action"] for s in (1000, 1500)] == ["delete", "delete"]
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in (root / "out").iterdir()) == ["checkpoint-2000", "checkpoint-500"]


def test_a_trainer_checkpoint_holding_an_orbax_run_is_kept(orbax_volume, tmp_path):
    root = tmp_path / "vol"
    ck = outer_run(root)
    copy_volume(orbax_volume, tmp_path / "orbax")
    shutil.copytree(tmp_path / "orbax" / "best_fn", ck / "jax", symlinks=True)
    age(ck, OLD + 500)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    d = decision(plan(cfg), "out/checkpoint-500")
    assert d["action"] == "keep" and "holds a run of its own: jax/1, jax/2, jax/3 and 1 more" in d["reasons"][0]


def test_a_checkpoint_with_dcp_parts_is_still_one_checkpoint(dcp_volume, tmp_path):
    """FSDP under the Trainer or accelerate saves a DCP directory inside each checkpoint
    (`pytorch_model_fsdp_0/`): a part of it, not a run of its own. Real DCP files (fwgen's
    2-rank save), put where FSDP puts them: FSDP itself needs several accelerators."""
    root = tmp_path / "vol"
    outer_run(root)
    copy_volume(dcp_volume, tmp_path / "dcp")
    for step in (500, 1000, 1500, 2000):
        shutil.copytree(tmp_path / "dcp" / "titan-a" / "checkpoint" / "step-10",
                        root / "out" / f"checkpoint-{step}" / "pytorch_model_fsdp_0")
        age(root / "out" / f"checkpoint-{step}", OLD + step)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    doc = plan(cfg)
    assert [decision(doc, f"out/checkpoint-{s}")["action"] for s in (500, 1000, 1500, 2000)] == [
        "delete", "delete", "delete", "keep"]
    assert not doc["warnings"]


def test_the_reaper_refuses_a_checkpoint_holding_a_run_whatever_the_plan_says(tmp_path):
    """The last line of defence: a plan that would delete it (a bug in the policy, an old plan)
    is refused by the reaper's own fresh look."""
    root = tmp_path / "vol"
    ck = outer_run(root)
    nested_trainer_run(ck)
    age(ck, OLD + 500)
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    planned = decide([(scanner.root, scanner.runs(now=time.time()))]).decisions
    forced = [replace(d, action=Action.DELETE, protected=False) if d.checkpoint.name == "checkpoint-500" else d
              for d in planned]
    [result] = [r for r in reaper.execute(forced) if r.decision.checkpoint.name == "checkpoint-500"]
    assert result.outcome is Outcome.REFUSED
    assert result.detail == "holds a run of its own: checkpoint-100, checkpoint-200"
    assert (ck / "checkpoint-200").is_dir()


# --- NeMo's model-parallel ranks: one step, one file in each rank's directory -------------------

NEMO = "megatron_gpt--val_loss=2.50-step={s}-consumed_samples={c}.0"
RANK_DIRS = {"mp_rank": "mp_rank_{:02d}", "tp_rank_pp_rank": "tp_rank_{:02d}_pp_rank_000",
             "mp_rank_fsdp_shard": "mp_rank_00_fsdp_shard_{:05d}", "fsdp_shard": "fsdp_shard_{:05d}"}


def nemo_ranks(ck: Path, spelling: str, steps: dict[int, tuple[int, ...]], name: str = NEMO) -> None:
    """Hand-made: NeMo is not installed here. Files in NeMo's names, zip archives as torch.save
    writes them, one per model-parallel rank's directory (inject_model_parallel_rank)."""
    for rank, held in steps.items():
        for s in held:
            write_zip(ck / RANK_DIRS[spelling].format(rank) / (name.format(s=s, c=s * 8) + ".ckpt"), 64)


def nemo_file(s: int, name: str = NEMO) -> str:
    return name.format(s=s, c=s * 8) + ".ckpt"


@pytest.mark.parametrize("spelling", RANK_DIRS)
def test_the_last_step_every_rank_holds_is_kept_without_a_marker(tmp_path, spelling):
    """Rank 0 saved step 300, rank 1 has not (a NeMo without the marker, or the marker removed):
    rank 0's newest is 300 by its own evidence, yet its part of step 200, the last step every rank
    has, must stay. The older step goes from every rank in the same prune."""
    ck = tmp_path / "vol" / "gpt" / "checkpoints"
    nemo_ranks(ck, spelling, {0: (100, 200, 300), 1: (100, 200)})
    age(ck.parent, OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rank0, rank1 = RANK_DIRS[spelling].format(0), RANK_DIRS[spelling].format(1)
    d = decision(plan(cfg), f"{rank0}/{nemo_file(200)}")
    assert (d["action"], d["protected"]) == ("keep", True)
    assert any(r.startswith(f"named by NeMo's model-parallel ranks {rank0}..{rank1} as the newest step all 2 hold")
               for r in d["reasons"]), d["reasons"]
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in (ck / rank0).iterdir()) == [nemo_file(200), nemo_file(300)]
    assert sorted(p.name for p in (ck / rank1).iterdir()) == [nemo_file(200)]


def test_nemos_marker_above_the_rank_directories_makes_every_ranks_file_unfinished(tmp_path):
    """NeMo's one `-unfinished` marker sits above the rank directories
    (format_checkpoint_unfinished_marker_path), for a Lightning-style name as for NeMo's own."""
    ck = tmp_path / "vol" / "run" / "checkpoints"
    name = "epoch=0-step={s}-consumed_samples={c}"
    nemo_ranks(ck, "mp_rank", {0: (100, 200), 1: (100, 200)}, name=name)
    (ck / (name.format(s=200, c=1600) + "-unfinished")).touch()
    age(ck.parent, OLD)
    doc = plan(config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0))
    for rank in ("mp_rank_00", "mp_rank_01"):
        d = decision(doc, f"{rank}/{nemo_file(200, name)}")
        assert d["state"] == "incomplete" and d["action"] == "keep", d
        assert decision(doc, f"{rank}/{nemo_file(100, name)}")["action"] == "keep"  # the newest complete


def test_a_command_restricted_to_some_ranks_of_a_step_is_refused(tmp_path):
    ck = tmp_path / "vol" / "gpt" / "checkpoints"
    nemo_ranks(ck, "mp_rank", {0: (100, 200, 300), 1: (100, 200)})
    age(ck.parent, OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    proc = run_ckptd("prune", "-c", cfg, ck / "mp_rank_00")
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "one model-parallel rank" in proc.stderr and "name the directory above the ranks" in proc.stderr
    assert len(list((ck / "mp_rank_00").iterdir())) == 3
    assert run_ckptd("prune", "-c", cfg, ck).returncode == 0  # the directory above: judged together
    assert sorted(p.name for p in (ck / "mp_rank_00").iterdir()) == [nemo_file(200), nemo_file(300)]


def test_the_reaper_refuses_a_ranks_part_of_the_last_whole_step_whatever_the_plan_says(tmp_path):
    ck = tmp_path / "vol" / "gpt" / "checkpoints"
    nemo_ranks(ck, "mp_rank", {0: (100, 200, 300), 1: (100, 200)})
    age(ck.parent, OLD)
    root = tmp_path / "vol"
    scanner = Scanner(Root(path=root, retention=Retention(keep_last=1, keep_best=0)))
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    planned = decide([(scanner.root, scanner.runs(now=time.time()))]).decisions
    target = ("gpt/checkpoints/mp_rank_00", nemo_file(200))
    forced = [replace(d, action=Action.DELETE, protected=False)
              if (d.checkpoint.run, d.checkpoint.name) == target else d for d in planned]
    results = {(r.decision.checkpoint.run, r.decision.checkpoint.name): r for r in reaper.execute(forced)}
    assert results[target].outcome is Outcome.REFUSED
    assert results[target].detail.startswith("no newer step is saved whole in every model-parallel rank")
    assert results[("gpt/checkpoints/mp_rank_00", nemo_file(100))].outcome is Outcome.TRASHED
    assert (ck / "mp_rank_00" / nemo_file(200)).is_file()


def test_a_checkpoint_holding_a_run_is_neither_deleted_nor_slimmed_by_the_policy():
    """Pure: checkpoints in, actions out. keep_full_last would slim the old one; keep_last=1 would
    delete it; holding a run, it is kept as it is, protected from the budgets too."""
    from ckptd.decide.policy import decide_run, enforce_max_size
    from ckptd.model import Check, Checkpoint, Run, Slimming, Verdict

    complete = (Check("quiet", Verdict.PASSED, "quiet"),)
    full = Slimming(removable=(("global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt", 60),), source="global_step1")

    def ck(step, holds=()):
        return Checkpoint(Path("/vol"), "run", f"checkpoint-{step}", step, "hf", complete, size_bytes=100,
                          saved_at=float(step), written_at=float(step), slim=full, holds=holds)

    run = Run(Path("/vol"), "run", (ck(1, holds=("checkpoint-5",)), ck(2), ck(3)))
    slims = decide_run(run, Retention(keep_last=3, keep_best=0, keep_full_last=1))
    assert [(d.checkpoint.step, str(d.action)) for d in slims] == [(1, "keep"), (2, "slim"), (3, "keep")]
    deletes = decide_run(run, Retention(keep_last=1, keep_best=0))
    assert [(d.checkpoint.step, str(d.action)) for d in deletes] == [(1, "keep"), (2, "delete"), (3, "keep")]
    assert deletes[0].reasons == ("holds a run of its own: checkpoint-5: never deleted as one checkpoint",)
    budget, _ = enforce_max_size(deletes, 1)
    assert str(budget[0].action) == "keep"
