"""Slimming without torch: consolidated weights written by hand, a fake consolidator, a reaper
for one root (test_slim.py, test_slim_daemon.py, test_fence.py)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.journal import Journal
from ckptd.judge import slim
from ckptd.removal.reaper import Reaper


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]] | None = None) -> None:
    """A small, valid safetensors file (zeros), written without torch."""
    header, offset = {}, 0
    for name, shape in (tensors or {"w": (4, 4)}).items():
        n = 4 * int(__import__("math").prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def reaper_for(root: Path, tmp_path: Path, **retention):
    retention = Retention(keep_best=0, **retention)
    scanner = Scanner(Root(path=root, retention=retention))
    journal = Journal(tmp_path / "state")
    reaper = Reaper(scanner, journal, dry_run=False, clock=time.time)
    return reaper, decide([(scanner.root, scanner.runs(now=time.time()))]), journal


@pytest.fixture
def unconsolidated(tmp_path: Path) -> Path:
    """Trainer+DeepSpeed checkpoints 10, 20, 30 without weights files: slimming 10 and 20 means
    consolidating them first; 30 is the run's newest full checkpoint, the anchor."""
    root = tmp_path / "vol"
    for i, step in enumerate((10, 20, 30)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=time.time() - 3600 + i)
    return root


def fake_consolidator(monkeypatch, during=lambda out_dir: None):
    """Writes what the real child writes (one shard, the index with ckptd's record), reports it
    as the parent's check would, then calls `during`: between the check and the move into place."""
    import ckptd.removal.consolidation

    class Fake:
        def __init__(self, save_dir, tag, model_states, out_dir, *, source_fingerprint, timeout):
            self.out_dir, self.tag, self.fp = out_dir, tag, source_fingerprint

        def run(self):
            out = write_consolidated(self.out_dir, self.tag, self.fp)
            during(self.out_dir)
            return out

    monkeypatch.setattr(ckptd.removal.consolidation, "Consolidation", Fake)


def write_consolidated(out_dir: Path, tag: str, source_fingerprint: str):
    """What the consolidator leaves in its work directory (one shard, the index with ckptd's record),
    and the parent's account of it. A look-alike: the real one needs torch, DeepSpeed and seconds."""
    from ckptd.removal.zero_to_fp32 import Consolidated

    shard = slim.shard_name(1, 1)
    write_safetensors(out_dir / shard)
    size = (out_dir / shard).stat().st_size
    record = {"source": tag, "source_fingerprint": source_fingerprint, "tool": "test",
              "files": [{"path": shard, "bytes": size, "sha256": "cd" * 32}]}
    index = {"metadata": {"total_size": 64, "ckptd": record}, "weight_map": {"w": shard}}
    (out_dir / slim.INDEX).write_text(json.dumps(index))
    ids = {}
    for name in (shard, slim.INDEX):
        st = (out_dir / name).stat()
        ids[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return Consolidated(out_dir, ((shard, size, "cd" * 32),), ids[slim.INDEX][2], "ef" * 32, 1, 0.01, "test", ids)
