"""A file rewritten in place to the same size with its mtime put back (`os.utime`) keeps its
device, inode, size and mtime, but not its ctime, which no call can set: the archive gate compares
it, so the bucket's old bytes are never taken for the new ones. Against moto's S3 API server on
127.0.0.1; the real `ckptd prune`/`ckptd restore` where the rewrite comes after the upload."""

from __future__ import annotations

import json
import os
import time

from ckptd.archive import manifest as manifestmod
from ckptd.archive import s3 as s3mod
from ckptd.archive import upload as uploadmod
from ckptd.removal.outcome import Outcome
from tests.archive.test_archive_cli import ckptd, setup
from tests.archive.test_archive_gate import make
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.support.volumes import volume as volume

NEW = b'{"model_type": "robertb"}'  # the demo's config.json, one letter changed: the same size


def rewrite_keeping_mtime(path):
    st = os.stat(path)
    old = path.read_bytes()
    assert len(old) == len(NEW) and old != NEW
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(NEW)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_a_rewrite_after_the_upload_with_its_mtime_put_back_is_kept(tmp_path, s3):  # noqa: F811
    root, cfg, _ = setup(tmp_path, s3)
    text = cfg.read_text()
    cfg.write_text(text.replace("keep_last = 1", "keep_last = 10").replace('concurrency = 1', 'concurrency = 1\nwhen = "on-complete"'))
    ckptd("prune", "-c", str(cfg), "-q")  # archives all three, deletes nothing
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert sorted(a["checkpoint"] for a in listed) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    rewrite_keeping_mtime(root / "run" / "checkpoint-10" / "config.json")
    cfg.write_text(text)  # keep_last = 1: 10 and 20 are to go
    plan = json.loads(ckptd("plan", "-c", str(cfg), "--json").stdout)
    by = {os.path.basename(c["path"]): c for c in plan["checkpoints"]}
    assert by["checkpoint-10"]["action"] == "keep", by["checkpoint-10"]
    assert any("config.json rewritten in place" in r for r in by["checkpoint-10"]["reasons"]), by["checkpoint-10"]
    r = ckptd("prune", "-c", str(cfg), check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"], r.stdout + r.stderr
    assert (root / "run" / "checkpoint-10" / "config.json").read_bytes() == NEW
    assert "rewritten in place" in r.stdout + r.stderr


def test_a_rewrite_during_the_upload_with_its_mtime_put_back_is_caught(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    monkeypatch.setattr(uploadmod, "RACY_NS", 0)  # the ctime alone (the racy re-read: below)
    real_put = s3mod.S3Store.put

    def rewrite(self, key, data, crc32c):
        out = real_put(self, key, data, crc32c)
        if key.endswith("checkpoint-20/config.json"):  # read and sent: rewritten behind ckptd's back
            rewrite_keeping_mtime(volume / "run" / "checkpoint-20" / "config.json")
        return out

    monkeypatch.setattr(s3mod.S3Store, "put", rewrite)
    reaper, plan, _ = make(volume, tmp_path, s3)
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-20"].outcome is Outcome.REFUSED, results["checkpoint-20"].detail
    assert "changed" in results["checkpoint-20"].detail, results["checkpoint-20"].detail
    assert (volume / "run" / "checkpoint-20" / "config.json").read_bytes() == NEW
    assert results["checkpoint-10"].outcome is Outcome.TRASHED


def test_a_rewrite_within_the_timestamp_tick_of_the_read_is_caught(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    """A filesystem whose ctime does not move within one tick, simulated: each file's ctime is
    reported as it was first seen, stamped as just written (as one saved within the tick before the
    upload's read). The rewrite after the read then keeps the whole identity; the upload reads such
    a racily clean file again once its tick is over, and its bytes tell."""
    first: dict[tuple[int, int], int] = {}
    real_identity = manifestmod.identity

    def coarse(st):
        dev, ino, size, mtime_ns, _ = real_identity(st)
        return (dev, ino, size, mtime_ns, first.setdefault((dev, ino), time.time_ns()))

    monkeypatch.setattr(manifestmod, "identity", coarse)
    monkeypatch.setattr(uploadmod, "identity", coarse)
    real_put = s3mod.S3Store.put

    def rewrite(self, key, data, crc32c):
        out = real_put(self, key, data, crc32c)
        if key.endswith("checkpoint-20/config.json"):
            rewrite_keeping_mtime(volume / "run" / "checkpoint-20" / "config.json")
        return out

    monkeypatch.setattr(s3mod.S3Store, "put", rewrite)
    reaper, plan, _ = make(volume, tmp_path, s3)
    reaper.archiver.archive_all(plan.decisions)
    assert "rewritten within its timestamp tick" in reaper.archiver.failures["run/checkpoint-20"]
    assert "run/checkpoint-10" not in reaper.archiver.failures


def test_a_rewrite_within_the_tick_to_the_same_crc32c_is_caught(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    """As above, the rewrite within the tick being to other bytes of the same size and CRC32C (4
    chosen bytes): the racy re-read compares the SHA-256 computed as the file was uploaded."""
    from tests.archive.test_archive_attack import forge_same_crc32c

    first: dict[tuple[int, int], int] = {}
    real_identity = manifestmod.identity

    def coarse(st):
        dev, ino, size, mtime_ns, _ = real_identity(st)
        return (dev, ino, size, mtime_ns, first.setdefault((dev, ino), time.time_ns()))

    monkeypatch.setattr(manifestmod, "identity", coarse)
    monkeypatch.setattr(uploadmod, "identity", coarse)
    real_put = s3mod.S3Store.put
    target = volume / "run" / "checkpoint-20" / "config.json"
    forged = forge_same_crc32c(target.read_bytes())

    def rewrite(self, key, data, crc32c):
        out = real_put(self, key, data, crc32c)
        if key.endswith("checkpoint-20/config.json"):
            st = os.stat(target)
            with open(target, "r+b") as f:
                f.write(forged)
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        return out

    monkeypatch.setattr(s3mod.S3Store, "put", rewrite)
    reaper, plan, _ = make(volume, tmp_path, s3)
    reaper.archiver.archive_all(plan.decisions)
    assert "rewritten within its timestamp tick" in reaper.archiver.failures["run/checkpoint-20"]
    assert target.read_bytes() == forged
