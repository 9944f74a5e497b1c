"""Judging commit records (`ckptd.attest`) against the disk.

A checkpoint directory holding `.ckptd/commit-rank<R>-of-<W>.json` records, or save leases, gets
its verdict here; one without either is judged exactly as before (`checks` returns nothing).

- `attested` passed: every rank 0..W-1 has a record, every file a record lists is there with the
  size and mtime it lists (in one record at least, where several list it: a rank may have
  listed another's file mid-write), no lease is live, and nothing in the checkpoint newer than the
  save's start is left unlisted. `model.classify` then needs no quiet period; every other check
  (the framework's contract, file integrity) must still pass.
- `commit records` passed: the same, but some file no record lists is newer than the save's
  start (another writer's?): the quiet period still applies.
- `commit records` passed too where every listed file is at a listed size but some at another
  mtime (a copy without mtimes, a rewrite in place): the records vouch for nothing, veto nothing.
- `commit records` failed: a rank's record is missing ("committed by 3/4 ranks"), records that
  disagree with each other or with the disk (a copy-in without its weights, a size changed), or
  a lease whose heartbeat stopped ("abandoned: rank 3's save stopped at ..."). Incomplete, never
  "complete on quiet". What an earlier save left before a whole later save of another world size
  began (a job restarted on fewer ranks) is superseded by it (`_latest_save`).
- `save lease` failed: a rank's save is in progress (its lease's heartbeat is recent): writing,
  whatever the files say.

Pure but for `checks`, which reads the records and the wall clock and hands them to `judge`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ckptd.attest import RECORD_DIR
from ckptd.formatting import format_age
from ckptd.model import ATTESTED, COMMIT_RECORDS, SAVE_LEASE, Check, Entry, Verdict
from ckptd.volume import volread

STALE_AFTER = 120.0  # seconds without a heartbeat before a lease is an abandoned save
STALE_BEATS = 6  # ... or this many of its own heartbeat intervals, if longer
MTIME_SLACK_NS = 2_000_000_000  # a copy onto a filesystem with coarser timestamps (cp -p)
MAX_RECORD_BYTES = 16 * 1024 * 1024
_RECORD = re.compile(r"commit-rank(\d+)-of-(\d+)\.json")
_LEASE = re.compile(r"lease-rank(\d+)-of-(\d+)\.json")


@dataclass(frozen=True)
class Record:
    rank: int
    world_size: int
    step: int | None
    committed_at: float
    started_at: float | None
    token: str | None
    host: str
    files: tuple[tuple[str, int, int], ...]  # (path, size, mtime_ns)


@dataclass(frozen=True)
class Lease:
    rank: int
    world_size: int
    token: str | None
    host: str
    pid: int | None
    started_at: float | None
    heartbeat: float
    beat_at: float  # the lease file's mtime: its last heartbeat


def is_metadata(rel: str) -> bool:
    """Whether `rel` (relative to a checkpoint) is ckptd's own metadata, not checkpoint content."""
    return rel == RECORD_DIR or rel.startswith(f"{RECORD_DIR}/")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_record(name: str, data: bytes) -> Record:
    """A record from its file name and bytes; ValueError saying what is wrong."""
    m = _RECORD.fullmatch(name)
    if m is None:
        raise ValueError("not a record's name")
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("ckptd_commit") != 1:
        raise ValueError("not a version 1 commit record")
    rank, world = doc.get("rank"), doc.get("world_size")
    if (rank, world) != (int(m[1]), int(m[2])):
        raise ValueError(f"its name says rank {m[1]} of {m[2]}, its content rank {rank} of {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of a world of {world}")
    files = doc.get("files")
    if not isinstance(files, list):
        raise ValueError("no file list")
    out = []
    for f in files:
        if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                and isinstance(f.get("mtime_ns"), int)):  # fmt: skip
            raise ValueError(f"a malformed file entry: {str(f)[:80]}")
        path = os.path.normpath(f["path"])
        if path.startswith(("/", "..")) or is_metadata(path):
            raise ValueError(f"lists a path outside the checkpoint: {f['path'][:80]}")
        out.append((path, f["size"], f["mtime_ns"]))
    committed = doc.get("committed_at")
    if not isinstance(committed, int | float):
        raise ValueError("no committed_at")
    started = doc.get("started_at")
    step = doc.get("step")
    return Record(
        rank, world, step if isinstance(step, int) else None, float(committed),
        float(started) if isinstance(started, int | float) else None,
        doc.get("token") if isinstance(doc.get("token"), str) else None,
        str(doc.get("host", "?")), tuple(out),
    )  # fmt: skip


def parse_lease(name: str, data: bytes, beat_at: float) -> Lease:
    m = _LEASE.fullmatch(name)
    if m is None:
        raise ValueError("not a lease's name")
    try:
        doc = json.loads(data)
    except ValueError:
        doc = {}  # torn or empty: still a save in progress, judged by its mtime
    doc = doc if isinstance(doc, dict) else {}
    beat = doc.get("heartbeat")
    started = doc.get("started_at")
    return Lease(
        int(m[1]), int(m[2]), doc.get("token") if isinstance(doc.get("token"), str) else None,
        str(doc.get("host", "?")), doc.get("pid") if isinstance(doc.get("pid"), int) else None,
        float(started) if isinstance(started, int | float) else None,
        float(beat) if isinstance(beat, int | float) and beat > 0 else 10.0, beat_at,
    )  # fmt: skip


def read(path: Path, files: Mapping[str, Entry]) -> tuple[list[Record], list[Lease], list[str]]:
    """The records and leases in the checkpoint at `path` (`files`: its walk), and the problems
    of those that cannot be read."""
    records: list[Record] = []
    leases: list[Lease] = []
    problems: list[str] = []
    for rel, e in files.items():
        d, _, name = rel.rpartition("/")
        if d != RECORD_DIR or e.kind != "f" or not (_RECORD.fullmatch(name) or _LEASE.fullmatch(name)):
            continue
        if e.size > MAX_RECORD_BYTES:
            problems.append(f"{rel} is {e.size} bytes, more than a record holds")
            continue
        try:
            data = volread.read_bytes(path / rel, MAX_RECORD_BYTES + 1)  # no FIFO, no symlink swapped in
            if name.startswith("commit-"):
                records.append(parse_record(name, data))
            else:
                leases.append(parse_lease(name, data, e.mtime_ns / 1e9))
        except FileNotFoundError:
            problems.append(f"{rel} vanished while read")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{rel} is unreadable: {exc}")
    return records, leases, problems


def stale_after(lease: Lease) -> float:
    return max(STALE_AFTER, STALE_BEATS * lease.heartbeat)


def _latest_save(records: list[Record], leases: list[Lease], now: float) -> tuple[list[Record], list[Lease]]:
    """The records and leases left once a later, complete save of another world size is taken to
    supersede what an earlier save into the same directory left: a job killed mid-save (its leases'
    heartbeat long stopped) or one that committed, restarted on more or fewer ranks, saving there
    again. Only what stopped before the later save began goes: a live lease, or a record or lease
    of another world size from while it ran, stays (two saves at once are no one save)."""
    began: dict[int, float] = {}  # world size -> when its save began, by its own records
    ranks: dict[int, set[int]] = {}
    for r in records:
        t = min(r.started_at or r.committed_at, r.committed_at)
        began[r.world_size] = min(began.get(r.world_size, t), t)
        ranks.setdefault(r.world_size, set()).add(r.rank)
    if not began or (len(began) == 1 and all(lease.world_size in began for lease in leases)):
        return records, leases
    world = max(began, key=lambda w: (began[w], w))
    if len(ranks[world]) < world:
        return records, leases  # not a whole save: supersedes nothing
    start = began[world]
    kept_records = [r for r in records if r.world_size == world or r.committed_at >= start]
    kept_leases = [
        lease for lease in leases
        if lease.world_size == world or lease.beat_at >= start or now - lease.beat_at <= stale_after(lease)
    ]  # fmt: skip
    return kept_records, kept_leases


def _lease_checks(
    leases: list[Lease], done: set[tuple[int, str | None]], now: float
) -> tuple[list[Check], list[str]]:
    """The checks of the leases whose save is in progress (heartbeat recent) and the problems of those
    whose heartbeat stopped; `done`: the (rank, token) of the saves that committed."""
    live: list[Check] = []
    abandoned: list[str] = []
    for lease in sorted(leases, key=lambda x: x.rank):
        if (lease.rank, lease.token) in done:
            continue  # its save committed; the lease outlived it (killed between the two)
        age = now - lease.beat_at
        who = f"rank {lease.rank}'s save ({lease.host}, pid {lease.pid})"
        if age <= stale_after(lease):  # a future mtime too: a clock ahead is not a stopped heartbeat
            beat = format_age(max(age, 0))
            live.append(Check(SAVE_LEASE, Verdict.FAILED, f"{who} in progress: heartbeat {beat} ago"))
        else:
            abandoned.append(
                f"abandoned: rank {lease.rank}'s save stopped at {_iso(lease.beat_at)} "
                f"(no heartbeat for {format_age(age)}, {lease.host} pid {lease.pid})"
            )
    return live, abandoned


def _missing_ranks(have: set[int], world: int) -> str:
    """The first few ranks of 0..world-1 without a record, "3, 5 ..." (a record may claim any world size)."""
    missing: list[int] = []
    for r in range(world):  # stops after the 9th missing: as many turns as records, and 9
        if r not in have:
            missing.append(r)
            if len(missing) > 8:
                break
    return ", ".join(map(str, missing[:8])) + (" ..." if world - len(have) > 8 else "")


def _disagreements(records: list[Record]) -> list[str]:
    """What the records say against one another: two world sizes, ranks without a record, two steps."""
    out: list[str] = []
    worlds = sorted({r.world_size for r in records})
    if len(worlds) > 1:
        out.append(f"records disagree on the world size ({', '.join(map(str, worlds))})")
    elif worlds:
        world = worlds[0]
        have = {r.rank for r in records}  # each in 0..world-1 (parse_record)
        if len(have) < world:
            shown = _missing_ranks(have, world)
            out.append(f"committed by {len(have)}/{world} ranks; no record from rank {shown}")
    steps = sorted({r.step for r in records if r.step is not None})
    if len(steps) > 1:
        out.append(f"records disagree on the step ({', '.join(map(str, steps))})")
    return out


def _listings(records: list[Record]) -> dict[str, list[tuple[int, int, int]]]:
    """Each listed path's listings, [(size, mtime_ns, rank)], the earliest committed first.

    A file may be listed by several ranks: on a shared filesystem a rank lists what changed since
    its save began, another rank's file mid-write among it. The rank that wrote it listed it
    whole, after writing it: one listing that the disk agrees with is enough."""
    listings: dict[str, list[tuple[int, int, int]]] = {}
    for r in sorted(records, key=lambda r: r.committed_at):
        for path, size, mtime_ns in r.files:
            listings.setdefault(path, []).append((size, mtime_ns, r.rank))
    return listings


def _against_disk(
    listings: Mapping[str, list[tuple[int, int, int]]], files: Mapping[str, Entry], removed: Collection[str]
) -> tuple[list[str], list[str], list[str]]:
    """The listed files that are not there, those at a size no listing gives, and those at a listed
    size but another mtime (the worst said first: a file missing, then changed)."""
    gone: list[str] = []
    resized: list[str] = []
    touched: list[str] = []
    for path, listed in sorted(listings.items()):
        e = files.get(path)
        size, _, rank = listed[-1]
        if e is None and path in removed:
            continue  # slimmed away by ckptd, as its marker records
        if e is None or e.kind != "f":
            gone.append(f"rank {rank}'s record lists {path}, which is not there")
        elif not any(e.size == s and abs(e.mtime_ns - m) <= MTIME_SLACK_NS for s, m, _ in listed):
            if all(e.size != s for s, _, _ in listed):
                resized.append(f"rank {rank}'s record lists {path} at {size} bytes, the disk has {e.size}")
            else:
                touched.append(f"{path} changed after rank {rank}'s record (its mtime differs)")
    return gone, resized, touched


def _passed(
    records: list[Record],
    listings: Mapping[str, list[tuple[int, int, int]]],
    files: Mapping[str, Entry],
    touched: list[str],
) -> Check:
    """The check of records that agree with one another and with the disk (`touched`: the listed
    files at another mtime): attested, or commit records that leave the quiet period in force."""
    world = records[0].world_size  # one world size by now (_disagreements)
    at = _iso(max(r.committed_at for r in records))
    if touched:
        # Every file there at the size a record lists, but some at another mtime: a copy that did
        # not keep mtimes (`cp -r`), or a rewrite in place. The records no longer describe those
        # files, so they vouch for nothing; they veto nothing either: judged as without them (quiet
        # period, the framework's checks). Missing or resized files above still fail.
        more = f" (and {len(touched) - 1} more)" if len(touched) > 1 else ""
        why = f"committed by {world}/{world} ranks at {at}; {touched[0]}{more}: judged on quiet too"
        return Check(COMMIT_RECORDS, Verdict.PASSED, why)
    said = f"committed by {world}/{world} ranks at {at}; every listed file as recorded"
    # When the save began, by the disk as much as by the records: the oldest mtime of a listed file
    # bounds it whatever a record says of itself (a started_at in the future hides nothing).
    starts = [min(r.started_at or r.committed_at, r.committed_at) * 1e9 for r in records]
    starts += [files[p].mtime_ns for p in listings if p in files]
    began_ns = int(min(starts)) - MTIME_SLACK_NS
    unlisted = sorted(
        rel for rel, e in files.items()
        if e.kind == "f" and rel not in listings and not is_metadata(rel) and e.mtime_ns > began_ns
    )  # fmt: skip
    if not listings:  # records that name no file vouch for none: what is there may be in flight
        return Check(COMMIT_RECORDS, Verdict.PASSED, f"{said}; no record lists a file: judged on quiet too")
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (" ..." if len(unlisted) > 3 else "")
        why = f"{said}; no record lists {shown}: judged on quiet too"
        return Check(COMMIT_RECORDS, Verdict.PASSED, why)
    return Check(ATTESTED, Verdict.PASSED, said)


def judge(
    records: list[Record],
    leases: list[Lease],
    problems: list[str],
    files: Mapping[str, Entry],
    *,
    now: float,
    removed: Collection[str] = frozenset(),
) -> list[Check]:
    """The checks the records and leases give the checkpoint whose walk is `files`, at wall time `now`.
    `removed`: the files ckptd's slim marker says it removed on purpose (not demanded)."""
    if not records and not leases and not problems:
        return []
    records, leases = _latest_save(records, leases, now)
    done = {(r.rank, r.token) for r in records if r.token is not None}
    live, abandoned = _lease_checks(leases, done, now)
    if live:
        return live  # a live lease blocks judgement whatever the records say
    listings = _listings(records)
    gone, resized, touched = _against_disk(listings, files, removed)
    failed = [*problems, *abandoned, *_disagreements(records), *gone, *resized]
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return [Check(COMMIT_RECORDS, Verdict.FAILED, f"{failed[0]}{more}")]
    return [_passed(records, listings, files, touched)]


def checks(path: Path, files: Mapping[str, Entry], removed: Collection[str] = frozenset()) -> list[Check]:
    """The records' checks for the checkpoint at `path` ([] without records or leases); `removed`: what
    ckptd's slim marker says it removed."""
    if RECORD_DIR not in files:
        return []
    records, leases, problems = read(path, files)
    return judge(records, leases, problems, files, now=time.time(), removed=removed)


def committed_summary(checks_: tuple[Check, ...]) -> str | None:
    """"committed by 8/8 ranks at ..." for a checkpoint whose records vouch for it, else None."""
    for k in checks_:
        if k.name in (ATTESTED, COMMIT_RECORDS) and k.verdict is Verdict.PASSED:
            return k.detail.split(";")[0]
    return None
