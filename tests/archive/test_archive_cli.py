"""The archive end to end: the real `ckptd` as a subprocess against moto's S3 API server on
127.0.0.1 (tests/support/s3server.py), killed with SIGKILL in the middle of a multipart upload."""

from __future__ import annotations

import filecmp
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptd.archive.upload import PAUSE_FIFO_ENV
from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.journal import read_journal
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)

MiB = 1024 * 1024


def setup(tmp_path: Path, s3, *, shard_size: int = 1024, steps=(10, 20, 30)):  # noqa: F811
    root = tmp_path / "vol"
    old = time.time() - 3600
    for i, step in enumerate(steps):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i, shard_size=shard_size)
    bucket = s3.bucket()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"

[[roots]]
path = "{root}"
world_size = 2

[roots.retention]
keep_last = 1
keep_best = 0

[roots.archive]
url = "s3://{bucket}/archive"
endpoint_url = "{s3.endpoint}"
part_size = "5MiB"
concurrency = 1
""")
    return root, cfg, bucket


def ckptd(*args: str, env=None, check=True):
    r = subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert not check or r.returncode == 0, r.stderr
    return r


def test_prune_archives_then_deletes_and_restore_gives_back_every_byte(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = setup(tmp_path, s3)
    saved = tmp_path / "copy"
    shutil.copytree(root / "run" / "checkpoint-10", saved)
    plan = json.loads(ckptd("plan", "-c", str(cfg), "--json").stdout)
    deletes = [c for c in plan["checkpoints"] if c["action"] == "delete"]
    assert len(deletes) == 2 and all(any("archived to s3://" in r for r in c["reasons"]) for c in deletes)
    ckptd("prune", "-c", str(cfg), "-q")
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert sorted((a["checkpoint"], a["state"], a["local"]) for a in listed) == [
        ("checkpoint-10", "archived", False), ("checkpoint-20", "archived", False)]
    ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"))
    back = tmp_path / "back" / "checkpoint-10"
    cmp = filecmp.dircmp(saved, back)
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files
    for d, _, files in os.walk(saved):
        for f in files:
            rel = Path(d, f).relative_to(saved)
            assert (saved / rel).read_bytes() == (back / rel).read_bytes()
    assert os.listdir(tmp_path / "back") == ["checkpoint-10"]  # no temporary directory left
    again = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"), check=False)
    assert again.returncode == 64 and "exists" in again.stderr  # never over what is there
    # latest --archive: the volume's newest while it is there; the archive's once it is gone
    r = ckptd("latest", "--archive", str(root / "run"), "-c", str(cfg))
    assert r.stdout.strip() == str(root / "run" / "checkpoint-30")
    shutil.rmtree(root / "run" / "checkpoint-30")
    r = ckptd("latest", "--archive", str(root / "run"), "-c", str(cfg))
    assert r.stdout.strip() == f"s3://{bucket}/archive/run/checkpoint-20"
    assert "ckptd restore run/checkpoint-20" in r.stderr


def test_plan_keeps_everything_while_the_store_is_down(tmp_path, s3):  # noqa: F811
    _, cfg, _ = setup(tmp_path, s3)
    s3.stop()
    plan = json.loads(ckptd("plan", "-c", str(cfg), "--json").stdout)
    assert [c["action"] for c in plan["checkpoints"]] == ["keep"] * 3
    kept = [c for c in plan["checkpoints"] if any("archive required" in r for r in c["reasons"])]
    assert len(kept) == 2, plan["checkpoints"]
    r = ckptd("prune", "-c", str(cfg), "-q", check=False)
    assert sorted(os.listdir(tmp_path / "vol" / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert "archive required" in r.stdout + r.stderr


def test_killed_mid_upload_the_next_prune_aborts_what_was_left_and_finishes(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = setup(tmp_path, s3, shard_size=6 * MiB, steps=(10, 20))
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the writer: else it gets ENXIO
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg), "-q"],
                                env={**os.environ, PAUSE_FIFO_ENV: str(fifo)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ready, _, _ = select.select([reader], [], [], 120)
        assert ready, "ckptd never reached the middle of a multipart upload"
        assert int(os.read(reader, 64).split()[0]) == proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        os.close(reader)
    client = s3.client()
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="archive/").get("Uploads", [])
    assert len(left) == 1  # the upload it was in the middle of
    assert (root / "run" / "checkpoint-10").is_dir()
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert events == ["archiving"]  # the intent, and no outcome: it died
    ckptd("prune", "-c", str(cfg), "-q")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix="archive/").get("Uploads", []) == []
    assert sorted(os.listdir(root / "run")) == ["checkpoint-20"]
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert events[1:3] == ["archiving", "archived"] and "trashed" in events


def test_archive_list_shows_what_is_still_to_be_archived_as_pending(tmp_path, s3):  # noqa: F811
    _, cfg, _ = setup(tmp_path, s3)
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert sorted((a["checkpoint"], a["state"]) for a in listed) == [
        ("checkpoint-10", "pending"), ("checkpoint-20", "pending")]  # the one kept is not to be archived
    assert all("retention would delete it" in a["why"] for a in listed)
    text = ckptd("archive", "list", "-c", str(cfg)).stdout
    assert "pending      run/checkpoint-10" in text
    ckptd("prune", "-c", str(cfg), "-q")
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert sorted(a["state"] for a in listed) == ["archived", "archived"]
    cfg.write_text(cfg.read_text().replace("concurrency = 1", 'concurrency = 1\nwhen = "on-complete"'))
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert [(a["checkpoint"], a["why"]) for a in listed if a["state"] == "pending"] == [
        ("checkpoint-30", "complete: archived at the next pass")]


def test_archive_list_needs_no_volume(tmp_path, s3):  # noqa: F811
    """Listed on a machine without the volume (to restore from): the archive, and nothing pending."""
    root, cfg, _ = setup(tmp_path, s3)
    ckptd("prune", "-c", str(cfg), "-q")
    root.rename(tmp_path / "elsewhere")
    listed = json.loads(ckptd("archive", "list", "-c", str(cfg), "--json").stdout)["archives"]
    assert sorted((a["checkpoint"], a["state"]) for a in listed) == [
        ("checkpoint-10", "archived"), ("checkpoint-20", "archived")]
