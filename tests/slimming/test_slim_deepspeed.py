"""Slimming real DeepSpeed checkpoints, written on the CPU by real multi-process DeepSpeed runs.

Volumes are generated once per session (conftest.py and below) and copied per
test. The test process never imports torch: tensor comparisons run in a
subprocess. The consolidation is paused and killed through the consolidator's
test hook (a FIFO it announces its pid on), never timed with sleeps.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from ckptd.discover.layouts import LEASE_DIR
from ckptd.journal import read_journal
from ckptd.judge import slim
from ckptd.removal.consolidation import WORK_DIR
from ckptd.removal.zero_to_fp32 import PAUSE_FIFO_ENV
from tests.support import dsgen
from tests.support.common import run_ckptd, wake_paused_consolidator
from tests.support.daemonproc import DaemonProc

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None,
        reason="needs ckptd[deepspeed] (torch==2.13.0, deepspeed, safetensors)",
    ),
]


@pytest.fixture(scope="session")
def zero2_bf16_hf_trainer(tmp_path_factory) -> Path:
    """2 ranks, ZeRO-2, bf16, Trainer layout with the Trainer's own bf16 model.safetensors (dsgen's
    trainer_weights: the engine module's state dict through safetensors' save_file, as
    save_pretrained does; the fp32 master weights are only in the optimizer shards)."""
    out = tmp_path_factory.mktemp("zero2-bf16-hf-trainer") / "run"
    dsgen.generate(out, world_size=2, stage=2, bf16=True, layout="hf", steps=(10, 20), trainer_weights=True)
    return out


@pytest.fixture(scope="session")
def zero2_bf16_bare_3ranks(tmp_path_factory) -> Path:
    """With conftest's zero2_hf (fp32) and zero3_bf16_bare: ZeRO-2 fp32 and bf16, ZeRO-3, 2 and 3 ranks."""
    out = tmp_path_factory.mktemp("zero2-bf16-bare-3") / "run"
    dsgen.generate(out, world_size=3, stage=2, bf16=True, layout="bare", steps=(10, 20))
    return out


def copy_run(src: Path, tmp_path: Path) -> Path:
    root = tmp_path / "vol"
    shutil.copytree(src, root / "run")
    age(root, time.time() - 3600)
    return root


def config(tmp_path: Path, root: Path, *, timeout: str = "2h", **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\nconsolidate_timeout = '{timeout}'",
             f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true",
             "[roots.retention]", *(f"{k} = {json.dumps(v)}" for k, v in retention.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def optimizer_shards(tag_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in tag_dir.glob("*optim_states.pt")}


def manifest(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root` with its size and sha256: what 'nothing lost' means (ckptd's own work
    area and trash aside)."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (WORK_DIR, ".ckptd-trash", LEASE_DIR)]  # ckptd's own
        for n in names:
            p = Path(dirpath, n)
            out[str(p.relative_to(root))] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


REFERENCE = """
import json, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers.trainer_utils import load_sharded_checkpoint
save_dir, tag, consolidated = sys.argv[1:4]
ref = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
# loaded as the HF ecosystem loads sharded weights (the index, then shard by shard), into the very
# model dsgen trained
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
load_sharded_checkpoint(model, consolidated, strict=True)
got = model.state_dict()
bits = lambda t: t.contiguous().view(-1).view(torch.uint8)
print(json.dumps({"ref": sorted(ref), "got": sorted(got), "dtypes": sorted({str(t.dtype) for t in got.values()}),
                  "unequal": [k for k in ref if k in got and not torch.equal(bits(ref[k]), bits(got[k]))]}))
"""


def compare_with_zero_to_fp32(save_dir: Path, tag: str, consolidated: Path) -> dict:
    """What zero_to_fp32 reconstructs from the original shards, against the slimmed checkpoint's fp32/
    loaded by transformers, bit for bit."""
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(save_dir), tag, str(consolidated)],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# (volume, checkpoint name pattern, retention, what the plan does to steps 10..)
CASES = {
    "zero2-fp32-hf": ("zero2_hf", "checkpoint-{}", dict(keep_last=1, keep_best=1, metric="eval_loss"),
                      {10: "slim", 20: "delete", 30: "delete", 40: "keep"}),
    "zero2-bf16-bare-3-ranks": ("zero2_bf16_bare_3ranks", "global_step{}", dict(keep_last=2, keep_best=0),
                                {10: "slim", 20: "keep"}),
    "zero3-bf16-bare": ("zero3_bf16_bare", "global_step{}", dict(keep_last=2, keep_best=0),
                        {10: "slim", 20: "keep"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prune_with_keep_full_last_leaves_verified_weights_only(case, request, tmp_path):
    volume, pattern, retention, expected = CASES[case]
    source = request.getfixturevalue(volume)
    root = copy_run(source, tmp_path)
    cfg = config(tmp_path, root, keep_full_last=1, **retention)
    ck = root / "run" / pattern.format(10)
    tag_dir = ck / "global_step10" if pattern.startswith("checkpoint") else ck
    shards = optimizer_shards(tag_dir)
    assert len(shards) == (3 if "3-ranks" in case else 2)
    freed = sum(shards.values())

    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    rows = {int(c["step"]): (c["action"], c["bytes_freed"]) for c in plan["checkpoints"]}
    assert {s: a for s, (a, _) in rows.items()} == expected
    assert rows[10] == ("slim", freed)

    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 1 slimmed (" in proc.stdout.splitlines()[-1] and " 0 failed" in proc.stdout.splitlines()[-1]
    assert "-> slimmed: consolidated global_step10 into fp32/ (" in proc.stdout

    # the optimizer shards are gone, everything else is there, and the trash is purged
    assert optimizer_shards(tag_dir) == {}
    src_ck = source / pattern.format(10)
    assert sorted(os.listdir(ck)) == sorted([*(set(os.listdir(src_ck)) - set(shards)), "fp32", slim.MARKER])
    assert sorted(os.listdir(ck / "fp32")) == [slim.shard_name(1, 1), slim.INDEX]
    assert os.listdir(root / ".ckptd-trash") == []
    newest = root / "run" / pattern.format(max(expected))
    assert len(optimizer_shards(newest / f"global_step{max(expected)}" if "hf" in case else newest)) == len(shards)

    # the marker says what was done, and the bytes add up
    marker = json.loads((ck / slim.MARKER).read_text())
    prefix = "global_step10/" if "hf" in case else ""
    assert marker["state"] == "done" and marker["bytes_freed"] == freed
    assert sorted(marker["removed"], key=lambda r: r["path"]) == [
        {"path": prefix + n, "bytes": b} for n, b in sorted(shards.items())]
    index = (ck / "fp32" / slim.INDEX).read_bytes()
    shard = (ck / "fp32" / slim.shard_name(1, 1)).read_bytes()
    assert marker["weights"]["sha256"] == hashlib.sha256(index).hexdigest()
    assert marker["weights"]["bytes"] == len(index) and marker["weights"]["consolidated"] is True
    assert marker["weights"]["files"] == [{"path": f"fp32/{slim.shard_name(1, 1)}", "bytes": len(shard),
                                           "sha256": hashlib.sha256(shard).hexdigest()}]
    slimmed = [r for r in read_journal(tmp_path / "state") if r["event"] == "slimmed"]
    assert [r["freed"] for r in slimmed] == [freed]

    # the weights equal what zero_to_fp32 reconstructs from the original shards, tensor by tensor
    save_dir, tag = (src_ck, "global_step10") if "hf" in case else (source, "global_step10")
    result = compare_with_zero_to_fp32(save_dir, tag, ck / "fp32")
    assert result["ref"] == result["got"] and len(result["ref"]) == 4
    assert result["unequal"] == [] and result["dtypes"] == ["torch.float32"]


def test_a_trainer_checkpoint_with_its_own_weights_is_slimmed_without_consolidating(zero2_hf, tmp_path):
    root = copy_run(zero2_hf, tmp_path)
    ck = root / "run" / "checkpoint-10"
    weights = _tiny_safetensors()
    (ck / "model.safetensors").write_bytes(weights)
    age(root, time.time() - 3600)
    cfg = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_loss", keep_full_last=1)
    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "consolidated" not in proc.stdout and "1 slimmed" in proc.stdout
    assert optimizer_shards(ck / "global_step10") == {}
    assert (ck / "model.safetensors").read_bytes() == weights
    marker = json.loads((ck / slim.MARKER).read_text())
    assert marker["weights"] == {"path": "model.safetensors", "bytes": len(weights), "consolidated": False,
                                 "dtype": "fp32"}


def _tiny_safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + b"\0" * 8


def test_a_checkpoint_missing_a_shard_is_never_slimmed(zero2_hf, tmp_path):
    root = copy_run(zero2_hf, tmp_path)
    ck = root / "run" / "checkpoint-10"  # the best: kept, and would be slimmed
    (ck / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    age(root, time.time() - 3600)
    cfg = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_loss", keep_full_last=1)
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    row = next(c for c in plan["checkpoints"] if c["step"] == 10)
    assert (row["state"], row["action"], row["bytes_freed"]) == ("incomplete", "keep", 0)
    before = manifest(ck)
    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert proc.returncode == 0 and " 0 slimmed" in proc.stdout.splitlines()[-1], proc.stdout
    assert manifest(ck) == before


def test_a_malicious_optimizer_shard_is_never_executed_by_the_consolidation(zero2_bf16_bare_3ranks, tmp_path):
    """zero_to_fp32 itself would load it with weights_only=False."""
    root = copy_run(zero2_bf16_bare_3ranks, tmp_path)
    canary = tmp_path / "pwned"
    shard = root / "run" / "global_step10" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    code = (
        "import os, sys, torch\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        "        return (os.system, ('touch ' + sys.argv[2],))\n"
        "torch.save({'optimizer_state_dict': Evil(), 'ds_version': '0.19.8'}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(shard), str(canary)], check=True, timeout=120)
    age(root, time.time() - 3600)
    before = manifest(root / "run")
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert not canary.exists()
    assert proc.returncode == 74, proc.stdout + proc.stderr
    assert "-> failed: consolidation failed, nothing removed: UnpicklingError: Weights only load failed" in proc.stdout
    assert manifest(root / "run") == before


def _wait_for_pause(fifo_fd: int, proc: subprocess.Popen, timeout: float = 180) -> int:
    """The consolidator's pid, once it has written its output and paused; fails if prune ends first."""
    ready, _, _ = select.select([fifo_fd, proc.stdout], [], [], timeout)
    assert fifo_fd in ready, f"the consolidator never paused: {proc.stdout.read() if ready else 'timed out'}"
    return int(os.read(fifo_fd, 64).decode().strip())


def _start_prune(cfg: Path, fifo: Path) -> tuple[subprocess.Popen, int]:
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before prune: the consolidator needs a listener
    env = {**os.environ, PAUSE_FIFO_ENV: str(fifo)}
    env.pop("CKPTD_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, reader


@contextlib.contextmanager
def _cleanup(proc: subprocess.Popen, reader: int):
    """Close our end of the FIFO; if the test failed midway, kill what it started."""
    try:
        yield
    finally:
        os.close(reader)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def work_files(root: Path) -> list[str]:
    """What consolidations have left in ckptd's work area: `<work directory>/<file>`."""
    area = root / WORK_DIR
    return sorted(str(p.relative_to(area)) for p in area.rglob("*") if p.is_file()) if area.exists() else []


def test_consolidation_killed_midway_loses_nothing_and_the_next_run_completes(zero3_bf16_bare, tmp_path):
    root = copy_run(zero3_bf16_bare, tmp_path)
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    ck = root / "run" / "global_step10"
    before = manifest(root)
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)

    # 1. the consolidator is killed once its first shard is written, before it is verified: prune
    #    says so, puts the unverified output in the trash (and purges it), and removes nothing else.
    proc, reader = _start_prune(cfg, fifo)
    with proc, _cleanup(proc, reader):
        pid = _wait_for_pause(reader, proc)
        [partial] = work_files(root)
        assert partial.endswith(f"/{slim.shard_name(1, 1)}") and not (ck / "fp32").exists()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 74, out
    assert "-> failed: consolidation failed, nothing removed: killed by signal 9" in out
    assert manifest(root) == before and work_files(root) == [] and os.listdir(root / ".ckptd-trash") == []

    # 2. prune itself is killed (its whole process group) at the same point: only the work directory
    #    is left, and the checkpoint is still full and complete.
    proc, reader = _start_prune(cfg, fifo)
    with proc, _cleanup(proc, reader):
        _wait_for_pause(reader, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    assert manifest(root) == before and len(work_files(root)) == 1
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    row = next(c for c in plan["checkpoints"] if c["step"] == 10)
    assert (row["state"], row["action"]) == ("complete", "slim")

    # 3. the next run moves the leftover to the trash, and completes it
    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 1 slimmed (" in proc.stdout.splitlines()[-1]
    assert work_files(root) == [] and os.listdir(root / ".ckptd-trash") == []
    assert (ck / "fp32" / slim.INDEX).exists() and optimizer_shards(ck) == {}
    assert json.loads((ck / slim.MARKER).read_text())["state"] == "done"

    # verify reports it as slimmed, and the plan keeps it as such
    proc = run_ckptd("verify", ck, "-c", cfg, "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["state"] == "complete" and doc["slimmed"] is True
    checks = {c["name"]: c["detail"] for c in doc["checks"]}
    assert checks["deepspeed shards"].startswith("2/4 files present, 2 optimizer shards removed by slimming, ZeRO-3")
    assert checks["slimmed"].startswith("optimizer state removed: 2 files, 16.9KiB; weights in "
                                        "fp32/model.safetensors.index.json (fp32, consolidated from global_step10 "
                                        "by zero_to_fp32, sha256 ")
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    row = next(c for c in plan["checkpoints"] if c["step"] == 10)
    assert (row["state"], row["action"], row["reasons"][-1]) == ("complete", "keep", "slimmed")


def test_slimming_a_bf16_checkpoint_keeps_its_fp32_master_weights(zero2_bf16_hf_trainer, tmp_path):
    """DeepSpeed bf16 training: the Trainer's model.safetensors is bf16 and the fp32
    master weights live only in the optimizer shards. Slimming consolidates them into fp32/ before
    removing anything: bit for bit what zero_to_fp32 reconstructs from the shards."""
    root = copy_run(zero2_bf16_hf_trainer, tmp_path)
    ck = root / "run" / "checkpoint-10"
    saved = (ck / "model.safetensors").read_bytes()
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    plan = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    row = next(c for c in plan["checkpoints"] if c["step"] == 10)
    assert row["action"] == "slim" and row["reasons"][0].endswith(
        "; keeps fp32 weights consolidated from global_step10 into fp32/ first (model.safetensors is bf16)")

    proc = run_ckptd("prune", "-c", cfg, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 1 slimmed (" in proc.stdout.splitlines()[-1]
    assert optimizer_shards(ck / "global_step10") == {}
    assert (ck / "model.safetensors").read_bytes() == saved  # the Trainer's own weights, as saved
    result = compare_with_zero_to_fp32(zero2_bf16_hf_trainer / "checkpoint-10", "global_step10", ck / "fp32")
    assert result["ref"] == result["got"] and len(result["ref"]) == 4
    assert result["unequal"] == [] and result["dtypes"] == ["torch.float32"]
    marker = json.loads((ck / slim.MARKER).read_text())
    assert marker["weights"]["path"] == "fp32/model.safetensors.index.json" and marker["weights"]["dtype"] == "fp32"

    # as-saved: the bf16 weights alone, and the plan says so
    root2 = copy_run(zero2_bf16_hf_trainer, tmp_path / "as-saved")
    cfg2 = config(tmp_path / "as-saved", root2, keep_last=2, keep_best=0, keep_full_last=1, slim_weights="as-saved")
    plan = json.loads(run_ckptd("plan", "-c", cfg2, "--json").stdout)
    row = next(c for c in plan["checkpoints"] if c["step"] == 10)
    assert row["action"] == "slim" and row["reasons"][0].endswith("; keeps model.safetensors as saved (bf16)")


@contextlib.contextmanager
def _paused_consolidation(cfg: Path, tmp_path: Path):
    """`prune` started with the pause hook, once its consolidator has paused: (prune, a pidfd of
    the consolidator). Whatever the test leaves running is killed on the way out."""
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)
    proc, reader = _start_prune(cfg, fifo)
    with proc, _cleanup(proc, reader):
        pid_fd = os.pidfd_open(_wait_for_pause(reader, proc))
        try:
            yield proc, pid_fd
        finally:
            os.close(pid_fd)


def _gone(pid_fd: int, timeout: float) -> bool:
    """Whether the process behind a pidfd has exited (the pidfd turns readable), waiting up to `timeout`."""
    ready, _, _ = select.select([pid_fd], [], [], timeout)
    return pid_fd in ready


def test_a_consolidation_that_overruns_its_timeout_is_killed_and_nothing_is_removed(zero3_bf16_bare, tmp_path):
    """The consolidator pauses (the test hook) once its output is written; 30 s is ample to get
    there and it then holds for 60 s, so the timeout is what ends it."""
    root = copy_run(zero3_bf16_bare, tmp_path)
    cfg = config(tmp_path, root, timeout="30s", keep_last=2, keep_best=0, keep_full_last=1)
    before = manifest(root)
    with _paused_consolidation(cfg, tmp_path) as (proc, pid_fd):
        out, _ = proc.communicate(timeout=120)
        assert _gone(pid_fd, 0)
    assert proc.returncode == 74, out
    assert "-> failed: consolidation failed, nothing removed: zero_to_fp32 took longer than 30s" in out
    assert manifest(root) == before and work_files(root) == []  # its partial output went to the trash


def test_a_consolidator_dies_with_the_ckptd_that_started_it(zero3_bf16_bare, tmp_path):
    """prune alone is killed (not its process group): the child must not write on by itself."""
    root = copy_run(zero3_bf16_bare, tmp_path)
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    before = manifest(root)
    with _paused_consolidation(cfg, tmp_path) as (proc, pid_fd):
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert _gone(pid_fd, 30), "the consolidator outlived prune"
    assert manifest(root) == before


# --- the daemon: consolidation on a worker of its own ----------------------------------------


def _pids(fifo_fd: int, timeout: float = 180):
    """The pid each consolidator announces on the pause FIFO, as it pauses, one at a time."""
    buffered = b""
    while True:
        while b"\n" not in buffered:
            ready, _, _ = select.select([fifo_fd], [], [], timeout)
            assert ready, "no consolidator paused"
            try:
                buffered += os.read(fifo_fd, 64)
            except BlockingIOError:  # woken with nothing to read (a writer came and went): wait again
                continue
        line, buffered = buffered.split(b"\n", 1)
        yield int(line)


def _daemon_config(tmp_path: Path, root: Path) -> Path:
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    # The first retention pass comes with the first reconcile (or a checkpoint completing).
    extra = "quiet_period = '0s'\nobserver = 'inotify'\nreconcile_interval = '2s'"
    cfg.write_text(cfg.read_text().replace("quiet_period = '0s'", extra))
    return cfg


def test_the_daemon_completes_and_deletes_while_a_consolidation_runs(zero3_bf16_bare, tmp_path):
    """`ckptd run` with its consolidator paused (the test hook): a new checkpoint completes and an
    old one is deleted meanwhile. The one deleted is the very one being consolidated: that
    consolidation is stopped, and the next one (the checkpoint now outside keep_full_last) runs to
    the end: consolidated, settled, slimmed, bit for bit what zero_to_fp32 makes of its shards."""
    root = copy_run(zero3_bf16_bare, tmp_path)
    run = root / "run"
    staged = tmp_path / "staged"
    shutil.copytree(run / "global_step20", staged / "global_step30")  # a real checkpoint, arriving later
    cfg = _daemon_config(tmp_path, root)
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the daemon: its consolidator needs a listener
    pids = _pids(reader)
    try:
        with DaemonProc("-c", cfg, env={PAUSE_FIFO_ENV: str(fifo)}) as daemon:
            first = os.pidfd_open(next(pids))  # paused, its first shard written
            mark = daemon.mark()
            os.rename(staged / "global_step30", run / "global_step30")
            (run / "latest").write_text("global_step30")  # as DeepSpeed does once the step is saved
            daemon.wait_for(lambda line: line.get("checkpoint") == "global_step30" and line.get("state") == "complete",
                            start=mark, timeout=60)
            daemon.wait_message("deleted run/global_step10 (", start=mark, timeout=60)
            daemon.wait_message("stopped consolidating run/global_step10: the plan no longer slims it (delete",
                                start=mark, timeout=60)
            assert _gone(first, 30), "the stopped consolidator is still running"
            daemon.wait_message("consolidating run/global_step10: fp32 weights from global_step10")
            os.close(first)
            assert not (run / "global_step10").exists() and not list(run.glob("*/fp32"))

            # the next one: global_step20, now outside keep_full_last=1; let it run to the end
            daemon.wait_message("consolidating run/global_step20", start=mark, timeout=60)
            wake_paused_consolidator(next(pids))
            daemon.wait_message("consolidated run/global_step20: consolidated global_step20 into fp32/", timeout=180)
            daemon.wait_message("slimmed run/global_step20 (", timeout=60)
            assert sorted(p.name for p in run.glob("global_step*")) == ["global_step20", "global_step30"]
            assert work_files(root) == []
    finally:
        os.close(reader)
    ck = run / "global_step20"
    assert optimizer_shards(ck) == {} and len(optimizer_shards(run / "global_step30")) == 2
    result = compare_with_zero_to_fp32(zero3_bf16_bare, "global_step20", ck / "fp32")
    assert result["ref"] == result["got"] and result["unequal"] == [] and result["dtypes"] == ["torch.float32"]
    events = [(r["event"], Path(r["path"]).name, r.get("action")) for r in read_journal(tmp_path / "state")
              if "path" in r]
    assert ("trashed", "global_step10", None) in events
    assert events.index(("consolidated", "global_step20", "consolidate")) < events.index(
        ("slimmed", "global_step20", "slim"))


def test_a_daemon_stopped_during_a_consolidation_stops_at_once_and_the_next_start_finishes(zero3_bf16_bare,
                                                                                          tmp_path):
    """SIGTERM while the consolidator holds (it would for 60 s): the daemon kills it and exits
    within its bounded shutdown, without timing out; what it left is cleared at the next start."""
    root = copy_run(zero3_bf16_bare, tmp_path)
    before = manifest(root)
    cfg = _daemon_config(tmp_path, root)
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with DaemonProc("-c", cfg, env={PAUSE_FIFO_ENV: str(fifo)}) as daemon:
            child = os.pidfd_open(next(_pids(reader)))
            mark = daemon.mark()
            assert daemon.stop(timeout=30) == 0
            assert _gone(child, 0), "the consolidator outlived the daemon"
            os.close(child)
            said = [line.get("message", "") for line in daemon.lines[mark:]]
            assert "stopped" in said and not any("timed out" in m for m in said), said
    finally:
        os.close(reader)
    assert manifest(root) == before and len(work_files(root)) == 1  # its first shard, never moved into place
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("slimmed run/global_step10 (", timeout=180)
    assert work_files(root) == [] and (root / "run" / "global_step10" / "fp32" / slim.INDEX).exists()


def test_a_shard_that_reads_back_different_is_never_taken_for_weights(zero2_bf16_bare_3ranks, tmp_path):
    """The consolidator pauses once its first shard is written; a byte of a tensor is flipped on disk
    (a torn write, a bad sector); its read-back against the shards catches it, and nothing is removed."""
    root = copy_run(zero2_bf16_bare_3ranks, tmp_path)
    cfg = config(tmp_path, root, keep_last=2, keep_best=0, keep_full_last=1)
    before = manifest(root)
    fifo = tmp_path / "pause.fifo"
    os.mkfifo(fifo)
    proc, reader = _start_prune(cfg, fifo)
    with proc, _cleanup(proc, reader):
        pid = _wait_for_pause(reader, proc)
        [partial] = work_files(root)
        with open(root / WORK_DIR / partial, "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last byte of the last tensor's data
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x01]))
        wake_paused_consolidator(pid)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 74, out
    assert "-> failed: consolidation failed, nothing removed: ValueError: 2.bias reads back different" in out
    assert manifest(root) == before and work_files(root) == []


def test_many_shards_and_remapped_sources_are_bit_identical(zero2_bf16_bare_3ranks, tmp_path):
    """The consolidator with tiny shards (one tensor each) and its mappings dropped before every
    tensor: the index across shards and the rebuilt state dicts give what zero_to_fp32 gives."""
    out = tmp_path / "out"
    out.mkdir()
    tag = zero2_bf16_bare_3ranks / "global_step10"
    proc = subprocess.run([sys.executable, "-m", "ckptd.removal.zero_to_fp32", str(zero2_bf16_bare_3ranks), "global_step10",
                           str(tag / "mp_rank_00_model_states.pt"), str(out), "--source-fingerprint", "t",
                           "--max-shard-bytes", "1", "--remap-bytes", "1"],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == [*(slim.shard_name(i, 4) for i in range(1, 5)), slim.INDEX]
    result = compare_with_zero_to_fp32(zero2_bf16_bare_3ranks, "global_step10", out)
    assert result["ref"] == result["got"] and result["unequal"] == [] and result["dtypes"] == ["torch.float32"]


@pytest.mark.slow
def test_the_consolidation_benchmark_runs(zero2_bf16_bare_3ranks):
    """`python -m bench.consolidation --quick` on a tiny real checkpoint (a minute: five children
    importing torch and deepspeed), so that the benchmark does not rot; its figures come from the
    full run, by hand."""
    from tests.support.common import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "bench.consolidation", "--quick", "--checkpoint",
                           str(zero2_bf16_bare_3ranks)], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 6 and rows[1].startswith("| floor") and any("| ckptd: lazy" in r for r in rows), proc.stdout
