"""The SHA-256 each manifest records per file, computed from the bytes read for upload: what tells
other bytes of the same size and CRC32C (4 bytes chosen by linear algebra: test_archive_attack's
`forge_same_crc32c`) from the archived ones, wherever ckptd compares bytes itself. And a manifest
written before SHA-256 was recorded: still trusted, its objects compared with the local files by
SHA-256 where its CRC32C would be the only word. The real `ckptd` as a subprocess against moto's
S3 API server on 127.0.0.1 (moto keeps whatever CRC32C a PUT claims, as a store that does not check
would)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from ckptd.archive.manifest import FORMAT, parse
from tests.archive.test_archive_attack import b64, crc32c_raw, forge_same_crc32c
from tests.archive.test_archive_cli import ckptd
from tests.archive.test_archive_readback import archived
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)

REL = "global_step10/mp_rank_00_model_states.pt"
KEY = f"archive/run/checkpoint-10/{REL}"
MKEY = "archive/run/checkpoint-10.ckptd-manifest.json"


def manifest(client, bucket, key=MKEY):
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def forge_object(client, bucket) -> bytes:
    """KEY's object replaced by other bytes of its size and CRC32C, claiming that CRC32C."""
    original = client.get_object(Bucket=bucket, Key=KEY)["Body"].read()
    forged = forge_same_crc32c(original, at=len(original) // 2)
    client.put_object(Bucket=bucket, Key=KEY, Body=forged, ChecksumAlgorithm="CRC32C",
                      ChecksumCRC32C=b64(crc32c_raw(original)))
    return forged


def as_an_older_ckptd_wrote_them(client, bucket) -> None:
    """Every manifest in the bucket without its files' sha256, as ckptd wrote them before."""
    for o in client.list_objects_v2(Bucket=bucket)["Contents"]:
        if o["Key"].endswith(".ckptd-manifest.json"):
            doc = manifest(client, bucket, o["Key"])
            for f in doc["files"]:
                del f["sha256"]
            client.put_object(Bucket=bucket, Key=o["Key"], Body=json.dumps(doc).encode())


def forge_local(path) -> None:
    """The file rewritten in place to other bytes of its size and CRC32C, its mtime put back."""
    st = os.stat(path)
    forged = forge_same_crc32c(path.read_bytes(), at=st.st_size // 2)
    with open(path, "r+b") as out:
        out.write(forged)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_manifest_naming_the_forged_bytes_sha256_is_checked_against_the_files(tmp_path, s3):  # noqa: F811
    """Someone who can write the bucket forges an object (same size and CRC32C, which the store's
    HEAD reports) and writes its SHA-256 into the manifest. No record of this ckptd matches that
    manifest, so every local file is read again: its CRC32C agrees, its SHA-256 does not. Kept."""
    root, cfg, bucket = archived(tmp_path, s3, "checksum")
    client = s3.client()
    forged = forge_object(client, bucket)
    doc = manifest(client, bucket)
    [f] = [f for f in doc["files"] if f["key"] == KEY]
    f["sha256"] = hashlib.sha256(forged).hexdigest()
    client.put_object(Bucket=bucket, Key=MKEY, Body=json.dumps(doc).encode())
    r = ckptd("prune", "-c", str(cfg), check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"], r.stdout + r.stderr
    assert "does not match" in r.stdout + r.stderr and "the same CRC32C over other bytes" in r.stdout + r.stderr


def test_an_older_manifest_without_sha256_is_still_trusted(tmp_path, s3):  # noqa: F811
    """Manifests an older ckptd wrote (no sha256): nothing changed, so the checkpoints go as before,
    and `restore` gives back every byte, saying it could verify their CRC32C only."""
    root, cfg, bucket = archived(tmp_path, s3, "checksum")
    saved = tmp_path / "saved"
    shutil.copytree(root / "run" / "checkpoint-10", saved)
    as_an_older_ckptd_wrote_them(s3.client(), bucket)
    ckptd("prune", "-c", str(cfg), "-q")
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    r = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"))
    assert "every file's CRC32C verified" in r.stdout and "has no SHA-256" in r.stdout, r.stdout
    for d, _, files in os.walk(saved):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), saved)
            assert (tmp_path / "back" / "checkpoint-10" / rel).read_bytes() == (saved / rel).read_bytes()


def test_read_back_of_an_older_manifest_compares_each_object_with_its_file(tmp_path, s3):  # noqa: F811
    """An older manifest has no SHA-256 to compare a download with: read-back compares the object's
    SHA-256 with the local file's, so a forged object of the same CRC32C is still caught."""
    root, cfg, bucket = archived(tmp_path, s3, "read-back")
    client = s3.client()
    as_an_older_ckptd_wrote_them(client, bucket)
    forge_object(client, bucket)
    r = ckptd("prune", "-c", str(cfg), check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"], r.stdout + r.stderr
    assert "reads back with SHA-256" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_local_rewrite_to_the_same_crc32c_under_an_older_manifest_is_kept(tmp_path, s3):  # noqa: F811
    """A file rewritten in place (same size and CRC32C, mtime put back) under a manifest with no
    SHA-256: its ctime moved, so the object is downloaded and the two SHA-256s compared. Kept."""
    root, cfg, bucket = archived(tmp_path, s3, "checksum")
    as_an_older_ckptd_wrote_them(s3.client(), bucket)
    forge_local(root / "run" / "checkpoint-10" / REL)
    r = ckptd("prune", "-c", str(cfg), check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"], r.stdout + r.stderr
    assert "rewritten in place" in r.stdout + r.stderr and "its object's" in r.stdout + r.stderr


@pytest.mark.parametrize("value", ["", "ab" * 31, "AB" * 32, "g" * 64, 7])
def test_a_malformed_sha256_makes_the_manifest_untrusted(value):
    doc = {"format": FORMAT, "run": "run", "checkpoint": "c", "is_file": False, "dirs": [],
           "files": [{"path": "a", "key": "k/a", "size": 1, "crc32c": "AAAAAA==", "identity": [1, 2, 1, 3, 4],
                      "sha256": value}]}
    with pytest.raises(ValueError, match="sha256"):
        parse(json.dumps(doc).encode())
    doc["files"][0]["sha256"] = "0" * 64
    assert parse(json.dumps(doc).encode()).files[0].sha256 == "0" * 64
