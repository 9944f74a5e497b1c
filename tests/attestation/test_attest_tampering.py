"""Adversarial cases against commit records (`ckptd.attest`, docs/attestation.md).

A record lets ckptd count a save complete without the quiet period, so every case here runs with
`quiet_period = "1d"`: whatever is complete in it is complete *because of* its records. The
checkpoints are real: tests/support/attestgen.py's HF Trainer runs (2-process DDP, gloo, with
`ckptd.integrations.hf.AttestCallback`) and its accelerate `save_state`, one generation per module,
copied per test with every mtime kept (`shutil.copytree` is `cp -p`). Where a case needs a state no
framework writes (a forged or garbled record), its docstring says so. ckptd runs as the real CLI
(`python -m ckptd plan|latest|verify|prune`) in a subprocess.

The promise under attack: never delete a checkpoint that is in flight, the newest complete one, a
pinned one, or anything outside the roots; and never call complete what cannot be loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli.demo_volume import age
from tests.support import fwgen

pytestmark = pytest.mark.frameworks


# A job killed mid-save (trainer-killed: 2 processes, SIGKILL inside checkpoint-4's save, each rank
# held before its rng state; trainer-killed-late: rank 0 held after its own) restarted an hour later
# on one process: the Trainer, with the callback, resumes from checkpoint-2 and saves checkpoint-4
# again, in place, into the same output_dir. One process restarts each run given, one after another.
_RESTART = r"""
import os, sys
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    os.environ.pop(k, None)
from pathlib import Path
from tests.support import fwgen
from ckptd.integrations.hf import AttestCallback
for out in map(Path, sys.argv[1:]):
    trainer = fwgen._trainer_parts(out, 4, ddp_backend=None)
    trainer.add_callback(AttestCallback(heartbeat=0.2))
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
"""


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Path:
    """tests/support/attestgen.py's volume (trainer-whole: checkpoint-2 and -4; trainer-killed and
    trainer-killed-late; accelerate), and trainer-restarted and trainer-restarted-late: those two
    killed runs, their leases an hour old, resumed on one process."""
    for fw in ("trainer", "accelerate"):
        if (why := fwgen.missing(fw)) is not None:
            pytest.skip(why)
    out = tmp_path_factory.mktemp("attack-attest")
    env = {**os.environ, **fwgen._CHILD_ENV}
    proc = subprocess.run([sys.executable, "-m", "tests.support.attestgen", str(out)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    restarted = [out / "trainer-restarted", out / "trainer-restarted-late"]
    for killed, run in zip(("trainer-killed", "trainer-killed-late"), restarted, strict=True):
        shutil.copytree(out / killed, run, symlinks=True)
        _age_leases(run / "checkpoint-4", 3600)
    proc = subprocess.run([sys.executable, "-c", _RESTART, *map(str, restarted)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _volume(gen: Path, tmp_path: Path, *runs: str, quiet: str = "1d", root_extra: str = "",
            keep_last: int = 1) -> tuple[Path, Path]:
    """A private root holding copies of `runs` (mtimes kept to the nanosecond), and its config."""
    root = tmp_path / "root"
    root.mkdir()
    for run in runs or ("trainer-whole",):
        shutil.copytree(gen / run, root / run, symlinks=True)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '{quiet}'\n{root_extra}\n"
        f"[roots.retention]\nkeep_last = {keep_last}\nkeep_best = 0\n"
    )
    return root, cfg


def _ckptd(cfg: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args, "-c", str(cfg)], capture_output=True,
                          text=True, timeout=timeout)


def _plan(cfg: Path) -> dict[str, dict[str, Any]]:
    """`ckptd plan --json`: {"run/checkpoint": its entry}."""
    proc = _ckptd(cfg, "plan", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {f"{c['run']}/{Path(c['path']).name}": c for c in json.loads(proc.stdout)["checkpoints"]}


def _state(cfg: Path, key: str = "trainer-whole/checkpoint-4") -> dict[str, Any]:
    return _plan(cfg)[key]


def _records(ckpt: Path) -> list[Path]:
    return sorted((ckpt / ".ckptd").glob("commit-*.json"))


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


# --- the attack surface exists -------------------------------------------------------------------


def test_real_records_complete_a_save_without_the_quiet_period(gen, tmp_path):
    """The control: the Trainer's own records make a fresh checkpoint-4 complete under a 1-day
    quiet period. Every other case starts from this state and must not reach `complete` unless said."""
    _root, cfg = _volume(gen, tmp_path)
    entry = _state(cfg)
    assert entry["state"] == "complete", entry
    assert entry["committed"].startswith("committed by 2/2 ranks"), entry


# --- forged census -------------------------------------------------------------------------------


def _forge_census(ckpt: Path, how: str) -> None:
    d = ckpt / ".ckptd"
    r0, r1 = d / "commit-rank0-of-2.json", d / "commit-rank1-of-2.json"
    if how == "duplicate-rank-by-leading-zero":  # rank 0 twice, rank 1 never
        shutil.copy2(r0, d / "commit-rank00-of-2.json")
        r1.unlink()
    elif how == "rank-1-name-rank-0-body":  # a copy of rank 0's record under rank 1's name
        shutil.copy2(r0, r1)
    elif how == "rank-not-below-world-size":  # ranks 0 and 2 of 2
        r1.rename(d / "commit-rank2-of-2.json")
    elif how == "name-of-1-body-of-2":  # the name says one rank, the body two
        r1.unlink()
        r0.rename(d / "commit-rank0-of-1.json")
    elif how == "huge-world-size":  # the census would be 10**12 ranks long
        r1.unlink()
        big = d / "commit-rank0-of-999999999999.json"
        r0.rename(big)
        _edit(big, lambda doc: doc.update(world_size=999999999999))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["duplicate-rank-by-leading-zero", "rank-1-name-rank-0-body",
                                 "rank-not-below-world-size", "name-of-1-body-of-2", "huge-world-size"])
def test_forged_census_does_not_complete(gen, tmp_path, how):
    """Hand-made (no framework writes these): records that do not cover ranks 0..W-1 exactly once,
    by name and by body, are not a census, and the quiet period stays in force."""
    root, cfg = _volume(gen, tmp_path)
    _forge_census(root / "trainer-whole/checkpoint-4", how)
    t0 = time.monotonic()
    entry = _state(cfg)
    assert entry["state"] != "complete", entry
    assert time.monotonic() - t0 < 30  # a 10**12-rank census is not walked


def test_smaller_world_size_forged_against_a_configured_world_size(gen, tmp_path):
    """Hand-made: rank 1 never wrote rng_state_1.pth; a forged `commit-rank0-of-1.json` (W smaller
    than the job's) claims the save. With `world_size = 2` set, the rng census says otherwise.
    (Without it, a first Trainer checkpoint cannot tell one rank from two: docs/frameworks/hf-trainer.md.)"""
    root, cfg = _volume(gen, tmp_path, root_extra="world_size = 2")
    run = root / "trainer-whole"
    shutil.rmtree(run / "checkpoint-2")
    ckpt = run / "checkpoint-4"
    (ckpt / "rng_state_1.pth").unlink()
    d = ckpt / ".ckptd"
    doc = json.loads((d / "commit-rank0-of-2.json").read_text())
    doc["world_size"] = 1
    doc["files"] = [f for f in doc["files"] if f["path"] != "rng_state_1.pth"]
    for p in _records(ckpt):
        p.unlink()
    (d / "commit-rank0-of-1.json").write_text(json.dumps(doc))
    entry = _state(cfg)
    assert entry["state"] != "complete", entry


# --- forged file lists ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["subset", "subset-started-in-the-future", "empty-started-in-the-future",
                                 "no-started-at", "started-at-a-string"])
def test_record_listing_a_subset_leaves_the_quiet_period_in_force(gen, tmp_path, how):
    """Hand-made: records that list only config.json (or nothing), with the save's start forged
    forward or away. The other files are as new as the save: no record vouches for them."""
    root, cfg = _volume(gen, tmp_path)

    def forge(doc):
        doc["files"] = [] if how.startswith("empty") else [f for f in doc["files"] if f["path"] == "config.json"]
        if "future" in how:
            doc["started_at"] = doc["committed_at"] = time.time() + 10**6
        elif how == "no-started-at":
            doc.pop("started_at")
        elif how == "started-at-a-string":
            doc["started_at"] = "yesterday"

    for p in _records(root / "trainer-whole/checkpoint-4"):
        _edit(p, forge)
    entry = _state(cfg)
    assert entry["state"] != "complete", entry


def _garble(path: Path, how: str) -> None:
    doc = json.loads(path.read_text())
    if how == "not-utf8":
        path.write_bytes(b"\xff\xfe\x00{\x80garbage")
    elif how == "deep-nesting":  # json.loads raises RecursionError, not ValueError
        path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    elif how == "a-json-array":
        path.write_text("[1, 2, 3]")
    elif how == "size-beyond-int-digits-limit":  # int() refuses it past 4300 digits
        doc["files"][0]["size"] = 12345
        path.write_text(json.dumps(doc).replace('"size": 12345', '"size": 1' + "0" * 5000, 1))
    elif how == "size-a-string":
        doc["files"][2]["size"] = str(doc["files"][2]["size"])
        path.write_text(json.dumps(doc))
    elif how == "files-a-dict":
        doc["files"] = {"model.safetensors": 17776}
        path.write_text(json.dumps(doc))
    elif how == "mtime-nan":
        doc["files"][2]["mtime_ns"] = float("nan")
        path.write_text(json.dumps(doc))
    elif how == "path-outside-checkpoint":
        doc["files"].append({"path": "../checkpoint-2/model.safetensors", "size": 1, "mtime_ns": 1})
        path.write_text(json.dumps(doc))
    elif how == "absolute-path":
        doc["files"].append({"path": "/etc/hostname", "size": 1, "mtime_ns": 1})
        path.write_text(json.dumps(doc))
    elif how == "20MB":
        doc["pad"] = "x" * 20_000_000
        path.write_text(json.dumps(doc))
    elif how == "a-fifo":  # opening it for reading would block forever
        path.unlink()
        os.mkfifo(path)
    elif how == "a-directory":
        path.unlink()
        path.mkdir()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["not-utf8", "deep-nesting", "a-json-array", "size-beyond-int-digits-limit",
                                 "size-a-string", "files-a-dict", "mtime-nan", "path-outside-checkpoint",
                                 "absolute-path", "20MB", "a-fifo", "a-directory"])
def test_garbled_record_is_not_evidence(gen, tmp_path, how):
    """Hand-made: rank 1's record garbled. ckptd neither hangs nor crashes nor counts it: the
    checkpoint is not complete (the quiet period applies), and the plan still runs."""
    root, cfg = _volume(gen, tmp_path)
    _garble(root / "trainer-whole/checkpoint-4/.ckptd/commit-rank1-of-2.json", how)
    entry = _state(cfg)  # a timeout (fifo) or a traceback fails here
    assert entry["state"] != "complete", entry
    assert entry["action"] == "keep", entry


# --- records that are not this checkpoint's ------------------------------------------------------


@pytest.mark.parametrize("target", ["other-checkpoint", "outside-root"])
def test_symlinked_ckptd_dir_is_not_evidence(gen, tmp_path, target):
    """Hand-made: checkpoint-4's `.ckptd/` replaced by a symlink to checkpoint-2's records (real,
    valid for checkpoint-2) or to a copy of its own records outside the root."""
    root, cfg = _volume(gen, tmp_path)
    ckpt = root / "trainer-whole/checkpoint-4"
    if target == "other-checkpoint":
        shutil.rmtree(ckpt / ".ckptd")
        os.symlink("../checkpoint-2/.ckptd", ckpt / ".ckptd")
    else:
        outside = tmp_path / "outside"
        shutil.copytree(ckpt / ".ckptd", outside)
        shutil.rmtree(ckpt / ".ckptd")
        os.symlink(outside, ckpt / ".ckptd")
    entry = _state(cfg)
    assert entry["state"] != "complete", entry


def test_records_copied_from_another_checkpoint_do_not_vouch(gen, tmp_path):
    """Hand-made: checkpoint-2's (real) records copied into checkpoint-4: the same names, sizes
    of the same model, but another save's mtimes."""
    root, cfg = _volume(gen, tmp_path)
    run = root / "trainer-whole"
    shutil.rmtree(run / "checkpoint-4/.ckptd")
    shutil.copytree(run / "checkpoint-2/.ckptd", run / "checkpoint-4/.ckptd")
    entry = _state(cfg)
    assert entry["state"] != "complete", entry


def test_symlinked_ckptd_dir_outside_root_survives_deletion(gen, tmp_path):
    """Hand-made: checkpoint-2 (complete on quiet) has its `.ckptd/` as a symlink to a directory
    outside the root. `ckptd prune` deletes checkpoint-2 (keep_last = 1) and nothing outside."""
    root, cfg = _volume(gen, tmp_path, quiet="60s")
    ckpt = root / "trainer-whole/checkpoint-2"
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / ".ckptd", outside)
    shutil.rmtree(ckpt / ".ckptd")
    os.symlink(outside, ckpt / ".ckptd")
    age(ckpt, time.time() - 3600)
    assert _state(cfg, "trainer-whole/checkpoint-2")["action"] == "delete"
    proc = _ckptd(cfg, "prune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not ckpt.exists()
    assert sorted(p.name for p in outside.iterdir()) == ["commit-rank0-of-2.json", "commit-rank1-of-2.json"]


# --- killed saves and leases ---------------------------------------------------------------------


def _age_leases(ckpt: Path, seconds: float) -> None:
    for p in (ckpt / ".ckptd").glob("lease-*.json"):
        os.utime(p, (time.time() - seconds,) * 2)


@pytest.mark.parametrize("lease", ["fresh", "heartbeat-stopped-1h", "deleted"])
def test_sigkilled_trainer_save_is_never_complete_nor_deleted(gen, tmp_path, lease):
    """Real: trainer-killed's checkpoint-4, the 2-process job SIGKILLed inside the save (each rank
    before its rng_state_<rank>.pth): both leases stay, no records. Whatever happens to the leases (a live
    heartbeat, one stopped an hour ago, deleted by a clean-up), it is neither complete nor deleted,
    and `ckptd prune` with keep_last = 1 deletes nothing of the run."""
    root, cfg = _volume(gen, tmp_path, "trainer-killed", quiet="60s")
    ckpt = root / "trainer-killed/checkpoint-4"
    if lease == "heartbeat-stopped-1h":
        _age_leases(ckpt, 3600)
    elif lease == "deleted":
        for p in (ckpt / ".ckptd").glob("lease-*.json"):
            p.unlink()
    entry = _state(cfg, "trainer-killed/checkpoint-4")
    assert entry["state"] != "complete" and entry["action"] == "keep", entry
    if lease == "heartbeat-stopped-1h":
        verify = _ckptd(cfg, "verify", str(ckpt))
        assert verify.returncode == 1 and "abandoned: rank 0's save stopped" in verify.stdout, verify.stdout
    proc = _ckptd(cfg, "prune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ckpt.exists() and (root / "trainer-killed/checkpoint-2").exists()


def test_live_lease_of_a_new_save_over_old_records_is_writing(gen, tmp_path):
    """Real records (trainer-whole's checkpoint-4) and a new save of the same directory begun with
    `ckptd.attest.begin` by a job of another world size (rank 3 of 4): in flight, whatever the old
    records say."""
    import ckptd.attest

    root, cfg = _volume(gen, tmp_path)
    save = ckptd.attest.begin(root / "trainer-whole/checkpoint-4", 3, 4, step=4, heartbeat=0.2)
    try:
        entry = _state(cfg)
    finally:
        save.stop(drop_lease=True)
    assert entry["state"] == "writing", entry


# --- copies --------------------------------------------------------------------------------------


def _copy_in(src: Path, dest: Path, *, die_at: str | None, partial: str | None = None) -> None:
    """Copy `src` file by file with `cp -p` in rsync's (sorted) order, `.ckptd/` first; stop
    before `die_at` (a copier killed there). `partial`: how the file it died in looks:
    "fresh" (half the bytes, mtime now: what `cp -p` leaves), "source-mtime" (half, the source's
    mtime: hand-made, no copier sets the mtime before the data)."""
    dest.mkdir(parents=True)
    for path in sorted(src.rglob("*"), key=lambda p: str(p.relative_to(src))):
        rel = path.relative_to(src)
        out = dest / rel
        if path.is_dir():
            out.mkdir(exist_ok=True)
            continue
        if str(rel) == die_at:
            if partial is not None:
                out.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
                if partial == "source-mtime":
                    st = path.stat()
                    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            return
        subprocess.run(["cp", "-p", str(path), str(out)], check=True)


@pytest.mark.parametrize("die_at,partial", [("model.safetensors", None), ("model.safetensors", "fresh"),
                                            ("model.safetensors", "source-mtime"), ("optimizer.pt", "source-mtime"),
                                            ("trainer_state.json", "source-mtime"), (None, None)])
def test_copy_in_with_records_that_dies_midway(gen, tmp_path, die_at, partial):
    """Real records and files (trainer-whole's checkpoint-4) copied into a new run with `cp -p`,
    `.ckptd/` first, the copier killed before (or inside) one file. Only the whole copy is complete."""
    root, cfg = _volume(gen, tmp_path)
    dest = root / "copied/checkpoint-4"
    _copy_in(gen / "trainer-whole/checkpoint-4", dest, die_at=die_at, partial=partial)
    entry = _state(cfg, "copied/checkpoint-4")
    if die_at is None:
        assert entry["state"] == "complete", entry
    else:
        assert entry["state"] != "complete", entry


@pytest.mark.parametrize("how", ["same-bytes-new-mtime", "truncated-mtime-kept", "appended"])
def test_listed_file_changed_after_the_commit(gen, tmp_path, how):
    """Hand-made: after the records were written, optimizer.pt rewritten with the same bytes (a
    re-save), truncated with its mtime put back (hand-made), or appended to."""
    root, cfg = _volume(gen, tmp_path)
    f = root / "trainer-whole/checkpoint-4/optimizer.pt"
    st = f.stat()
    data = f.read_bytes()
    if how == "same-bytes-new-mtime":
        f.write_bytes(data)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10 * 10**9))
    elif how == "truncated-mtime-kept":
        f.write_bytes(data[: len(data) - 100])
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        with f.open("ab") as fh:
            fh.write(b"\0" * 10)
    entry = _state(cfg)
    assert entry["state"] != "complete", entry


# --- what `latest` names, what retention deletes -------------------------------------------------


def test_latest_names_a_checkpoint_that_retention_keeps(gen, tmp_path):
    """Real: trainer-whole's checkpoint-2 with its records; checkpoint-4 is the same job's save
    with its `.ckptd/` removed, which is what a save without the hook writes (a job resumed from
    checkpoint-2 by a script without the callback), written after checkpoint-2 (the run's newest
    by step and by time: no other anchor keeps checkpoint-2) and quiet since. `ckptd latest` names
    checkpoint-2 (passing over checkpoint-4: no records); then `ckptd prune` (keep_last = 1) must
    not delete what a restart was just told to resume from."""
    root, cfg = _volume(gen, tmp_path, quiet="1s", root_extra="allow_short_quiet_period = true")
    run = root / "trainer-whole"
    shutil.rmtree(run / "checkpoint-4/.ckptd")
    saved_2 = max(p.stat().st_mtime for p in (run / "checkpoint-2").rglob("*") if p.is_file())
    time.sleep(max(0.0, saved_2 + 2.5 - time.time()))  # a bounded wait on the clock: quiet_period past
    age(run / "checkpoint-4", saved_2 + 0.5)
    proc = _ckptd(cfg, "latest", str(run))
    assert proc.returncode == 0, proc.stderr
    named = Path(proc.stdout.strip())
    assert named == run / "checkpoint-2", proc.stdout  # the premise: latest passes over checkpoint-4
    proc = _ckptd(cfg, "prune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert named.exists(), "the checkpoint `ckptd latest` named was deleted"


# --- accelerate ----------------------------------------------------------------------------------


def test_accelerate_records_hold_against_a_missing_random_state(gen, tmp_path):
    """Real: accelerate's `save_state` with `ckptd.integrations.accelerate.install`; then
    random_states_0.pkl (written last) removed, as a copier that died before it would leave it."""
    root, cfg = _volume(gen, tmp_path, "accelerate")
    entry = _state(cfg, "accelerate/step_2")
    assert entry["state"] == "complete", entry  # the control
    (root / "accelerate/step_2/random_states_0.pkl").unlink()
    entry = _state(cfg, "accelerate/step_2")
    assert entry["state"] != "complete", entry


def test_run_copied_without_mtimes_can_still_be_resumed(gen, tmp_path):
    """Real: trainer-whole moved to a new volume with `cp -r` (no -p: every mtime is the copy's),
    an hour ago. Every file is whole and the size its record says. Without the records `ckptd
    latest` names checkpoint-4; with them it must still name something."""
    root, cfg = _volume(gen, tmp_path, "accelerate", quiet="60s")
    subprocess.run(["cp", "-r", str(gen / "trainer-whole"), str(root / "moved")], check=True)
    age(root / "moved", time.time() - 3600)
    proc = _ckptd(cfg, "latest", str(root / "moved"))
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == root / "moved/checkpoint-4"


def test_restart_with_another_world_size_supersedes_the_abandoned_save(gen, tmp_path):
    """Real: trainer-killed's job SIGKILLed inside checkpoint-4's save (leases of ranks 0 and 1 of 2
    left, their heartbeat stopped an hour ago), restarted on one process: the Trainer with the
    callback resumes from checkpoint-2 and saves checkpoint-4 again in place, committed by 1/1.
    That save is whole; ckptd must count it, and `ckptd latest` name it."""
    root, cfg = _volume(gen, tmp_path, "trainer-restarted")
    ckpt = root / "trainer-restarted/checkpoint-4"
    assert sorted(p.name for p in (ckpt / ".ckptd").iterdir()) == [
        "commit-rank0-of-1.json", "lease-rank0-of-2.json", "lease-rank1-of-2.json"]  # the premise
    assert not {"rng_state_0.pth", "rng_state_1.pth"} & {p.name for p in ckpt.iterdir()}  # nothing left of theirs
    entry = _state(cfg, "trainer-restarted/checkpoint-4")
    assert entry["state"] == "complete", entry
    proc = _ckptd(cfg, "latest", str(root / "trainer-restarted"))
    assert Path(proc.stdout.strip()) == ckpt, proc.stderr


def test_restart_over_a_killed_save_with_rank_0s_rng_state_says_the_rank_census_holds_it(gen, tmp_path):
    """Real: trainer-killed-late's job SIGKILLed after rank 0 wrote checkpoint-4's rng_state_0.pth
    (rank 1 before its own), restarted on one process, which saves checkpoint-4 again in place:
    rng_state.pth and a record of 1/1, and beside them the abandoned save's rng_state_0.pth, older
    than the new save and listed by no record. The records stand in for the quiet period, but the
    run's rank census counts one rank's rng file against checkpoint-2's two and, not told that the
    job shrank, holds it incomplete (the safe side: the Trainer on one process reads rng_state.pth
    and never that file; `world_size = 1` for the run releases it). What a user reads, in plan and in
    `latest`, must be that census, not the quiet period the records stood in for; `verify` agrees."""
    root, cfg = _volume(gen, tmp_path, "trainer-restarted-late")
    ckpt = root / "trainer-restarted-late/checkpoint-4"
    assert {"rng_state.pth", "rng_state_0.pth"} <= {p.name for p in ckpt.iterdir()}  # the premise
    assert "rng_state_1.pth" not in {p.name for p in ckpt.iterdir()}
    assert [p.name for p in _records(ckpt)] == ["commit-rank0-of-1.json"]
    census = "rank census failed: 1 ranks' files, the run's last complete checkpoint checkpoint-2 has 2"
    entry = _state(cfg, "trainer-restarted-late/checkpoint-4")
    assert entry["state"] == "incomplete" and entry["action"] == "keep", entry
    assert entry["reasons"][0].startswith(f"incomplete, never deleted: {census}"), entry["reasons"]
    assert entry["committed"].startswith("committed by 1/1 ranks at "), entry
    proc = _ckptd(cfg, "latest", str(root / "trainer-restarted-late"))
    assert Path(proc.stdout.strip()) == root / "trainer-restarted-late/checkpoint-2", proc.stderr
    assert f"passed over checkpoint-4: incomplete: {census}" in proc.stderr, proc.stderr
    verify = _ckptd(cfg, "verify", str(ckpt))  # the run's census too, as plan asks it
    assert verify.returncode == 1 and f"{ckpt}: incomplete " in verify.stdout, verify.stdout
    (tmp_path / "shrank").mkdir()
    _root, cfg1 = _volume(gen, tmp_path / "shrank", "trainer-restarted-late", root_extra="world_size = 1")
    assert _state(cfg1, "trainer-restarted-late/checkpoint-4")["state"] == "complete"


def test_live_lease_on_a_complete_checkpoint_blocks_its_deletion(gen, tmp_path):
    """Real records (trainer-whole): checkpoint-2 is complete and outside keep_last = 1; a job then
    begins saving into it again (`ckptd.attest.begin`, as a resumed job's callback does). In flight:
    `ckptd prune` leaves it."""
    import ckptd.attest

    root, cfg = _volume(gen, tmp_path)
    ckpt = root / "trainer-whole/checkpoint-2"
    assert _state(cfg, "trainer-whole/checkpoint-2")["action"] == "delete"  # the control
    save = ckptd.attest.begin(ckpt, 0, 2, step=2, heartbeat=0.2)
    try:
        proc = _ckptd(cfg, "prune")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ckpt.exists()
    finally:
        save.stop(drop_lease=True)


def test_daemon_acts_on_records_but_never_on_a_killed_save(gen, tmp_path):
    """Real: `ckptd run --foreground` over trainer-whole (records) and trainer-killed (a SIGKILLed
    save's leases, heartbeat stopped an hour ago), quiet_period 1 day, keep_last = 1. The records
    let it delete trainer-whole's checkpoint-2 at once; in the same passes it keeps trainer-killed's
    checkpoint-4 (abandoned, incomplete) and checkpoint-2 (its newest complete)."""
    from tests.support.daemonproc import DaemonProc

    root, cfg = _volume(gen, tmp_path, "trainer-whole", "trainer-killed")
    _age_leases(root / "trainer-killed/checkpoint-4", 3600)
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("deleted trainer-whole/checkpoint-2", timeout=60)
    assert not (root / "trainer-whole/checkpoint-2").exists()
    assert (root / "trainer-whole/checkpoint-4").exists()
    assert (root / "trainer-killed/checkpoint-4").exists() and (root / "trainer-killed/checkpoint-2").exists()
