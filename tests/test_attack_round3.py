"""Attack, round 3 (an outside attacker's reproductions, from the docs and real files).

Each hole is an xfail(strict=True): it passes while the hole is open and fails once it is fixed.
Near-misses (safe, but a wrong answer that would lead a user to delete by hand) are marked alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_ckptd


def _demo(tmp_path: Path, **retention: object) -> tuple[Path, Path]:
    """`ckptd demo` (Trainer+DeepSpeed and Megatron runs), quiet_period 0s: (config, root)."""
    proc = run_ckptd("demo", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr
    cfg = tmp_path / "demo" / "ckptd.toml"
    text = cfg.read_text().replace('quiet_period = "60s"', 'quiet_period = "0s"')
    for k, v in retention.items():
        text = text.replace("[roots.retention]\n", f"[roots.retention]\n{k} = {json.dumps(v)}\n", 1)
    cfg.write_text(text)
    return cfg, tmp_path / "demo" / "experiments"


def _prune(cfg: Path) -> str:
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# --- 1. The trash: what ckptd purges that it did not put there ---------------------------------


@pytest.mark.xfail(strict=True, reason="hole: a pinned checkpoint moved into .ckptd-trash/ under its own "
                   "name (no ckptd-style origin) is purged without the pin re-check the docs promise "
                   "('anything else ... checked against protection ... pinned')")
def test_a_pinned_checkpoint_moved_into_the_trash_by_hand_is_not_purged(tmp_path):
    cfg, root = _demo(tmp_path)
    ckpt = root / "roberta-mlm" / "checkpoint-1000"
    (ckpt / ".ckptd-keep").touch()
    (root / ".ckptd-trash").mkdir(exist_ok=True)
    os.rename(ckpt, root / ".ckptd-trash" / "checkpoint-1000")
    _prune(cfg)
    assert (root / ".ckptd-trash" / "checkpoint-1000").exists() or ckpt.exists()


@pytest.mark.xfail(strict=True, reason="hole: a spoofed ckptd-style name ending in %slim skips every "
                   "re-check (origin[1] set): a pinned, whole checkpoint is purged")
def test_a_pinned_checkpoint_under_a_slim_looking_name_is_not_purged(tmp_path):
    cfg, root = _demo(tmp_path)
    ckpt = root / "roberta-mlm" / "checkpoint-1000"
    (ckpt / ".ckptd-keep").touch()
    (root / ".ckptd-trash").mkdir(exist_ok=True)
    spoof = root / ".ckptd-trash" / "1700000000-deadbeef-roberta-mlm%2Fcheckpoint-1000%slim"
    os.rename(ckpt, spoof)
    _prune(cfg)
    assert spoof.exists() or ckpt.exists()


@pytest.mark.xfail(strict=True, reason="hole: anything in a root whose name starts with '.ckptd-trash.' "
                   "(an operator's rescued copy of the trash, notes) is purged as a full-disk hidden trash "
                   "entry, though ckptd never made it")
@pytest.mark.parametrize("name", [".ckptd-trash.rescued", ".ckptd-trash.bak"])
def test_an_operators_copy_beside_the_trash_is_not_purged(tmp_path, name):
    cfg, root = _demo(tmp_path)
    import shutil

    shutil.copytree(root / "roberta-mlm" / "checkpoint-500", root / name, symlinks=True)
    (root / f"{name}.txt").write_text("what I rescued from the trash\n")
    _prune(cfg)
    assert (root / name).exists() and (root / f"{name}.txt").exists()
