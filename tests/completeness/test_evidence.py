"""Recognition and completeness evidence, on a real filesystem.

File ages are set with os.utime and `now` is passed in: no test waits.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, deepspeed_files, hf_deepspeed_checkpoint, write_model_states, write_zip
from ckptd.config import Root
from ckptd.decide.planner import Scanner
from ckptd.discover import layouts
from ckptd.discover.runs import find_runs
from ckptd.frameworks import dsmeta, formats, nemo
from ckptd.frameworks.formats import safetensors_problem
from ckptd.judge import evidence, wholefile
from ckptd.judge.evidence import Inspector, RunContext
from ckptd.judge.verdicts import RACY_NS, Verdicts
from ckptd.model import State, Verdict
from tests.support.ddpfiles import ddp_checkpoint

NOW = 1_800_000_000.0
OLD = NOW - 3600


def scan(root: Path, **root_kw) -> dict[str, object]:
    """Every checkpoint under `root`, by its path relative to the root."""
    runs = Scanner(Root(path=root, **root_kw)).runs(now=NOW)
    return {c.rel: c for run in runs for c in run.checkpoints}


def later_inspector() -> Inspector:
    """An inspector whose looks come well after the files were last written (by the wall clock
    its verdicts cache reads): what it reads is remembered (verdicts.RACY_NS)."""
    def later() -> int:  # the test files' mtimes are around NOW, their ctimes the real now
        return max(int(NOW * 1e9), time.time_ns()) + 5 * RACY_NS

    return Inspector(quiet_period=60, verdicts=Verdicts(clock_ns=later))


def checks(ckpt) -> dict[str, tuple[Verdict, str]]:
    return {c.name: (c.verdict, c.detail) for c in ckpt.checks}


# --- recognition -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "is_dir", "expected"),
    [
        ("checkpoint-1200", True, ("hf", 1200)),
        ("checkpoint-1200", False, None),
        ("global_step40", True, ("deepspeed", 40)),
        ("iter_0005000", True, ("megatron", 5000)),
        ("iter_5000", True, None),
        ("42.orbax-checkpoint-tmp-1700000000", True, ("orbax", 42)),
        ("megatron_gpt--val_loss=1.23-step=1000-consumed_samples=8000.0.ckpt", False, ("nemo", 1000)),
        ("megatron_gpt--val_loss=1.23-step=1000-consumed_samples=8000.0", True, ("nemo", 1000)),
        ("epoch=3-step=900.ckpt", False, ("lightning", 900)),
        # Lightning templates without a step: ordered by epoch (then time); NeMo's default has none
        ("epoch=1-val_loss=0.40.ckpt", False, ("lightning", 1)),
        ("epoch=1-val_loss=-0.40-v1.ckpt", False, ("lightning", 1)),
        ("model-epoch=02-val_loss=0.52.ckpt", False, ("lightning", 2)),
        ("megatron_gpt--val_loss=2.3456-epoch=3.ckpt", False, ("nemo", 3)),
        ("megatron_gpt--val_loss=2.3456-epoch=0-consumed_samples=8000.0", True, ("nemo", 8000)),
        ("megatron_gpt.nemo", False, None),  # NeMo's archive, rewritten in place: no step of its own
        ("val_loss=0.40.ckpt", False, None),  # nothing to order by
        # last copies are not steps: Lightning's save_last, NeMo's -last
        ("last.ckpt", False, None),
        ("last-v1.ckpt", False, None),
        ("epoch=3-last.ckpt", False, None),
        ("megatron_gpt--val_loss=2.3456-epoch=3-step=900-last.ckpt", False, None),
        ("megatron_gpt--val_loss=2.3456-epoch=3-step=900-last", True, None),
        ("megatron_gpt--step=1000-unfinished", False, None),
        ("step_3.orbax-checkpoint-tmp", True, ("orbax", 3)),  # Orbax's step_prefix
        ("notes-step=5.txt", False, None),
        ("ckpt_77", True, ("pattern", 77)),
        ("ckpt_77.tmp", True, None),
        ("runs", True, None),
        ("latest", False, None),
        ("lr=0.1,warmup_step=100", True, None),  # a Hydra sweep directory: warmup_step is not a step
    ],
)
def test_recognise_by_name(name, is_dir, expected):
    cand = layouts.recognise_by_name(name, is_dir, [layouts.compile_pattern("ckpt_{step}")])
    assert (None if cand is None else (cand.layout, cand.step)) == expected


@pytest.mark.parametrize(
    ("name", "children", "expected"),
    [
        ("42", ["_CHECKPOINT_METADATA", "default"], ("orbax", 42)),
        ("42", ["checkpoint-1"], None),  # a run named 42 is not an Orbax step
        ("step_100", ["_CHECKPOINT_METADATA", "commit_success.txt", "default"], ("orbax", 100)),
        ("step_000100", ["_CHECKPOINT_METADATA", "default"], ("orbax", 100)),  # fixed length
        ("00000100", ["_CHECKPOINT_METADATA", "default"], ("orbax", 100)),
        ("step_10", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"], ("accelerate", 10)),
        ("step-30", [".metadata", "__0_0.distcp"], ("torchtitan", 30)),
        ("step-30", ["model.safetensors.index.json", "model-00001-of-00001.safetensors"], ("torchtitan", 30)),
        ("step_300", [".metadata", "__0_0.distcp"], ("dcp", 300)),
        ("step_300", ["__0_0.distcp"], ("dcp", 300)),  # in flight: recognised, then incomplete
        ("final", [".metadata"], None),  # no step to order by
    ],
)
def test_recognise_by_contents(name, children, expected):
    cand = layouts.recognise_by_contents(name, children)
    assert (None if cand is None else (cand.layout, cand.step)) == expected


def test_runs_are_found_at_any_depth_up_to_max_depth(tmp_path):
    for rel in ("a/checkpoint-1", "team/b/checkpoint-2", "x/y/z/deep/checkpoint-3"):
        (tmp_path / rel).mkdir(parents=True)
    (tmp_path / "a" / "checkpoint-1" / "nested" / "checkpoint-9").mkdir(parents=True)  # inside a checkpoint
    (tmp_path / ".hidden" / "checkpoint-4").mkdir(parents=True)
    assert [r.rel for r in find_runs(tmp_path, max_depth=4)] == ["a", "team/b", "x/y/z/deep"]
    assert [r.rel for r in find_runs(tmp_path, max_depth=2)] == ["a", "team/b"]


def test_symlinks_are_never_followed_or_recognised(tmp_path):
    outside = tmp_path / "outside"
    (outside / "checkpoint-5").mkdir(parents=True)
    root = tmp_path / "root"
    (root / "run" / "checkpoint-1").mkdir(parents=True)
    (root / "run" / "checkpoint-2").symlink_to(outside / "checkpoint-5")
    (root / "linked-run").symlink_to(outside)
    write_zip(outside / "epoch=1-step=50.ckpt")  # a file checkpoint, as Lightning writes them
    (root / "run" / "epoch=1-step=50.ckpt").symlink_to(outside / "epoch=1-step=50.ckpt")
    runs = find_runs(root)
    assert [(r.rel, [c.name for c in r.candidates]) for r in runs] == [("run", ["checkpoint-1"])]


def test_trash_is_not_scanned(tmp_path):
    (tmp_path / layouts.TRASH_DIR / "123-run%checkpoint-1").mkdir(parents=True)
    (tmp_path / layouts.TRASH_DIR / "checkpoint-7").mkdir()
    assert find_runs(tmp_path) == []


# --- quiet ---------------------------------------------------------------


def test_quiet_uses_the_newest_mtime_of_anything_inside(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    inner = ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.utime(inner, (NOW - 5, NOW - 5))
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert c.state is State.WRITING
    assert checks(c)["quiet"] == (Verdict.FAILED, "last change 5.0s ago, quiet_period=1m")
    os.utime(inner, (OLD, OLD))
    assert scan(tmp_path, world_size=2)["run/checkpoint-10"].state is State.COMPLETE


def test_a_future_mtime_is_not_quiet(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=NOW + 120)
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert c.state is State.WRITING and "in the future" in checks(c)["quiet"][1]


def test_an_entry_removed_counts_as_a_change(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    before = scan(tmp_path, world_size=2)["run/checkpoint-10"].fingerprint
    (ckpt / "config.json").unlink()
    os.utime(ckpt, (OLD, OLD))  # even with the directory's mtime put back
    assert scan(tmp_path, world_size=2)["run/checkpoint-10"].fingerprint != before


# --- Hugging Face + DeepSpeed (synthetic; real DeepSpeed runs are in test_deepspeed.py) ---


def test_hf_deepspeed_complete(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=4, mtime=OLD)
    c = scan(tmp_path, world_size=4)["run/checkpoint-10"]
    assert c.state is State.COMPLETE, c.checks
    assert checks(c)["deepspeed shards (global_step10)"] == (
        Verdict.PASSED,
        "5/5 files present, ZeRO-2 (dp_world_size=4, mp_world_size=1 from mp_rank_00_model_states.pt)",
    )
    assert checks(c)["rng states"] == (Verdict.PASSED, "4/4 ranks")


def test_missing_shard_is_named(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=8, mtime=OLD,
                            skip={"zero_pp_rank_3_mp_rank_00_optim_states.pt"})
    c = scan(tmp_path, world_size=8)["run/checkpoint-10"]
    assert c.state is State.INCOMPLETE
    assert checks(c)["deepspeed shards (global_step10)"] == (
        Verdict.FAILED,
        "zero_pp_rank_3_mp_rank_00_optim_states.pt missing (dp_world_size=8, mp_world_size=1 from mp_rank_00_model_states.pt)",
    )


def test_zero3_needs_every_ranks_model_states(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, stage=3, mtime=OLD,
                            skip={"zero_pp_rank_1_mp_rank_00_model_states.pt"})
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    verdict, detail = checks(c)["deepspeed shards (global_step10)"]
    assert verdict is Verdict.FAILED and detail.startswith("zero_pp_rank_1_mp_rank_00_model_states.pt missing")


def test_world_size_from_config_when_the_metadata_cannot_be_read(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=4, mtime=OLD)
    write_zip(ckpt / "global_step10" / "mp_rank_00_model_states.pt")  # a zip without a pickle in it
    age(ckpt, OLD)
    c = scan(tmp_path, world_size=4)["run/checkpoint-10"]
    assert checks(c)["deepspeed shards (global_step10)"] == (
        Verdict.PASSED, "5/5 files present, ZeRO (dp_world_size=4, mp_world_size=1 from config world_size)")


def test_without_readable_metadata_or_world_size_the_census_is_unknown(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    write_zip(ckpt / "global_step10" / "mp_rank_00_model_states.pt")
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-10"]
    verdict, detail = checks(c)["deepspeed shards (global_step10)"]
    assert verdict is Verdict.UNKNOWN and detail.startswith("cannot count shards")
    assert c.state is State.INCOMPLETE


def test_trainer_state_missing_or_broken(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD, skip={"trainer_state.json"})
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2, mtime=OLD)
    (ckpt / "trainer_state.json").write_text('{"global_step": 20, "log_hist')
    age(ckpt, OLD)
    found = scan(tmp_path, world_size=2)
    assert checks(found["run/checkpoint-10"])["trainer_state.json"][0] is Verdict.FAILED
    assert checks(found["run/checkpoint-20"])["trainer_state.json"][1].startswith("unreadable: JSONDecodeError")
    assert {found[k].state for k in found} == {State.INCOMPLETE}


def test_rng_state_per_rank(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=4, mtime=OLD, skip={"rng_state_2.pth"})
    c = scan(tmp_path, world_size=4)["run/checkpoint-10"]
    assert checks(c)["rng states"] == (Verdict.FAILED, "rng_state_2.pth missing (3/4 ranks)")


def test_plain_trainer_checkpoint_without_deepspeed(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    write_zip(ckpt / "optimizer.pt", 10)
    write_zip(ckpt / "scheduler.pt", 10)  # written with optimizer.pt (Trainer._save_optimizer_and_scheduler)
    write_zip(ckpt / "rng_state.pth", 10)
    _safetensors(ckpt / "model.safetensors", {"w": 16})
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-5"]
    assert c.state is State.COMPLETE, c.checks
    assert checks(c)["file integrity"] == (Verdict.PASSED, "4 torch/safetensors files intact")
    (ckpt / "scheduler.pt").unlink()  # optimizer.pt says the save was not save_only_model
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-5"]
    assert c.state is State.INCOMPLETE
    assert checks(c)["trainer state files"][0] is Verdict.FAILED


def test_truncated_torch_file_fails_integrity(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD, shard_size=4096)
    shard = ckpt / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    (ckpt / "global_step10" / "empty.pt").write_bytes(b"")
    age(ckpt, OLD)
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    verdict, detail = checks(c)["file integrity"]
    assert verdict is Verdict.FAILED
    assert "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt is not a complete zip archive" in detail
    assert "global_step10/empty.pt is empty" in detail


def _safetensors(path: Path, tensors: dict[str, int], truncate: int = 0) -> None:
    header, offset = {}, 0
    for name, nbytes in tensors.items():
        header[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + b"\0" * offset
    path.write_bytes(data[: len(data) - truncate])


@pytest.mark.parametrize(
    ("truncate", "problem"),
    [(0, None), (1, "tensors need 48 data bytes, the file has 47 (truncated?)"), (60, "header length")],
)
def test_safetensors_header_must_fit_the_file(tmp_path, truncate, problem):
    path = tmp_path / "model.safetensors"
    _safetensors(path, {"a": 16, "b": 32}, truncate=truncate)
    found = safetensors_problem(path, path.stat().st_size)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"\x10\0\0", "model.safetensors: 3 bytes: too short for a header"),
        (None, "model.safetensors: tensors need 48 data bytes, the file has 47 (truncated?)"),
    ],
)
def test_a_truncated_weights_file_makes_the_checkpoint_incomplete(tmp_path, content, problem):
    ckpt = tmp_path / "run" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    if content is None:
        _safetensors(ckpt / "model.safetensors", {"a": 16, "b": 32}, truncate=1)
    else:
        (ckpt / "model.safetensors").write_bytes(content)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-5"]
    assert c.state is State.INCOMPLETE
    assert checks(c)["file integrity"] == (Verdict.FAILED, problem)


# --- the other layouts -----------------------------------------------------


def test_bare_deepspeed(tmp_path):
    run = tmp_path / "run"
    for step, skip in ((10, ()), (20, ("zero_pp_rank_1_mp_rank_00_optim_states.pt",))):
        gs = run / f"global_step{step}"
        gs.mkdir(parents=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
            if name not in skip:
                write_zip(gs / name)
        age(gs, OLD)
    (run / "latest").write_text("global_step20")  # not evidence: written before the slow rank finished
    found = scan(tmp_path, world_size=2)
    assert found["run/global_step10"].state is State.COMPLETE
    assert found["run/global_step20"].state is State.INCOMPLETE


def test_bf16_optimizer_shards_are_counted_by_their_own_names(tmp_path):
    """DeepSpeed's bf16 optimizer writes bf16_zero_pp_rank_* shards: each rank's must be there."""
    run = tmp_path / "run"
    for step, skip in ((10, ()), (20, ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",))):
        gs = run / f"global_step{step}"
        for name in deepspeed_files(2, bf16=True):
            if name.endswith("model_states.pt"):
                write_model_states(gs / name, 2)
            elif name not in skip:
                write_zip(gs / name)
        age(gs, OLD)
    found = scan(tmp_path)
    assert found["run/global_step10"].state is State.COMPLETE
    verdict, detail = checks(found["run/global_step20"])["deepspeed shards"]
    assert verdict is Verdict.FAILED and "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt missing" in detail


def test_megatron_tracker(tmp_path):
    run = tmp_path / "run"
    for step in (1000, 2000):
        write_zip(run / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt")
        age(run / f"iter_{step:07d}", OLD)
    (run / "latest_checkpointed_iteration.txt").write_text("1000\n")
    found = scan(tmp_path)
    assert found["run/iter_0001000"].state is State.COMPLETE
    assert checks(found["run/iter_0002000"])["megatron tracker"] == (
        Verdict.FAILED, "tracker at iteration 1000 < 2000: still being saved")


def test_megatron_without_its_tracker_is_not_complete(tmp_path):
    """The tracker is written after every rank saved; without it nothing proves the save finished."""
    write_zip(tmp_path / "run" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt")
    age(tmp_path / "run", OLD)
    c = scan(tmp_path)["run/iter_0001000"]
    assert c.state is State.INCOMPLETE
    assert checks(c)["megatron tracker"] == (
        Verdict.FAILED, "latest_checkpointed_iteration.txt missing (written after every rank saved)")


def test_dcp_needs_metadata(tmp_path):
    run = tmp_path / "run"
    for name, with_meta in (("step_100", True), ("step_200", False)):
        d = run / name
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
        (d / "__1_0.distcp").write_bytes(b"x" * 10)
        if with_meta:
            (d / ".metadata").write_bytes(b"meta")
        age(d, OLD)
    found = scan(tmp_path)
    # b"meta" is no DCP metadata pickle: what it names cannot be read (real saves: test_frameworks.py,
    # tests/completeness/test_damaged_saves.py), so .metadata's presence alone no longer makes the step complete
    assert found["run/step_100"].state is State.INCOMPLETE
    assert checks(found["run/step_100"])["dcp storage (.metadata)"][0] is Verdict.FAILED
    assert checks(found["run/step_100"])["dcp .metadata"][0] is Verdict.PASSED
    assert found["run/step_200"].state is State.INCOMPLETE


def test_dcp_inside_a_trainer_checkpoint(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-3"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    (ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"x")
    (ckpt / "trainer_state.json").write_text("{}")
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-3"]
    assert checks(c)["dcp .metadata (pytorch_model_fsdp_0)"][0] is Verdict.FAILED


def test_dcp_metadata_alone_makes_a_dcp_directory_inside_a_checkpoint(tmp_path):
    """Every `*.distcp` gone: the directory's `.metadata` (or a rank's `__<rank>.metadata`) still makes
    it a DCP save whose storage is demanded (real files: test_dcp_nested.py). Hand-made junk metadata
    here, which no check may pass; a `.metadata/` directory (an Eclipse workspace) is no DCP's."""
    ckpt = tmp_path / "run" / "checkpoint-3"
    for d, name in (("pytorch_model_fsdp_0", ".metadata"), ("optimizer_0", "__0.metadata")):
        (ckpt / d).mkdir(parents=True)
        (ckpt / d / name).write_bytes(b"m")
    (ckpt / "ws" / ".metadata").mkdir(parents=True)
    (ckpt / "ws" / ".metadata" / "version.ini").write_text("1")
    (ckpt / "trainer_state.json").write_text("{}")
    age(ckpt, OLD)
    c = scan(tmp_path)["run/checkpoint-3"]
    found = checks(c)
    assert c.state is State.INCOMPLETE
    assert found["dcp .metadata (pytorch_model_fsdp_0)"][0] is Verdict.PASSED
    assert found["dcp storage (pytorch_model_fsdp_0/.metadata)"][0] is Verdict.FAILED
    assert found["dcp storage (optimizer_0/__0.metadata)"][0] is Verdict.FAILED
    assert not [name for name in found if "ws" in name], found


def test_orbax(tmp_path):
    run = tmp_path / "run"
    (run / "100" / "default").mkdir(parents=True)
    (run / "100" / "_CHECKPOINT_METADATA").write_text("{}")
    (run / "200.orbax-checkpoint-tmp-1700000000" / "default").mkdir(parents=True)
    age(run, OLD)
    found = scan(tmp_path)
    assert found["run/100"].state is State.COMPLETE
    assert found["run/200.orbax-checkpoint-tmp-1700000000"].state is State.INCOMPLETE


def test_nemo_unfinished_marker(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    done = "megatron_gpt--val_loss=1.10-step=100-consumed_samples=800.0.ckpt"
    busy = "megatron_gpt--val_loss=1.00-step=200-consumed_samples=1600.0.ckpt"
    write_zip(run / done)
    write_zip(run / busy)
    (run / nemo.unfinished_marker(busy)).write_text("")
    age(run, OLD)
    found = scan(tmp_path)
    assert found[f"run/{done}"].state is State.COMPLETE
    assert checks(found[f"run/{busy}"])["nemo marker"][0] is Verdict.FAILED


def test_user_pattern_is_complete_on_quiet_alone_and_says_so(tmp_path):
    (tmp_path / "run" / "ckpt_5").mkdir(parents=True)
    age(tmp_path / "run", OLD)
    c = scan(tmp_path, patterns=("ckpt_{step}",))["run/ckpt_5"]
    assert c.state is State.COMPLETE
    assert checks(c)["evidence"] == (
        Verdict.PASSED,
        "pattern 'ckpt_{step}' names no completion evidence: complete on quiet alone, the weakest evidence there is",
    )


def test_pins(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 20, world=2, mtime=OLD)
    (ckpt / layouts.PIN_FILE).write_text("")
    found = scan(tmp_path, world_size=2)
    assert not found["run/checkpoint-10"].pinned and found["run/checkpoint-20"].pinned


def test_world_size_cache_is_keyed_by_file_identity(tmp_path, monkeypatch):
    """Re-inspecting an unchanged checkpoint does not read its metadata again."""
    inspector = later_inspector()
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    cand = layouts.recognise_by_name(ckpt.name, True)
    ctx = RunContext(tmp_path / "run", frozenset(os.listdir(tmp_path / "run")))
    reads = []
    real_read = dsmeta.read_world_sizes
    monkeypatch.setattr(dsmeta, "read_world_sizes", lambda path: reads.append(path) or real_read(path))
    first = inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    assert len(reads) == 1 and first.state is State.COMPLETE
    # rewritten by a resumed job with twice the ranks: read again, and two shards are now missing
    write_model_states(ckpt / "global_step10" / "mp_rank_00_model_states.pt", 4)
    age(ckpt, OLD + 100)
    again = inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    assert len(reads) == 2
    assert checks(again)["deepspeed shards (global_step10)"][0] is Verdict.FAILED


def test_trainer_state_is_parsed_again_only_when_it_changed(tmp_path, monkeypatch):
    from ckptd.frameworks import hf

    inspector = later_inspector()
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, losses={10: 0.5}, mtime=OLD)
    cand = layouts.recognise_by_name(ckpt.name, True)
    ctx = RunContext(tmp_path / "run", frozenset(os.listdir(tmp_path / "run")))
    parses = []
    real_parse = hf.parse_trainer_state
    monkeypatch.setattr(hf, "parse_trainer_state", lambda data: parses.append(1) or real_parse(data))
    first = inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    second = inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    assert len(parses) == 1 and second.trainer_state == first.trainer_state
    assert first.trainer_state.history[10]["eval_loss"] == 0.5
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": [
        {"step": 10, "eval_loss": 0.25}]}))  # rewritten by a resumed job
    age(ckpt, OLD + 100)
    third = inspector.inspect(tmp_path, "run", ctx, cand, now=NOW)
    assert len(parses) == 2 and third.trainer_state.history[10]["eval_loss"] == 0.25


def test_world_sizes_are_read_without_torch_and_without_running_anything(tmp_path):
    """A torch.save-shaped zip whose data.pkl names a function to call: it is never looked up."""
    import pickle
    import sys
    import zipfile

    from ckptd.frameworks.dsmeta import read_plain_data

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "mp_rank_00_model_states.pt"
    payload = {"dp_world_size": 8, "mp_world_size": 2, "ds_config": {"zero_optimization": {"stage": 3}},
               "evil": Evil()}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mp_rank_00_model_states/data.pkl", pickle.dumps(payload, protocol=2))
    torch_before = "torch" in sys.modules
    data = read_plain_data(path)
    assert (data["dp_world_size"], data["mp_world_size"], data["ds_config"]["zero_optimization"]["stage"]) == (8, 2, 3)
    assert not (tmp_path / "pwned").exists()
    assert ("torch" in sys.modules) == torch_before


@pytest.mark.parametrize(
    "rel",
    [
        "multirun/lr=0.1,warmup_step=100/checkpoint-1000",  # a Hydra sweep directory is a run
        "multirun/model--step=5/checkpoint-1000",  # a NeMo-looking name that holds checkpoints
        "dcp-run7/checkpoint-1000",  # a run directory dcp.save also wrote .metadata into
        "logs-step=3/checkpoint-1000",
    ],
)
def test_a_directory_holding_checkpoints_is_a_run_not_a_checkpoint(tmp_path, rel):
    ckpt = tmp_path / rel
    ckpt.mkdir(parents=True)
    (ckpt.parent / ".metadata").write_bytes(b"m")
    (ckpt.parent / "weights").mkdir()
    runs = find_runs(tmp_path, max_depth=4)
    assert [(r.rel, [c.name for c in r.candidates]) for r in runs] == [(str(ckpt.parent.relative_to(tmp_path)),
                                                                       ["checkpoint-1000"])]


def test_a_nemo_named_directory_without_nemo_contents_is_not_a_checkpoint(tmp_path):
    (tmp_path / "run" / "epoch=1-step=100" / "tensorboard").mkdir(parents=True)
    (tmp_path / "run" / "megatron--step=200" / "weights").mkdir(parents=True)
    [run] = find_runs(tmp_path)
    assert [c.name for c in run.candidates] == ["megatron--step=200"]


def test_a_model_states_file_still_being_written_does_not_import_torch(tmp_path):
    """A zip whose central directory is not written yet: found in the load test, where the
    daemon's first look at a new checkpoint imported torch (233 MiB RSS) for it."""
    import subprocess
    import sys

    path = tmp_path / "mp_rank_00_model_states.pt"
    write_zip(path, 4096)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the local header is there, the directory is not
    code = (
        "import sys; from pathlib import Path; from ckptd.frameworks.dsmeta import MetadataUnavailable, read_world_sizes\n"
        "try:\n    read_world_sizes(Path(sys.argv[1]))\nexcept MetadataUnavailable as exc:\n    print(exc)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["mp_rank_00_model_states.pt is an incomplete zip (still being written?)",
                                       "False"], out.stdout + out.stderr


@pytest.mark.parametrize("content", [b"", b"garbage that is not a torch file"])
def test_an_empty_or_foreign_model_states_file_does_not_import_torch(tmp_path, content):
    import subprocess
    import sys

    path = tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(content)
    code = (
        "import sys; from pathlib import Path; from ckptd.frameworks.dsmeta import MetadataUnavailable, read_world_sizes\n"
        "try:\n    read_world_sizes(Path(sys.argv[1]))\nexcept MetadataUnavailable as exc:\n    print('refused')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["refused", "False"], out.stdout + out.stderr


# --- zip integrity: the end record must end the file, consistent with its directory ---------------


def _torch_save(path: Path, obj: object) -> bytes:
    torch = pytest.importorskip("torch")
    torch.save(obj, path)
    return path.read_bytes()


def test_every_prefix_of_a_real_torch_file_is_incomplete(tmp_path):
    """torch.save's own output (which carries a zip64 record even when small) passes whole, and
    fails cut at every byte: the writer's directory comes last, so no prefix is a whole archive."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "states.pt"
    data = _torch_save(path, {"w": torch.arange(40.0), "step": 7, "name": "x" * 50})
    assert formats.is_zip(path, len(data))
    cut = tmp_path / "cut.pt"
    accepted = []
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        if formats.is_zip(cut, n):
            accepted.append(n)
    assert accepted == []


def test_a_torch_file_whose_directory_is_longer_than_the_tail_read_at_once(tmp_path):
    """`_zip_directory_ok` reads the last 8 KiB at once and anything before it by itself: a torch file
    of 400 tensors (a central directory of about 40 KiB) passes whole and fails cut."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "many.pt"
    data = _torch_save(path, {f"t{i}": torch.zeros(2) for i in range(400)})
    record = data.rfind(b"PK\x05\x06")
    directory = struct.unpack_from("<I", data, record + 16)[0]
    assert len(data) - directory > 2 * formats._TAIL  # the directory starts well before the tail
    assert formats.is_zip(path, len(data))
    for cut in (1, 22, 23, 98, len(data) - directory, len(data) // 2):
        path.write_bytes(data[: len(data) - cut])
        assert not formats.is_zip(path, len(data) - cut), cut


def test_a_half_written_file_holding_a_whole_zip_is_incomplete(tmp_path):
    """The hole: a tensor whose bytes are a zip (an archive stored in a checkpoint), the file cut
    just after that inner zip's end record. zipfile.is_zipfile takes the inner record for the
    file's own; ckptd must not."""
    import io
    import zipfile

    torch = pytest.importorskip("torch")
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("a.txt", "hello")
    payload = inner.getvalue()
    path = tmp_path / "optim.pt"
    data = _torch_save(path, {"blob": torch.frombuffer(bytearray(payload), dtype=torch.uint8), "tail": torch.zeros(4096)})
    end = data.find(payload) + len(payload)
    assert end > len(payload)  # the inner zip sits inside the torch file
    path.write_bytes(data[:end])  # killed right after writing the inner zip's end record
    assert zipfile.is_zipfile(path), "the state that fooled the old check"
    assert not formats.is_zip(path, end)
    entry = evidence.Entry("optim.pt", "f", end, 0)
    assert wholefile.file_problem(path, entry) == " is not a complete zip archive (truncated?)"


@pytest.mark.parametrize("entries", [1, 70_000])  # 70k entries: Python writes zip64 end records
@pytest.mark.parametrize("comment", [b"", b"a comment after the end record"])
def test_other_writers_zips_pass_whole_and_fail_cut(tmp_path, entries, comment):
    import zipfile

    path = tmp_path / "model.bin"
    with zipfile.ZipFile(path, "w") as z:
        for i in range(entries):
            z.writestr(f"f{i}", b"")
        z.comment = comment
    data = path.read_bytes()
    assert formats.is_zip(path, len(data))
    for cut in (1, 21, 22, 23, len(comment) + 22, len(data) // 2):
        path.write_bytes(data[: len(data) - cut])
        assert not formats.is_zip(path, len(data) - cut), cut


def test_an_end_record_whose_numbers_add_up_must_point_at_a_directory_entry(tmp_path):
    """Hand-made (no writer produces it; a torn write could): the last 22 bytes are an end record
    whose directory offset and size add up to where it starts, over bytes that are no directory."""
    body = b"\x00" * 100
    record = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, 40, 60, 0)
    path = tmp_path / "torn.pt"
    local, entry = b"PK\x03\x04", b"PK\x01\x02"
    path.write_bytes(local + body[4:] + record)  # a member where a zip begins, no entry at 60
    assert not formats.is_zip(path, len(body) + len(record))
    path.write_bytes(body[:60] + entry + body[64:] + record)  # the entry, but zeros where a zip begins
    assert not formats.is_zip(path, len(body) + len(record))
    path.write_bytes(local + body[4:60] + entry + body[64:] + record)
    assert formats.is_zip(path, len(body) + len(record))


# --- when a checkpoint was saved: a pin or a touch does not move it ----------------------------


def test_save_times_leave_out_ckptds_own_files_and_directories(tmp_path):
    ck = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2, mtime=OLD)
    os.utime(ck / "trainer_state.json", (OLD + 5, OLD + 5))
    (ck / layouts.PIN_FILE).write_text("")
    os.utime(ck / layouts.PIN_FILE, (NOW, NOW))
    os.utime(ck, (NOW, NOW))  # a touch of the directory
    c = scan(tmp_path, world_size=2)["run/checkpoint-10"]
    assert (c.saved_at, c.written_at) == (OLD, OLD + 5)
    assert c.newest_mtime == NOW and c.pinned  # quiet still sees everything


def test_pinning_an_old_checkpoint_makes_nothing_deletable(tmp_path, state_env):
    """`touch checkpoint-1/.ckptd-keep` re-anchored keep_within at the pin's mtime: checkpoints kept
    a moment before were deleted. End to end through `ckptd plan`."""
    import time

    from tests.support.common import run_ckptd

    root = tmp_path / "vol"
    hour = 3600
    base = time.time() - 100 * hour
    for i in range(1, 6):
        hf_deepspeed_checkpoint(root / "run", i, world=2, mtime=base + i * hour)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\nworld_size = 2\n[roots.retention]\n"
                   "keep_last = 1\nkeep_best = 0\nkeep_within = '2h'\n")

    def deleted() -> list[str]:
        proc = run_ckptd("plan", "-c", cfg, "--json", env=state_env)
        assert proc.returncode == 0, proc.stderr
        return [c["path"].rsplit("/", 1)[1] for c in json.loads(proc.stdout)["checkpoints"] if c["action"] == "delete"]

    assert deleted() == ["checkpoint-1", "checkpoint-2"]  # 3, 4 within 2h of 5; 5 the newest
    run = root / "run"
    (run / "checkpoint-1" / layouts.PIN_FILE).write_text("")  # pin the oldest
    os.utime(run / "checkpoint-3")  # touch a directory
    os.utime(run / "checkpoint-2" / "trainer_state.json")  # touch a file: it now looks recent
    assert deleted() == []  # before: the window moved to now, and 3 and 4 were deleted


# --- a rank census without a known world size learns from the run ----------------------------


def test_a_checkpoint_one_rank_short_of_the_runs_last_complete_one_is_incomplete(tmp_path):
    """rng_state_0..6 are contiguous, and rank 7 never wrote its file: before, that passed, the
    checkpoint became the newest complete, and with keep_last=1 the last loadable ones went."""
    run = tmp_path / "run"
    for i, step in enumerate((100, 200)):
        ddp_checkpoint(run, step, 8, OLD + i)
    ddp_checkpoint(run, 300, 7, OLD + 10)
    got = scan(tmp_path)
    assert got["run/checkpoint-200"].state is State.COMPLETE
    c = got["run/checkpoint-300"]
    assert c.state is State.INCOMPLETE
    assert checks(c)["rank census"] == (
        Verdict.FAILED,
        "7 ranks' files, the run's last complete checkpoint checkpoint-200 has 8: a rank is missing, "
        "or the job shrank (then set world_size for this run)",
    )
    assert checks(c)["rng states"] == (Verdict.PASSED, "ranks 0..6 contiguous (world size not known)")


def test_a_run_that_grew_is_fine_and_a_configured_world_size_decides(tmp_path):
    run = tmp_path / "run"
    ddp_checkpoint(run, 100, 4, OLD)
    ddp_checkpoint(run, 200, 8, OLD + 1)  # resumed on more GPUs
    ddp_checkpoint(run, 300, 7, OLD + 2)
    got = scan(tmp_path)
    assert got["run/checkpoint-200"].state is State.COMPLETE
    assert got["run/checkpoint-300"].state is State.INCOMPLETE  # against 200, not 100
    got = scan(tmp_path, world_size=7)  # the operator says the job shrank
    assert got["run/checkpoint-300"].state is State.COMPLETE
    assert checks(got["run/checkpoint-300"])["rng states"] == (Verdict.PASSED, "7/7 ranks")
    assert got["run/checkpoint-200"].state is State.COMPLETE  # ranks 0..6 there (an eighth file is not asked for)


def test_verify_asks_the_runs_census_as_plan_does(tmp_path, state_env):
    """`ckptd verify` of a checkpoint one rank short of the run's last complete one says what plan
    says (incomplete, the rank census failed, exit 1), not complete on the checkpoint's own files."""
    from tests.support.common import run_ckptd

    root = tmp_path / "vol"
    then = time.time() - 3600
    ddp_checkpoint(root / "run", 100, 2, then)
    ddp_checkpoint(root / "run", 200, 1, then + 60)  # rank 1 never wrote rng_state_1.pth
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\nquiet_period = '1m'\n")
    why = ("1 ranks' files, the run's last complete checkpoint checkpoint-100 has 2: a rank is missing, "
           "or the job shrank (then set world_size for this run)")
    plan = run_ckptd("plan", "-c", cfg, "--json", env=state_env)
    rows = {Path(c["path"]).name: c for c in json.loads(plan.stdout)["checkpoints"]}
    assert rows["checkpoint-200"]["reasons"][0] == f"incomplete, never deleted: rank census failed: {why}"
    verify = run_ckptd("verify", "-c", cfg, root / "run" / "checkpoint-200", env=state_env)
    assert verify.returncode == 1 and verify.stdout.startswith(f"{root / 'run' / 'checkpoint-200'}: incomplete ")
    said = [" ".join(line.split()) for line in verify.stdout.splitlines()]  # its columns' widths vary
    assert f"failed rank census {why}" in said, verify.stdout
    assert run_ckptd("verify", "-c", cfg, root / "run" / "checkpoint-100", env=state_env).returncode == 0


# --- completion evidence a user names for a pattern of their own --------------------------------


def own_checkpoint(run: Path, step: int, files: list[str]) -> Path:
    """A checkpoint in the user's own format (theirs to define: made by hand, as they would)."""
    ck = run / f"ckpt_{step}"
    ck.mkdir(parents=True)
    for f in files:
        (ck / f).parent.mkdir(parents=True, exist_ok=True)
        (ck / f).write_text("x")
    age(ck, OLD + step)
    return ck


def test_a_pattern_names_the_evidence_that_completes_its_checkpoints(tmp_path):
    run = tmp_path / "run"
    own_checkpoint(run, 1, ["model.pt.part", "shards/shard_0.dat", "shards/shard_1.dat", "COMMITTED"])
    own_checkpoint(run, 2, ["model.pt.part", "shards/shard_0.dat", "shards/shard_1.dat"])  # killed before COMMITTED
    own_checkpoint(run, 3, ["shards/shard_0.dat", "COMMITTED"])  # rank 1's shard missing
    pattern = {"name": "ckpt_{step}", "require": ["COMMITTED"], "ranks": "shards/shard_{rank}.dat"}
    got = scan(tmp_path, patterns=(pattern,), world_size=2)
    assert got["run/ckpt_1"].state is State.COMPLETE
    assert checks(got["run/ckpt_1"])["requires COMMITTED"] == (Verdict.PASSED, "COMMITTED present")
    assert checks(got["run/ckpt_1"])["ranks (shards/shard_{rank}.dat)"] == (Verdict.PASSED, "2/2 ranks")
    assert checks(got["run/ckpt_2"])["requires COMMITTED"] == (Verdict.FAILED, "no such file")
    assert got["run/ckpt_2"].state is State.INCOMPLETE
    assert checks(got["run/ckpt_3"])["ranks (shards/shard_{rank}.dat)"] == (
        Verdict.FAILED, "shards/shard_1.dat missing (1/2 ranks)")
    # without a world size, the run's last complete checkpoint sets the count
    got = scan(tmp_path, patterns=(pattern,))
    assert got["run/ckpt_3"].state is State.INCOMPLETE
    assert "the run's last complete checkpoint ckpt_1 has 2" in checks(got["run/ckpt_3"])["rank census"][1]


def test_plan_says_plainly_when_checkpoints_are_complete_on_quiet_alone(tmp_path, state_env):
    from tests.support.common import run_ckptd

    root = tmp_path / "vol"
    for step in (1, 2, 3):
        own_checkpoint(root / "run", step, ["weights.dat"])
        age(root / "run" / f"ckpt_{step}", OLD - 3600 * 24 * 400 + step)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\npatterns = ['ckpt_{{step}}']\n")
    proc = run_ckptd("plan", "-c", cfg, env=state_env)
    assert proc.returncode == 0, proc.stderr
    assert (f"warning: {root / 'run'}: 3 checkpoint(s) complete on quiet alone: nothing in them proves a "
            "save finished; name the evidence in the pattern") in proc.stdout
    verify = run_ckptd("verify", "-c", cfg, root / "run" / "ckpt_3", env=state_env)
    assert "complete on quiet alone, the weakest evidence there is" in verify.stdout
