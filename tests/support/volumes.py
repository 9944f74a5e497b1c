"""A small volume of hand-made checkpoints for the reaper's tests (test_reaper.py, test_fence.py,
test_late_rename.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.journal import Journal
from ckptd.removal.reaper import Reaper

NOW = 1_800_000_000.0


OLD = NOW - 3600


@pytest.fixture
def volume(tmp_path: Path):
    """Four complete checkpoints; keep_last=1 plans to delete the three oldest."""
    root = tmp_path / "vol"
    for i, step in enumerate((10, 20, 30, 40)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + i)
    return root


def make(root: Path, tmp_path: Path, *, dry_run: bool = False):
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    journal = Journal(tmp_path / "state")
    reaper = Reaper(scanner, None if dry_run else journal, dry_run=dry_run, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    return reaper, plan, journal


def names(root: Path) -> list[str]:
    return sorted(os.listdir(root / "run"))
