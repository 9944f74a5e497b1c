"""The purge asks the archive again: with `required = true`, a checkpoint trashed after its archive
verified is purged only if that archive still verifies then. The real `ckptd prune` and
`ckptd trash purge --now` as subprocesses against moto's S3 API server on 127.0.0.1, with the
default trash_grace (the suite's CKPTD_TRASH_GRACE=0 unset), the bucket changed in between."""

from __future__ import annotations

import os

from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import read_journal
from tests.archive.test_archive_cli import ckptd, setup
from tests.support.fwfixtures import copy_volume, fw_torch_volumes, lightning_volume  # noqa: F401  (fixtures)
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)

GRACE = {"CKPTD_TRASH_GRACE": ""}  # the config's trash_grace, default 15m: the entries wait


def pruned(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = setup(tmp_path, s3)
    ckptd("prune", "-c", str(cfg), "-q", env=GRACE)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    assert len(os.listdir(root / TRASH_DIR)) >= 2
    return root, cfg, bucket


def restored_why(tmp_path):
    return {os.path.basename(r["path"]): r["why"] for r in read_journal(tmp_path / "state") if r["event"] == "restored"}


def test_an_archive_emptied_during_the_grace_keeps_the_checkpoint(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = pruned(tmp_path, s3)
    client = s3.client()
    for o in client.list_objects_v2(Bucket=bucket)["Contents"]:
        client.delete_object(Bucket=bucket, Key=o["Key"])
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "purged 0" in r.stdout, r.stdout + r.stderr
    # judged again says keep, as for a pin or a resume pointer: moved back into its run
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    why = restored_why(tmp_path)
    assert sorted(why) == ["checkpoint-10", "checkpoint-20"]
    assert all("with its archive no longer verified (archive required: not archived to" in w for w in why.values()), why
    assert "judged again at its purge (found in the trash with its archive no longer verified" in r.stderr, r.stderr
    # the next prune archives them again, verifies, and trashes them
    ckptd("prune", "-c", str(cfg), "-q", env=GRACE)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    assert "archive/run/checkpoint-10.ckptd-manifest.json" in {
        o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}


def test_an_object_changed_in_the_bucket_during_the_grace_keeps_the_checkpoint(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = pruned(tmp_path, s3)
    client = s3.client()
    client.put_object(Bucket=bucket, Key="archive/run/checkpoint-10/config.json", Body=b"{}")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "purged 1" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"]
    assert "is not what was read" in restored_why(tmp_path)["checkpoint-10"]
    # and it stays: its archive is there but not whole, and ckptd never replaces an archive
    r = ckptd("prune", "-c", str(cfg), env=GRACE, check=False)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-30"]


def test_a_manifest_deleted_during_the_grace_keeps_the_checkpoint(tmp_path, s3):  # noqa: F811
    root, cfg, bucket = pruned(tmp_path, s3)
    s3.client().delete_object(Bucket=bucket, Key="archive/run/checkpoint-20.ckptd-manifest.json")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "purged 1" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-20", "checkpoint-30"]


def test_the_store_down_at_the_purge_keeps_everything(tmp_path, s3):  # noqa: F811
    root, cfg, _ = pruned(tmp_path, s3)
    s3.stop()
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "purged 0" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert all("its archive cannot be checked" in w for w in restored_why(tmp_path).values())


def test_an_archive_that_still_verifies_is_purged(tmp_path, s3):  # noqa: F811
    root, cfg, _ = pruned(tmp_path, s3)
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "purged 2" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    assert os.listdir(root / TRASH_DIR) == []


def test_a_checkpoint_that_is_one_file_is_purged_though_its_rename_moved_its_ctime(lightning_volume, tmp_path, s3):  # noqa: F811
    """Lightning's .ckpt files (its own writer): renamed into the trash, each file's ctime moves,
    so the purge's gate reads it again and finds the archived bytes: purged, not kept forever."""
    root = copy_volume(lightning_volume, tmp_path / "vol")
    bucket = s3.bucket()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"
[[roots]]
path = "{root}"
[roots.retention]
keep_last = 1
keep_best = 0
[roots.archive]
url = "s3://{bucket}/archive"
endpoint_url = "{s3.endpoint}"
""")
    ckptd("prune", "-c", str(cfg), "-q", env=GRACE)
    trashed = [n for n in os.listdir(root / TRASH_DIR) if n.endswith(".ckpt")]
    assert trashed
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert f"purged {len(trashed)} " in r.stdout, r.stdout + r.stderr
    assert "restored" not in [e["event"] for e in read_journal(tmp_path / "state")]
