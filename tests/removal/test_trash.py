"""The trash: never on another filesystem, never a symlink or a mount, and the purge takes only what
ckptd put there (an operator's copy, a pinned checkpoint moved in by hand, a name ckptd did not make
wait), re-checking the newest complete checkpoint first."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.decide.policy import Action
from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import Journal
from ckptd.judge import slim
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from ckptd.volume import mounts
from tests.support.common import run_ckptd
from tests.support.rtkit import config, demo_config, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- The trash directory itself a mount point ---------------------------------------------------




def test_a_mount_at_the_trash_is_never_purged(tmp_path, mount):
    """Purging opens <root>/.ckptd-trash without following a symlink, and checks each entry for
    mounts *below* it, but not whether the trash directory itself is a mount point: another
    filesystem (or a bind mount of a directory outside the root) mounted there is emptied by
    the purge every prune and every daemon start does first."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 1, world=2, mtime=OLD)
    outside = tmp_path / "datasets"
    (outside / "imagenet").mkdir(parents=True)
    (outside / "imagenet" / "train.tar").write_bytes(b"x" * 4096)
    (outside / "README").write_text("not ckptd's\n")
    (root / ".ckptd-trash").mkdir()
    mount("--bind", outside, root / ".ckptd-trash")
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert sorted(os.listdir(outside)) == ["README", "imagenet"], "data outside the root was purged"


def test_a_hidden_trash_name_ckptd_did_not_make_is_never_purged(tmp_path):
    """A checkpoint renamed aside on a full disk is `.ckptd-trash.<time>-<random>-<rel>`; the purge
    takes it for ckptd's. A directory at the root's top that merely starts like that (a person's,
    or a spoof) says nothing of where it came from: left alone, whatever it holds."""
    root = tmp_path / "vol"
    theirs = root / ".ckptd-trash.notes"
    theirs.mkdir(parents=True)
    (theirs / "results.csv").write_text("step,loss\n10,0.5\n")
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    prune(cfg)
    assert (theirs / "results.csv").read_text() == "step,loss\n10,0.5\n"


NOW = time.time()


# --- the trash directory on another filesystem ---------------------------------------------------




def two_checkpoints(root: Path) -> Scanner:
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
    return Scanner(Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=0)))


@pytest.mark.parametrize("how", ["tmpfs", "bind"])
def test_nothing_is_moved_into_a_trash_on_another_filesystem(tmp_path, mount, how):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    if how == "tmpfs":
        mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    else:
        (tmp_path / "elsewhere").mkdir()
        mount("--bind", tmp_path / "elsewhere", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    results = reaper.execute(plan.decisions)
    assert [(r.outcome, r.decision.checkpoint.name) for r in results] == [(Outcome.FAILED, "checkpoint-1")]
    assert "a mount point" in results[0].detail or "another filesystem" in results[0].detail
    assert reaper.purge() == (0, 0)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]
    assert os.listdir(root / TRASH_DIR) == ["keep-me"]


def test_a_trash_on_another_device_is_refused_where_the_kernel_cannot_tell_a_mount(tmp_path, mount, monkeypatch):
    """Without statx's mount-root bit (kernels before 5.8) and an unreadable mount table, the
    device number alone tells a tmpfs mounted at the trash."""
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    monkeypatch.setattr(mounts, "is_mount_root", lambda *a, **k: None)
    monkeypatch.setattr(mounts, "read_mounts", lambda *a, **k: [])
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    assert reaper.purge() == (0, 0)
    assert os.listdir(root / TRASH_DIR) == ["keep-me"]
    # and nothing is renamed towards it: refused by the device number, before any rename is tried
    results = reaper.execute(decide([(scanner.root, scanner.runs(now=NOW))]).decisions)
    assert [(r.outcome, r.decision.checkpoint.name) for r in results] == [(Outcome.FAILED, "checkpoint-1")]
    assert "on another filesystem than the root" in results[0].detail, results[0].detail
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]


def test_a_bind_mount_at_the_trash_is_found_from_the_mount_table_where_statx_cannot_tell(tmp_path, mount,
                                                                                        monkeypatch):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    (tmp_path / "elsewhere").mkdir()
    mount("--bind", tmp_path / "elsewhere", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    monkeypatch.setattr(mounts, "is_mount_root", lambda *a, **k: None)
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    assert reaper.purge() == (0, 0)
    assert os.listdir(tmp_path / "elsewhere") == ["keep-me"]
    # and nothing is renamed towards it: a bind mount keeps the device number, so only the mount
    # table tells, before any rename is tried
    results = reaper.execute(decide([(scanner.root, scanner.runs(now=NOW))]).decisions)
    assert [(r.outcome, r.decision.checkpoint.name) for r in results] == [(Outcome.FAILED, "checkpoint-1")]
    assert "a mount point" in results[0].detail, results[0].detail
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]
    assert os.listdir(tmp_path / "elsewhere") == ["keep-me"]


def test_a_trash_that_is_a_symlink_is_never_purged_nor_filled(tmp_path):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep-me").write_text("not ckptd's\n")
    (root / TRASH_DIR).symlink_to(tmp_path / "elsewhere")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = reaper.execute(decide([(scanner.root, scanner.runs(now=NOW))]).decisions)
    assert [r.outcome for r in results] == [Outcome.FAILED]
    assert reaper.purge() == (0, 0)
    assert os.listdir(tmp_path / "elsewhere") == ["keep-me"]
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]


def test_slimming_refuses_a_trash_on_another_filesystem(tmp_path, mount):
    """A slim moves optimizer shards into the trash too: the same refusal, nothing moved."""
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        ck = hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
        (ck / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # weights: no consolidation
        age(ck, OLD + step)
    (root / TRASH_DIR).mkdir()
    mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    scanner = Scanner(Root(path=root, quiet_period=0, retention=Retention(keep_last=3, keep_best=0,
                                                                          keep_full_last=1)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    assert [d.checkpoint.step for d in plan.decisions if d.action is Action.SLIM] == [1, 2]
    before = sorted(p.name for p in (root / "run" / "checkpoint-1" / "global_step1").iterdir())
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} <= {Outcome.FAILED, Outcome.REFUSED}, [r.line() for r in results]
    assert sorted(p.name for p in (root / "run" / "checkpoint-1" / "global_step1").iterdir()) == before
    assert not (root / "run" / "checkpoint-1" / slim.MARKER).exists()


# --- The trash: what ckptd purges that it did not put there ------------------------------------


def test_a_pinned_checkpoint_moved_into_the_trash_by_hand_is_not_purged(tmp_path):
    cfg, root = demo_config(tmp_path)
    ckpt = root / "roberta-mlm" / "checkpoint-1000"
    (ckpt / ".ckptd-keep").touch()
    (root / ".ckptd-trash").mkdir(exist_ok=True)
    os.rename(ckpt, root / ".ckptd-trash" / "checkpoint-1000")
    prune(cfg)
    prune(cfg)
    held = root / ".ckptd-trash" / "checkpoint-1000%review"  # where ckptd holds it, never purged
    assert any((p / ".ckptd-keep").exists() for p in (held, root / ".ckptd-trash" / "checkpoint-1000", ckpt))


def test_a_pinned_checkpoint_under_a_slim_looking_name_is_not_purged(tmp_path):
    cfg, root = demo_config(tmp_path)
    ckpt = root / "roberta-mlm" / "checkpoint-1000"
    (ckpt / ".ckptd-keep").touch()
    (root / ".ckptd-trash").mkdir(exist_ok=True)
    spoof = root / ".ckptd-trash" / "1700000000-deadbeef-roberta-mlm%2Fcheckpoint-1000%slim"
    os.rename(ckpt, spoof)
    prune(cfg)
    prune(cfg)
    held = spoof.with_name(spoof.name + "%review")
    assert any((p / ".ckptd-keep").exists() for p in (held, spoof, ckpt))


@pytest.mark.parametrize("name", [".ckptd-trash.rescued", ".ckptd-trash.bak"])
def test_an_operators_copy_beside_the_trash_is_not_purged(tmp_path, name):
    cfg, root = demo_config(tmp_path)
    shutil.copytree(root / "roberta-mlm" / "checkpoint-500", root / name, symlinks=True)
    (root / f"{name}.txt").write_text("what I rescued from the trash\n")
    prune(cfg)
    assert (root / name).exists() and (root / f"{name}.txt").exists()


# --- The purge's re-check of a late rename: the run's newest complete by time ---------------------


def test_a_late_rename_of_the_newest_by_time_is_moved_back(tmp_path):
    cfg, root = demo_config(tmp_path)
    run = root / "roberta-mlm"
    ckpt = run / "checkpoint-1000"  # not the best (checkpoint-500), outside keep_last=2 by step
    import time

    t = time.time() - 600  # written last, 10 minutes ago: the run's newest complete by time
    for dirpath, dirnames, filenames in os.walk(ckpt):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (t, t), follow_symlinks=False)
    os.utime(ckpt, (t, t))
    plan = run_ckptd("plan", "-c", cfg, "--json")
    rows = json.loads(plan.stdout)["checkpoints"]
    (row,) = [c for c in rows if c["path"].endswith("roberta-mlm/checkpoint-1000")]
    assert row["action"] == "keep", row
    # What a leader stopped between its checks and its rename leaves, found by the next purge.
    (root / ".ckptd-trash").mkdir(exist_ok=True)
    entry = root / ".ckptd-trash" / f"{int(time.time())}-0badc0de-roberta-mlm%2Fcheckpoint-1000"
    os.rename(ckpt, entry)
    prune(cfg)
    assert ckpt.is_dir() or entry.exists()


# --- A slimmed checkpoint made whole again --------------------------------------------------------


def _slimmed_marker(ckpt: Path, step: int) -> None:
    """What ckptd's slim leaves (`.ckptd-slim.json`, state done, listing the optimizer shards it moved
    and the fp32 model.safetensors it kept), the shards then restored by the user from a backup."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weights = ckpt / "model.safetensors"
    safetensors_torch.save_file({"w": torch.zeros(4, 4)}, str(weights))
    tag = ckpt / f"global_step{step}"
    opt = sorted(p.name for p in tag.iterdir() if p.name.endswith("optim_states.pt"))
    st = (ckpt / "trainer_state.json").stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    doc = {"ckptd_slim": 1, "state": "done", "time": st.st_mtime + 60,
           "removed": [{"path": f"global_step{step}/{n}", "bytes": (tag / n).stat().st_size} for n in opt],
           "bytes_freed": sum((tag / n).stat().st_size for n in opt),
           "weights": {"path": "model.safetensors", "bytes": weights.stat().st_size, "consolidated": False,
                       "dtype": "fp32"},
           "reasons": ["keep_last=2 (#2 newest)"]}
    (ckpt / ".ckptd-slim.json").write_text(json.dumps(doc))


def test_optimizer_state_restored_into_a_slimmed_checkpoint_is_not_removed_again(tmp_path):
    cfg, root = demo_config(tmp_path)
    ckpt = root / "roberta-mlm" / "checkpoint-1500"
    _slimmed_marker(ckpt, 1500)
    assert "keep_full_last" not in cfg.read_text()
    prune(cfg)
    left = sorted(p.name for p in (ckpt / "global_step1500").iterdir())
    assert any(n.endswith("optim_states.pt") for n in left), left
