"""Archive before delete, against moto's S3 API server on 127.0.0.1 (tests/support/s3server.py):
the reaper archives what it is about to delete, verifies it, and deletes nothing whose archive is
not whole, verified and of these very files. Real filesystem, real HTTP, real multipart uploads."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ckptd.archive import s3 as s3mod
from ckptd.archive import upload as uploadmod
from ckptd.archive.manifest import file_digest, manifest_key, snapshot
from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import Retention, Root
from ckptd.config.archive import Archive
from ckptd.decide.planner import Scanner, decide
from ckptd.journal import Journal, read_journal
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.support.volumes import NOW, OLD, names
from tests.support.volumes import volume as volume

MiB = 1024 * 1024


def make(root: Path, tmp_path: Path, s3, *, dry_run=False, **archive):  # noqa: F811
    bucket = s3.bucket()
    cfg = Archive(url=f"s3://{bucket}/archive", endpoint_url=s3.endpoint, part_size="5MiB", **archive)
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0), archive=cfg))
    journal = Journal(tmp_path / "state")
    reaper = Reaper(scanner, None if dry_run else journal, dry_run=dry_run, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    return reaper, plan, bucket


def objects(s3, bucket):  # noqa: F811
    return {o["Key"]: o["Size"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_archives_verifies_then_deletes(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, bucket = make(volume, tmp_path, s3)
    before = {d.checkpoint.name: snapshot(d.checkpoint.path) for d in plan.deletions}
    sums = {(d.checkpoint.name, rel): file_digest(d.checkpoint.path / rel)
            for d in plan.deletions for rel in before[d.checkpoint.name].files}
    # each file's SHA-256 as hashlib computes it from the bytes on disk (not the Digest that writes it)
    shas = {k: hashlib.sha256((volume / "run" / k[0] / k[1]).read_bytes()).hexdigest() for k in sums}
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3, [r.line() for r in results]
    assert names(volume) == ["checkpoint-40"]
    client = s3.client()
    for name, snap in before.items():
        doc = json.loads(client.get_object(Bucket=bucket, Key=f"archive/run/{name}.ckptd-manifest.json")["Body"].read())
        assert {f["path"]: f["crc32c"] for f in doc["files"]} == {rel: sums[(name, rel)].crc32c for rel in snap.files}
        assert {f["path"]: f["sha256"] for f in doc["files"]} == {rel: shas[(name, rel)] for rel in snap.files}
        assert doc["framework"] and doc["step"] == int(name.split("-")[1]) and doc["verdict"]["state"] == "complete"
        for f in doc["files"]:  # the store's own checksum of each object: what was read here
            head = client.head_object(Bucket=bucket, Key=f["key"], ChecksumMode="ENABLED")
            assert head["ChecksumCRC32C"] == f["crc32c"] and head["ContentLength"] == f["size"]
    assert not any(k.startswith("archive/run/checkpoint-40") for k in objects(s3, bucket))  # kept: not archived
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    # each checkpoint archived (intent, outcome) before anything is moved
    assert events[:6] == ["archiving", "archived"] * 3 and events[6:] == ["trashing", "trashed"] * 3


def test_a_big_file_goes_in_parts_with_a_full_object_checksum(tmp_path, s3):  # noqa: F811
    root = tmp_path / "vol"
    for i, step in enumerate((10, 20)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + i, shard_size=6 * MiB)
    reaper, plan, bucket = make(root, tmp_path, s3)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED], [r.line() for r in results]
    big = [k for k, size in objects(s3, bucket).items() if size > 5 * MiB]
    assert big
    head = s3.client().head_object(Bucket=bucket, Key=big[0], ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "FULL_OBJECT" and "-" in head["ETag"]  # a multipart object


def test_store_down_keeps_everything_and_says_why(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, _ = make(volume, tmp_path, s3)
    s3.stop()
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.REFUSED] * 3
    assert all("archive required" in r.detail and "cannot" in r.detail for r in results), results[0].detail
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    events = [r["event"] for r in read_journal(tmp_path / "state")]
    assert "archive-failed" in events and "trashing" not in events


def test_not_required_deletes_what_cannot_be_archived(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, _ = make(volume, tmp_path, s3, required=False)
    s3.stop()
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3


def test_credentials_refused_keeps_everything(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    reaper, plan, _ = make(volume, tmp_path, s3)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.REFUSED] * 3
    assert "credentials" in results[0].detail.lower(), results[0].detail


def test_a_wrong_checksum_the_store_accepted_is_caught(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    """moto keeps whatever CRC32C a PUT claims (as a store that does not check would): ckptd's
    comparison with what it computed is what catches it, and no manifest is written."""
    real_put = s3mod.S3Store.put

    def corrupt(self, key, data, crc32c):
        if key.endswith("config.json"):
            crc32c = "AAAAAA=="
        return real_put(self, key, data, crc32c)

    monkeypatch.setattr(s3mod.S3Store, "put", corrupt)
    reaper, plan, bucket = make(volume, tmp_path, s3)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.REFUSED] * 3
    assert "config.json: the store reports" in results[0].detail, results[0].detail
    assert not [k for k in objects(s3, bucket) if k.endswith(".ckptd-manifest.json")]
    assert names(volume) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]


def test_a_file_changed_during_upload_is_kept(volume, tmp_path, s3, monkeypatch):  # noqa: F811
    # The identity check alone: these files were written within the second before, and the
    # re-read of such racily clean files (test_archive_rewrite.py) would catch the change too.
    monkeypatch.setattr(uploadmod, "RACY_NS", 0)
    real_put = s3mod.S3Store.put

    def rewrite(self, key, data, crc32c):
        out = real_put(self, key, data, crc32c)
        if key.endswith("checkpoint-20/config.json"):  # the trainer re-saves while ckptd reads
            (volume / "run" / "checkpoint-20" / "config.json").write_text('{"model_type": "bert"}')
        return out

    monkeypatch.setattr(s3mod.S3Store, "put", rewrite)
    reaper, plan, bucket = make(volume, tmp_path, s3)
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-20"].outcome is Outcome.REFUSED
    assert "changed" in results["checkpoint-20"].detail, results["checkpoint-20"].detail
    assert "archive/run/checkpoint-20.ckptd-manifest.json" not in objects(s3, bucket)
    assert (volume / "run" / "checkpoint-20").is_dir()


def test_a_checkpoint_changed_after_it_was_archived_is_kept(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, _ = make(volume, tmp_path, s3)
    reaper.archiver.archive_all(plan.decisions)
    (volume / "run" / "checkpoint-10" / "config.json").write_text('{"model_type": "roberta", "re": 1}')
    os.utime(volume / "run" / "checkpoint-10" / "config.json", (OLD, OLD))
    plan = decide([(reaper.scanner.root, reaper.scanner.runs(now=NOW))])
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-10"].outcome is Outcome.REFUSED
    assert "differs from its archive" in results["checkpoint-10"].detail, results["checkpoint-10"].detail
    assert results["checkpoint-20"].outcome is Outcome.TRASHED


def test_a_manifest_written_by_hand_is_not_trusted(volume, tmp_path, s3):  # noqa: F811
    """Objects and a manifest that agree with each other, and with each file's identity, but whose
    checksums are not of these files: read again here, and refused."""
    reaper, plan, bucket = make(volume, tmp_path, s3)
    client = s3.client()
    target = volume / "run" / "checkpoint-10"
    snap = snapshot(target)
    files = []
    for rel, ident in snap.files.items():
        key = f"archive/run/checkpoint-10/{rel}"
        junk = b"\0" * ident[2]
        client.put_object(Bucket=bucket, Key=key, Body=junk, ChecksumAlgorithm="CRC32C", ChecksumCRC32C="AAAAAA==")
        files.append({"path": rel, "key": key, "size": ident[2], "crc32c": "AAAAAA==", "identity": list(ident)})
    doc = {"format": "ckptd-archive/1", "run": "run", "checkpoint": "checkpoint-10", "is_file": False,
           "files": files, "dirs": list(snap.dirs)}
    client.put_object(Bucket=bucket, Key=manifest_key("archive/run/checkpoint-10"), Body=json.dumps(doc).encode())
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-10"].outcome is Outcome.REFUSED
    assert "does not match" in results["checkpoint-10"].detail, results["checkpoint-10"].detail
    assert target.is_dir()


def test_an_archive_missing_an_object_is_not_whole(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, bucket = make(volume, tmp_path, s3)
    reaper.archiver.archive_all(plan.decisions)
    s3.client().delete_object(Bucket=bucket, Key="archive/run/checkpoint-10/config.json")
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-10"].outcome is Outcome.REFUSED
    assert "missing" in results["checkpoint-10"].detail


def test_an_unfinished_upload_left_behind_is_aborted_and_the_archive_completed(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, bucket = make(volume, tmp_path, s3)
    client = s3.client()
    left = client.create_multipart_upload(Bucket=bucket, Key="archive/run/checkpoint-10/global_step10/x",
                                          ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT")
    client.upload_part(Bucket=bucket, Key="archive/run/checkpoint-10/global_step10/x",
                       UploadId=left["UploadId"], PartNumber=1, Body=b"x" * 100)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3
    assert client.list_multipart_uploads(Bucket=bucket, Prefix="archive/").get("Uploads", []) == []


def test_dry_run_uploads_nothing_and_would_delete(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, bucket = make(volume, tmp_path, s3, dry_run=True)
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.DRY_RUN] * 3
    assert objects(s3, bucket) == {}


def test_on_complete_archives_every_complete_checkpoint_kept_or_not(volume, tmp_path, s3):  # noqa: F811
    reaper, plan, bucket = make(volume, tmp_path, s3, when="on-complete")
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3
    manifests = sorted(k for k in objects(s3, bucket) if k.endswith(".ckptd-manifest.json"))
    assert manifests == [f"archive/run/checkpoint-{s}.ckptd-manifest.json" for s in (10, 20, 30, 40)]


def test_a_failed_attempt_waits_before_the_next_doubling_each_time(volume, tmp_path, s3):  # noqa: F811
    now = [NOW]
    reaper, plan, bucket = make(volume, tmp_path, s3)
    reaper.archiver.clock = lambda: now[0]
    s3.stop()
    for at, tried in ((NOW, True), (NOW + 59, False), (NOW + 60, True), (NOW + 60 + 119, False)):
        now[0] = at
        events = len(read_journal(tmp_path / "state"))
        reaper.archiver.archive_all(plan.deletions[:1])
        assert (len(read_journal(tmp_path / "state")) > events) is tried, at - NOW
    s3.start()  # back, empty (moto keeps nothing across a restart)
    s3.client().create_bucket(Bucket=bucket)
    now[0] = NOW + 60 + 120
    reaper.archiver.archive_all(plan.deletions[:1])
    assert read_journal(tmp_path / "state")[-1]["event"] == "archived"


REAL_BUCKET = os.environ.get("CKPTD_TEST_S3_URL")  # s3://bucket/prefix, credentials from the standard chain


@pytest.mark.network
@pytest.mark.skipif(not REAL_BUCKET, reason="opt-in: set CKPTD_TEST_S3_URL=s3://bucket/prefix (and AWS credentials)")
def test_against_a_real_bucket(volume, tmp_path):
    """The same archive, verify, delete against a real S3 bucket (its own checksums, its own
    If-None-Match): under a fresh prefix each run, which ckptd never deletes (a lifecycle rule should)."""
    import uuid

    cfg = Archive(url=f"{REAL_BUCKET.rstrip('/')}/ckptd-test-{uuid.uuid4().hex[:8]}", part_size="5MiB")
    scanner = Scanner(Root(path=volume, world_size=2, retention=Retention(keep_last=1, keep_best=0), archive=cfg))
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    results = reaper.execute(plan.decisions)
    assert [r.outcome for r in results] == [Outcome.TRASHED] * 3, [r.line() for r in results]


def test_an_archive_gone_from_the_store_is_made_again_before_a_deletion(volume, tmp_path, s3):  # noqa: F811
    """This ckptd's own record that it archived a checkpoint is not taken for the archive itself:
    a checkpoint about to be deleted is looked for at the store, and archived again if it is gone."""
    reaper, plan, bucket = make(volume, tmp_path, s3)
    reaper.archiver.archive_all(plan.decisions)
    s3.client().delete_object(Bucket=bucket, Key="archive/run/checkpoint-10.ckptd-manifest.json")
    results = {r.decision.checkpoint.name: r for r in reaper.execute(plan.decisions)}
    assert results["checkpoint-10"].outcome is Outcome.TRASHED, results["checkpoint-10"].detail
    assert "archive/run/checkpoint-10.ckptd-manifest.json" in objects(s3, bucket)
