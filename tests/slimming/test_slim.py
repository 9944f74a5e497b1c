"""Slimming without torch: Trainer checkpoints that hold their weights, the marker, the census,
the reaper's re-checks, and the CLI end to end. Real filesystem; ages set with os.utime."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, trainer_state, write_zip
from ckptd.config import DEFAULT_SLIM_FILES, ConfigError, Retention, Root, format_size, parse_config
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import Action
from ckptd.discover.layouts import PIN_FILE, TRASH_DIR
from ckptd.frameworks.base import matches, matches_any
from ckptd.journal import read_journal
from ckptd.judge import slim
from ckptd.model import State, Verdict
from ckptd.removal.outcome import Outcome
from tests.support.common import in_trash, run_ckptd
from tests.support.slimkit import fake_consolidator, reaper_for, write_safetensors
from tests.support.slimkit import unconsolidated as unconsolidated

NOW = 1_800_000_000.0
OLD = NOW - 3600


def trainer_checkpoint(run: Path, step: int, *, mtime: float, weights: bool = True) -> Path:
    """`checkpoint-<step>/` as the Trainer writes it without DeepSpeed."""
    ck = run / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    if weights:
        write_safetensors(ck / "model.safetensors")
    write_zip(ck / "optimizer.pt", 4000)
    write_zip(ck / "scheduler.pt", 100)
    write_zip(ck / "rng_state.pth", 16)
    (ck / "trainer_state.json").write_text(json.dumps(trainer_state(step, {}, None)))
    (ck / "config.json").write_text("{}")
    age(ck, mtime)
    return ck


def config_file(tmp_path: Path, root: Path, **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'", f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true",
             "[roots.retention]", *(f"{k} = {json.dumps(v)}" for k, v in retention.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trainer_volume(tmp_path: Path) -> Path:
    root = tmp_path / "vol"
    for i, step in enumerate((100, 200, 300)):
        trainer_checkpoint(root / "run", step, mtime=time.time() - 3600 + i)
    return root


# --- which files, and where the weights are --------------------------------


@pytest.mark.parametrize(
    ("path", "glob", "expected"),
    [
        ("global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step*/*optim_states.pt", True),
        ("global_step10/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", "global_step*/*optim_states.pt", True),
        ("global_step10/sub/x_optim_states.pt", "global_step*/*optim_states.pt", False),  # '*' stays in a segment
        ("optimizer.pt", "optimizer.pt", True),
        ("sub/optimizer.pt", "optimizer.pt", False),
    ],
)
def test_slim_file_globs_match_segment_by_segment(path, glob, expected):
    assert matches(path, glob) is expected
    assert matches_any(path, (glob,)) is expected


def test_the_survey_s_compiled_globs_agree_with_matching_one_glob_at_a_time():
    """`matches_any` (each glob compiled once, by segment count) says what `any(matches(...))` says,
    for every combination of a few globs over paths of every depth."""
    import itertools

    globs = ["global_step*/*optim_states.pt", "optimizer.pt", "a/[ab]?/*", "*", "x*/y", "*/z", "?"]
    paths = [
        "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step5/sub/x_optim_states.pt",
        "optimizer.pt", "a/b/optimizer.pt", "a/bc/d", "a/cc/d", "x", "xy/y", "xy/z/y", "q/z", "q/r/z", "",
        "global_step5/optim_states.pt.tmp", "a/b\nc/d",
    ]
    for path in paths:
        for r in range(len(globs) + 1):
            for chosen in itertools.combinations(globs, r):
                assert matches_any(path, chosen) == any(matches(path, g) for g in chosen), (path, chosen)


def test_weights_and_model_states_are_never_removed_whatever_the_globs_say(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    write_safetensors(tmp_path / "run" / "checkpoint-10" / "model.safetensors")
    age(tmp_path / "run", OLD)
    # Greedy, but refused by nothing loading needs ("*" would be: test_slim_files_that_remove_what_loading_needs).
    greedy = ("*.safetensors", "*.pth", "trainer_state.json", "*/*")
    c = Scanner(Root(path=tmp_path, world_size=2, retention=Retention(slim_files=greedy))).runs(now=NOW)[0].checkpoints[0]
    removable = {p for p, _ in c.slim.removable}
    assert "model.safetensors" not in removable and "trainer_state.json" not in removable
    assert "global_step10/mp_rank_00_model_states.pt" not in removable
    assert "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt" in removable and "rng_state_1.pth" in removable


def test_a_checkpoint_without_weights_or_a_deepspeed_tag_is_not_slimmed(tmp_path):
    root = tmp_path / "vol"
    trainer_checkpoint(root / "run", 100, mtime=OLD, weights=False)
    trainer_checkpoint(root / "run", 200, mtime=OLD + 1)
    retention = Retention(keep_last=2, keep_best=0, keep_full_last=1)
    scanner = Scanner(Root(path=root, retention=retention))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    first = plan.decisions[0]
    assert first.action is Action.KEEP
    # A Trainer save without weights is not finished at all (the Trainer writes them first): kept
    # whole as incomplete, which no slim touches either.
    assert first.reasons[-1].startswith("incomplete, never deleted: weights failed: no model weights")


# --- which weights a slim keeps: fp32, or as saved ---------------------------------------


def save_weights(path: Path, dtype: str = "float32", tensors: dict[str, tuple[int, ...]] | None = None) -> None:
    """Weights as the Trainer saves them: safetensors' own torch writer, {"format": "pt"}."""
    import torch
    from safetensors.torch import save_file

    shapes = tensors or {"w": (4, 4), "b": (4,)}
    save_file({k: torch.zeros(v, dtype=getattr(torch, dtype)) for k, v in shapes.items()}, str(path),
              metadata={"format": "pt"})


def ds_run(root: Path, weights=None) -> Path:
    """Trainer+DeepSpeed checkpoints 10 and 20 (synthetic shards: ckptd.cli.demo_volume), each given `weights(ck)`."""
    for i, step in enumerate((10, 20)):
        ck = hf_deepspeed_checkpoint(root / "run", step, world=2)
        if weights is not None:
            weights(ck)
        age(ck, time.time() - 3600 + i)
    return root / "run" / "checkpoint-10"


def bf16(ck: Path) -> None:
    save_weights(ck / "model.safetensors", "bfloat16")


def bf16_sharded(ck: Path) -> None:
    """transformers' sharded layout: two shards and the index that names them."""
    save_weights(ck / "model-00001-of-00002.safetensors", "bfloat16", {"a": (4,)})
    save_weights(ck / "model-00002-of-00002.safetensors", "float32", {"b": (4,)})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 24}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def plan_first(root: Path, **retention):
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=2, keep_best=0, keep_full_last=1,
                                                                       **retention)))
    return decide([(scanner.root, scanner.runs(now=time.time()))]).decisions[0]


CONSOLIDATE = "keeps fp32 weights consolidated from global_step10 into fp32/ first"


@pytest.mark.parametrize(
    ("weights", "setting", "source", "keeps"),
    [
        (lambda ck: save_weights(ck / "model.safetensors"), "fp32", None, "keeps model.safetensors as saved (fp32)"),
        (bf16, "fp32", "global_step10", f"{CONSOLIDATE} (model.safetensors is bf16)"),
        (bf16, "as-saved", None, "keeps model.safetensors as saved (bf16)"),
        (lambda ck: save_weights(ck / "model.safetensors", "float16"), "fp32", "global_step10",
         f"{CONSOLIDATE} (model.safetensors is fp16)"),
        (bf16_sharded, "fp32", "global_step10", f"{CONSOLIDATE} (model.safetensors.index.json is bf16+fp32)"),
        # a pickle's dtypes are not read: not known to be fp32, so consolidated (the safe side)
        (lambda ck: write_zip(ck / "pytorch_model.bin", 100), "fp32", "global_step10",
         f"{CONSOLIDATE} (pytorch_model.bin is a pickle: its dtypes are not read)"),
        (None, "fp32", "global_step10", f"{CONSOLIDATE} (no weights file)"),
        (None, "as-saved", "global_step10", f"{CONSOLIDATE} (no weights file)"),
    ],
)
def test_the_plan_says_which_weights_a_slim_keeps(tmp_path, weights, setting, source, keeps):
    ds_run(tmp_path / "vol", weights)
    d = plan_first(tmp_path / "vol", slim_weights=setting)
    assert d.action is Action.SLIM and d.checkpoint.slim.source == source
    assert d.reasons[0].endswith(f"(kept for: keep_last=2 (#2 newest)); {keeps}")


def test_16_bit_weights_with_nothing_to_consolidate_from_are_not_slimmed(tmp_path):
    """A Trainer checkpoint without DeepSpeed: bf16 weights, optimizer.pt. With "fp32" nothing can
    consolidate fp32 weights, so it keeps its optimizer state, and the plan says how to opt out."""
    root = tmp_path / "vol"
    for i, step in enumerate((100, 200)):
        bf16(trainer_checkpoint(root / "run", step, mtime=time.time() - 3600 + i, weights=False))
        age(root / "run" / f"checkpoint-{step}", time.time() - 3600 + i)
    d = plan_first(root)
    assert (d.action, d.reasons[-1]) == (Action.KEEP, 'not slimmed: model.safetensors is bf16 and no global_step '
                                         'directories to consolidate from; slim_weights = "as-saved" would keep '
                                         'model.safetensors alone')
    assert plan_first(root, slim_weights="as-saved").action is Action.SLIM


def test_slim_weights_per_run_and_in_check_config(tmp_path):
    config = parse_config({"roots": [{"path": "/x", "runs": [{"match": "sft/*", "slim_weights": "as-saved"}]}]})
    assert config.roots[0].retention_for("pretrain")[0].slim_weights == "fp32"
    assert config.roots[0].retention_for("sft/a")[0].slim_weights == "as-saved"
    with pytest.raises(ConfigError) as info:
        parse_config({"roots": [{"path": "/x", "retention": {"slim_weights": "bf16"}}]}, "c.toml")
    assert info.value.problems == ["c.toml: roots[0].retention.slim_weights: input should be 'fp32' or 'as-saved' "
                                   "(got 'bf16')"]
    (tmp_path / "vol").mkdir()  # beside the state_dir: a root may not hold it
    cfg = config_file(tmp_path, tmp_path / "vol", keep_full_last=1)
    shown = json.loads(run_ckptd("check-config", "-c", cfg).stdout)
    assert shown["roots"][0]["retention"]["slim_weights"] == "fp32"


def settle_weights(ck: Path) -> None:
    """Age what consolidating added (fp32/ and the checkpoint directory's own mtime), and only that:
    the shards' mtimes are part of what the consolidated weights were made from."""
    # Older than checkpoint-20's save (ds_run), so that a fp32/ ckptd cannot vouch for (not its
    # record, or shards changed) does not make checkpoint-10 the run's newest save.
    age(ck / "fp32", time.time() - 3600 + 0.5)
    os.utime(ck, (time.time() - 3600 + 0.5,) * 2)


def two_phase(root: Path, tmp_path: Path, monkeypatch, during=lambda out_dir: None):
    """The daemon's way: the slim comes back DEFERRED, the consolidation is begun, run (here by the
    fake consolidator), finished; returns (reaper, result of finishing, work)."""
    import ckptd.removal.consolidation

    fake_consolidator(monkeypatch, during)
    reaper, plan, _ = reaper_for(root, tmp_path, keep_last=2, keep_full_last=1)
    [deferred] = [r for r in reaper.execute(plan.decisions, consolidate=False)]
    assert (deferred.outcome, deferred.detail) == (Outcome.DEFERRED, "consolidating fp32 weights from global_step10 "
                                                                     "first")
    work = reaper.begin_consolidation(deferred.decision, deferred.anchors)
    assert isinstance(work, ckptd.removal.consolidation.Work) and work.path.is_dir() and not any(work.path.iterdir())
    try:
        out = ckptd.removal.consolidation.Consolidation(work.save_dir, work.tag, work.model_states, work.path,
                                                        source_fingerprint=work.source_fingerprint, timeout=None).run()
    except Exception as exc:  # handed on, as the daemon does
        out = exc
    return reaper, reaper.finish_consolidation(work, out), work


def test_consolidating_first_and_slimming_in_a_later_pass(tmp_path, monkeypatch):
    ck = ds_run(tmp_path / "vol", bf16)
    weights = (ck / "model.safetensors").read_bytes()
    shards = sorted((ck / "global_step10").glob("*optim_states.pt"))
    reaper, result, work = two_phase(tmp_path / "vol", tmp_path, monkeypatch)
    assert result.outcome is Outcome.CONSOLIDATED and result.detail.startswith("consolidated global_step10 into fp32/")
    assert sorted(os.listdir(ck / "fp32")) == [slim.shard_name(1, 1), slim.INDEX] and not work.path.exists()
    assert all(s.exists() for s in shards) and not (ck / slim.MARKER).exists()  # it only added fp32/
    assert stat.S_IMODE((ck / "fp32").stat().st_mode) == stat.S_IMODE(ck.stat().st_mode)  # not 0700

    # the next pass: the checkpoint holds fp32 weights ckptd consolidated from these very shards
    settle_weights(ck)
    reaper, plan, journal = reaper_for(tmp_path / "vol", tmp_path, keep_last=2, keep_full_last=1)
    d = plan.decisions[0]
    assert d.checkpoint.slim.weights == "fp32/model.safetensors.index.json" and d.checkpoint.slim.source is None
    assert d.reasons[0].endswith("; keeps fp32 weights consolidated from global_step10 into fp32/")
    [slimmed] = reaper.execute(plan.decisions, consolidate=False)
    assert slimmed.outcome is Outcome.SLIMMED and not any(s.exists() for s in shards)
    marker = json.loads((ck / slim.MARKER).read_text())["weights"]
    index = (ck / "fp32" / slim.INDEX).read_bytes()
    assert marker["path"] == "fp32/model.safetensors.index.json" and marker["consolidated"] is True
    assert marker["sha256"] == __import__("hashlib").sha256(index).hexdigest() and marker["bytes"] == len(index)
    assert [f["path"] for f in marker["files"]] == ["fp32/model-00001-of-00001.safetensors"]
    assert (ck / "model.safetensors").read_bytes() == weights  # the Trainer's bf16 weights stay as they were
    journal.close()
    events = [(r["event"], r.get("action")) for r in read_journal(tmp_path / "state")]
    assert events == [("consolidated", "consolidate"), ("slimming", "slim"), ("slimmed", "slim")]


def test_fp32_weights_from_shards_that_changed_since_are_not_trusted(tmp_path, monkeypatch):
    """A trainer that saved this step again (a resumed run) rewrote the shards: fp32/ is theirs no more,
    and nothing is slimmed until a person looks (fp32/ is in the way of a new consolidation)."""
    ck = ds_run(tmp_path / "vol", bf16)
    two_phase(tmp_path / "vol", tmp_path, monkeypatch)
    shard = ck / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    write_zip(shard, 1024)  # written again: the same size, another mtime (before checkpoint-20's save)
    assert shard.stat().st_size == size
    os.utime(shard, (time.time() - 3600 + 0.25,) * 2)
    settle_weights(ck)
    d = plan_first(tmp_path / "vol")
    assert (d.action, d.reasons[-1]) == (
        Action.KEEP, "not slimmed: model.safetensors is bf16 and fp32/ was consolidated from global_step10 as it was "
                     'then: its shards changed since; slim_weights = "as-saved" would keep model.safetensors alone')


def test_fp32_weights_missing_a_shard_are_not_taken_for_weights(tmp_path, monkeypatch):
    ck = ds_run(tmp_path / "vol", bf16)
    two_phase(tmp_path / "vol", tmp_path, monkeypatch)
    (ck / "fp32" / slim.shard_name(1, 1)).unlink()
    settle_weights(ck)
    d = plan_first(tmp_path / "vol")
    assert (d.action, d.reasons[-1]) == (
        Action.KEEP, "not slimmed: model.safetensors is bf16 and fp32/model-00001-of-00001.safetensors is missing or "
                     "not the size ckptd recorded when it consolidated it; slim_weights = \"as-saved\" would keep "
                     "model.safetensors alone")


def test_a_checkpoint_replaced_by_a_copy_while_consolidating_gets_nothing(tmp_path, monkeypatch):
    """Moved away and copied back with every mtime kept (`cp -a`): the same entries, another
    directory. What was consolidated from the first is not moved into the second."""
    root = tmp_path / "vol"
    ck = ds_run(root, bf16)

    def replace_with_a_copy(out_dir):
        os.rename(ck, tmp_path / "moved")
        __import__("shutil").copytree(tmp_path / "moved", ck)
        os.utime(ck, ns=((tmp_path / "moved").stat().st_atime_ns, (tmp_path / "moved").stat().st_mtime_ns))

    _, result, _ = two_phase(root, tmp_path, monkeypatch, replace_with_a_copy)
    assert (result.outcome, result.detail) == (Outcome.REFUSED,
                                               "moved or replaced while its weights were being consolidated")
    assert not (ck / "fp32").exists() and not (tmp_path / "moved" / "fp32").exists() and no_work_left(root)


def test_beginning_a_consolidation_re_checks_the_fingerprint_itself_after_the_recheck(tmp_path, monkeypatch):
    """A file lands between the shared re-check and the consolidation's own walk."""
    root = tmp_path / "vol"
    ck = ds_run(root, bf16)
    reaper, plan, _ = reaper_for(root, tmp_path, keep_last=2, keep_full_last=1)
    [deferred] = reaper.execute(plan.decisions, consolidate=False)
    real_recheck = reaper.rechecks.recheck
    monkeypatch.setattr(reaper.rechecks, "recheck", lambda d, a: real_recheck(d, a) or add(ck, "notes.txt"))
    result = reaper.begin_consolidation(deferred.decision, deferred.anchors)
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "changed since the plan was made")
    assert not (root / ".ckptd-consolidating").exists() or no_work_left(root)


def test_a_marker_naming_weights_outside_the_checkpoint_is_unreadable(tmp_path):
    ck = slimmed_deepspeed_checkpoint(tmp_path / "run")
    doc = json.loads((ck / slim.MARKER).read_text())
    doc["weights"]["files"] = [{"path": "../elsewhere/model.safetensors", "bytes": 1}]
    (ck / slim.MARKER).write_text(json.dumps(doc))
    age(ck, OLD)
    c = inspect_one(tmp_path)
    assert c.state is State.INCOMPLETE and c.slimmed
    assert "malformed weights file" in next(k for k in c.checks if k.name == "slimmed").detail


def test_a_directory_named_fp32_that_ckptd_did_not_write_is_not_taken_for_weights(tmp_path):
    ck = ds_run(tmp_path / "vol", bf16)
    (ck / "fp32").mkdir()
    save_weights(ck / "fp32" / "model.safetensors")
    age(ck, time.time() - 3600 + 0.5)  # saved before checkpoint-20
    d = plan_first(tmp_path / "vol")
    assert d.action is Action.KEEP
    assert d.reasons[-1].startswith("not slimmed: model.safetensors is bf16 and fp32/ holds no fp32 weights ckptd "
                                    "consolidated (fp32/model.safetensors.index.json missing)")


def test_a_checkpoint_deleted_while_consolidating_gets_nothing_and_loses_nothing(tmp_path, monkeypatch):
    """A deletion of the same checkpoint (a budget, the plan changing) while zero_to_fp32 runs: the
    rename into the trash works, and the consolidator's output goes to the trash on its own."""
    root = tmp_path / "vol"
    ck = ds_run(root, bf16)
    trashed = []

    def delete_meanwhile(out_dir):
        reaper, plan, _ = reaper_for(root, tmp_path / "other", keep_last=1)
        [d] = plan.deletions
        trashed.append(reaper.trash_one(d, [(plan.decisions[1].checkpoint, "newest complete")]))

    _, result, work = two_phase(root, tmp_path, monkeypatch, delete_meanwhile)
    assert trashed[0].outcome is Outcome.TRASHED and not ck.exists()
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "gone while its weights were being consolidated")
    assert not (trashed[0].trash_path / "fp32").exists() and no_work_left(root)
    assert sorted(in_trash(root / TRASH_DIR)) == sorted(
        [trashed[0].trash_path.name, f"{work.name}%consolidating"])


def test_a_failed_consolidation_leaves_its_output_in_the_trash_only(tmp_path, monkeypatch):
    from ckptd.removal.zero_to_fp32 import ConsolidationFailed

    def fail(out_dir):
        raise ConsolidationFailed("killed by signal 9 (no output)")

    ck = ds_run(tmp_path / "vol", bf16)
    _, result, work = two_phase(tmp_path / "vol", tmp_path, monkeypatch, fail)
    assert (result.outcome, result.detail) == (
        Outcome.FAILED, "consolidation failed, nothing removed: killed by signal 9 (no output)")
    assert not (ck / "fp32").exists() and no_work_left(tmp_path / "vol") and untouched(ck)
    assert (tmp_path / "vol" / TRASH_DIR / f"{work.name}%consolidating").is_dir()


def test_leftovers_of_a_crash_go_to_the_trash_at_the_next_start(tmp_path):
    from ckptd.removal.consolidation import WORK_DIR

    root = tmp_path / "vol"
    ds_run(root, bf16)
    (root / WORK_DIR / "1700000000-abcd-run%2Fcheckpoint-10").mkdir(parents=True)
    (root / WORK_DIR / "1700000000-abcd-run%2Fcheckpoint-10" / slim.shard_name(1, 2)).write_text("half")
    reaper, _, journal = reaper_for(root, tmp_path, keep_last=2, keep_full_last=1)
    assert reaper.clear_work() == 1 and no_work_left(root)
    assert reaper.purge()[0] == 1 and os.listdir(root / TRASH_DIR) == []
    journal.close()


def test_a_leftover_of_an_older_ckptds_consolidation_goes_with_the_optimizer_state(tmp_path):
    """Before fp32/, ckptd consolidated inside the checkpoint (model.safetensors.ckptd-tmp/); a crash
    left its partial output there."""
    ck = ds_run(tmp_path / "vol", lambda ck: save_weights(ck / "model.safetensors"))
    (ck / slim.LEGACY_WORK_DIR).mkdir()
    (ck / slim.LEGACY_WORK_DIR / "weights.partial").write_bytes(b"\0" * 100)
    age(ck, time.time() - 3000)
    d = plan_first(tmp_path / "vol")
    assert ("model.safetensors.ckptd-tmp/weights.partial", 100) in d.checkpoint.slim.removable


# --- the marker and the census -----------------------------------------------


def slimmed_deepspeed_checkpoint(run: Path, *, weights: bool = True, listed=("0", "1"), removed=("0", "1")) -> Path:
    ck = hf_deepspeed_checkpoint(run, 10, world=2)
    files = [(f"global_step10/zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 1234) for r in listed]
    for r in removed:
        (ck / f"global_step10/zero_pp_rank_{r}_mp_rank_00_optim_states.pt").unlink()
    if weights:
        write_safetensors(ck / "model.safetensors")
    doc = slim.marker_document(state="done", time=OLD, removed=files, reasons=["test"], weights={
        "path": "model.safetensors", "consolidated": True, "source": "global_step10", "sha256": "ab" * 32})
    (ck / slim.MARKER).write_text(json.dumps(doc))
    age(ck, OLD)
    return ck


def inspect_one(root: Path):
    return Scanner(Root(path=root, world_size=2)).runs(now=NOW)[0].checkpoints[0]


def test_census_does_not_demand_the_shards_the_marker_lists(tmp_path):
    slimmed_deepspeed_checkpoint(tmp_path / "run")
    c = inspect_one(tmp_path)
    checks = {k.name: (k.verdict, k.detail) for k in c.checks}
    assert c.state is State.COMPLETE and c.slimmed and not c.slim.removable
    assert checks["deepspeed shards (global_step10)"] == (
        Verdict.PASSED,
        "1/3 files present, 2 optimizer shards removed by slimming, ZeRO-2 (dp_world_size=2, mp_world_size=1 "
        "from mp_rank_00_model_states.pt)",
    )
    assert checks["slimmed"] == (
        Verdict.PASSED,
        "optimizer state removed: 2 files, 2.4KiB; weights in model.safetensors "
        "(consolidated from global_step10 by zero_to_fp32, sha256 abababababab)",
    )


@pytest.mark.parametrize(
    ("kw", "failed", "detail"),
    [
        (dict(weights=False), "slimmed", "model.safetensors missing: the marker says the weights are there"),
        # a shard the marker does not list is still demanded
        (dict(listed=("0",)), "deepspeed shards (global_step10)", "zero_pp_rank_1_mp_rank_00_optim_states.pt missing"),
    ],
)
def test_a_slimmed_checkpoint_that_lost_more_is_incomplete(tmp_path, kw, failed, detail):
    slimmed_deepspeed_checkpoint(tmp_path / "run", **kw)
    c = inspect_one(tmp_path)
    check = next(k for k in c.checks if k.name == failed)
    assert c.state is State.INCOMPLETE and check.verdict is Verdict.FAILED and check.detail.startswith(detail)


def test_an_unreadable_marker_makes_it_incomplete_and_not_full(tmp_path):
    ck = slimmed_deepspeed_checkpoint(tmp_path / "run")
    (ck / slim.MARKER).write_text("{torn")
    age(ck, OLD)
    c = inspect_one(tmp_path)
    assert c.state is State.INCOMPLETE and c.slimmed
    assert next(k for k in c.checks if k.name == "slimmed").detail.startswith(".ckptd-slim.json unreadable")


# --- the reaper --------------------------------------------------------------


def add(ck: Path, name: str) -> None:
    (ck / name).write_text("x")
    age(ck, time.time() - 3600)


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda ck: add(ck, PIN_FILE), "pinned"),
        (lambda ck: add(ck, "notes.txt"), "changed since the plan was made"),
        (lambda ck: os.rename(ck.parent / "checkpoint-300", ck.parent / "elsewhere"),
         "the run's newest complete checkpoint checkpoint-300 is gone, changed or no longer complete"),
    ],
)
def test_slimming_re_checks_first_and_refuses(trainer_volume, tmp_path, tamper, why):
    reaper, plan, journal = reaper_for(trainer_volume, tmp_path, keep_last=3, keep_full_last=1)
    assert [d.checkpoint.step for d in plan.slims] == [100, 200]
    tamper(trainer_volume / "run" / "checkpoint-100")
    results = reaper.execute([plan.slims[0]] + [d for d in plan.decisions if d.action is Action.KEEP])
    assert [(r.outcome, r.detail) for r in results] == [(Outcome.REFUSED, why)]
    assert (trainer_volume / "run" / "checkpoint-100" / "optimizer.pt").exists()
    assert not (trainer_volume / "run" / "checkpoint-100" / slim.MARKER).exists()
    journal.close()
    assert [r["event"] for r in read_journal(tmp_path / "state")] == ["refused"]


def test_an_interrupted_slimming_is_finished_by_the_next_run(trainer_volume, tmp_path):
    """A crash after the marker was written and before the optimizer file was moved."""
    ck = trainer_volume / "run" / "checkpoint-100"
    size = (ck / "optimizer.pt").stat().st_size
    blocks = (ck / "optimizer.pt").stat().st_blocks * 512  # what the purge frees (space.py)
    doc = slim.marker_document(state="removing", time=OLD, removed=[("optimizer.pt", size)], reasons=["test"],
                               weights={"path": "model.safetensors", "consolidated": False})
    (ck / slim.MARKER).write_text(json.dumps(doc))
    age(ck, time.time() - 3600)
    code, out = verify(ck)
    assert code == 0 and "interrupted: 1 of 1 files still present, prune finishes it" in out
    reaper, plan, journal = reaper_for(trainer_volume, tmp_path, keep_last=3)  # slimming is off now
    [d] = plan.slims
    assert d.checkpoint.step == 100 and d.reasons[0].startswith("slim: finish interrupted slimming")
    [result] = reaper.execute(plan.decisions)
    assert result.outcome is Outcome.SLIMMED and result.moved_bytes == size
    assert not (ck / "optimizer.pt").exists()
    marker = json.loads((ck / slim.MARKER).read_text())
    assert marker["state"] == "done" and marker["removed"] == [{"path": "optimizer.pt", "bytes": size}]
    entry = result.trash_path.stat().st_blocks * 512  # the trash entry's own directory
    assert reaper.purge() == (1, blocks + entry)
    journal.close()


def verify(path: Path, *args: str) -> tuple[int, str]:
    proc = run_ckptd("verify", path, *args)
    return proc.returncode, proc.stdout


# --- end to end ---------------------------------------------------------------


def test_prune_slims_trainer_checkpoints_to_their_weights(trainer_volume, tmp_path):
    cfg = config_file(tmp_path, trainer_volume, keep_last=3, keep_best=0, keep_full_last=1)
    run = trainer_volume / "run"
    optim = (run / "checkpoint-100" / "optimizer.pt").stat().st_size
    one, two = format_size(optim), format_size(2 * optim)
    weights = (run / "checkpoint-100" / "model.safetensors").read_bytes()

    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    rows = [(Path(c["path"]).name, c["action"], c["bytes_freed"]) for c in plan["checkpoints"]]
    assert rows == [("checkpoint-100", "slim", optim), ("checkpoint-200", "slim", optim), ("checkpoint-300", "keep", 0)]
    table = run_ckptd("plan", "-c", cfg).stdout.splitlines()
    assert table[1].split()[6:9] == ["slim", one, "slim:"] and table[-1] == f"1 keep, 0 delete, 2 slim ({two} to free)"

    dry = run_ckptd("prune", "-c", cfg, "--dry-run")
    assert dry.returncode == 0 and f"would move 1 optimizer files ({one})" in dry.stdout
    assert "(dry run; not actually removing anything)" in dry.stdout.splitlines()[-1]
    assert (run / "checkpoint-100" / "optimizer.pt").exists()

    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"prune: 0 deleted (0B freed), 2 slimmed ({two} of optimizer state freed), 0 refused on re-check, 0 failed"
    )
    for step in (100, 200):
        ck = run / f"checkpoint-{step}"
        assert sorted(os.listdir(ck)) == [slim.MARKER, "config.json", "model.safetensors", "rng_state.pth",
                                          "scheduler.pt", "trainer_state.json"]
        assert (ck / "model.safetensors").read_bytes() == weights  # not consolidated: it had its weights
        marker = json.loads((ck / slim.MARKER).read_text())
        assert marker["state"] == "done" and marker["bytes_freed"] == optim
        assert marker["weights"] == {"path": "model.safetensors", "bytes": len(weights), "consolidated": False,
                                     "dtype": "fp32"}
    assert (run / "checkpoint-300" / "optimizer.pt").exists()
    assert os.listdir(trainer_volume / TRASH_DIR) == []
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert events == ["slimming", "slimmed"] * 2 + ["purging", "purged"] * 2

    code, out = verify(run / "checkpoint-100", "-c", str(cfg))
    assert code == 0 and ": complete, slimmed: weights only (hf layout, step 100," in out.splitlines()[0]
    again = run_ckptd("prune", "-c", cfg)
    assert again.stdout.splitlines()[-1].startswith("prune: 0 deleted (0B freed), 0 slimmed")
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    assert [c["reasons"] for c in plan["checkpoints"][:2]] == [["keep_last=3 (#3 newest)", "slimmed"],
                                                                ["keep_last=3 (#2 newest)", "slimmed"]]


# --- config ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retention", "message"),
    [
        ({"keep_full_last": 0}, "roots[0].retention.keep_full_last: must be >= 1 (got 0)"),
        ({"keep_full_last": "1"}, "roots[0].retention.keep_full_last: input should be a valid integer (got '1')"),
        ({"slim_files": ["../optimizer.pt"]},
         "roots[0].retention.slim_files: a slim_files glob is a relative path without '.' or '..' "
         "(got '../optimizer.pt')"),
    ],
)
def test_slim_config_mistakes(retention, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"roots": [{"path": "/x", "retention": retention}]}, "c.toml")
    assert info.value.problems == [f"c.toml: {message}"]


@pytest.mark.parametrize(
    ("globs", "needed"),
    [(["*", "*/*"], "config.json"), (["optimizer.pt", "*.json"], "config.json"), (["*.model"], "tokenizer.model"),
     (["tok*"], "tokenizer.json"), (["*.txt"], "vocab.txt"), (["special_tokens_map.json"], "special_tokens_map.json")],
)
def test_slim_files_that_remove_what_loading_needs_are_refused(tmp_path, state_env, globs, needed):
    """A glob that takes the model's config or the tokenizer with the optimizer state cannot be meant:
    `from_pretrained` fails on what is left. One line naming the key and the file, exit 78."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[roots]]\npath = "{tmp_path}"\n[roots.retention]\nslim_files = {json.dumps(globs)}\n')
    proc = run_ckptd("check-config", "-c", cfg, env=state_env)
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "roots[0].retention.slim_files:" in lines[0], lines
    assert f"would remove {needed}, which loading the weights needs" in lines[0]


@pytest.mark.parametrize("globs", [["global_step*/*optim_states.pt", "optimizer.pt"], ["*.pt", "global_step*/*"],
                                   ["*optim*"], ["rng_state*.pth", "scheduler.pt"]])
def test_slim_files_that_spare_what_loading_needs_pass(globs):
    """Globs that match weights or model states are harmless (slimming keeps those whatever they say)."""
    config = parse_config({"roots": [{"path": "/x", "retention": {"slim_files": globs}}]})
    assert config.roots[0].retention.slim_files == tuple(globs)


def test_keep_full_last_per_run():
    config = parse_config({"roots": [{"path": "/x", "retention": {"keep_full_last": 3},
                                      "runs": [{"match": "sweeps/*", "keep_full_last": 1}]}]})
    root = config.roots[0]
    assert root.retention_for("main")[0].keep_full_last == 3
    assert root.retention_for("sweeps/a")[0].keep_full_last == 1
    assert Retention().keep_full_last is None and Retention().slim_files == DEFAULT_SLIM_FILES


def test_a_symlink_planted_under_the_markers_temp_name_is_not_followed(trainer_volume, tmp_path):
    """The marker's temp file must not be opened by path: that follows a link planted there."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ck = trainer_volume / "run" / "checkpoint-100"
    (ck / f"{slim.MARKER}.tmp").symlink_to(victim)
    age(ck, time.time() - 3600)
    cfg = config_file(tmp_path, trainer_volume, keep_last=3, keep_best=0, keep_full_last=1)
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert victim.read_text() == "precious"
    assert json.loads((ck / slim.MARKER).read_text())["state"] == "done"


# --- the reaper, raced: what changes between its checks and its moves (mutation audit) -------


def test_slimming_re_checks_the_fingerprint_itself_after_the_recheck(trainer_volume, tmp_path, monkeypatch):
    """A file lands between the shared re-check and slimming's own walk."""
    reaper, plan, _ = reaper_for(trainer_volume, tmp_path, keep_last=3, keep_full_last=1)
    ck = trainer_volume / "run" / "checkpoint-100"
    real_recheck = reaper.rechecks.recheck
    monkeypatch.setattr(reaper.rechecks, "recheck", lambda d, a: real_recheck(d, a) or add(ck, "notes.txt"))
    [result] = reaper.execute([plan.slims[0]] + [d for d in plan.decisions if d.action is Action.KEEP])
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "changed since the plan was made")
    assert (ck / "optimizer.pt").exists() and not (ck / slim.MARKER).exists()


def test_the_markers_temp_file_is_created_exclusively_and_never_through_a_link(trainer_volume, tmp_path,
                                                                               monkeypatch):
    """A symlink planted under the temp name after ckptd removed it (a lost race): the open
    must fail rather than truncate what the link points to."""
    import ckptd.removal.slimming

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    real_unlink = ckptd.removal.slimming._unlink_at

    def unlink_then_plant(name, dir_fd):
        real_unlink(name, dir_fd)
        os.symlink(victim, name, dir_fd=dir_fd)

    monkeypatch.setattr(ckptd.removal.slimming, "_unlink_at", unlink_then_plant)
    reaper, plan, _ = reaper_for(trainer_volume, tmp_path, keep_last=3, keep_full_last=1)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 2
    assert "File exists" in results[0].detail
    assert victim.read_text() == "precious"
    assert (trainer_volume / "run" / "checkpoint-100" / "optimizer.pt").exists()


def swap_for_link(ck: Path, tmp_path: Path) -> Path:
    """Move the checkpoint away and put a symlink to a look-alike outside the root in its place."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "optimizer.pt").write_text("not ckptd's to move")
    os.rename(ck, tmp_path / "moved-away")
    ck.symlink_to(outside)
    return outside


def test_a_checkpoint_swapped_for_a_link_after_the_marker_brings_nothing_into_the_trash(trainer_volume, tmp_path,
                                                                                         monkeypatch):
    reaper, plan, _ = reaper_for(trainer_volume, tmp_path, keep_last=3, keep_full_last=1)
    ck = trainer_volume / "run" / "checkpoint-100"
    real_write = reaper.slimming._write_marker
    outside = []

    def write_then_swap(c, state, *args):
        real_write(c, state, *args)
        if state == "removing" and c.path == ck:
            outside.append(swap_for_link(ck, tmp_path))

    monkeypatch.setattr(reaper.slimming, "_write_marker", write_then_swap)
    result = reaper.execute(plan.decisions)[0]
    assert result.outcome is Outcome.FAILED and result.detail.startswith("moved 0 of 1 files, then:")
    assert (outside[0] / "optimizer.pt").read_text() == "not ckptd's to move"
    assert (tmp_path / "moved-away" / "optimizer.pt").exists()


def test_a_swap_inside_the_move_still_moves_the_checked_file(trainer_volume, tmp_path, monkeypatch):
    """The swap lands after the source directory was opened: the rename works from that
    descriptor, so it takes the checkpoint's own file, never the look-alike's."""
    reaper, plan, _ = reaper_for(trainer_volume, tmp_path, keep_last=3, keep_full_last=1)
    ck = trainer_volume / "run" / "checkpoint-100"
    real_rename = os.rename
    outside = []

    def swap_then_rename(src, dst, **kw):
        if not outside and str(src).endswith("optimizer.pt"):
            outside.append(swap_for_link(ck, tmp_path))
        return real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", swap_then_rename)
    results = reaper.execute(plan.decisions)
    assert outside and (outside[0] / "optimizer.pt").read_text() == "not ckptd's to move"
    assert results[0].outcome is Outcome.SLIMMED
    assert not (tmp_path / "moved-away" / "optimizer.pt").exists()  # the checked file went to the trash


def test_the_marker_says_removing_before_any_file_moves(tmp_path, monkeypatch):
    """A move that fails midway (a crash would too) leaves a checkpoint that is still complete,
    whose marker lists the files, and which the next run finishes."""
    root = tmp_path / "vol"
    for i, step in enumerate((10, 20)):
        ck = hf_deepspeed_checkpoint(root / "run", step, world=2)
        write_safetensors(ck / "model.safetensors")
        age(ck, time.time() - 3600 + i)
    reaper, plan, journal = reaper_for(root, tmp_path, keep_last=2, keep_full_last=1)
    assert [d.checkpoint.step for d in plan.slims] == [10]
    real_rename = os.rename
    calls = []

    def fail_the_second_shard(src, dst, **kw):
        if str(src).endswith("optim_states.pt"):
            calls.append(src)
            if len(calls) == 2:
                raise OSError(5, "Input/output error")
        return real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", fail_the_second_shard)
    [result] = reaper.execute(plan.decisions)
    assert result.outcome is Outcome.FAILED and result.detail.startswith("moved 1 of 2 files, then:")
    ck = root / "run" / "checkpoint-10"
    marker = json.loads((ck / slim.MARKER).read_text())
    assert marker["state"] == "removing" and len(marker["removed"]) == 2
    monkeypatch.setattr(os, "rename", real_rename)
    age(ck, time.time() - 3600)  # quiet again, and still older than checkpoint-20
    again, plan, _ = reaper_for(root, tmp_path, keep_last=2)
    c = plan.slims[0].checkpoint
    assert c.state is State.COMPLETE and plan.slims[0].reasons[0].startswith("slim: finish interrupted slimming")
    [result] = again.execute(plan.decisions)
    assert result.outcome is Outcome.SLIMMED
    assert json.loads((ck / slim.MARKER).read_text())["state"] == "done"
    assert not list((ck / "global_step10").glob("*optim_states.pt"))
    journal.close()


# --- consolidation's re-checks ----------------------------------------------------
# The consolidator is replaced by one that writes a small valid shard and index at once: what
# is tested is what the reaper checks around it. Real zero_to_fp32 runs on real DeepSpeed
# checkpoints in test_slim_deepspeed.py (seconds to minutes, not milliseconds).


def slim_first(root: Path, tmp_path: Path):
    reaper, plan, _ = reaper_for(root, tmp_path, keep_last=3, keep_full_last=1)
    assert [d.checkpoint.step for d in plan.slims] == [10, 20]
    return reaper, reaper.execute([plan.slims[0]] + [d for d in plan.decisions if d.action is Action.KEEP])


def untouched(ck: Path) -> bool:
    shards = [ck / f"global_step10/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    return all(s.exists() for s in shards) and not (ck / slim.MARKER).exists()


def no_work_left(root: Path) -> bool:
    """Nothing of the consolidation is left in the work area: a failed one's output is in the trash."""
    from ckptd.removal.consolidation import WORK_DIR

    return not any((root / WORK_DIR).iterdir())


def test_a_consolidated_checkpoint_is_slimmed(unconsolidated, tmp_path, monkeypatch):
    """The baseline for the refusals below: nothing raced, so it goes through."""
    fake_consolidator(monkeypatch)
    _, [result] = slim_first(unconsolidated, tmp_path)
    ck = unconsolidated / "run" / "checkpoint-10"
    assert result.outcome is Outcome.SLIMMED and result.detail.startswith("consolidated global_step10 into fp32/")
    assert sorted(os.listdir(ck / slim.WEIGHTS_DIR)) == [slim.shard_name(1, 1), slim.INDEX]
    assert no_work_left(unconsolidated)
    marker = json.loads((ck / slim.MARKER).read_text())
    assert marker["weights"]["path"] == "fp32/model.safetensors.index.json"
    assert marker["weights"]["sha256"] == "ef" * 32
    assert marker["weights"]["files"] == [{"path": "fp32/model-00001-of-00001.safetensors",
                                           "bytes": (ck / "fp32" / slim.shard_name(1, 1)).stat().st_size,
                                           "sha256": "cd" * 32}]
    # the marker's shards are demanded by the census too
    age(ck, OLD)
    assert inspect_one(unconsolidated).state is State.COMPLETE
    (ck / "fp32" / slim.shard_name(1, 1)).unlink()
    age(ck, OLD)
    c = inspect_one(unconsolidated)
    assert c.state is State.INCOMPLETE
    assert next(k for k in c.checks if k.name == "slimmed").detail.startswith(
        "fp32/model-00001-of-00001.safetensors missing")


def test_a_checkpoint_changed_while_consolidating_is_not_slimmed(unconsolidated, tmp_path, monkeypatch):
    ck = unconsolidated / "run" / "checkpoint-10"
    fake_consolidator(monkeypatch, lambda out: (ck / "notes.txt").write_text("a late write"))
    _, [result] = slim_first(unconsolidated, tmp_path)
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "changed while its weights were being consolidated")
    assert untouched(ck) and not (ck / slim.WEIGHTS_DIR).exists() and no_work_left(unconsolidated)


def test_the_anchor_is_looked_at_again_after_consolidating(unconsolidated, tmp_path, monkeypatch):
    """The newest full checkpoint deleted meanwhile (by a trainer's own save_total_limit, say): the
    fp32 weights were added (that removes nothing), but nothing is removed."""
    run = unconsolidated / "run"
    fake_consolidator(monkeypatch, lambda out: os.rename(run / "checkpoint-30", tmp_path / "gone-30"))
    _, [result] = slim_first(unconsolidated, tmp_path)
    assert (result.outcome, result.detail) == (
        Outcome.REFUSED,
        "the run's newest complete checkpoint checkpoint-30 is gone, changed or no longer complete")
    assert untouched(run / "checkpoint-10")


def test_weights_that_appear_while_consolidating_are_not_overwritten(unconsolidated, tmp_path, monkeypatch):
    """An fp32/ lands after the last look at the checkpoint's entries, just before the rename."""
    import ckptd.removal.consolidation
    import ckptd.removal.slimming

    ck = unconsolidated / "run" / "checkpoint-10"
    fake_consolidator(monkeypatch)
    real_walk, walks = ckptd.removal.slimming.walk, []

    def walk_then_plant(path):
        entries = real_walk(path)
        walks.append(path)
        if len(walks) == 3:  # the look just before moving the weights into place
            (ck / "fp32").mkdir()
            (ck / "fp32" / "mine.txt").write_text("the user's own")
        return entries

    for module in (ckptd.removal.slimming, ckptd.removal.consolidation):  # each walk, counted in order
        monkeypatch.setattr(module, "walk", walk_then_plant)
    _, [result] = slim_first(unconsolidated, tmp_path)
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "fp32/ appeared while consolidating")
    assert os.listdir(ck / "fp32") == ["mine.txt"] and untouched(ck) and no_work_left(unconsolidated)


def test_a_change_right_after_the_weights_went_into_place_stops_the_slim(unconsolidated, tmp_path, monkeypatch):
    """`prune` slims straight after consolidating: the checkpoint is looked at once more in between."""
    import ckptd.removal.consolidation
    import ckptd.removal.slimming

    ck = unconsolidated / "run" / "checkpoint-10"
    fake_consolidator(monkeypatch)
    real_walk, walks = ckptd.removal.slimming.walk, []

    def walk_then_write(path):
        walks.append(path)
        if len(walks) == 4:  # the look after fp32/ went into place
            (ck / "notes.txt").write_text("a late write")
        return real_walk(path)

    for module in (ckptd.removal.slimming, ckptd.removal.consolidation):  # each walk, counted in order
        monkeypatch.setattr(module, "walk", walk_then_write)
    _, [result] = slim_first(unconsolidated, tmp_path)
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "changed while its weights were being consolidated")
    assert untouched(ck) and (ck / "fp32" / slim.INDEX).exists()  # added, and nothing removed


def test_a_consolidated_file_replaced_by_a_link_is_not_moved_into_place(unconsolidated, tmp_path, monkeypatch):
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside)

    def replace_with_link(out_dir):
        (out_dir / slim.shard_name(1, 1)).unlink()
        (out_dir / slim.shard_name(1, 1)).symlink_to(outside)

    fake_consolidator(monkeypatch, replace_with_link)
    _, [result] = slim_first(unconsolidated, tmp_path)
    ck = unconsolidated / "run" / "checkpoint-10"
    assert (result.outcome, result.detail) == (
        Outcome.REFUSED, "the consolidated files are not the ones that were verified")
    assert untouched(ck) and not os.path.lexists(ck / "fp32") and outside.is_file()


def test_a_work_directory_replaced_is_not_moved_into_place(unconsolidated, tmp_path, monkeypatch):
    """Another directory (or a link) under the work directory's name: not the one checked."""
    def replace_directory(out_dir):
        os.rename(out_dir, tmp_path / "checked")
        os.mkdir(out_dir)
        for name in os.listdir(tmp_path / "checked"):
            (out_dir / name).write_bytes((tmp_path / "checked" / name).read_bytes())

    fake_consolidator(monkeypatch, replace_directory)
    _, [result] = slim_first(unconsolidated, tmp_path)
    ck = unconsolidated / "run" / "checkpoint-10"
    assert (result.outcome, result.detail) == (
        Outcome.REFUSED, "the consolidated weights are not where the consolidator left them")
    assert untouched(ck) and not os.path.lexists(ck / "fp32")


def test_a_file_swapped_in_just_before_the_rename_does_not_become_the_weights(unconsolidated, tmp_path,
                                                                            monkeypatch):
    """Between the last check of the consolidator's output and the rename: what lands in place
    is not what was verified, so it is taken back out and nothing is removed."""
    fake_consolidator(monkeypatch)
    real_rename = os.rename

    def swap_then_rename(src, dst, **kw):
        if dst == slim.WEIGHTS_DIR:
            shard = slim.shard_name(1, 1)
            work_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY, dir_fd=kw["src_dir_fd"])
            os.unlink(shard, dir_fd=work_fd)
            fd = os.open(shard, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=work_fd)
            os.write(fd, b"unverified")
            os.close(fd)
            os.close(work_fd)
        return real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", swap_then_rename)
    _, [result] = slim_first(unconsolidated, tmp_path)
    ck = unconsolidated / "run" / "checkpoint-10"
    assert (result.outcome, result.detail) == (Outcome.REFUSED, "fp32/ is not what the consolidator wrote")
    assert untouched(ck)
    assert not (ck / "fp32").exists()  # else the next run would slim trusting it
    assert no_work_left(unconsolidated)


def test_a_consolidation_finished_after_dry_run_was_switched_on_is_not_moved_into_place(tmp_path, monkeypatch):
    """A reload turned dry run on while zero_to_fp32 ran: its output is not moved into the checkpoint."""
    root = tmp_path / "vol"
    ck = ds_run(root, bf16)

    def dry_run_on(out_dir):
        reaper.dry_run = True

    import ckptd.removal.consolidation

    fake_consolidator(monkeypatch, dry_run_on)
    reaper, plan, _ = reaper_for(root, tmp_path, keep_last=2, keep_full_last=1)
    [deferred] = reaper.execute(plan.decisions, consolidate=False)
    work = reaper.begin_consolidation(deferred.decision, deferred.anchors)
    out = ckptd.removal.consolidation.Consolidation(work.save_dir, work.tag, work.model_states, work.path,
                                                    source_fingerprint=work.source_fingerprint, timeout=None).run()
    result = reaper.finish_consolidation(work, out)
    assert (result.outcome, result.detail) == (
        Outcome.REFUSED, "dry run: not moved into place (dry run; not actually removing anything)")
    assert not (ck / "fp32").exists() and untouched(ck) and no_work_left(root)


def test_optimizer_state_put_back_after_a_done_slim_is_kept_and_the_reaper_refuses_it(trainer_volume, tmp_path):
    """A marker saying "done" is rewritten only after every listed file has gone (Reaper.slim_one):
    optimizer files present beside it were put back by hand (to resume), not left by a crash. The
    plan keeps them and says so; and the reaper, deciding the run again from fresh reads before it
    acts, refuses a plan that would remove them. (The marker is flipped in place, same size and mtime, so that the
    plan's fingerprint still matches: a state no real sequence makes, to reach the reaper's check.)"""
    ck = trainer_volume / "run" / "checkpoint-100"
    size = (ck / "optimizer.pt").stat().st_size
    doc = slim.marker_document(state="removing", time=OLD, removed=[("optimizer.pt", size)], reasons=["test"],
                               weights={"path": "model.safetensors", "consolidated": False})
    removing = json.dumps(doc)
    done = removing.replace('"state": "removing"', '"state": "done"    ')
    assert len(done) == len(removing)
    (ck / slim.MARKER).write_text(done)
    age(ck, time.time() - 3600)
    reaper, plan, journal = reaper_for(trainer_volume, tmp_path, keep_last=3)
    assert not plan.slims
    [kept] = [d for d in plan.decisions if d.checkpoint.step == 100]
    assert kept.reasons[-1] == "slimmed, its optimizer state put back since: kept as it is"
    journal.close()
    (ck / slim.MARKER).write_text(removing)
    age(ck, time.time() - 3600)
    reaper, plan, journal = reaper_for(trainer_volume, tmp_path, keep_last=3)
    assert len(plan.slims) == 1  # planned while the marker said "removing"
    st = (ck / slim.MARKER).stat()
    (ck / slim.MARKER).write_text(done)
    os.utime(ck / slim.MARKER, ns=(st.st_atime_ns, st.st_mtime_ns))
    [result] = reaper.execute(plan.decisions)
    assert result.outcome is Outcome.REFUSED, result.detail
    assert result.detail.startswith("decided again from its run's files as they are now: keep (")
    assert result.detail.endswith("slimmed, its optimizer state put back since: kept as it is)")
    assert (ck / "optimizer.pt").exists()
    journal.close()
