"""Hostile layouts and files, and filesystem faults: nothing outside a root is touched,
nothing that cannot be re-checked is deleted, and nothing crashes.

Faults that cannot be produced for real here (we run as root, so EACCES never happens;
no read-only or stale NFS mount can be made in this container) are injected at the I/O
seam each test names.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint, write_zip
from ckptd.config import Retention, Root
from ckptd.decide.planner import Scanner, decide
from ckptd.discover.layouts import TRASH_DIR
from ckptd.frameworks.base import MAX_TRAINER_STATE_BYTES
from ckptd.journal import Journal, read_journal
from ckptd.judge import evidence
from ckptd.judge.evidence import MAX_WALK_DEPTH, TooDeep, walk
from ckptd.model import State, Verdict
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import run_ckptd

NOW = 1_800_000_000.0
OLD = NOW - 3600


def volume(root: Path, steps=(10, 20, 30)) -> Path:
    for i, step in enumerate(steps):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + i)
    return root


def reaper_for(root: Path, tmp_path: Path) -> tuple[Reaper, object]:
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    return reaper, decide([(scanner.root, scanner.runs(now=NOW))])


# --- filesystem faults at the destructive seam --------------------------------


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EBUSY, errno.EXDEV, errno.ESTALE])
def test_a_failing_rename_leaves_the_checkpoint_and_says_why(tmp_path, monkeypatch, code):
    """Injected at os.rename, the reaper's one destructive call."""
    root = volume(tmp_path / "vol")
    reaper, plan = reaper_for(root, tmp_path)

    def rename(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "rename", rename)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.FAILED}
    assert os.strerror(code) in results[0].detail
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert [r["event"] for r in read_journal(tmp_path / "state")] == ["trashing", "failed"] * 2


def test_a_journal_that_cannot_be_written_means_no_rename(tmp_path, monkeypatch):
    """ENOSPC injected at the journal's write: the intent is not on disk, so nothing moves."""
    root = volume(tmp_path / "vol")
    reaper, plan = reaper_for(root, tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Journal, "record", full)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.FAILED}
    assert "No space left on device" in results[0].detail
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]


def test_a_stale_file_handle_while_re_checking_refuses(tmp_path, monkeypatch):
    """ESTALE injected at the evidence walk during the re-check: cannot be sure, so no delete."""
    root = volume(tmp_path / "vol")
    reaper, plan = reaper_for(root, tmp_path)

    def stale(path):
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))

    monkeypatch.setattr(evidence, "walk", stale)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.REFUSED}
    assert results[0].detail.startswith("cannot re-check it: [Errno 116] Stale file handle")
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]


def test_a_file_vanishing_between_listing_and_stat_is_skipped(tmp_path, monkeypatch):
    """ENOENT race injected at DirEntry.stat (the window cannot be hit on purpose)."""
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    real_scandir = os.scandir

    class Vanishing:
        def __init__(self, entry):
            self._e = entry
            self.name, self.path = entry.name, entry.path

        def stat(self, follow_symlinks=True):
            if self.name == "config.json":
                raise FileNotFoundError(errno.ENOENT, "gone", self.path)
            return self._e.stat(follow_symlinks=follow_symlinks)

    class Scan:
        def __init__(self, path):
            self._it = real_scandir(path)

        def __enter__(self):
            return self

        def __iter__(self):
            return (Vanishing(e) for e in self._it)

        def __exit__(self, *exc):
            self._it.close()

    monkeypatch.setattr(evidence.os, "scandir", Scan)
    names = {e.rel for e in evidence.walk(ckpt)}
    assert "config.json" not in names and "trainer_state.json" in names


# --- hostile layouts ---------------------------------------------------------------


def test_names_with_newlines_and_bytes_that_are_not_utf8(tmp_path, state_env):
    root = tmp_path / "vol"
    run = Path(os.fsdecode(os.fsencode(str(root)) + b"/run\xff\nline"))
    old = time.time() - 3600
    for step in (1, 2):
        write_zip(run / f"ckpt_{step}" / "weights.pt")
        age(run / f"ckpt_{step}", old + step)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[[roots]]\npath = '{root}'\npatterns = ['ckpt_{{step}}']\n[roots.retention]\nkeep_last = 1\n"
                   f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n")
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert plan.returncode == 0, plan.stderr
    rows = json.loads(plan.stdout)["checkpoints"]
    assert [os.fsencode(r["run"]) for r in rows] == [b"run\xff\nline"] * 2
    table = run_ckptd("plan", "-c", cfg)
    assert table.returncode == 0 and "\\udcff" in table.stdout
    prune = run_ckptd("prune", "-c", cfg)
    assert prune.returncode == 0, prune.stderr
    assert os.listdir(run) == ["ckpt_2"]


def test_a_very_deep_checkpoint_is_never_deleted(tmp_path):
    root = tmp_path / "vol"
    deep = root / "run" / "ckpt_1"
    d = deep
    for _ in range(MAX_WALK_DEPTH + 5):
        d = d / "d"
    d.mkdir(parents=True)
    (root / "run" / "ckpt_2").mkdir()
    age(root, OLD)
    scanner = Scanner(Root(path=root, patterns=("ckpt_{step}",), retention=Retention(keep_last=0, keep_best=0)))
    runs = scanner.runs(now=NOW)
    by_name = {c.name: c for c in runs[0].checkpoints}
    assert by_name["ckpt_1"].state is State.INCOMPLETE
    walk_check = next(c for c in by_name["ckpt_1"].checks if c.name == "walk")
    assert walk_check.verdict is Verdict.UNKNOWN and "deeper than" in walk_check.detail
    assert decide([(scanner.root, runs)]).deletions == ()


def test_paths_too_long_to_reach_make_the_walk_unknown_not_a_crash(tmp_path):
    """20 levels of 250-character names: not deep, but past PATH_MAX (4096), so the walk's
    scandir gets ENAMETOOLONG. Built from directory descriptors, the only way to make one."""
    root = tmp_path / "vol"
    (root / "run" / "ckpt_2").mkdir(parents=True)
    fd = os.open(root / "run", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ["ckpt_1"] + ["n" * 250] * 20:
            os.mkdir(name, dir_fd=fd)
            next_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    finally:
        os.close(fd)
    with pytest.raises(TooDeep, match="paths too long to walk"):
        walk(root / "run" / "ckpt_1")
    age(root / "run" / "ckpt_2", OLD)
    os.utime(root / "run" / "ckpt_1", (OLD, OLD))
    scanner = Scanner(Root(path=root, patterns=("ckpt_{step}",), retention=Retention(keep_last=0, keep_best=0)))
    runs = scanner.runs(now=NOW)
    c = next(c for c in runs[0].checkpoints if c.name == "ckpt_1")
    assert c.state is State.INCOMPLETE
    assert next(k for k in c.checks if k.name == "walk").verdict is Verdict.UNKNOWN
    assert decide([(scanner.root, runs)]).deletions == ()


def test_a_hundred_thousand_entries_in_one_run_directory(tmp_path):
    run = tmp_path / "vol" / "run"
    run.mkdir(parents=True)
    fd = os.open(run, os.O_RDONLY)
    try:
        for i in range(100_000):
            os.close(os.open(f"event.{i}", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD)
    t0 = time.monotonic()
    scanner = Scanner(Root(path=tmp_path / "vol", world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    elapsed = time.monotonic() - t0
    assert [d.checkpoint.name for d in plan.deletions] == ["checkpoint-1", "checkpoint-2"]
    assert elapsed < 60  # generous: a guard against quadratic behaviour, not a benchmark


# --- hostile files --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[" * 100_000 + "]" * 100_000, "unreadable: RecursionError"),
        ('{"global_step": 10, "log_hist', "unreadable: JSONDecodeError"),
        ("[1, 2, 3]", "not a JSON object"),
        ("\xff\xfe garbage", "unreadable"),
    ],
)
def test_malformed_trainer_state(tmp_path, content, expected):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    (ckpt / "trainer_state.json").write_text(content, encoding="utf-8", errors="surrogateescape")
    age(ckpt, OLD)
    c = Scanner(Root(path=tmp_path, world_size=2)).runs(now=NOW)[0].checkpoints[0]
    check = next(k for k in c.checks if k.name == "trainer_state.json")
    assert check.verdict is Verdict.FAILED and check.detail.startswith(expected)
    assert c.state is State.INCOMPLETE


def test_a_huge_trainer_state_is_not_read(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    with open(ckpt / "trainer_state.json", "r+b") as f:
        f.truncate(MAX_TRAINER_STATE_BYTES + 1)  # sparse: costs no disk
    age(ckpt, OLD)
    c = Scanner(Root(path=tmp_path, world_size=2)).runs(now=NOW)[0].checkpoints[0]
    check = next(k for k in c.checks if k.name == "trainer_state.json")
    assert check.detail.endswith("larger than this tool will parse")


def test_metrics_that_are_nan_infinite_or_strings(tmp_path):
    losses = {10: "NaN", 20: "Infinity", 30: '"low"', 40: "0.5", 50: "0.9"}
    for i, step in enumerate(losses):
        ckpt = hf_deepspeed_checkpoint(tmp_path / "run", step, world=2)
        history = ",".join(f'{{"step": {s}, "eval_loss": {v}}}' for s, v in losses.items() if s <= step)
        (ckpt / "trainer_state.json").write_text(f'{{"global_step": {step}, "log_history": [{history}]}}')
        age(ckpt, OLD + i)
    scanner = Scanner(Root(path=tmp_path, world_size=2,
                           retention=Retention(keep_last=1, keep_best=1, metric="eval_loss")))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    actions = {d.checkpoint.step: str(d.action) for d in plan.decisions}
    # 40 is the only comparable best; 30's string counts as missing (kept); NaN/inf are deletable
    assert actions == {10: "delete", 20: "delete", 30: "keep", 40: "keep", 50: "keep"}


def test_the_trash_itself_being_a_symlink_stops_purging(tmp_path):
    root = volume(tmp_path / "vol")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (root / TRASH_DIR).symlink_to(outside)
    reaper, plan = reaper_for(root, tmp_path)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} == {Outcome.FAILED}
    assert reaper.purge() == (0, 0)
    assert (outside / "precious").exists()
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]


def _model_states_with(tmp_path: Path, data: bytes) -> Path:
    import zipfile

    path = tmp_path / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data)
    return path


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # LONG_BINPUT 2**31-1: CPython would grow its memo to 16 GiB for these 9 bytes
        (b"\x80\x02}r\xff\xff\xff\x7f.", "memo index"),
        (b"\x80\x02\x82\x01.", "extension codes"),  # EXT1: the copyreg extension registry
        (b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b".", "cannot read"),  # BINBYTES8 of a terabyte
    ],
)
def test_pickles_that_would_exhaust_memory_are_refused(tmp_path, data, why):
    import resource

    from ckptd.frameworks.dsmeta import MetadataUnavailable, read_plain_data

    path = _model_states_with(tmp_path, data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MetadataUnavailable, match=why):
        read_plain_data(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: no blow-up


def test_a_huge_pickle_is_not_read(tmp_path):
    """65 MiB of data.pkl (compressed to almost nothing in the zip): refused by its declared size."""
    import resource
    import zipfile

    from ckptd.frameworks.dsmeta import MAX_PICKLE_BYTES, MetadataUnavailable, read_world_sizes

    path = tmp_path / "mp_rank_00_model_states.pt"
    chunk = b"\0" * (1 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("archive/data.pkl", "w", force_zip64=True) as f:
        for _ in range(MAX_PICKLE_BYTES // len(chunk) + 1):
            f.write(chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MetadataUnavailable, match=f"data.pkl larger than {MAX_PICKLE_BYTES} bytes"):
        read_world_sizes(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 32 * 1024  # KiB: never read


def test_an_absurd_world_size_is_not_believed(tmp_path):
    import pickle

    from ckptd.frameworks.dsmeta import MetadataUnavailable, read_world_sizes

    path = _model_states_with(tmp_path, pickle.dumps({"dp_world_size": 2**31 - 1, "mp_world_size": 1}))
    with pytest.raises(MetadataUnavailable, match="no usable dp_world_size"):
        read_world_sizes(path)


def test_a_huge_rank_number_in_a_file_name_does_not_hang_the_census(tmp_path):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    (ckpt / "rng_state_10000000000.pth").write_bytes(b"")
    age(ckpt, OLD)
    t0 = time.monotonic()
    c = Scanner(Root(path=tmp_path)).runs(now=NOW)[0].checkpoints[0]
    assert time.monotonic() - t0 < 30
    check = next(k for k in c.checks if k.name == "rng states")
    assert check.verdict is Verdict.PASSED  # ranks 0 and 1 of a 2-rank job are there; the stray is ignored
