"""A ROOT on the command line spelled differently from the configured root.

`ckptd prune /vol/team -c cfg` (a directory inside the configured root /vol), or a symlink to
/vol, ran with the built-in defaults: pins and overrides were ignored, pinned checkpoints
deleted, and a subdirectory took a different lock, so it ran beside the daemon. It is that
root now, restricted to the subtree. Real processes, a real filesystem.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.errors import EX_USAGE
from ckptd.fleet.locks import RootLock
from tests.support.common import run_ckptd

OLD = time.time() - 3600


@pytest.fixture
def vol(tmp_path: Path) -> tuple[Path, Path]:
    """/vol with team/a and team/b (4 checkpoints each) and other/c; the config pins
    team/a/checkpoint-1 and keeps 3 in team/b."""
    root = tmp_path / "vol"
    for run in ("team/a", "team/b", "other/c"):
        for step in (1, 2, 3, 4):
            hf_deepspeed_checkpoint(root / run, step, world=2, mtime=OLD + step)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        f"[[roots]]\npath = '{root}'\nworld_size = 2\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 0\npins = ['team/a/checkpoint-1']\n"
        "[[roots.runs]]\nmatch = 'team/b'\nkeep_last = 3\n"
    )
    return root, cfg


def plan(*args: str | Path) -> dict[str, str]:
    proc = run_ckptd("plan", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    return {c["path"]: c["action"] for c in doc["checkpoints"]}


def actions(root: Path, doc: dict[str, str]) -> dict[str, str]:
    real = os.path.realpath(root)
    return {os.path.relpath(os.path.realpath(p), real): a for p, a in doc.items()}


@pytest.mark.parametrize("spelling", ["subdir", "symlink", "dotdot", "symlink-subdir", "the run itself"])
def test_a_root_spelled_otherwise_is_the_configured_root(vol, tmp_path, spelling):
    root, cfg = vol
    (tmp_path / "link").symlink_to(root)
    arg = {
        "subdir": root / "team",
        "symlink": tmp_path / "link",
        "dotdot": root / "other" / ".." / "team",
        "symlink-subdir": tmp_path / "link" / "team",
        "the run itself": root / "team" / "a",
    }[spelling]
    got = actions(root, plan(arg, "-c", cfg))
    if spelling == "the run itself":
        assert got == {"team/a/checkpoint-1": "keep", "team/a/checkpoint-2": "delete",
                       "team/a/checkpoint-3": "delete", "team/a/checkpoint-4": "keep"}
        return
    if spelling == "symlink":
        assert got["other/c/checkpoint-3"] == "delete"  # the whole root
    else:
        assert not any(k.startswith("other/") for k in got)  # restricted to the subtree
    assert got["team/a/checkpoint-1"] == "keep"  # pinned by the config
    assert got["team/a/checkpoint-2"] == "delete"
    assert [got[f"team/b/checkpoint-{s}"] for s in (1, 2, 3, 4)] == ["delete", "keep", "keep", "keep"]


def test_prune_on_a_subdirectory_keeps_the_pins_and_takes_the_roots_lock(vol):
    root, cfg = vol
    with RootLock(cfg.parent / "state", root):  # what the daemon on /vol holds
        held = run_ckptd("prune", root / "team", "-c", cfg)
    assert held.returncode == 75 and "another ckptd is deleting in" in held.stderr
    assert len(os.listdir(root / "team" / "a")) == 4
    done = run_ckptd("prune", root / "team", "-c", cfg)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(root / "team" / "a")) == ["checkpoint-1", "checkpoint-4"]
    assert len(os.listdir(root / "other" / "c")) == 4  # outside the subtree: untouched
    assert (root / ".ckptd-trash").is_dir() and not (root / "team" / ".ckptd-trash").exists()


def test_roots_from_the_environment_are_matched_the_same_way(vol, tmp_path):
    root, cfg = vol
    (tmp_path / "link").symlink_to(root)
    proc = run_ckptd("plan", "--json", "-c", cfg, env={"CKPTD_ROOTS": f"{tmp_path / 'link' / 'team'}"})
    assert proc.returncode == 0, proc.stderr
    got = actions(root, {c["path"]: c["action"] for c in json.loads(proc.stdout)["checkpoints"]})
    assert got["team/a/checkpoint-1"] == "keep" and not any(k.startswith("other/") for k in got)


@pytest.mark.parametrize(
    ("where", "message"),
    [("team/a/checkpoint-2", "is inside the run"), ("team/a/checkpoint-2/global_step2", "is inside the run"),
     ("..", "holds the configured root")],
)
def test_a_root_inside_a_run_or_holding_the_configured_root_is_refused(vol, where, message):
    root, cfg = vol
    proc = run_ckptd("prune", os.path.normpath(root / where), "-c", cfg)
    assert proc.returncode == EX_USAGE and message in proc.stderr, proc.stderr
    assert all(len(os.listdir(root / r)) == 4 for r in ("team/a", "team/b", "other/c"))


def test_min_free_is_not_applied_to_a_subtree(vol, tmp_path):
    """min_free is per filesystem: a subtree's plan cannot weigh the rest of the volume, and would
    take more from the subtree than a whole-root plan would. It says so and takes nothing."""
    root, cfg = vol
    cfg.write_text(cfg.read_text().replace("keep_last = 1\n", "keep_last = 4\nmin_free = '99%'\n", 1))
    proc = run_ckptd("plan", root / "team", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert "min_free=99% not applied: this covers only team of the root" in proc.stdout
    whole = run_ckptd("plan", root, "-c", cfg)
    assert "min_free=99% cannot be met" in whole.stdout


def test_the_daemon_on_a_subdirectory_is_the_configured_root_restricted(vol):
    """`ckptd run /vol/team -c cfg`: the root's pins and lock, only the subtree's runs."""
    from tests.support.daemonproc import DaemonProc

    root, cfg = vol
    cfg.write_text(cfg.read_text().replace("[[roots]]\n", "[[roots]]\nquiet_period = '0s'\nallow_short_quiet_period = true\n", 1))
    with DaemonProc(root / "team", "-c", cfg) as d:
        d.wait_message("ready: watching 1 root(s)")
        for run in ("team/a", "other/c"):  # a checkpoint completing starts a retention pass
            hf_deepspeed_checkpoint(root / run, 5, world=2)
        # checkpoint-4 goes once checkpoint-5 is complete; what the start-up pass deleted was
        # purged before that (a "purged" line alone may be that one's).
        gone = d.wait_message("deleted team/a/checkpoint-4", timeout=60)[-1]
        d.wait_message("purged", start=d.lines.index(gone), timeout=60)
    assert sorted(os.listdir(root / "team" / "a")) == ["checkpoint-1", "checkpoint-5"]  # the pin held
    assert sorted(os.listdir(root / "team" / "b")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert len(os.listdir(root / "other" / "c")) == 5  # outside the subtree: not even looked at
