"""Quiet seen through a FUSE mount whose attribute cache the mount table does not show (bindfs
with a 30-second attr_timeout): a checkpoint judged on quiet alone is not complete there until
the root says how long the cache lasts (`attribute_cache`), and then quiet is watched that much
longer, as NFS's actimeo is. Real `ckptd` commands on a real FUSE mount. Before, ckptd warned and
used quiet_period as given: a checkpoint still being written, seen through the cache, was
declared complete and the previous newest deleted.

The checkpoints are hand-made (`ckpt_<step>/weights.pt`): a user's own pattern, which is the
case in point; no framework saves under it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckptd.cli.demo_volume import age, write_zip
from tests.support.common import run_ckptd

CACHING = ("attr_timeout=30", "entry_timeout=30")


def config(tmp: Path, root: Path, extra: str = "", pattern: str = "'ckpt_{step}'") -> Path:
    path = tmp / "c.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp / 'state'}'\nleadership = 'local'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '2s'\nallow_short_quiet_period = true\npatterns = [{pattern}]\n{extra}\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n"
    )
    return path


def states(cfg: Path) -> dict[str, tuple[str, str]]:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return {Path(c["path"]).name: (c["state"], json.dumps(c)) for c in json.loads(proc.stdout)["checkpoints"]}


def volume(tmp_path: Path, bindfs, ages: tuple[float, float] = (600, 500)) -> Path:
    backing = tmp_path / "backing"
    for step, seconds in zip((1, 2), ages, strict=True):
        write_zip(backing / "run" / f"ckpt_{step}" / "weights.pt")
        age(backing / "run" / f"ckpt_{step}", time.time() - seconds)
    return bindfs(backing, tmp_path / "vol", *CACHING)


def test_quiet_alone_on_a_fuse_mount_completes_nothing_until_its_cache_is_declared(tmp_path, bindfs):
    root = volume(tmp_path, bindfs)
    cfg = config(tmp_path, root)
    got = states(cfg)
    assert {k: v[0] for k, v in got.items()} == {"ckpt_1": "incomplete", "ckpt_2": "incomplete"}, got
    assert "quiet alone proves nothing on" in got["ckpt_1"][1] and "set attribute_cache" in got["ckpt_1"][1]
    prune = run_ckptd("prune", "-c", cfg)
    assert prune.returncode == 0, prune.stderr
    assert sorted(p.name for p in (root / "run").iterdir()) == ["ckpt_1", "ckpt_2"]
    check = run_ckptd("check-config", "-c", cfg)
    assert "patterns without require or ranks complete nothing: quiet alone proves nothing" in check.stdout + check.stderr
    # Declared: quiet is watched for quiet_period + attribute_cache, and then it is enough.
    cfg = config(tmp_path, root, "attribute_cache = '30s'")
    check = run_ckptd("check-config", "-c", cfg)
    assert "caches attributes up to 30s (attribute_cache, as configured)" in check.stdout + check.stderr
    assert "quiet_period 2s is watched as 32s" in check.stdout + check.stderr
    assert {k: v[0] for k, v in states(cfg).items()} == {"ckpt_1": "complete", "ckpt_2": "complete"}
    prune = run_ckptd("prune", "-c", cfg)
    assert prune.returncode == 0, prune.stderr
    assert sorted(p.name for p in (root / "run").iterdir()) == ["ckpt_2"]


def test_a_declared_cache_lengthens_quiet_on_a_fuse_mount(tmp_path, bindfs):
    """Last written 10s ago: past quiet_period (2s), not past quiet_period + attribute_cache (32s)."""
    root = volume(tmp_path, bindfs, ages=(600, 10))
    cfg = config(tmp_path, root, "attribute_cache = '30s'")
    assert {k: v[0] for k, v in states(cfg).items()} == {"ckpt_1": "complete", "ckpt_2": "writing"}


def test_evidence_is_enough_on_a_fuse_mount(tmp_path, bindfs):
    root = volume(tmp_path, bindfs)
    cfg = config(tmp_path, root, pattern="{name = 'ckpt_{step}', require = ['weights.pt']}")
    assert {k: v[0] for k, v in states(cfg).items()} == {"ckpt_1": "complete", "ckpt_2": "complete"}
