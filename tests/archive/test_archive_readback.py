"""`verify = "read-back"`: an object overwritten in the bucket with other bytes of the same size,
while claiming the original CRC32C (moto keeps whatever checksum a PUT claims, as a store that does
not check would), is caught by downloading it again; the default (`checksum`: the store's HEAD) is
not, as docs/archive.md says. The real `ckptd prune` and `ckptd trash purge --now` as subprocesses
against moto's S3 API server on 127.0.0.1."""

from __future__ import annotations

import json
import os

from ckptd.journal import read_journal
from tests.archive.test_archive_cli import ckptd, setup
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)

KEY = "archive/run/checkpoint-10/config.json"


def zero_overwrite(s3, bucket):  # noqa: F811
    """The object's bytes replaced by zeros, its claimed CRC32C the original one."""
    client = s3.client()
    doc = json.loads(client.get_object(Bucket=bucket, Key="archive/run/checkpoint-10.ckptd-manifest.json")["Body"].read())
    [f] = [f for f in doc["files"] if f["key"] == KEY]
    client.put_object(Bucket=bucket, Key=KEY, Body=b"\0" * f["size"], ChecksumAlgorithm="CRC32C",
                      ChecksumCRC32C=f["crc32c"])
    head = client.head_object(Bucket=bucket, Key=KEY, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == f["crc32c"] and head["ContentLength"] == f["size"]  # the store says all is well


def archived(tmp_path, s3, verify):  # noqa: F811
    """All three archived (on-complete, nothing deleted); the config then deletes 10 and 20."""
    root, cfg, bucket = setup(tmp_path, s3)
    text = cfg.read_text().replace("concurrency = 1", f'concurrency = 1\nverify = "{verify}"')
    cfg.write_text(text.replace("keep_last = 1", "keep_last = 10").replace("concurrency = 1", 'concurrency = 1\nwhen = "on-complete"'))
    ckptd("prune", "-c", str(cfg), "-q")
    cfg.write_text(text)
    return root, cfg, bucket


def test_read_back_catches_an_overwrite_that_claims_the_original_checksum(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = archived(tmp_path, s3, "read-back")
    zero_overwrite(s3, bucket)
    r = ckptd("prune", "-c", str(cfg), check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"], r.stdout + r.stderr
    assert "config.json at s3://" in r.stdout + r.stderr and "reads back as" in r.stdout + r.stderr


def test_read_back_at_the_purge_catches_an_overwrite_during_the_grace(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = archived(tmp_path, s3, "read-back")
    ckptd("prune", "-c", str(cfg), "-q", env={"CKPTD_TRASH_GRACE": ""})
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    zero_overwrite(s3, bucket)
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env={"CKPTD_TRASH_GRACE": ""})
    assert "purged 1" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"]
    [why] = [e["why"] for e in read_journal(tmp_path / "state") if e["event"] == "restored"]
    assert "reads back as" in why


def test_the_default_trusts_the_stores_checksum(tmp_path, s3):  # noqa: F811
    """The limit docs/archive.md states: `checksum` compares what the store reports, and a store
    that keeps a claimed checksum over other bytes is believed."""
    root, cfg, bucket = archived(tmp_path, s3, "checksum")
    zero_overwrite(s3, bucket)
    ckptd("prune", "-c", str(cfg), "-q")
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
