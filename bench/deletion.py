"""7. Deletion: how soon a checkpoint is gone from its run, and how fast the trash empties.

Gone from its run: ckptd's `Reaper.trash_one` re-checks the checkpoint afresh
(walk, evidence, fingerprint), journals the intent (fsync) and renames it into
`<root>/.ckptd-trash/`; from then a trainer's auto-resume can no longer see it.
`rm -rf` leaves a half-deleted checkpoint in the run until its last unlink. Both on
a 256-rank checkpoint (256 shards, 256 rng states, 12 small files) that was
synced to disk first, as an old checkpoint would be; once with tiny shards and
once with 4 MiB shards (1 GiB), because the rename should not care.

Purge: `Reaper.purge` (rmtree from directory file descriptors, one journal
record per entry) vs `rm -rf` of an identical tree, in files/s and MB/s.

The second phase's cost: the purge's judging again of one trash entry (`Purging._rejudged`: its
record, a walk of it, pins, the resume pointer, the run's newest inspected afresh), per entry and
per GB, beside the first phase (`trash_one`) of the same checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from bench.context import Context
from bench.measure import check, fmt_bytes, fmt_ratio, fmt_time, median, run_child, settle, spread
from bench.report import Row, Section
from bench.volume import HOUR, write_checkpoint
from ckptd.config import Retention, Root
from ckptd.decide import rules
from ckptd.decide.planner import Scanner, decide
from ckptd.discover.layouts import TRASH_DIR
from ckptd.journal import Journal
from ckptd.judge.evidence import walk
from ckptd.model import Action
from ckptd.removal import trash as trash_module
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper

NAME = "7. deletion"
TARGET_S = 0.010


class _TimedOs:
    """`os` for the reaper module, with `rename` timed: how long the rename itself takes."""

    def __init__(self) -> None:
        self.rename_s = 0.0
        self.renamed_at = 0.0  # perf_counter when the checkpoint left its run

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def rename(self, src: object, dst: object, **kwargs: object) -> None:
        t0 = time.perf_counter()
        os.rename(src, dst, **kwargs)  # type: ignore[arg-type]  # the reaper renames via dir fds
        self.renamed_at = time.perf_counter()
        self.rename_s = self.renamed_at - t0


def _entries(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(path):
        files += len(filenames) + len(dirnames)
        size += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in filenames)
    return files, size


def gone_from_run(ctx: Context, work: Path, *, world: int, shard: int, reps: int) -> dict[str, list[float]]:
    root = work / "root"
    state = work / "state"
    run = root / "run"
    now = time.time()
    write_checkpoint(run, 10_000, world=world, mtime=now - HOUR)  # the run's newest: kept
    cfg = Root(path=root, world_size=world, retention=Retention(keep_last=1, keep_best=0), runs=())
    out: dict[str, list[float]] = {k: [] for k in ("gone", "trash_one", "recheck", "walk", "rename", "rm_rf",
                                                  "rejudge", "bytes")}
    timed_os = _TimedOs()
    for i in range(reps):
        step = 1000 + i
        target = write_checkpoint(run, step, world=world, mtime=now - 2 * HOUR, shard_size=shard)
        other = write_checkpoint(work / "rm", step, world=world, mtime=now - 2 * HOUR, shard_size=shard)
        settle(work)  # an old checkpoint is on disk, not dirty in the page cache
        scanner = Scanner(cfg)
        plan = decide([(cfg, scanner.runs(now=time.time()))])
        decision = next(d for d in plan.decisions if d.checkpoint.name == target.name)
        anchor = rules.anchors(d.checkpoint for d in plan.decisions)  # the run's newest: 10_000
        assert decision.action is Action.DELETE, decision.reasons
        reaper = Reaper(scanner, Journal(state), dry_run=False)
        if i % 2:  # alternate which goes first, so neither always meets the other's writeback
            out["rm_rf"].append(check(run_child(["rm", "-rf", str(other)]), "rm -rf").wall)
        t0 = time.perf_counter()
        walk(target)
        out["walk"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert reaper.recheck(decision, anchor) is None
        out["recheck"].append(time.perf_counter() - t0)
        trash_module.os = timed_os  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            result = reaper.trash_one(decision, anchor)
            out["trash_one"].append(time.perf_counter() - t0)
            out["gone"].append(timed_os.renamed_at - t0)
        finally:
            trash_module.os = os
        assert result.outcome is Outcome.TRASHED and not target.exists(), result.detail
        out["rename"].append(timed_os.rename_s)
        if not i % 2:
            out["rm_rf"].append(check(run_child(["rm", "-rf", str(other)]), "rm -rf").wall)
        assert result.trash_path is not None
        out["bytes"].append(_entries(result.trash_path)[1])
        trash_fd = os.open(result.trash_path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            t0 = time.perf_counter()
            why = reaper.purging._rejudged(result.trash_path.name, trash_fd, decision.checkpoint.rel)
            out["rejudge"].append(time.perf_counter() - t0)
        finally:
            os.close(trash_fd)
        assert why is None, why
        reaper.purge()
        assert reaper.journal is not None
        reaper.journal.close()
    return out


def purge_vs_rm(work: Path, *, checkpoints: int, world: int, shard: int, reps: int) -> dict:
    """Seconds for `Reaper.purge` and for `rm -rf` to delete identical trees, interleaved."""
    root = work / "root"
    trash = root / TRASH_DIR
    purge: list[float] = []
    rm: list[float] = []
    files = size = 0
    for i in range(reps):
        now = time.time()
        for c in range(checkpoints):
            write_checkpoint(trash, 1000 + c, world=world, mtime=now - HOUR, shard_size=shard)
            write_checkpoint(work / "rm", 1000 + c, world=world, mtime=now - HOUR, shard_size=shard)
            # Named as the trash names a slim's files (`removal/trash._trash_origin`): purged without
            # judging, so this measures the removal alone (the judging is measured beside the rename)
            (trash / f"checkpoint-{1000 + c}").rename(trash / f"{int(now)}-{c:08x}-checkpoint-{1000 + c}%slim")
        files, size = _entries(trash)
        settle(work)
        if i % 2:
            rm.append(check(run_child(["rm", "-rf", str(work / "rm")]), "rm -rf").wall)
        reaper = Reaper(Scanner(Root(path=root)), Journal(work / "state"), dry_run=False)
        t0 = time.perf_counter()
        count, _ = reaper.purge()
        purge.append(time.perf_counter() - t0)
        assert count == checkpoints and not any(trash.iterdir())
        assert reaper.journal is not None
        reaper.journal.close()
        if not i % 2:
            rm.append(check(run_child(["rm", "-rf", str(work / "rm")]), "rm -rf").wall)
    return {"files": files, "bytes": size, "purge": purge, "rm": rm}


def run(ctx: Context) -> tuple[list[Row], Section]:
    rows: list[Row] = []
    section = Section(
        NAME,
        "Gone from its run: `Reaper.trash_one` (re-check, fsynced journal record, rename into "
        "`.ckptd-trash/`) vs `rm -rf` (as a subprocess) of an identical checkpoint, both synced to "
        "disk first; the rename alone is timed inside trash_one. Purge: `Reaper.purge` of a full "
        "trash vs `rm -rf` of an identical tree. Target: gone from its run ≤ 10 ms, whatever its size.",
    )
    world = 16 if ctx.quick else 256
    big = (256 << 10) if ctx.quick else (4 << 20)
    reps = 2 if ctx.quick else 7
    # Untimed: the first deletion after other disk work is the slowest on this kind of box.
    warm = ctx.scratch("deletion-warm-up")
    write_checkpoint(warm, 1, world=world, mtime=time.time() - HOUR)
    settle(warm)
    shutil.rmtree(warm)
    for shard, k in ((0, reps), (big, 2 if ctx.quick else 5)):
        need = 3 * world * shard
        if need > ctx.free_bytes() * 0.8:
            ctx.log(f"deletion: skipping {world} × {fmt_bytes(shard)}: not enough free disk")
            continue
        label = f"{world} shards × {fmt_bytes(shard)}" if shard else f"{world} tiny shards"
        ctx.log(f"deletion: gone from run, {label}, {k} repetitions")
        t = gone_from_run(ctx, ctx.scratch("deletion"), world=world, shard=shard, reps=k)
        gone, rm, rename = median(t["gone"]), median(t["rm_rf"]), median(t["rename"])
        note = ""
        if gone > TARGET_S:
            note = (
                "The rename takes microseconds whatever the size; the rest is the strict re-check "
                "(`verdicts.strict`): this checkpoint and the run's newest complete one walked and their "
                "torch files' tails read afresh, trusting no remembered verdict, so it grows with the file "
                "count. Reusing the plan's evidence would cut it to a few walks, at the price of letting a "
                "cache decide a deletion."
            )
        rows.append(
            Row(
                NAME,
                f"{label}: gone from its run: the rename vs `rm -rf`",
                fmt_time(rename),
                fmt_time(rm),
                fmt_ratio(rename / rm),
                "≤ 10 ms",
                rename <= TARGET_S,
            )
        )
        rows.append(
            Row(
                NAME,
                f"{label}: gone from its run: re-check + journal + rename vs `rm -rf`",
                fmt_time(gone),
                fmt_time(rm),
                fmt_ratio(gone / rm),
                "≤ 10 ms",
                gone <= TARGET_S,
                note,
            )
        )
        rejudge, first = median(t["rejudge"]), median(t["trash_one"])
        gb = median(t["bytes"]) / 1e9
        rows.append(
            Row(
                NAME,
                f"{label}: the purge's judging again of its entry vs the first phase (trash_one)",
                f"{fmt_time(rejudge)}" + (f", {fmt_time(rejudge / gb)}/GB" if shard else ""),
                fmt_time(first),
                fmt_ratio(rejudge / first),
            )
        )
        section.details.append(
            f"{label}: the purge judges its entry again in {spread(t['rejudge'])}"
            f" ({fmt_bytes(int(median(t['bytes'])))}); the first phase took {fmt_time(first)}."
        )
        section.details.append(
            f"{label}: gone from its run after {spread(t['gone'])}: re-check {spread(t['recheck'])}, "
            f"a fsynced journal record, rename {spread(t['rename'])}; trash_one returns after "
            f"{fmt_time(median(t['trash_one']))} (a second journal record); `rm -rf` {spread(t['rm_rf'])}."
        )
    for n, shard in ((3 if ctx.quick else 5, 0), (1, big)):
        if 2 * n * world * shard > ctx.free_bytes() * 0.8:
            continue
        label = f"{n} × {world} tiny shards" if not shard else f"{n} × {world} shards × {fmt_bytes(shard)}"
        k = 2 if ctx.quick else (5 if not shard else 3)
        ctx.log(f"deletion: purge vs rm -rf, {label}, {k} repetitions")
        p = purge_vs_rm(ctx.scratch("purge"), checkpoints=n, world=world, shard=shard, reps=k)
        purge, rm = median(p["purge"]), median(p["rm"])
        mb = ", {:,.0f} MB/s" if shard else ""
        rows.append(
            Row(
                NAME,
                f"purge {label} vs `rm -rf` (time ratio)",
                f"{p['files'] / purge:,.0f} files/s" + mb.format(p["bytes"] / purge / 1e6),
                f"{p['files'] / rm:,.0f} files/s" + mb.format(p["bytes"] / rm / 1e6),
                fmt_ratio(purge / rm),
            )
        )
        section.details.append(
            f"purge {label} ({p['files']:,} entries, {fmt_bytes(p['bytes'])}): ckptd {spread(p['purge'])}, "
            f"`rm -rf` {spread(p['rm'])}; interleaved, alternating which goes first."
        )
    shutil.rmtree(ctx.workdir / "deletion", ignore_errors=True)
    shutil.rmtree(ctx.workdir / "purge", ignore_errors=True)
    return rows, section
