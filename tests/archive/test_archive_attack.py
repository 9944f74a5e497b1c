"""Attempts, by someone who had not seen the archive's code, to make ckptd delete a local checkpoint
whose archive is not whole and verified (`[roots.archive] required = true`), or to make `ckptd
restore` give back other bytes than were archived. The real `ckptd` as a subprocess against moto's
S3 API server on 127.0.0.1; a purge killed with SIGKILL where strace holds it (no sleep). An attack
that still succeeds is marked xfail(strict=True) until the product refuses it (none now)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.archive.upload import PAUSE_FIFO_ENV
from ckptd.discover.layouts import TRASH_DIR
from tests.archive.test_archive_cli import ckptd, setup
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)

GRACE = {"CKPTD_TRASH_GRACE": ""}  # the config's trash_grace (15m): trashed entries wait


def crc32c_raw(data: bytes) -> int:
    import crc32c

    return crc32c.crc32c(data)


def b64(v: int) -> str:
    return base64.b64encode(v.to_bytes(4, "big")).decode()


def forge_same_crc32c(data: bytes, at: int = 0) -> bytes:
    """Other bytes of the same size and CRC32C as `data`: 4 bytes at `at` changed, the next 4 chosen
    so the CRC comes out the same (CRC32C is affine over GF(2): a 32x32 linear system)."""
    want = crc32c_raw(data)
    base = bytearray(data)
    base[at] ^= 0xFF  # the change we want
    fix = at + 4 if at + 8 <= len(base) else at - 4
    assert fix >= 0 and fix + 4 <= len(base)

    def crc_with(x: int) -> int:
        b = bytearray(base)
        b[fix:fix + 4] = (int.from_bytes(base[fix:fix + 4], "little") ^ x).to_bytes(4, "little")
        return crc32c_raw(bytes(b))

    c0 = crc_with(0)
    cols = [crc_with(1 << i) ^ c0 for i in range(32)]  # the linear part, column by column
    target = want ^ c0
    # solve sum(x_i * cols[i]) = target over GF(2)
    rows = [(cols[i], 1 << i) for i in range(32)]
    basis: list[tuple[int, int]] = []
    for v, tag in rows:
        for bv, btag in basis:
            if v ^ bv < v:
                v, tag = v ^ bv, tag ^ btag
        if v:
            basis.append((v, tag))
            basis.sort(reverse=True)
    x, t = 0, target
    for bv, btag in basis:
        if t ^ bv < t:
            t, x = t ^ bv, x ^ btag
    assert t == 0, "no solution"
    out = bytearray(base)
    out[fix:fix + 4] = (int.from_bytes(base[fix:fix + 4], "little") ^ x).to_bytes(4, "little")
    assert crc32c_raw(bytes(out)) == want and bytes(out) != data and len(out) == len(data)
    return bytes(out)


def with_grace_cfg(cfg: Path, **archive: str) -> None:
    text = cfg.read_text()
    for k, v in archive.items():
        text += f'{k} = "{v}"\n'
    cfg.write_text(text)


def pruned(tmp_path, s3, **archive):  # noqa: F811
    root, cfg, bucket = setup(tmp_path, s3)
    with_grace_cfg(cfg, **archive)
    ckptd("prune", "-c", str(cfg), "-q", env=GRACE)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-30"]
    return root, cfg, bucket


def entries(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root / TRASH_DIR) if not n.endswith("%decision"))


def test_read_back_catches_an_object_of_the_same_size_and_crc32c(tmp_path, s3):  # noqa: F811
    """verify = "read-back" catches other bytes kept under the original checksum. A CRC32C is no
    digest: 4 bytes chosen by linear algebra give other bytes of the same size and CRC32C, which a
    read-back comparing CRC32C accepted (the local copy purged, `restore` handing back the forged
    bytes as 'every file verified'). The SHA-256 the manifest records tells them apart: the purge
    moves the checkpoint back, and `restore` refuses the object and leaves nothing."""
    root, cfg, bucket = pruned(tmp_path, s3, verify="read-back")
    client = s3.client()
    key = "archive/run/checkpoint-10/global_step10/mp_rank_00_model_states.pt"
    original = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    forged = forge_same_crc32c(original, at=len(original) // 2)
    client.put_object(Bucket=bucket, Key=key, Body=forged, ChecksumAlgorithm="CRC32C",
                      ChecksumCRC32C=b64(crc32c_raw(original)))
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    back = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"), check=False)
    restored = tmp_path / "back/checkpoint-10/global_step10/mp_rank_00_model_states.pt"
    assert "checkpoint-10" in os.listdir(root / "run"), (
        "purged with its archive holding other bytes: " + r.stdout
        + f" / restore rc={back.returncode} gives back the forged bytes: "
        + str(restored.exists() and restored.read_bytes() == forged))
    assert back.returncode == 74 and "SHA-256" in back.stderr, back.stdout + back.stderr
    assert not (tmp_path / "back" / "checkpoint-10").exists()


def _hold_purge_after_its_claim(cfg: Path, root: Path) -> str:
    """`ckptd trash purge --now` under strace, every unlinkat held 60 s at its entry: killed with
    SIGKILL once an entry is renamed `%purging` (its claim), before anything of it is removed.
    The entry's name in the trash."""
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=unlinkat:delay_enter=60000000",
         sys.executable, "-m", "ckptd", "trash", "purge", "--now", "-c", str(cfg)],
        env={**os.environ, **GRACE}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            claimed = [n for n in os.listdir(root / TRASH_DIR) if n.endswith("%purging")]
            if claimed:
                return claimed[0]
            assert proc.poll() is None, "the purge ended before any claim"
            os.sched_yield()
        raise AssertionError("no entry claimed within 60 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_purge_killed_after_its_claim_asks_the_archive_again(tmp_path, s3):  # noqa: F811
    """A purge killed (SIGKILL) just after renaming an entry `%purging`, before removing anything
    of it, leaves the checkpoint whole in the trash. Its archive's manifest is then deleted from
    the bucket. The next purge finishes the removal without asking the archive: the checkpoint is
    gone, and nothing in the bucket says it was whole."""
    root, cfg, bucket = pruned(tmp_path, s3)
    claimed = _hold_purge_after_its_claim(cfg, root)
    name = claimed.removesuffix("%purging")
    ckpt = "checkpoint-10" if name.endswith("checkpoint-10") else "checkpoint-20"
    n_files = sum(len(f) for _, _, f in os.walk(root / TRASH_DIR / claimed))
    assert n_files > 5  # whole: nothing of it removed yet
    s3.client().delete_object(Bucket=bucket, Key=f"archive/run/{ckpt}.ckptd-manifest.json")
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE, check=False)
    here = os.listdir(root / "run") + os.listdir(root / TRASH_DIR)
    assert any(ckpt in n for n in here), f"{ckpt} purged with no manifest in the bucket: {r.stdout}{r.stderr}"


def test_restore_refuses_a_manifest_that_names_another_checkpoint(tmp_path, s3):  # noqa: F811
    """checkpoint-20's manifest copied over checkpoint-10's: the gate refuses it (it names another
    checkpoint), but `restore run/checkpoint-10` gives back checkpoint-20's files as checkpoint-10,
    'every file verified'."""
    _root, cfg, bucket = pruned(tmp_path, s3)
    client = s3.client()
    other = client.get_object(Bucket=bucket, Key="archive/run/checkpoint-20.ckptd-manifest.json")["Body"].read()
    client.put_object(Bucket=bucket, Key="archive/run/checkpoint-10.ckptd-manifest.json", Body=other)
    r = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"), check=False)
    back = tmp_path / "back" / "checkpoint-10"
    got = (back / "latest").read_text() if back.exists() else None
    assert r.returncode != 0 and got is None, f"restored as checkpoint-10: latest says {got!r}; {r.stdout}"


def test_restore_makes_nothing_outside_its_target(tmp_path, s3):  # noqa: F811
    """A manifest's `dirs` are not checked as its files' paths are (manifest.parse): one naming
    `../../../x` makes a directory outside the --to directory."""
    _root, cfg, bucket = pruned(tmp_path, s3)
    client = s3.client()
    key = "archive/run/checkpoint-10.ckptd-manifest.json"
    doc = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    doc["dirs"].append("../../../escaped")  # from <to>/back/.ckptd-restore-*/checkpoint-10
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(doc).encode())
    (tmp_path / "to").mkdir()
    ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "to" / "back"), check=False)
    assert not (tmp_path / "to" / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_a_local_file_rewritten_to_the_same_crc32c_is_kept(tmp_path, s3):  # noqa: F811
    """After its archive verified, a file of the checkpoint is rewritten in place: other bytes, the
    same size and CRC32C (4 chosen bytes), its mtime put back with os.utime. The ctime moved, so
    the gate reads it again; comparing its CRC32C alone let the local copy, which is not what the
    archive holds, be deleted. Its SHA-256 is compared: kept."""
    root, cfg, bucket = setup(tmp_path, s3)
    with_grace_cfg(cfg, when="on-complete")
    ckpt = root / "run" / "checkpoint-10"
    # archive every complete checkpoint first, deleting nothing (keep_last high)
    keep_all = cfg.read_text().replace("keep_last = 1", "keep_last = 5")
    cfg_keep = tmp_path / "keep.toml"
    cfg_keep.write_text(keep_all)
    ckptd("prune", "-c", str(cfg_keep), "-q", env=GRACE)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert s3.client().head_object(Bucket=bucket, Key="archive/run/checkpoint-10.ckptd-manifest.json")
    f = ckpt / "global_step10" / "mp_rank_00_model_states.pt"
    st = os.stat(f)
    data = f.read_bytes()
    forged = forge_same_crc32c(data, at=len(data) // 2)
    with open(f, "r+b") as out:
        out.write(forged)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = ckptd("prune", "-c", str(cfg), "-q", env={"CKPTD_TRASH_GRACE": "0"}, check=False)
    assert "checkpoint-10" in os.listdir(root / "run"), f"deleted though it differs from its archive: {r.stderr}"
    assert "the same CRC32C over other bytes" in r.stdout + r.stderr, r.stdout + r.stderr


ODD = "r +%2F?#&=ü~*'\\"  # a run's name S3 keys and URLs treat specially: space, plus, percent, query, fragment


def test_odd_names_archive_verify_and_restore_bit_identical(tmp_path, s3):  # noqa: F811
    """A run whose name holds characters URLs and S3 listings treat specially: archived under a key
    that says the same name, verified, deleted, and restored byte for byte."""
    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint

    root, cfg, bucket = setup(tmp_path, s3, steps=())
    old = time.time() - 3600
    for i, step in enumerate((10, 20, 30)):
        ckpt = hf_deepspeed_checkpoint(root / ODD, step, world=2)
        # names that differ only where URLs or Unicode normalisation might fold them together
        for n, name in enumerate(("x+y", "x y", "x%2By", "\u00e9", "e\u0301", "a?b#c")):
            (ckpt / name).write_bytes(f"{name} {n}".encode() * (n + 1))
        for d, _, files in os.walk(ckpt, topdown=False):
            for f in files:
                os.utime(Path(d, f), (old + i, old + i))
            os.utime(d, (old + i, old + i))
    saved = tmp_path / "saved"
    shutil.copytree(root / ODD / "checkpoint-10", saved)
    ckptd("prune", "-c", str(cfg), "-q")
    assert sorted(os.listdir(root / ODD)) == ["checkpoint-30"]
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert f"archive/{ODD}/checkpoint-10.ckptd-manifest.json" in keys
    ckptd("restore", f"{ODD}/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"))
    back = tmp_path / "back" / "checkpoint-10"
    for d, _, files in os.walk(saved):
        for f in files:
            rel = Path(d, f).relative_to(saved)
            assert (back / rel).read_bytes() == (saved / rel).read_bytes()
    assert sum(len(f) for _, _, f in os.walk(back)) == sum(len(f) for _, _, f in os.walk(saved))


def test_restore_refuses_an_object_changed_in_the_bucket_and_leaves_nothing(tmp_path, s3):  # noqa: F811
    """An object overwritten after the deletion with other bytes of the same size, claiming the
    original CRC32C (moto keeps the claim): restore computes the CRC32C itself and refuses, leaving
    neither the checkpoint nor its temporary directory."""
    _root, cfg, bucket = setup(tmp_path, s3)
    ckptd("prune", "-c", str(cfg), "-q")
    client = s3.client()
    key = "archive/run/checkpoint-10/global_step10/mp_rank_00_model_states.pt"
    original = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=bytes(len(original)), ChecksumAlgorithm="CRC32C",
                      ChecksumCRC32C=b64(crc32c_raw(original)))
    (tmp_path / "back").mkdir()
    r = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"), check=False)
    assert r.returncode == 74, r.stderr
    assert os.listdir(tmp_path / "back") == []


def test_another_checkpoints_manifest_copied_over_during_the_grace_keeps_it(tmp_path, s3):  # noqa: F811
    """During the grace, checkpoint-20's manifest is copied over checkpoint-10's, once as it is and
    once with its run and checkpoint rewritten to say checkpoint-10: the purge puts checkpoint-10
    back into its run either way (the names differ; the files' identities differ)."""
    root, cfg, bucket = pruned(tmp_path, s3)
    client = s3.client()
    other = client.get_object(Bucket=bucket, Key="archive/run/checkpoint-20.ckptd-manifest.json")["Body"].read()
    key = "archive/run/checkpoint-10.ckptd-manifest.json"
    client.put_object(Bucket=bucket, Key=key, Body=other)
    r = ckptd("trash", "purge", "--now", "-c", str(cfg), env=GRACE)
    assert "checkpoint-10" in os.listdir(root / "run"), r.stdout + r.stderr
    ckptd("prune", "-c", str(cfg), "-q", env=GRACE, check=False)  # kept: its archive is not its own
    assert "checkpoint-10" in os.listdir(root / "run")
    doc = json.loads(other)
    doc["checkpoint"] = "checkpoint-10"
    for f in doc["files"]:
        f["key"] = f["key"].replace("checkpoint-20", "checkpoint-10")
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(doc).encode())
    r = ckptd("prune", "-c", str(cfg), "-q", env={"CKPTD_TRASH_GRACE": "0"}, check=False)
    assert "checkpoint-10" in os.listdir(root / "run"), r.stderr


def test_the_daemon_killed_mid_upload_then_a_file_rewritten_archives_what_is_there_now(tmp_path, s3):  # noqa: F811
    """`ckptd run` killed with SIGKILL in the middle of a multipart upload, after it uploaded
    config.json; config.json is then rewritten in place (same size, its mtime put back). The next
    daemon sends it again (its CRC32C differs from the object's), and what it deletes restores as
    the files were when they were deleted, byte for byte."""
    import select

    from tests.support.daemonproc import DaemonProc

    root, cfg, bucket = setup(tmp_path, s3, shard_size=6 * 1024 * 1024, steps=(10, 20))
    # the rewrite makes checkpoint-10 settle again: a short quiet period keeps the test short
    cfg.write_text(cfg.read_text().replace("world_size = 2", 'world_size = 2\nquiet_period = "5s"'))
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    env = {"CKPTD_TRASH_GRACE": "0"}
    try:
        with DaemonProc("-c", cfg, env={**env, PAUSE_FIFO_ENV: str(fifo)}) as daemon:
            ready, _, _ = select.select([reader], [], [], 120)
            assert ready, "the daemon never reached the middle of a multipart upload\n" + daemon.dump()
            assert int(os.read(reader, 64).split()[0]) == daemon.proc.pid
            daemon.proc.kill()
            daemon.proc.wait(timeout=30)
    finally:
        os.close(reader)
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert "archive/run/checkpoint-10/config.json" in keys
    f = root / "run" / "checkpoint-10" / "config.json"
    st = os.stat(f)
    new = f.read_bytes().replace(b"roberta", b"ROBERTA")
    with open(f, "r+b") as out:
        out.write(new)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    saved = tmp_path / "saved"
    shutil.copytree(root / "run" / "checkpoint-10", saved)
    with DaemonProc("-c", cfg, env=env) as daemon:
        daemon.wait_for(lambda line: "purged" in line.get("message", "") and "checkpoint-10" in line.get("message", ""),
                        timeout=120)
    assert "checkpoint-10" not in os.listdir(root / "run")
    ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"))
    back = tmp_path / "back" / "checkpoint-10"
    for d, _, files in os.walk(saved):
        for name in files:
            rel = Path(d, name).relative_to(saved)
            assert (back / rel).read_bytes() == (saved / rel).read_bytes(), rel


RENAMEAT = 264  # x86_64


def _in_syscall(session: int, syscall: int) -> bool:
    """Whether a process of `session` (strace's, and what it runs) is inside `syscall` now."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == session:
            continue
        try:
            if os.getsid(int(pid)) != session:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/syscall") as fh:
                    if fh.read().split(" ", 1)[0] == str(syscall):
                        return True
        except OSError:
            continue
    return False


def _held_at_trash_rename(proc: subprocess.Popen, root: Path, journal: Path, timeout: float) -> str:
    """Poll (bounded) until the `ckptd` under strace is held in the rename of a checkpoint into
    the trash: its intent journaled, its decision record in place, the checkpoint still in its
    run. That checkpoint's name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _in_syscall(proc.pid, RENAMEAT) and journal.exists():
            for line in journal.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("event") != "trashing":
                    continue
                name = os.path.basename(rec["path"])
                target = os.path.basename(rec["trash"])
                if (root / "run" / name).exists() and (root / TRASH_DIR / f"{target}%decision").exists() \
                        and _in_syscall(proc.pid, RENAMEAT):
                    return name
        os.sched_yield()
    raise AssertionError("never held at a rename into the trash")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="renameat's number is x86_64's")
def test_the_archive_gone_and_a_file_rewritten_between_the_gate_and_the_rename(tmp_path, s3):  # noqa: F811
    """`ckptd prune` (trash_grace 0) held by strace at the rename into the trash, just after the
    gate passed: meanwhile the manifest is deleted from the bucket and a file rewritten in place
    (same size, mtime put back). The rename goes ahead, but the purge asks again: the checkpoint
    goes back into its run."""
    root, cfg, bucket = setup(tmp_path, s3)
    # Each rename is held 6 s: the bucket's delete and the rewrite below must land inside the
    # hold, and on a loaded 2-core machine 2 s was once too short for them.
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=renameat:delay_enter=6000000",
         sys.executable, "-m", "ckptd", "prune", "-c", str(cfg), "-q"],
        env={**os.environ, "CKPTD_TRASH_GRACE": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        ckpt = _held_at_trash_rename(proc, root, tmp_path / "state" / "journal.jsonl", 120)
        s3.client().delete_object(Bucket=bucket, Key=f"archive/run/{ckpt}.ckptd-manifest.json")
        f = root / "run" / ckpt / "config.json"
        st = os.stat(f)
        data = f.read_bytes()
        with open(f, "r+b") as out:
            out.write(data.upper())
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (root / "run" / ckpt / "config.json").read_bytes() == data.upper(), err


def test_one_deeply_nested_manifest_breaks_no_listing(tmp_path, s3):  # noqa: F811
    """A manifest that is JSON nested 100000 deep (written by hand): the gate keeps its checkpoint
    (it cannot be checked), but `archive list` and `latest --archive` die on it with exit 70 and a
    traceback, for every checkpoint of the archive, and `restore` with an internal error, not a
    line saying the manifest is not one ckptd can trust (exit 74)."""
    root, cfg, bucket = pruned(tmp_path, s3)
    s3.client().put_object(Bucket=bucket, Key="archive/run/checkpoint-10.ckptd-manifest.json",
                           Body=b"[" * 100000 + b"]" * 100000)
    listed = ckptd("archive", "list", "-c", str(cfg), check=False)
    latest = ckptd("latest", "--archive", str(root / "run"), "-c", str(cfg), check=False)
    restore = ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "b"), check=False)
    assert (listed.returncode, latest.returncode, restore.returncode) == (0, 0, 74), (
        listed.stderr[-300:] + latest.stderr[-300:] + restore.stderr[-300:])
    assert "checkpoint-20" in listed.stdout


def test_the_daemon_killed_after_its_purge_claim_asks_the_archive_again(tmp_path, s3):  # noqa: F811
    """`ckptd run` (trash_grace 0) under strace, every unlinkat held at its entry, killed with
    SIGKILL once it has renamed a trashed checkpoint `%purging`. The checkpoint's manifest is then
    deleted from the bucket; the next daemon removes the whole checkpoint without asking."""
    root, cfg, bucket = setup(tmp_path, s3)
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=unlinkat:delay_enter=20000000",
         sys.executable, "-m", "ckptd", "run", "--foreground", "-c", str(cfg)],
        env={**os.environ, "CKPTD_TRASH_GRACE": "0"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        claimed: list[str] = []
        while not claimed and time.monotonic() < deadline and proc.poll() is None:
            if (root / TRASH_DIR).is_dir():
                claimed = [n for n in os.listdir(root / TRASH_DIR) if n.endswith("%purging")]
            os.sched_yield()
        assert claimed, "the daemon never claimed an entry"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ckpt = "checkpoint-10" if claimed[0].removesuffix("%purging").endswith("checkpoint-10") else "checkpoint-20"
    assert sum(len(f) for _, _, f in os.walk(root / TRASH_DIR / claimed[0])) > 5  # whole
    s3.client().delete_object(Bucket=bucket, Key=f"archive/run/{ckpt}.ckptd-manifest.json")
    from tests.support.daemonproc import DaemonProc

    with DaemonProc("-c", cfg, env={"CKPTD_TRASH_GRACE": "0"}) as daemon:
        daemon.wait_message("state written", timeout=120)
    here = os.listdir(root / "run") + os.listdir(root / TRASH_DIR)
    assert any(ckpt in n for n in here), f"{ckpt} removed with no manifest in the bucket"


def _hf_checkpoints(run: Path, steps, mtime: float) -> None:
    """HF Trainer checkpoints (no DeepSpeed) written by torch's and safetensors' own writers: a
    tiny model's weights, its AdamW state after a step, the Trainer's state."""
    import torch
    from safetensors.torch import save_file

    from ckptd.cli.demo_volume import age, trainer_state

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    for i, step in enumerate(steps):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        ckpt = run / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
        torch.save(opt.state_dict(), ckpt / "optimizer.pt")
        torch.save({"lr": 1e-3}, ckpt / "scheduler.pt")
        torch.save({"python": 1}, ckpt / "rng_state.pth")
        (ckpt / "config.json").write_text(json.dumps({"model_type": "bert"}))
        (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state(step, {}, None, run_dir=str(run))))
        age(ckpt, mtime + i)


def test_a_slim_is_archived_whole_first_and_its_optimizer_state_restores(tmp_path, s3):  # noqa: F811
    """keep_full_last: the older checkpoints are slimmed (their optimizer state removed), each
    archived whole first; restore gives back the optimizer state byte for byte."""
    root, cfg, _bucket = setup(tmp_path, s3, steps=())
    _hf_checkpoints(root / "run", (10, 20, 30), time.time() - 3600)
    cfg.write_text(cfg.read_text().replace("keep_last = 1", "keep_last = 3\nkeep_full_last = 1"))
    saved = tmp_path / "saved"
    shutil.copytree(root / "run" / "checkpoint-10", saved)
    ckptd("prune", "-c", str(cfg), "-q", env={"CKPTD_TRASH_GRACE": "0"})
    optim = [p for p in saved.rglob("optimizer.pt")]
    assert optim and not any((root / "run" / "checkpoint-10" / p.relative_to(saved)).exists() for p in optim)
    ckptd("restore", "run/checkpoint-10", "-c", str(cfg), "--to", str(tmp_path / "back"))
    for p in optim:
        assert (tmp_path / "back" / "checkpoint-10" / p.relative_to(saved)).read_bytes() == p.read_bytes()


def test_two_roots_under_one_prefix_through_one_endpoint_spelled_twice_are_refused(tmp_path):
    """The same store and prefix for two roots, the endpoint once with a trailing slash: accepted,
    though the two roots would share keys (the second's checkpoints meet the first's manifests and
    are kept forever; `restore RUN/CKPT` takes the first root's)."""
    for name in ("v1", "v2"):
        (tmp_path / name).mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"
[[roots]]
path = "{tmp_path / 'v1'}"
[roots.archive]
url = "s3://b/archive"
endpoint_url = "http://127.0.0.1:9000"
[[roots]]
path = "{tmp_path / 'v2'}"
[roots.archive]
url = "s3://b/archive"
endpoint_url = "http://127.0.0.1:9000/"
""")
    r = ckptd("check-config", "-c", str(cfg), check=False)
    assert r.returncode == 78, r.stderr[-300:]
