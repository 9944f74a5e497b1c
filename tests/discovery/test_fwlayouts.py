"""Layouts as their frameworks name them, on a real filesystem.

The frameworks that can run here write their own volumes (test_frameworks.py). NeMo and
Megatron-core cannot save on a CPU-only torch (FWGEN_NOTES.md: megatron-core calls
torch.cuda.synchronize(), NeMo's strategy needs CUDA), so their checkpoints here are hand-made
look-alikes of what their source writes, file for file, and each test says so. Ages are set with
os.utime; `now` is passed in.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from ckptd import frameworks
from ckptd.cli.demo_volume import age, write_zip
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner
from ckptd.decide.policy import decide_run, metric_warnings
from ckptd.discover import layouts
from ckptd.discover.runs import depth_of, find_runs
from ckptd.frameworks import lightning
from ckptd.frameworks.formats import tar_problem
from ckptd.model import State
from tests.support.fwdcp_one import put_dcp

NOW = 1_800_000_000.0
OLD = NOW - 3600


def scan(root: Path, **kw) -> dict[str, object]:
    runs = Scanner(Root(path=root, **kw)).runs(now=NOW)
    return {c.rel: c for run in runs for c in run.checkpoints}


def failed(c) -> list[str]:
    return [f"{k.name}: {k.detail}" for k in c.checks if k.verdict != "passed"]


# --- discovery: framework-made directories do not count against max_depth -------------------------


def test_framework_made_directories_do_not_count_against_max_depth(tmp_path):
    """Lightning's default tree under team/run folders is 5 levels down, below the default max_depth
    of 4: it was found empty, without a word. Its directories (and NeMo's timestamped version,
    torchtitan's checkpoint/) are not counted; any other directory is."""
    lightning = tmp_path / "team" / "run" / "lightning_logs" / "version_0" / "checkpoints"
    nemo = tmp_path / "nemo_experiments" / "gpt" / "2024-01-31_12-00-00" / "checkpoints"
    titan = tmp_path / "titan" / "outputs" / "checkpoint"
    write_zip(lightning / "epoch=0-step=2.ckpt")
    write_zip(nemo / "gpt--val_loss=2.5000-epoch=0.ckpt")
    (titan / "step-10").mkdir(parents=True)
    (titan / "step-10" / ".metadata").write_bytes(b"m")
    (tmp_path / "data" / "a" / "b" / "checkpoint-1").mkdir(parents=True)  # depth 3: beyond max_depth=2
    found = [r.rel for r in find_runs(tmp_path, max_depth=2)]
    assert found == ["nemo_experiments/gpt/2024-01-31_12-00-00/checkpoints",
                     "team/run/lightning_logs/version_0/checkpoints", "titan/outputs/checkpoint"]
    assert find_runs(tmp_path, max_depth=2, framework_dirs=False) == []
    assert depth_of("team/run/lightning_logs/version_0/checkpoints") == 2  # what the daemon's re-listing uses
    assert depth_of(".") == 0


# --- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("epoch=3-step=40-val_loss=0.52.ckpt", {"epoch": "3", "step": "40", "val_loss": "0.52"}),
        ("epoch=1-val_loss=-0.40-v1.ckpt", {"epoch": "1", "val_loss": "-0.40"}),
        ("megatron_gpt--val_loss=2.3456-epoch=3-consumed_samples=8000.0",
         {"val_loss": "2.3456", "epoch": "3", "consumed_samples": "8000.0"}),
        ("lr=1e-05-epoch=2.ckpt", {"lr": "1e-05", "epoch": "2"}),
        ("val_acc=nan-epoch=2.ckpt", {"val_acc": "nan", "epoch": "2"}),
        ("lr=0.1,warmup_step=100", {}),  # a Hydra sweep directory
    ],
)
def test_name_fields(name, fields):
    assert frameworks.name_fields(name) == fields


# --- NeMo (hand-made look-alikes of what NeMo's source writes: it cannot save here) ----------------


def nemo2_checkpoint(dcp_one, run: Path, name: str, *, metadata: bool = True) -> Path:
    """NeMo 2's distributed checkpoint: <name>/weights/ holds megatron-core's files (common.pt, the
    DCP shards and .metadata, then metadata.json last), <name>/context/ the model's config. The DCP
    files are a real save by torch's own writer (`dcp_one`): ckptd reads their .metadata."""
    ckpt = run / name
    write_zip(ckpt / "weights" / "common.pt")
    put_dcp(dcp_one, ckpt / "weights")
    if metadata:
        (ckpt / "weights" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (ckpt / "context").mkdir()
    (ckpt / "context" / "io.json").write_text("{}")
    return ckpt


@pytest.mark.frameworks
def test_nemo_distributed_checkpoints_need_megatron_cores_metadata_json_and_no_marker(dcp_one, tmp_path):
    """Hand-made (NeMo cannot save on a CPU torch), its weights/ DCP files real (`dcp_one`).
    megatron-core writes weights/metadata.json last; NeMo's `-unfinished` marker is there while it
    saves; `-last` copies are not steps."""
    run = tmp_path / "gpt" / "checkpoints"
    nemo2_checkpoint(dcp_one, run, "gpt--val_loss=2.5000-epoch=0-consumed_samples=4000.0")
    nemo2_checkpoint(dcp_one, run, "gpt--val_loss=2.4000-epoch=0-consumed_samples=8000.0", metadata=False)
    nemo2_checkpoint(dcp_one, run, "gpt--val_loss=2.3000-epoch=0-consumed_samples=12000.0")
    (run / "gpt--val_loss=2.3000-epoch=0-consumed_samples=12000.0-unfinished").touch()
    nemo2_checkpoint(dcp_one, run, "gpt--val_loss=2.3000-epoch=0-consumed_samples=12000.0-last")
    age(tmp_path, OLD)
    seen = scan(tmp_path)
    names = {rel.rsplit("/", 1)[1]: c for rel, c in seen.items()}
    assert sorted((c.step, c.unit, c.layout) for c in names.values()) == [
        (4000, "consumed_samples", "nemo"), (8000, "consumed_samples", "nemo"), (12000, "consumed_samples", "nemo")]
    assert names["gpt--val_loss=2.5000-epoch=0-consumed_samples=4000.0"].state is State.COMPLETE
    assert failed(names["gpt--val_loss=2.4000-epoch=0-consumed_samples=8000.0"]) == [
        "megatron-core weights/metadata.json: missing (megatron-core writes it last)"]
    assert failed(names["gpt--val_loss=2.3000-epoch=0-consumed_samples=12000.0"]) == [
        "nemo marker: gpt--val_loss=2.3000-epoch=0-consumed_samples=12000.0-unfinished present: save not finished"]


def test_nemo_metric_and_epoch_order_from_its_default_names(tmp_path):
    """NeMo 1's default name, `{name}--{val_loss:.4f}-{epoch}`, has no step: ordered by epoch, val_loss
    read from the name (hand-made .ckpt files: zips as torch.save writes them)."""
    run = tmp_path / "exp" / "checkpoints"
    for epoch, loss in ((0, 2.5), (1, 2.1), (2, 2.3)):
        write_zip(run / f"megatron_gpt--val_loss={loss:.4f}-epoch={epoch}.ckpt")
    write_zip(run / "megatron_gpt--val_loss=2.3000-epoch=2-last.ckpt")
    age(tmp_path, OLD)
    [run_] = Scanner(Root(path=tmp_path)).runs(now=NOW)
    assert [(c.step, c.unit) for c in run_.checkpoints] == [(0, "epoch"), (1, "epoch"), (2, "epoch")]
    decisions = decide_run(run_, Retention(keep_last=1, keep_best=1, metric="val_loss"))
    assert [(d.checkpoint.step, str(d.action), d.metric, d.metric_source) for d in decisions] == [
        (0, "delete", 2.5, "file name"), (1, "keep", 2.1, "file name"), (2, "keep", 2.3, "file name")]
    assert decisions[2].reasons == ("newest complete (by epoch, then time: its name has no step)",)


def nemo_archive(path: Path, payload: int = 3000) -> bytes:
    """A .nemo as NeMo's save_restore_connector writes it: tarfile.open(path, 'w:'), config and weights."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as tar:
        for name, data in (("model_config.yaml", b"a: 1\n"), ("model_weights.ckpt", b"\x01" * payload)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def test_a_nemo_archive_is_whole_only_with_its_members_and_end_blocks(tmp_path):
    """NeMo writes .nemo in place, with no marker: the tar's own structure is the only evidence."""
    data = nemo_archive(tmp_path / "a.nemo")
    assert tar_problem(tmp_path / "a.nemo", len(data)) is None
    # two members (512 + 512, 512 + 3072 bytes), tar's two zero blocks at 4608, zeros to 10240
    for cut in (512, 1024, 2048, 4096, 4608, 5120):
        (tmp_path / "b.nemo").write_bytes(data[:cut])
        assert tar_problem(tmp_path / "b.nemo", cut) is not None, cut
    (tmp_path / "b.nemo").write_bytes(data[:5632])  # cut in the padding after the end blocks: whole
    assert tar_problem(tmp_path / "b.nemo", 5632) is None
    (tmp_path / "run").mkdir()
    nemo_archive(tmp_path / "run" / "gpt--step=100.nemo")
    (tmp_path / "run" / "gpt--step=200.nemo").write_bytes(data[:2048])
    nemo_archive(tmp_path / "run" / "gpt.nemo")  # NeMo's usual name: no step, rewritten in place
    age(tmp_path, OLD)
    seen = scan(tmp_path)
    assert sorted(seen) == ["run/gpt--step=100.nemo", "run/gpt--step=200.nemo"]
    assert seen["run/gpt--step=100.nemo"].state is State.COMPLETE
    assert "file integrity" in failed(seen["run/gpt--step=200.nemo"])[0]


# --- Megatron-core and torchtitan ------------------------------------------------------------------


@pytest.mark.frameworks
def test_megatron_torch_dist_needs_metadata_json_and_the_tracker(dcp_one, tmp_path):
    """Hand-made (megatron-core cannot save on a CPU torch), its DCP files real (`dcp_one`):
    Megatron-LM's iter_N in the torch_dist format holds megatron-core's files; metadata.json is
    written last, the tracker after that."""
    run = tmp_path / "gpt"
    for it, meta in ((100, True), (200, False)):
        d = run / f"iter_{it:07d}"
        write_zip(d / "common.pt")
        put_dcp(dcp_one, d)
        if meta:
            (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    age(tmp_path, OLD)
    seen = scan(tmp_path)
    assert seen["gpt/iter_0000100"].state is State.COMPLETE
    assert failed(seen["gpt/iter_0000200"]) == ["megatron-core metadata.json: missing (megatron-core writes it last)"]


def test_a_megatron_tracker_rolled_back_says_so(tmp_path):
    """Hand-made (Megatron-LM is not installed): iterations 100 and 200 saved, the tracker then rolled
    back by hand to 100 to resume from there. 200 is kept, not deleted, and said why: not "still being
    saved" forever. While 200 is being saved (the tracker older than its files) it says that."""
    run = tmp_path / "gpt"
    for i, it in enumerate((100, 200)):
        write_zip(run / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt")
        age(run / f"iter_{it:07d}", OLD + i * 60)
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("100")
    age(tracker, OLD + 30)  # written after iteration 100, before 200's files: 200 is being saved
    seen = scan(tmp_path)
    assert failed(seen["gpt/iter_0000200"]) == ["megatron tracker: tracker at iteration 100 < 200: still being saved"]
    age(tracker, OLD + 3600)  # rewritten to 100 after 200 was saved: rolled back
    seen = scan(tmp_path)
    assert seen["gpt/iter_0000100"].state is State.COMPLETE
    assert failed(seen["gpt/iter_0000200"]) == [
        "megatron tracker: above the tracker the framework resumes from (rolled back?): tracker at iteration "
        "100 < 200, written after this iteration's files"]
    [run_] = Scanner(Root(path=tmp_path)).runs(now=NOW)
    decisions = decide_run(run_, Retention(keep_last=1, keep_best=0))
    assert [(d.checkpoint.step, str(d.action)) for d in decisions] == [(100, "keep"), (200, "keep")]


def test_torchtitans_last_save_in_hf_format(tmp_path):
    """torchtitan's last_save_in_hf: step-N holds model.safetensors.index.json and the shards it names."""
    run = tmp_path / "outputs" / "checkpoint"
    for step, shards in ((10, 2), (20, 1)):
        d = run / f"step-{step}"
        d.mkdir(parents=True)
        names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
        for n in names[:shards]:
            (d / n).write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    age(tmp_path, OLD)
    seen = scan(tmp_path)
    assert seen["outputs/checkpoint/step-10"].state is State.COMPLETE
    assert failed(seen["outputs/checkpoint/step-20"]) == [
        "torchtitan step: model-00002-of-00002.safetensors missing (1/2 shards in the HF index)"]


# --- metrics the checkpoints carry -------------------------------------------------------------------


def test_an_unreadable_orbax_metrics_item_is_said_so(tmp_path):
    run = tmp_path / "run"
    for step, text in ((1, '{"loss": 0.5}'), (2, "{not json")):
        d = run / str(step)
        (d / "metrics").mkdir(parents=True)
        (d / "metrics" / "metrics").write_text(text)
        (d / "commit_success.txt").write_text("ok")
        (d / "_CHECKPOINT_METADATA").write_text("{}")
    age(tmp_path, OLD)
    [run_] = Scanner(Root(path=tmp_path)).runs(now=NOW)
    [w] = metric_warnings(run_, Retention(metric="loss"))
    assert "metric 'loss' found for 1 of 2 complete checkpoints; none for 2" in w
    assert "metrics/metrics unreadable: JSONDecodeError" in w


def test_a_second_callbacks_state_does_not_lend_its_score_to_a_file(tmp_path):
    """Every callback's state goes into every .ckpt: a file saved by a callback without a monitor
    carries the monitoring callback's state too, with its current_score from an earlier save. Only
    a ModelCheckpoint whose best_k_models lists this very file (by name: the paths are absolute as
    written) gives its score. Hand-made with torch.save: fwgen's Lightning runs have one callback."""
    torch = pytest.importorskip("torch")
    watcher = {"monitor": "val_loss", "current_score": torch.tensor(0.4),
               "best_k_models": {"/elsewhere/ckpts/epoch=1-step=4.ckpt": torch.tensor(0.4)}}
    plain = {"monitor": None, "current_score": None, "best_k_models": {}}
    state = {"callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": watcher, "ModelCheckpoint{'monitor': None}": plain}}
    torch.save(state, tmp_path / "epoch=1-step=4.ckpt")
    torch.save(state, tmp_path / "step=5.ckpt")  # saved by the other callback, one step later
    assert lightning.ckpt_scores(tmp_path / "epoch=1-step=4.ckpt") == {"val_loss": pytest.approx(0.4)}
    assert lightning.ckpt_scores(tmp_path / "step=5.ckpt") == (
        "no ModelCheckpoint with a monitor lists this file in its state")


def test_nemos_unfinished_marker_counts_for_a_lightning_named_file_too(tmp_path):
    """NeMo's ModelCheckpoint may name its files as Lightning's do (a user template without `--`):
    its `-unfinished` marker beside one still says the save is not finished (hand-made marker)."""
    run = tmp_path / "run"
    write_zip(run / "epoch=0-step=100.ckpt")
    write_zip(run / "epoch=1-step=200.ckpt")
    (run / "epoch=1-step=200-unfinished").touch()
    age(tmp_path, OLD)
    seen = scan(tmp_path)
    assert seen["run/epoch=0-step=100.ckpt"].state is State.COMPLETE
    assert failed(seen["run/epoch=1-step=200.ckpt"]) == [
        "nemo marker: epoch=1-step=200-unfinished present: save not finished"]


def test_the_daemons_polling_finds_a_new_lightning_version_below_max_depth(tmp_path):
    """A resumed fit opens lightning_logs/version_1/checkpoints: the daemon's re-listing of the
    directory that changed counts depth as discovery does (framework-made directories are free)."""
    from ckptd.daemon.tracker import RootTracker

    logs = tmp_path / "team" / "run" / "lightning_logs"
    write_zip(logs / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt")
    t = RootTracker(Root(path=tmp_path, max_depth=2), lambda: 1000.0)
    t.full_scan()
    assert [c.rel for c in t.checkpoints()] == ["team/run/lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt"]
    write_zip(logs / "version_1" / "checkpoints" / "epoch=1-step=4.ckpt")
    t.poll()
    assert sorted(c.rel for c in t.checkpoints()) == [
        "team/run/lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt",
        "team/run/lightning_logs/version_1/checkpoints/epoch=1-step=4.ckpt"]


def test_the_daemons_relisting_counts_depth_as_discovery_does(tmp_path):
    """Re-listing a changed directory below framework-made ones: `lightning_logs/version_0` has used
    none of max_depth=2, so a run two levels below it is in reach, as a full scan finds it."""
    from ckptd.daemon.tracker import RootTracker

    version = tmp_path / "lightning_logs" / "version_0"
    write_zip(version / "checkpoints" / "epoch=0-step=2.ckpt")
    t = RootTracker(Root(path=tmp_path, max_depth=2), lambda: 1000.0)
    t.full_scan()
    (version / "exp" / "run" / "checkpoint-1").mkdir(parents=True)
    t.poll()
    assert "lightning_logs/version_0/exp/run/checkpoint-1" in {c.rel for c in t.checkpoints()}
    assert [r.rel for r in find_runs(tmp_path, max_depth=2)] == [
        "lightning_logs/version_0/checkpoints", "lightning_logs/version_0/exp/run"]


@pytest.mark.frameworks
def test_torchtitans_staged_shards_are_not_a_save_it_loads(dcp_one, tmp_path):
    """torchtitan stages an HF save's shards in step-N/sharded/ (a whole DCP save there: a real one
    by torch's writer, `dcp_one`) and then consolidates them; killed before the index is written,
    step-N holds neither .metadata nor model.safetensors.index.json at its top, and
    `_find_load_step` skips it."""
    staged = tmp_path / "outputs" / "checkpoint" / "step-30" / "sharded"
    put_dcp(dcp_one, staged)
    age(tmp_path, OLD)
    c = scan(tmp_path)["outputs/checkpoint/step-30"]
    assert (c.layout, c.state) == ("torchtitan", State.INCOMPLETE)
    assert failed(c) == ["torchtitan step: neither .metadata nor model.safetensors.index.json (written last)"]


def test_values_from_more_than_one_source_and_missing_ones_are_said(tmp_path):
    """A template changed mid-run: older names carry val_loss, newer ones not (read from the .ckpt
    state instead), and one has it nowhere. Pure: the checkpoints as a scan leaves them."""
    from dataclasses import replace

    from ckptd.model import CKPT_STATE, FILE_NAME, Checkpoint, Reading, Run, Verdict
    from ckptd.model import Check as K

    def ckpt(step: int, metrics: tuple) -> Checkpoint:
        return Checkpoint(tmp_path, "run", f"epoch={step}-step={step}.ckpt", step, "lightning",
                          (K("quiet", Verdict.PASSED, "q"),), written_at=float(step), saved_at=float(step))

    run = Run(tmp_path, "run", (
        replace(ckpt(1, ()), metrics=(("val_loss", Reading(0.5, FILE_NAME)),)),
        replace(ckpt(2, ()), metrics=(("val_loss", Reading(0.4, CKPT_STATE)),)),
        ckpt(3, ()),
    ))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=1, metric="val_loss"))
    assert [(d.metric, d.metric_source) for d in decisions] == [(0.5, FILE_NAME), (0.4, CKPT_STATE), (None, None)]
    warnings = metric_warnings(run, Retention(keep_last=1, keep_best=1, metric="val_loss"), decisions)
    assert warnings == [
        f"{tmp_path}/run: metric 'val_loss' comes from more than one source: .ckpt ModelCheckpoint state (1), "
        "file name (1); a file name's value is rounded as the name was formatted",
        f"{tmp_path}/run: metric 'val_loss' found for 2 of 3 complete checkpoints; none for epoch=3-step=3.ckpt: "
        "keep_missing_metric keeps them",
    ]
    assert metric_warnings(run, Retention(keep_last=1, keep_best=1, metric="val_loss")) == warnings  # no decisions


@pytest.mark.parametrize("pattern, name, expected", [
    ("ckpt_{step}", "ckpt_120", (120, "step")),
    ("ep*-ba{step}-rank0.pt", "ep3-ba1200-rank0.pt", (1200, "step")),
    ("ep*-ba{step}-rank0.pt", "ep3-ba1200-rank1.pt", None),  # another rank's file: not the checkpoint
    ("ep?-ba{step}.pt", "ep12-ba5.pt", None),  # '?' is one character
    ("run*_step{step}", "run_a_b_step7", (7, "step")),
    ("checkpoint_{time}", "checkpoint_2026-12-01_09-00-00.000000", (20261201090000000000, "time")),
    ("snap-{time}", "snap-20261201T0900", (202612010900, "time")),
    ("snap-{time}", "snap-latest", None),
    ("ckpt.{step}", "ckptX12", None),  # '.' is a dot, not any character
])
def test_user_pattern_fields_and_wildcards(pattern, name, expected):
    cand = layouts.recognise_by_name(name, True, [layouts.compile_pattern(pattern)])
    assert (None if cand is None else (cand.step, cand.unit)) == expected


def test_a_pattern_directory_gets_the_shard_and_whole_file_checks_whatever_require_says(tmp_path):
    """Hand-made states that a killed save_pretrained does not leave in this order (its own kills
    are in tests/completeness/test_pattern_formats.py): an index naming a shard that is not there,
    a torn config.json, all behind a `require` they meet."""
    root = tmp_path / "vol"
    shards = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    index = json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}})
    states = {
        "step_1": {"config.json": "{}", shards[0]: None, shards[1]: None, "model.safetensors.index.json": index},
        "step_2": {"config.json": "{}", shards[0]: None, "model.safetensors.index.json": index},
        "step_3": {"config.json": '{"n_embd": 1', shards[0]: None, shards[1]: None,
                   "model.safetensors.index.json": index},
    }
    for step, files in states.items():
        for rel, text in files.items():
            p = root / "run" / step / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}" if text is None else text.encode())
    age(root, OLD)
    found = scan(root, patterns=[{"name": "step_{step}", "require": ["config.json", "*.safetensors"]}])
    assert failed(found["run/step_1"]) == []
    assert failed(found["run/step_2"]) == [
        "sharded weights: model-00002-of-00002.safetensors missing (1/2 named by model.safetensors.index.json)"]
    assert [f.split(":")[0] for f in failed(found["run/step_3"])] == ["whole files"]
    assert found["run/step_3"].state is State.INCOMPLETE
