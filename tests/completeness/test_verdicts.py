"""What was read from a checkpoint's files, remembered by identity, and across processes (verdicts.py).

Real files in tmp_path; the wall clock the racy-clean rule compares with is passed in, so that a
test's files (written a moment ago) count as old or young as the test needs, without waiting.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.config import Root
from ckptd.decide.planner import Scanner
from ckptd.frameworks import dsmeta, hf
from ckptd.frameworks.base import MemoryKind
from ckptd.judge import evidence, wholefile
from ckptd.judge.evidence import Entry
from ckptd.judge.verdicts import RACY_NS, Verdicts, cache_path
from ckptd.model import State

SHARD = "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def later() -> int:
    """The wall clock of a look well after the test's files were written."""
    return time.time_ns() + 10 * RACY_NS


def scanner(root: Path, state_dir: Path | None = None, clock=later) -> Scanner:
    v = Verdicts(clock_ns=clock)
    if state_dir is not None:
        v.load(cache_path(state_dir, root), root)
    return Scanner(Root(path=root, quiet_period=60, world_size=2), state_dir=state_dir, verdicts=v)


def by_rel(s: Scanner) -> dict:
    return {c.rel: c for run in s.runs(now=time.time() + 3600) for c in run.checkpoints}


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every file whose contents are read for a verdict (zip tails and headers, world sizes, trainer state)."""
    seen: list[str] = []
    real_problem, real_world, real_ts = wholefile.file_problem, dsmeta.read_world_sizes, hf._trainer_state
    monkeypatch.setattr(wholefile, "file_problem", lambda p, e: seen.append(str(p)) or real_problem(p, e))
    monkeypatch.setattr(dsmeta, "read_world_sizes", lambda p: seen.append(str(p)) or real_world(p))
    monkeypatch.setattr(hf, "_trainer_state", lambda p, f: seen.append(str(p)) or real_ts(p, f))
    return seen


# --- the identity rule, on one look at a time ----------------------------------


def entry(**kw) -> Entry:
    fields = {"rel": "a.pt", "kind": "f", "size": 10, "mtime_ns": 1_000, "ctime_ns": 2_000, "ino": 7, "dev": 3}
    return Entry(**{**fields, **kw})


@pytest.mark.parametrize("field", ["size", "mtime_ns", "ctime_ns", "ino", "dev"])
def test_a_verdict_is_used_again_only_for_the_same_identity(field):
    """Each of (dev, inode, size, mtime, ctime) differing alone means: read again."""
    v = Verdicts(clock_ns=lambda: 10 * RACY_NS)
    first = entry()
    look = v.begin("/c", [first])
    assert look.verdict(MemoryKind.FILE, first, lambda: " first read") == " first read"
    v.end(look, [first], "fp")
    look = v.begin("/c", [first])
    assert look.verdict(MemoryKind.FILE, first, lambda: " read again") == " first read"  # same identity: remembered
    v.end(look, [first], "fp")
    changed = entry(**{field: getattr(first, field) + 1})
    look = v.begin("/c", [changed])
    assert look.verdict(MemoryKind.FILE, changed, lambda: " read again") == " read again"


def test_a_racily_clean_file_is_read_again():
    """A file changed within RACY_NS of the look could be rewritten to the same identity in the same
    timestamp tick: what was read from it is not remembered until it is older."""
    now = [entry().ctime_ns + RACY_NS // 2]
    v = Verdicts(clock_ns=lambda: now[0])
    e = entry()
    for expected in (" read 1", " read 2"):
        look = v.begin("/c", [e])
        assert look.verdict(MemoryKind.FILE, e, lambda expected=expected: expected) == expected
        v.end(look, [e], "fp")
    now[0] = entry().ctime_ns + RACY_NS
    look = v.begin("/c", [e])
    assert look.verdict(MemoryKind.FILE, e, lambda: " read 3") == " read 3"
    v.end(look, [e], "fp")
    look = v.begin("/c", [e])
    assert look.verdict(MemoryKind.FILE, e, lambda: " read 4") == " read 3"


def test_an_io_error_is_not_remembered(tmp_path, monkeypatch):
    """An EIO while reading a shard's tail makes this look fail the file, and the next look reads it
    again (injected at os.open: a real EIO needs a failing disk)."""
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    s = scanner(tmp_path)
    real_open = os.open
    failing = {str(tmp_path / "run" / "checkpoint-10" / SHARD)}

    def flaky_open(path, *args, **kwargs):
        if str(path) in failing:
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(evidence.os, "open", flaky_open)
    for _ in range(2):  # failing twice: an unchanged checkpoint, but the shard was never read
        look = by_rel(s)["run/checkpoint-10"]
        assert look.state is State.INCOMPLETE
        assert "could not be read: Input/output error" in str(look.checks)
    failing.clear()
    assert by_rel(s)["run/checkpoint-10"].state is State.COMPLETE


def test_an_unreadable_trainer_state_is_not_remembered(tmp_path, monkeypatch):
    hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    s = scanner(tmp_path)
    import ckptd.volume.volread

    real_open = ckptd.volume.volread.open_file
    failing = [True]

    def flaky_open(path, *args, **kwargs):  # every read from the volume goes through volread
        if failing[0] and str(path).endswith("trainer_state.json"):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(ckptd.volume.volread, "open_file", flaky_open)
    assert by_rel(s)["run/checkpoint-10"].state is State.INCOMPLETE
    failing[0] = False
    assert by_rel(s)["run/checkpoint-10"].state is State.COMPLETE


# --- one process: an unchanged checkpoint is read once ---------------------------


def looked(s: Scanner, rel: str = "run/checkpoint-10"):
    """One checkpoint looked at in full (walked and inspected), as the daemon's looks are."""
    from ckptd.discover.runs import find_run

    run_rel, _, name = rel.rpartition("/")
    run_dir = find_run(s.root.path, run_rel, patterns=s.patterns)
    cand = next(c for c in run_dir.candidates if c.name == name)
    return s.inspect(run_dir, cand, now=time.time() + 3600)


def test_an_unchanged_checkpoint_is_read_once_and_a_changed_file_again(tmp_path, reads):
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=2)
    s = scanner(tmp_path)
    assert looked(s).state is State.COMPLETE
    first = len(reads)
    assert first > 5
    looked(s)
    assert len(reads) == first  # nothing read again
    (ckpt / SHARD).write_bytes(b"\0" * 100)  # a shard rewritten, truncated: not a zip
    assert looked(s).state is State.INCOMPLETE
    assert reads[first:] == [str(ckpt / SHARD)]  # only the changed file read again


def test_a_settled_checkpoint_keeps_no_per_file_record(tmp_path):
    """Memory: a complete checkpoint costs a digest and its few non-trivial verdicts, not an
    entry per shard (the M volume's 64k shards were most of the daemon's RSS over target)."""
    ckpt = hf_deepspeed_checkpoint(tmp_path / "run", 10, world=8)
    old = time.time() - 3600
    for dirpath, dirnames, filenames in os.walk(ckpt):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (old, old))
    os.utime(ckpt, (old, old))
    s = scanner(tmp_path, clock=lambda: time.time_ns() + 3600 * 10**9)
    by_rel(s)
    rec = s.verdicts._records[str(ckpt)]
    assert rec.whole and len(rec.files) == 3  # the world sizes, the trainer state, the tag `latest` names
    assert {k for k, _ in rec.verdicts} == {"world", "ts", "fw"}  # fw: latest, config.json (frameworks' reads)


# --- across processes: the cache in state_dir --------------------------------------


def test_a_second_process_reads_nothing_on_an_unchanged_volume(tmp_path, reads):
    for step in (10, 20):
        hf_deepspeed_checkpoint(tmp_path / "vol" / "run", step, world=2, losses={10: 0.5, 20: 0.4})
    state = tmp_path / "state"
    state.mkdir()
    first = by_rel(scanner(tmp_path / "vol", state))
    assert cache_path(state, tmp_path / "vol").is_file()
    n = len(reads)
    second = by_rel(scanner(tmp_path / "vol", state))
    assert reads[n:] == []
    assert {k: (c.state, c.fingerprint, c.checks, c.trainer_state) for k, c in second.items()} == {
        k: (c.state, c.fingerprint, c.checks, c.trainer_state) for k, c in first.items()
    }


def test_no_state_dir_no_cache_and_none_created(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "vol" / "run", 10, world=2)
    by_rel(scanner(tmp_path / "vol", tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


def test_a_file_changed_while_no_ckptd_ran_is_read_again(tmp_path, reads):
    """Replaced (a new file renamed over it, its directory changed): restored no more, read again.
    Rewritten in place (no directory changed): `plan` restores what was saved (it stats
    directories, not files), but a full look, as the daemon's and the reaper's are, reads it."""
    ckpt = hf_deepspeed_checkpoint(tmp_path / "vol" / "run", 10, world=2)
    other = hf_deepspeed_checkpoint(tmp_path / "vol" / "run", 20, world=2)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(tmp_path / "vol", state))
    (ckpt / "global_step10" / "new.tmp").write_bytes(b"\0" * 100)
    os.replace(ckpt / "global_step10" / "new.tmp", ckpt / SHARD)  # truncated, by rename
    shard20 = other / SHARD.replace("10", "20")
    with open(shard20, "r+b") as f:
        f.truncate(100)  # truncated in place
    n = len(reads)
    again = scanner(tmp_path / "vol", state)
    found = by_rel(again)
    assert found["run/checkpoint-10"].state is State.INCOMPLETE
    assert str(ckpt / SHARD) in reads[n:]
    assert found["run/checkpoint-20"].state is State.COMPLETE  # restored: as saved
    assert looked(again, "run/checkpoint-20").state is State.INCOMPLETE  # a full look reads it again


def test_a_saved_checkpoint_is_restored_by_stats_of_its_directories_alone(tmp_path, monkeypatch):
    """What `plan` on an unchanged volume costs with the cache: no walk, no read; and what the
    restore depends on: its directories, the config for its run, its run directory's entries."""
    from ckptd.judge import evidence

    for step in (10, 20):
        hf_deepspeed_checkpoint(tmp_path / "vol" / "run", step, world=2, losses={10: 0.5, 20: 0.4})
    state = tmp_path / "state"
    state.mkdir()
    first = by_rel(scanner(tmp_path / "vol", state))
    walks: list[Path] = []
    real_walk = evidence.walk
    monkeypatch.setattr(evidence, "walk", lambda p: walks.append(p) or real_walk(p))
    second = by_rel(scanner(tmp_path / "vol", state))
    assert walks == []
    assert {k: (c.state, c.fingerprint, c.checks, c.trainer_state, c.slim, c.size_bytes)
            for k, c in second.items()} == {
        k: (c.state, c.fingerprint, c.checks, c.trainer_state, c.slim, c.size_bytes) for k, c in first.items()}
    (tmp_path / "vol" / "run" / "notes.txt").write_text("x")  # the run directory's context changed
    by_rel(scanner(tmp_path / "vol", state))
    assert len(walks) == 2
    walks.clear()
    v = Verdicts(clock_ns=later)
    v.load(cache_path(state, tmp_path / "vol"), tmp_path / "vol")
    other = Scanner(Root(path=tmp_path / "vol", quiet_period=60, world_size=3), state_dir=state, verdicts=v)
    by_rel(other)  # another world_size for its runs: the census may differ, so look again
    assert len(walks) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # torn write
        lambda b: b[:-100] + bytes([b[-100] ^ 1]) + b[-99:],  # a flipped bit: the checksum says so
        lambda b: b"garbage\n" + b,
        lambda b: b"",
        lambda b: b.replace(b"ckptd-verdicts 1 ", b"ckptd-verdicts 999 "),  # a newer format
        lambda b: b"\xff\xfe" + b[2:],
    ],
    ids=["torn", "bitflip", "garbage", "empty", "version", "not-utf8"],
)
def test_a_damaged_cache_is_ignored(tmp_path, reads, damage):
    hf_deepspeed_checkpoint(tmp_path / "vol" / "run", 10, world=2)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(tmp_path / "vol", state))
    path = cache_path(state, tmp_path / "vol")
    path.write_bytes(damage(path.read_bytes()))
    n = len(reads)
    s = scanner(tmp_path / "vol", state)
    assert len(s.verdicts) == 0
    assert by_rel(s)["run/checkpoint-10"].state is State.COMPLETE
    assert len(reads) - n == n  # everything read again, as the first time


def test_a_cache_written_for_another_root_is_ignored(tmp_path):
    hf_deepspeed_checkpoint(tmp_path / "a" / "run", 10, world=2)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(tmp_path / "a", state))
    cache_path(state, tmp_path / "a").rename(cache_path(state, tmp_path / "b"))
    v = Verdicts()
    v.load(cache_path(state, tmp_path / "b"), tmp_path / "b")
    assert len(v) == 0


def rewrite_cache(state: Path, root: Path, edit, *, checksum: bool = True) -> None:
    """Apply `edit` to each checkpoint line of the cache ([rel, digest, verdicts, summary?]): what a
    cache written by a buggy or tampered ckptd could say. The checksum is made to match, or not."""
    import hashlib

    path = cache_path(state, root)
    head, _, body = path.read_bytes().partition(b"\n")
    lines = [json.loads(line) for line in zlib.decompress(body).splitlines()]
    for line in lines[1:]:
        edit(line)
    fmt, version, logic, old_sum = head.decode().split(" ")
    body = zlib.compress(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    new_sum = hashlib.blake2b(body, digest_size=16).hexdigest() if checksum else old_sum
    path.write_bytes(f"{fmt} {version} {logic} {new_sum}\n".encode() + body)


def lying_cache(state: Path, root: Path, ckpt: Path, *, checksum: bool = True, lie: str = "verdicts") -> None:
    """Rewrite the cache so that it says the truncated shard of `ckpt` is intact.
    `lie`: "verdicts" (the shard's problem dropped, and the saved checkpoint, so a look uses
    the verdicts) or "checkpoint" (the saved checkpoint's failing check made to pass)."""
    rel = str(ckpt.relative_to(root))

    def edit(line: list) -> None:
        if line[0] != rel:
            return
        if lie == "verdicts":
            line[2:] = [[v for v in line[2] if v[0] != MemoryKind.FILE]]  # and no saved checkpoint
        else:
            for check in line[3]["checks"]:
                check[1] = "passed"

    rewrite_cache(state, root, edit, checksum=checksum)


def test_a_cache_edited_without_its_checksum_is_ignored(tmp_path):
    root = tmp_path / "vol"
    ckpt = hf_deepspeed_checkpoint(root / "run", 10, world=2, skip={SHARD.split("/")[1]})
    (ckpt / SHARD).write_bytes(b"\0" * 100)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(root, state))
    lying_cache(state, root, ckpt, checksum=False)
    s = scanner(root, state)
    assert len(s.verdicts) == 0
    assert by_rel(s)["run/checkpoint-10"].state is State.INCOMPLETE


@pytest.mark.parametrize("removable", [None, False, 0, [["a"]], [["a", 1, 2]], [[1, "a", "b"]]])
def test_a_saved_checkpoint_with_malformed_removable_files_makes_the_cache_ignored(tmp_path, removable):
    """The removable files are [path, bytes] pairs; anything else (null, false, 0, another arity)
    is refused, and the whole cache with it: everything is looked at again (review of b3cc810)."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 10, world=2)
    age(root, time.time() - 3600)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(root, state))
    assert len(scanner(root, state).verdicts) == 1  # the truthful cache is taken

    def edit(line):
        line[3]["slim"][1] = removable

    rewrite_cache(state, root, edit)
    s = scanner(root, state)
    assert len(s.verdicts) == 0
    assert by_rel(s)["run/checkpoint-10"].state is State.COMPLETE  # looked at again


def test_a_saved_check_that_is_not_text_is_decoded_as_before(tmp_path):
    """Checks are saved as three strings; one saved otherwise decodes as its str(), each on its own
    (1, 1.0 and True are equal keys to a dict: they must not share one decoded Check)."""
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 10, world=2)
    hf_deepspeed_checkpoint(root / "run", 20, world=2)
    age(root, time.time() - 3600)
    state = tmp_path / "state"
    state.mkdir()
    by_rel(scanner(root, state))
    odd = iter([[True, "passed", True], [1, "passed", 1]])

    def edit(line):
        line[3]["checks"].append(next(odd))

    rewrite_cache(state, root, edit)
    s = scanner(root, state)
    names = sorted(c.name for rec in s.verdicts._records.values() for c in rec.checkpoint.checks)
    assert "1" in names and "True" in names


def test_the_reapers_recheck_never_rests_on_the_cache(tmp_path):
    """A cache that lies (a truncated shard said intact) fools `plan`'s report, by design (it is
    what it remembers), but never the re-check the reaper makes before it acts. The lie is in
    the verdicts (the saved checkpoint is dropped, so the look uses them), then in the saved
    checkpoint itself (restored as it is)."""
    root = tmp_path / "vol"
    ckpt = hf_deepspeed_checkpoint(root / "run", 10, world=2, skip={SHARD.split("/")[1]})
    (ckpt / SHARD).write_bytes(b"\0" * 100)
    state = tmp_path / "state"
    state.mkdir()
    assert by_rel(scanner(root, state))["run/checkpoint-10"].state is State.INCOMPLETE
    for lie in ("verdicts", "checkpoint"):
        by_rel(scanner(root, state))  # the truthful cache, written again
        lying_cache(state, root, ckpt, lie=lie)
        s = scanner(root, state)
        assert by_rel(s)["run/checkpoint-10"].state is State.COMPLETE  # the lie, as plan would show it
        fresh = s.reinspect("run", "checkpoint-10", now=time.time() + 3600)
        assert fresh.state is State.INCOMPLETE
        assert f"{SHARD.split('/')[1]} is not a complete zip archive" in str(fresh.checks)


@pytest.mark.parametrize("lie", ["verdicts", "checkpoint"])
def test_prune_with_a_lying_cache_deletes_nothing_it_must_not(tmp_path, lie):
    """End to end: the lie makes the truncated newest checkpoint look complete, so the plan deletes
    the older one; the reaper's re-check of the anchor (read afresh) refuses."""
    from tests.support.common import run_ckptd

    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 10, world=2)
    ckpt = hf_deepspeed_checkpoint(root / "run", 20, world=2)
    (ckpt / SHARD.replace("10", "20")).write_bytes(b"\0" * 100)
    old = time.time() - 3600
    for p in [*root.rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "c.toml"
    config.write_text(
        f"[daemon]\nstate_dir = '{state}'\n[[roots]]\npath = '{root}'\nworld_size = 2\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n"
    )
    by_rel(scanner(root, state))
    lying_cache(state, root, ckpt, lie=lie)
    plan = run_ckptd("plan", "-c", config, "--json")
    assert plan.returncode == 0, plan.stderr
    actions = {c["path"].rsplit("/", 1)[1]: c["action"] for c in json.loads(plan.stdout)["checkpoints"]}
    assert actions == {"checkpoint-10": "delete", "checkpoint-20": "keep"}  # the lie at work
    pruned = run_ckptd("prune", "-c", config)
    assert pruned.returncode == 0, pruned.stderr
    assert "refused" in pruned.stdout and "checkpoint-20" in pruned.stdout
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20"]


def test_a_runs_checkpoints_share_one_log_history(tmp_path):
    """Memory: each checkpoint's trainer_state.json logs the run's history up to its step; it is kept
    once per run, each checkpoint's a view of its first steps. A run restarted with another
    history keeps its own."""
    from ckptd.judge.verdicts import SharedHistory

    losses = {10: 0.5, 20: 0.4, 30: 0.3}
    for step in (30, 10, 20):  # looked at in any order
        hf_deepspeed_checkpoint(tmp_path / "run", step, world=2, losses=losses)
    hf_deepspeed_checkpoint(tmp_path / "run", 40, world=2, losses={10: 0.9, 40: 0.2})  # restarted
    s = scanner(tmp_path)
    found = {c.name: c.trainer_state.history for c in by_rel(s).values()}
    assert {name: dict(h) for name, h in found.items()} == {
        "checkpoint-10": {10: {"step": 10, "eval_loss": 0.5, "epoch": 0.01}},
        "checkpoint-20": {10: {"step": 10, "eval_loss": 0.5, "epoch": 0.01},
                          20: {"step": 20, "eval_loss": 0.4, "epoch": 0.02}},
        "checkpoint-30": {s: {"step": s, "eval_loss": v, "epoch": s / 1000} for s, v in losses.items()},
        "checkpoint-40": {10: {"step": 10, "eval_loss": 0.9, "epoch": 0.01},
                          40: {"step": 40, "eval_loss": 0.2, "epoch": 0.04}},
    }
    shared = [found[f"checkpoint-{s}"] for s in (10, 20, 30)]
    assert all(isinstance(h, SharedHistory) for h in shared) and not isinstance(found["checkpoint-40"], SharedHistory)
    assert shared[0][10] is shared[2][10]  # one row, not one per checkpoint
    assert 20 not in shared[0] and shared[0].get(30) is None and len(shared[1]) == 2


# --- what a restore and a re-check may rest on (deletion safety) ------------------------------------


def plain_scanner(root: Path, state: Path) -> Scanner:
    """No world size configured: the Trainer's DDP census counts ranks (`Checkpoint.ranks`)."""
    v = Verdicts(clock_ns=later)
    v.load(cache_path(state, root), root)
    return Scanner(Root(path=root, quiet_period=60), state_dir=state, verdicts=v)


def test_world_sizes_keep_every_field_through_the_cache():
    """`WorldSizes.shards` and `.bf16` decide whether optimizer shards are demanded at all (a
    ds_config saved as a path says no stage). Dropped on disk, a restart's census of an unchanged
    checkpoint with a missing shard demanded none: incomplete became complete."""
    import dataclasses

    from ckptd.judge.verdicts import _decode_verdict, _encode_verdict

    ws = dsmeta.WorldSizes(dp=4, mp=1, stage=None, source="model states", shards=True, bf16=True)
    encoded = json.loads(json.dumps(_encode_verdict(MemoryKind.WORLD, ws, {}, [])))
    back = _decode_verdict(MemoryKind.WORLD, encoded, [], dict)
    assert dataclasses.asdict(back) == dataclasses.asdict(ws)


def test_a_restored_checkpoint_is_the_looked_at_one_in_every_field(tmp_path):
    """Every field evidence computes survives a restart: written_at orders the 'written last'
    anchor, saved_at and ranks feed the sibling rank census, mounts are never deleted, metrics
    rank keep_best. Only the quiet check is judged afresh."""
    import dataclasses

    from tests.support.ddpfiles import ddp_checkpoint

    root = tmp_path / "vol"
    ddp_checkpoint(root / "run", 100, 8, time.time() - 7200)
    ddp_checkpoint(root / "run", 200, 8, time.time() - 3600)
    state = tmp_path / "state"
    state.mkdir()
    first = by_rel(plain_scanner(root, state))
    second = by_rel(plain_scanner(root, state))
    assert second.keys() == first.keys()
    for rel, c in first.items():
        assert c.ranks == 8 and c.written_at > 0 and c.saved_at > 0
        for f in dataclasses.fields(c):
            a, b = getattr(c, f.name), getattr(second[rel], f.name)
            if f.name == "checks":
                a, b = ([k for k in x if k.name != "quiet"] for x in (a, b))
            assert a == b, (rel, f.name)


def test_a_restart_keeps_the_sibling_rank_census(tmp_path):
    """Rank 7 of a DDP job never wrote its rng_state: only the run's earlier checkpoint (8 ranks)
    shows it. Restored without its rank count and save time, the census was skipped, and the
    short checkpoint became the run's newest complete one (keep_last=1: the last loadable goes)."""
    from tests.support.ddpfiles import ddp_checkpoint

    root = tmp_path / "vol"
    ddp_checkpoint(root / "run", 100, 8, time.time() - 7200)
    ddp_checkpoint(root / "run", 200, 7, time.time() - 3600)
    state = tmp_path / "state"
    state.mkdir()
    assert by_rel(plain_scanner(root, state))["run/checkpoint-200"].state is State.INCOMPLETE
    s = plain_scanner(root, state)
    assert s.verdicts.loaded == 2  # (restored, not looked at)
    assert by_rel(s)["run/checkpoint-200"].state is State.INCOMPLETE


def test_the_recheck_reads_every_file_even_what_this_process_read(tmp_path, reads):
    """The reaper's re-check consults no remembered verdict, its own process's included: a file
    rewritten in place within one timestamp tick keeps its identity (a volume whose clock lags
    ours defeats the racy-clean rule), and a deletion rests on what the files say now."""
    root = tmp_path / "vol"
    ckpt = hf_deepspeed_checkpoint(root / "run", 10, world=2)
    s = scanner(root)
    by_rel(s)
    torch_files = {str(p) for p in ckpt.rglob("*.pt*")}
    del reads[:]
    s.reinspect("run", "checkpoint-10", now=time.time() + 3600)
    assert torch_files <= set(reads)
    n = len(reads)
    by_rel(s)  # outside the re-check, the remembered verdicts serve
    assert not torch_files & set(reads[n:])


def test_a_cache_from_other_checks_or_layouts_is_ignored(tmp_path, monkeypatch):
    """The cache is versioned by the code its verdicts and restored checkpoints came from: the
    checks (evidence, dsmeta, slim), layouts (commit files, markers),
    mounts, config (patterns) and planner (the restore)."""
    from ckptd.judge import verdicts

    monkeypatch.setattr(verdicts, "_LOGIC", None)
    before = verdicts.logic_version()
    for name in ("discover/layouts", "volume/mounts", "decide/planner", "volume/volread", "judge/weights"):
        code = tmp_path / name
        shutil.copytree(verdicts._CODE_DIR, code, ignore=shutil.ignore_patterns("__pycache__"))
        with open(code / f"{name}.py", "a") as f:
            f.write("\n# another version\n")
        monkeypatch.setattr(verdicts, "_CODE_DIR", code)
        monkeypatch.setattr(verdicts, "_LOGIC", None)
        assert verdicts.logic_version() != before, name
        monkeypatch.undo()
        monkeypatch.setattr(verdicts, "_LOGIC", None)


def test_every_framework_module_is_part_of_the_logic_version():
    """A framework's save contract decides what a look finds: a change to any module of the
    frameworks package must discard saved verdicts, as a change to evidence.py does."""
    from ckptd.judge import verdicts

    package = Path(verdicts.__file__).parents[1] / "frameworks"
    modules = sorted(package.glob("*.py"))
    assert modules and set(modules) <= set(verdicts.logic_files())
    assert all(path.exists() for path in verdicts.logic_files())


def test_every_module_a_look_reads_through_is_part_of_the_logic_version():
    """The modules evidence.py and the whole-file readers import decide what a look finds: code
    moved out of evidence.py into a module of its own must still discard saved verdicts when it
    changes (a module the digest left out would let a cache hold verdicts the new code would not give)."""
    import ast

    from ckptd.judge import verdicts

    code = Path(verdicts.__file__).parents[1]
    digested = {path.resolve() for path in verdicts.logic_files()}
    for name in ("judge/evidence.py", "judge/wholefile.py"):
        tree = ast.parse((code / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptd"):
                package = code.joinpath(*node.module.split(".")[1:]).is_dir()
                targets = [f"{node.module}.{a.name}" for a in node.names] if package else [node.module]
                for target in targets:
                    rel = target.split(".")[1:]
                    module, package = code.joinpath(*rel).with_suffix(".py"), code.joinpath(*rel)
                    if target == "ckptd.judge.verdicts":
                        continue  # the digest's own file, hashed by logic_version itself
                    if module.exists():
                        assert module.resolve() in digested, f"{name} imports {target}: not in logic_files()"
                    elif package.is_dir():
                        assert (package / "__init__.py").resolve() in digested, f"{name} imports {target}"
