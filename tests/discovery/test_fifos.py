"""Files that are not regular where ckptd reads (a FIFO, a socket, a directory, a symlink): every read goes
through volread, refused at once without blocking, and what it could have protected is kept."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.discover import layouts
from ckptd.frameworks import dsmeta, hf, megatron, orbax, torchtitan
from ckptd.frameworks.base import read_pointer
from ckptd.judge import evidence, slim, wholefile
from ckptd.judge.evidence import Entry
from ckptd.volume import volread
from tests.support.common import run_ckptd
from tests.support.rtkit import bare_deepspeed_run, config_file

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- near-miss: a FIFO where ckptd reads a file hangs it for good --------------------------------


@pytest.mark.parametrize("where", ["run/latest_checkpointed_iteration.txt",
                                   "run2/checkpoint-5/global_step5/mp_rank_00_model_states.pt"])
def test_a_fifo_where_ckptd_reads_does_not_hang_it(tmp_path, where):
    """The Megatron tracker is read with read_text() and a model-states file with
    zipfile.is_zipfile(), neither with O_NONBLOCK nor a regular-file check: a FIFO there
    blocks the open forever (plan, prune, and the daemon's one filesystem thread, which the
    systemd watchdog then restarts into the same hang)."""
    root = tmp_path / "vol"
    (root / "run" / "iter_0000100").mkdir(parents=True)
    (root / "run" / "iter_0000100" / "model_optim_rng.pt").write_bytes(b"x")
    hf_deepspeed_checkpoint(root / "run2", 5, world=1, skip=["mp_rank_00_model_states.pt"])
    os.mkfifo(root / where)
    age(root, OLD)
    try:
        proc = run_ckptd("plan", root, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptd plan hung on a FIFO at {where}")
    assert proc.returncode == 0, proc.stderr


# --- files ckptd reads that are not regular files ----------------------------------------------


def never_blocks(fn, fifo: Path):
    """fn() in a thread; a reader stuck opening the FIFO is let go (a writer opens it) and fails."""
    out: dict[str, object] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # any outcome but blocking is fine here
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked open returns; the read sees EOF
        os.close(fd)
        t.join(5)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return out


def as_file(size: int = 4096) -> Entry:
    """What the walk saw a moment earlier: a regular file (swapped for a FIFO since)."""
    return Entry("x", "f", size, 0)


READERS = {
    "slim marker": (slim.MARKER, lambda d, f: evidence.read_slim_marker(d, {slim.MARKER: as_file()})),
    "trainer_state.json": (hf.TRAINER_STATE,
                           lambda d, f: hf._trainer_state(d, {hf.TRAINER_STATE: as_file()})),
    "torchtitan index": (torchtitan.HF_INDEX,
                         lambda d, f: torchtitan._torchtitan(d, {torchtitan.HF_INDEX: as_file()})),
    "megatron-core metadata.json": ("metadata.json",
                                    lambda d, f: megatron._megatron_core(d, {"metadata.json": as_file()}, "")),
    "orbax metadata": (orbax.METADATA, lambda d, f: orbax._orbax(
        layouts.Candidate("1", 1, "orbax", True), d, {orbax.METADATA: as_file()})),
    "orbax metrics": (orbax.METRICS_FILE, lambda d, f: orbax.from_orbax(d)),
    "torch zip": ("model.pt", lambda d, f: wholefile.file_problem(f, as_file())),
    "safetensors": ("model.safetensors", lambda d, f: wholefile.file_problem(f, as_file())),
    "nemo tar": ("model.nemo", lambda d, f: wholefile.file_problem(f, as_file())),
    "model states": ("mp_rank_00_model_states.pt", lambda d, f: dsmeta.read_world_sizes(f)),
    "model states (zip)": ("mp_rank_00_model_states.pt", lambda d, f: dsmeta.read_plain_data(f)),
    "deepspeed latest": ("latest", lambda d, f: read_pointer(f)),
    "megatron tracker": (megatron.TRACKER, lambda d, f: read_pointer(f)),
}


@pytest.mark.parametrize("what", sorted(READERS))
def test_a_fifo_swapped_in_where_ckptd_reads_is_refused_without_blocking(tmp_path, what):
    """Every reader of the volume's files goes through volread: a FIFO is unreadable at once."""
    rel, read = READERS[what]
    fifo = tmp_path / rel
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    out = never_blocks(lambda: read(tmp_path, fifo), fifo)
    error = out.get("error")
    if error is not None:  # refused: as unreadable, never as "read, and empty"
        assert isinstance(error, (OSError, dsmeta.MetadataUnavailable)), repr(error)
        assert "FIFO" in str(error) or isinstance(error, dsmeta.MetadataUnavailable), repr(error)
    else:  # a verdict of its own: a problem, a check not passed, or why it cannot be read
        value = out["value"]
        if isinstance(value, tuple):
            value = value[0] if isinstance(value[0], evidence.Check) else value[1]
        if isinstance(value, evidence.Check):
            assert value.verdict is not evidence.PASSED, value
        else:
            assert isinstance(value, str) and value, value


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "symlink"])
def test_volread_opens_regular_files_only(tmp_path, kind):
    path = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "target").write_text("x")
        path.symlink_to(tmp_path / "target")
    out = never_blocks(lambda: volread.read_bytes(path, 10), path)
    assert isinstance(out.get("error"), OSError), out
    if kind == "symlink":
        assert volread.read_bytes(path, 10, follow_symlinks=True) == b"x"


@pytest.mark.parametrize("where", ["run/latest", "run2/checkpoint-5/trainer_state.json",
                                   "run2/checkpoint-5/global_step5/mp_rank_00_model_states.pt"])
def test_a_fifo_in_a_run_neither_hangs_prune_nor_deletes_what_it_could_protect(tmp_path, where):
    root = tmp_path / "vol"
    bare_deepspeed_run(root / "run", (10, 20))
    for step in (5, 6):
        hf_deepspeed_checkpoint(root / "run2", step, world=2, mtime=OLD + step)
    os.unlink(root / where) if (root / where).exists() else None
    os.mkfifo(root / where)
    age(root, OLD)
    before = {d: sorted(os.listdir(root / d)) for d in ("run", "run2")}
    cfg = config_file(tmp_path, root)
    try:
        proc = run_ckptd("prune", "-c", cfg, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptd prune hung on a FIFO at {where}")
    assert proc.returncode == 0, proc.stderr
    if where == "run/latest":  # may name either: both kept
        assert sorted(os.listdir(root / "run")) == before["run"]
    else:  # a FIFO is not the file it is named as: checkpoint-5 is not complete, and kept
        assert sorted(os.listdir(root / "run2")) == before["run2"]
        plan = run_ckptd("plan", "-c", cfg, timeout=30)
        assert "checkpoint-5" in plan.stdout and "incomplete" in plan.stdout.split("checkpoint-5")[1][:200], (
            plan.stdout)


def test_a_fifo_as_the_volume_lease_record_is_read_as_a_garbled_record(tmp_path):
    """<root>/.ckptd/leader.json is on the volume too: a FIFO there is a record that does not
    parse (as a torn one), read without blocking."""
    from ckptd.fleet.leaserecord import RECORD, RecordIO

    (tmp_path / layouts.LEASE_DIR).mkdir()
    os.mkfifo(tmp_path / layouts.LEASE_DIR / RECORD)
    out = never_blocks(lambda: RecordIO(tmp_path).read(), tmp_path / layouts.LEASE_DIR / RECORD)
    seen = out["value"]
    assert seen.raw == b"" and seen.record is None, seen


def test_a_fifo_named_like_a_shard_is_missing_from_the_deepspeed_census(tmp_path):
    """The census counts files (or links to them) only: a FIFO named as rank 1's optimizer shard
    is not that shard. Other checks may also refuse the checkpoint; this one names the shard."""
    from ckptd.config import Root
    from ckptd.decide.planner import Scanner
    from ckptd.model import Verdict

    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 5, world=2, mtime=OLD)
    shard = root / "run" / "checkpoint-5" / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.unlink()
    os.mkfifo(shard)
    age(root, OLD)
    (ckpt,) = [c for run in Scanner(Root(path=root, world_size=2)).runs(now=time.time()) for c in run.checkpoints]
    census = {c.name: c for c in ckpt.checks}["deepspeed shards (global_step5)"]
    assert census.verdict is Verdict.FAILED, census
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt missing" in census.detail, census.detail
