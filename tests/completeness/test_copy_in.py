"""A checkpoint copied in by a copier that died before its weights is not complete.

Restoring a run from object storage (`aws s3 sync`, `rclone copy`, `gsutil -m cp`) copies files in
parallel, small ones first, each with the source's mtime: a copier killed before the big file
leaves every small file of a real Trainer or accelerate save whole and old, the weights missing
(or one shard an index names, or a temporary `.partial` beside). Such a checkpoint must be
incomplete, naming why; `ckptd latest` must pass over it; `keep_last=1` must keep the older one
the framework can load (the Trainer refuses the other: "Can't find a valid checkpoint").

The saves are the frameworks' own (fwweights.py: the Trainer and accelerate on the CPU, each form
of weights they write). The dead copier is the real save with its big file removed (or renamed to
the copier's temporary name, cut to half) and every other file's and directory's mtime kept: what
the copier leaves, without running one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.common import run_ckptd

pytestmark = pytest.mark.frameworks

HOUR = 3600.0


def copy_run(volume: dict[str, Any], run: str, root: Path) -> Path:
    """A copy of one run under `root`, every mtime moved an hour back (their order kept: the save
    order is evidence too), so that it is quiet without waiting."""
    dest = root / run
    shutil.copytree(volume["out_dir"] / run, dest, symlinks=True)
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in filenames + dirnames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(HOUR * 1e9)), follow_symlinks=False)
    return dest


def dead_copier(ckpt: Path, big: str, *, partial: str | None = None) -> None:
    """What a parallel copier killed before `big` leaves: the file never landed (or, with `partial`,
    only half of it under the copier's temporary name); the directory's mtime is the source's."""
    st = ckpt.stat()
    if partial is None:
        (ckpt / big).unlink()
    else:
        data = (ckpt / big).read_bytes()
        (ckpt / big).unlink()
        (ckpt / partial).write_bytes(data[: len(data) // 2])
        os.utime(ckpt / partial, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))


def write_config(tmp_path: Path, root: Path) -> Path:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    return cfg


def plan_rows(cfg: Path, root: Path) -> dict[str, dict[str, Any]]:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return {os.path.relpath(c["path"], root): c for c in json.loads(proc.stdout)["checkpoints"]}


RUNS = ["trainer-safetensors", "trainer-save-only-model", "trainer-sharded", "accelerate-safetensors",
        "accelerate-bin"]


@pytest.mark.parametrize("run", RUNS)
def test_every_whole_save_is_complete(weights_volume, tmp_path, run):
    """The contract is met by every form the frameworks write: nothing whole is held back."""
    root = tmp_path / "vol"
    copy_run(weights_volume, run, root)
    rows = plan_rows(write_config(tmp_path, root), root)
    for ckpt in weights_volume["runs"][run]:
        assert rows[ckpt]["state"] == "complete", rows[ckpt]


# (run, the file the copier never finished, the copier's temporary name or None, the reason said)
COPIES = [
    ("trainer-safetensors", "model.safetensors", None, "weights failed: no model weights"),
    ("trainer-save-only-model", "model.safetensors", None, "weights failed: no model weights"),
    ("trainer-sharded", "model-00002-of-00003.safetensors", None,
     "weights failed: model-00002-of-00003.safetensors missing (2/3 shards named by model.safetensors.index.json)"),
    ("accelerate-safetensors", "model.safetensors", None, "weights failed: no model weights"),
    ("accelerate-bin", "pytorch_model.bin", None, "weights failed: no model weights"),
    ("trainer-safetensors", "model.safetensors", "model.safetensors.3f9a1c2b.partial",
     "copy leftovers failed: model.safetensors.3f9a1c2b.partial"),  # rclone
    ("trainer-sharded", "model-00003-of-00003.safetensors", "model-00003-of-00003.safetensors_.gstmp",
     "copy leftovers failed: model-00003-of-00003.safetensors_.gstmp"),  # gsutil
    # the weights whole, the optimizer mid-copy: the Trainer would resume without its state
    ("trainer-safetensors", "optimizer.pt", "optimizer.pt.3f9a1c2b.partial",
     "copy leftovers failed: optimizer.pt.3f9a1c2b.partial"),
    ("accelerate-safetensors", "model.safetensors", "model.safetensors.A1b2C3d4",
     "copy leftovers failed: model.safetensors.A1b2C3d4"),  # aws s3's s3transfer
]


@pytest.mark.parametrize(("run", "big", "partial", "reason"), COPIES,
                         ids=[f"{r}:{p or b}" for r, b, p, _ in COPIES])
def test_a_copy_in_without_its_weights_is_incomplete_and_the_older_one_is_kept(
        weights_volume, tmp_path, run, big, partial, reason):
    root = tmp_path / "vol"
    run_dir = copy_run(weights_volume, run, root)
    older, newest = weights_volume["runs"][run]
    dead_copier(root / newest, big, partial=partial)
    cfg = write_config(tmp_path, root)
    rows = plan_rows(cfg, root)
    assert rows[newest]["state"] == "incomplete", rows[newest]
    said = rows[newest]["reasons"][0]
    assert said.startswith("incomplete, never deleted: ") and reason in said, said
    assert rows[older]["state"] == "complete" and rows[older]["action"] == "keep", rows[older]

    proc = run_ckptd("latest", run_dir, env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{root / older}\n"
    assert f"passed over {os.path.basename(newest)}: incomplete" in proc.stderr

    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert (root / older).is_dir() and (root / newest).is_dir()


def test_an_adapter_only_save_needs_its_adapter(weights_volume, tmp_path):
    """Adapter-only (LoRA through PEFT: save_pretrained writes adapter_model.safetensors and
    adapter_config.json in place of model.safetensors). PEFT is not installed here, so this one is
    made from the Trainer's real save by renaming its weights as PEFT names them: a look-alike."""
    root = tmp_path / "vol"
    run_dir = copy_run(weights_volume, "trainer-safetensors", root)
    older, newest = weights_volume["runs"]["trainer-safetensors"]
    for ckpt in (older, newest):
        d = root / ckpt
        st = d.stat()
        (d / "model.safetensors").rename(d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        os.utime(d / "adapter_config.json", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    cfg = write_config(tmp_path, root)
    rows = plan_rows(cfg, root)
    assert rows[newest]["state"] == "complete" and rows[older]["state"] == "complete"
    dead_copier(root / newest, "adapter_model.safetensors")
    rows = plan_rows(cfg, root)
    assert rows[newest]["state"] == "incomplete" and rows[older]["action"] == "keep"
    proc = run_ckptd("latest", run_dir, env={"CKPTD_CONFIG": ""})
    assert proc.stdout == f"{root / older}\n"


def test_time_moves_on_and_a_dead_copy_is_still_incomplete(weights_volume, tmp_path):
    """Nothing about quiet: a day later the dead copy is as incomplete as it was."""
    root = tmp_path / "vol"
    copy_run(weights_volume, "trainer-safetensors", root)
    newest = weights_volume["runs"]["trainer-safetensors"][-1]
    dead_copier(root / newest, "model.safetensors")
    day = time.time() - 24 * HOUR
    for p in (root / newest).iterdir():
        os.utime(p, (day, day))
    os.utime(root / newest, (day, day))
    rows = plan_rows(write_config(tmp_path, root), root)
    assert rows[newest]["state"] == "incomplete"


def test_a_user_pattern_over_accelerates_saves_gets_accelerates_evidence(weights_volume, tmp_path):
    """A pattern `step_{step}` matching accelerate's own save_state() directories made them "complete on
    quiet alone", though accelerate's evidence (its random_states census, its weights) is known. Now
    they are accelerate's: the dead copy is incomplete, the whole one complete."""
    root = tmp_path / "vol"
    copy_run(weights_volume, "accelerate-safetensors", root)
    older, newest = weights_volume["runs"]["accelerate-safetensors"]
    dead_copier(root / newest, "model.safetensors")
    cfg = write_config(tmp_path, root)
    cfg.write_text(cfg.read_text().replace("[roots.retention]", "patterns = [\"step_{step}\"]\n[roots.retention]"))
    rows = plan_rows(cfg, root)
    assert rows[older]["layout"] == "accelerate" and rows[older]["state"] == "complete", rows[older]
    assert rows[newest]["state"] == "incomplete", rows[newest]
    assert "weights failed: no model weights" in rows[newest]["reasons"][0]


def test_a_user_pattern_over_accelerates_saves_gets_its_random_states_census(weights_volume, tmp_path):
    """Under the same pattern, accelerate's own census of its last-written files holds: a copy that
    died before random_states_0.pkl (each process writes its own, last) is incomplete, saying so,
    though every other file, the weights among them, is whole."""
    root = tmp_path / "vol"
    copy_run(weights_volume, "accelerate-safetensors", root)
    older, newest = weights_volume["runs"]["accelerate-safetensors"]
    dead_copier(root / newest, "random_states_0.pkl")
    cfg = write_config(tmp_path, root)
    cfg.write_text(cfg.read_text().replace("[roots.retention]", "patterns = [\"step_{step}\"]\n[roots.retention]"))
    rows = plan_rows(cfg, root)
    assert rows[newest]["layout"] == "accelerate" and rows[newest]["state"] == "incomplete", rows[newest]
    assert "random states failed: random_states_0.pkl missing" in rows[newest]["reasons"][0], rows[newest]["reasons"]
    assert rows[older]["state"] == "complete" and rows[older]["action"] == "keep", rows[older]


def chunked_copier(ckpt: Path, name: str, written: list[int], *, chunks: int = 4,
                   control: str | None = None) -> None:
    """What a copier that writes into the final name leaves when killed (AzCopy, aria2c with
    preallocation, rclone's multi-thread copies): the file made at its full size first, then only
    the chunks in `written` at their offsets, the rest zeros; with `control`, the control file it
    keeps beside the file until the file is whole (aria2c's `<name>.aria2`). Mtimes kept."""
    path, st = ckpt / name, (ckpt / name).stat()
    data = path.read_bytes()
    size = -(-len(data) // chunks)
    with open(path, "r+b") as f:
        f.truncate(0)
        f.truncate(len(data))
        for k in written:
            f.seek(k * size)
            f.write(data[k * size : (k + 1) * size])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    if control is not None:
        (ckpt / control).write_bytes(b"\0\1" + bytes(64))
        os.utime(ckpt / control, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(ckpt, ns=(ckpt.stat().st_atime_ns, st.st_mtime_ns))


# (run, file, chunks written, control file, the reason said)
CHUNKED = [
    # the end records whole over zeros where the first members belong: torch.load fails
    ("trainer-safetensors", "optimizer.pt", [3], None, "optimizer.pt is not a complete zip archive"),
    ("accelerate-safetensors", "optimizer.bin", [2, 3], None, "optimizer.bin is not a complete zip archive"),
    # the header landed and fits the file: only aria2c's control file says the rest did not
    ("trainer-safetensors", "model.safetensors", [0], "model.safetensors.aria2",
     "copy leftovers failed: model.safetensors.aria2"),
]


@pytest.mark.parametrize(("run", "name", "written", "control", "reason"), CHUNKED,
                         ids=[f"{r}:{n}:{w}" for r, n, w, _, _ in CHUNKED])
def test_a_chunked_copy_killed_partway_is_incomplete_and_the_older_one_is_kept(
        weights_volume, tmp_path, run, name, written, control, reason):
    root = tmp_path / "vol"
    copy_run(weights_volume, run, root)
    older, newest = weights_volume["runs"][run]
    chunked_copier(root / newest, name, written, control=control)
    rows = plan_rows(write_config(tmp_path, root), root)
    assert rows[newest]["state"] == "incomplete", rows[newest]
    said = rows[newest]["reasons"][0]
    assert reason in said, said
    assert rows[older]["state"] == "complete" and rows[older]["action"] == "keep", rows[older]


@pytest.mark.parametrize(("run", "last"), [("trainer-safetensors", "trainer_state.json"),
                                           ("accelerate-safetensors", "random_states_0.pkl")])
def test_a_resave_in_place_killed_after_its_weights_is_incomplete(weights_volume, tmp_path, run, last):
    """A second job saving into the same directory, killed right after its weights (the Trainer's
    _save_checkpoint and accelerate's save_accelerator_state write the model first, `last` at the
    end): the new weights beside the old save's optimizer, scheduler, rng state and `last`. The
    Trainer's resume then fails or goes on with mixed state. Assembled from the frameworks' own
    files: the older checkpoint's model.safetensors written over the newer one's half an hour ago,
    every other file an hour old (the outside attack that found it killed a real Trainer and a real accelerate
    job inside the save). Without DeepSpeed nothing writes the weights after `last`."""
    root = tmp_path / "vol"
    copy_run(weights_volume, run, root)
    older, newest = weights_volume["runs"][run]
    st = (root / newest).stat()
    shutil.copyfile(root / older / "model.safetensors", root / newest / "model.safetensors")
    killed = time.time() - HOUR / 2  # half an hour ago: quiet since, the rest of the save an hour old
    os.utime(root / newest / "model.safetensors", (killed, killed))
    os.utime(root / newest, ns=(st.st_atime_ns, st.st_mtime_ns))
    rows = plan_rows(write_config(tmp_path, root), root)
    assert rows[newest]["state"] == "incomplete", rows[newest]
    said = f"weights order failed: files from two saves: {last} is "
    assert any(said in r and "older than model.safetensors" in r for r in rows[newest]["reasons"]), rows[newest]
    assert rows[older]["state"] == "complete" and rows[older]["action"] == "keep", rows[older]
