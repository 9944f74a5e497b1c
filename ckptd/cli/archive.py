"""`ckptd archive list` and `ckptd restore`: what each root's archive holds, and a checkpoint back
from it, every file verified against its manifest, into a directory that appears only when whole."""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

from ckptd.archive.manifest import SUFFIX, Digest, outside, parse
from ckptd.archive.store import StoreError, object_url
from ckptd.archive.upload import Archiver, archiver_for_plan
from ckptd.cli.common import load, scan_all, with_effective_quiet
from ckptd.cli.progress import Ticker
from ckptd.config import Config, Root
from ckptd.decide.policy import Decision
from ckptd.errors import EX_OK, IOFault, UsageError
from ckptd.formatting import format_size
from ckptd.journal import read_journal
from ckptd.model import Action
from ckptd.removal.fs import _remove_at, _rename_noreplace
from ckptd.volume.mounts import holder

ARCHIVE_EVENTS = ("archiving", "archived", "archive-failed")
# A restore's hidden directory beside its target, `<RESTORE_TMP><checkpoint>-<random>`, held with
# flock(2) while the restore runs (`_new_temp`); one no restore holds was left by a killed one
RESTORE_TMP = ".ckptd-restore-"

log = logging.getLogger(__name__)


def _archived_roots(config: Config, target: str | None) -> tuple[list[Root], str | None]:
    """The roots with an archive that `target` names (a root, a directory inside one, or a run
    relative to a root), and the run prefix within it."""
    roots = [r for r in config.roots if r.archive is not None]
    if not roots:
        raise UsageError("no root has an archive: configure [roots.archive] (docs/archive.md)")
    if target is None:
        return roots, None
    path = Path(os.path.abspath(target))
    for r in roots:
        if path == r.path:
            return [r], None
        if path.is_relative_to(r.path):
            return [r], str(path.relative_to(r.path))
    return roots, target.strip("/")  # a run named as the archive names it


def _local_states(config: Config) -> dict[str, tuple[str, str]]:
    """Each checkpoint's last archive event in the journal, by its path: (event, why)."""
    out: dict[str, tuple[str, str]] = {}
    for rec in read_journal(config.daemon.state_dir):
        if rec.get("event") in ARCHIVE_EVENTS:
            out[str(rec.get("path"))] = (str(rec["event"]), str(rec.get("why", "")))
    return out


def _decisions(config: Config) -> dict[Path, list[Decision]]:
    """Each root's decisions as `plan` makes them now (the volume read, nothing written). A root
    that is not here (the list read on another machine, to restore from) has none: the list is of
    the archive first."""
    here = tuple(r for r in config.roots if r.archive is not None and r.path.is_dir())
    if not here:
        return {}
    _, plan = scan_all(with_effective_quiet(config.model_copy(update={"roots": here})), time.time(), quiet=True)
    out: dict[Path, list[Decision]] = {}
    for d in plan.decisions:
        out.setdefault(d.checkpoint.root, []).append(d)
    return out


def _pending(
    archiver: Archiver, decisions: list[Decision], seen: set[str], run: str | None
) -> list[dict[str, object]]:
    """The checkpoints to be archived (`Archiver.wanted`: retention would delete or slim them, or
    every complete one 'on-complete') with no archive and no attempt yet."""
    rows: list[dict[str, object]] = []
    for c in archiver.wanted(decisions):
        if str(c.path) in seen or (run and c.run != run and not c.run.startswith(f"{run}/")):
            continue
        why = ("complete: archived at the next pass" if archiver.cfg.when == "on-complete" and
               not any(d.checkpoint is c and d.action in (Action.DELETE, Action.SLIM) for d in decisions)
               else "retention would delete it: archived first, at the next pass")
        rows.append({"root": str(c.root), "run": c.run, "checkpoint": c.name, "state": "pending", "why": why,
                     "step": c.step, "local": True})
    return rows


def cmd_archive(args: argparse.Namespace) -> int:
    config = load(args)
    roots, run = _archived_roots(config, args.target)
    rows = []
    journal = _local_states(config)
    decisions = _decisions(config)
    for root in roots:
        archiver = archiver_for_plan(root, config.daemon.state_dir)
        store = archiver.store
        prefix = store.key(run) if run else store.key()
        prefix = f"{prefix}/" if prefix else ""
        seen = set()
        try:
            for key in store.keys(prefix):
                if not key.endswith(SUFFIX):
                    continue
                data = store.get(key)
                try:
                    m = parse(data or b"")
                except ValueError as exc:
                    rows.append({"root": str(root.path), "key": key, "state": "unreadable", "why": str(exc)})
                    continue
                path = root.path / m.run / m.checkpoint if m.run != "." else root.path / m.checkpoint
                seen.add(str(path))
                rows.append({"root": str(root.path), "run": m.run, "checkpoint": m.checkpoint, "state": "archived",
                             "step": m.meta.get("step"), "files": len(m.files), "bytes": m.size,
                             "archived_at": m.meta.get("archived_at"), "local": path.exists(),
                             "url": object_url(store, key)})
        except StoreError as exc:
            raise IOFault(f"{root.path}: {exc}") from None
        for path, (event, why) in sorted(journal.items()):
            if path in seen or not Path(path).is_relative_to(root.path) or event == "archived":
                continue
            rel = os.path.relpath(path, root.path)
            if run and not rel.startswith(f"{run}/"):
                continue
            state = "failed" if event == "archive-failed" else "interrupted"
            seen.add(path)
            rows.append({"root": str(root.path), "run": os.path.dirname(rel) or ".", "checkpoint": os.path.basename(rel),
                         "state": state, "why": why, "local": os.path.exists(path)})
        rows += _pending(archiver, decisions.get(root.path, []), seen, run)
    if args.json:
        print(json.dumps({"archives": rows}, indent=2))
        return EX_OK
    for r in rows:
        where = f"{r.get('run', '?')}/{r.get('checkpoint', r.get('key'))}"
        if r["state"] == "archived":
            local = "local copy present" if r["local"] else "local copy gone"
            print(f"archived     {where}  {r['files']} files, {format_size(r['bytes'])}, {local}")
        else:
            print(f"{r['state']:<12} {where}  {r.get('why', '')}".rstrip())
    if not rows:
        print("nothing archived yet")
    return EX_OK


def cmd_restore(args: argparse.Namespace) -> int:
    config = load(args)
    roots, _ = _archived_roots(config, None)
    run, _, name = args.checkpoint.strip("/").rpartition("/")
    run = run or "."
    for root in roots:
        store = archiver_for_plan(root, None).store
        mkey = f"{store.key(run, name)}{SUFFIX}"
        try:
            data = store.get(mkey)
        except StoreError as exc:
            raise IOFault(f"{root.path}: {exc}") from None
        if data is not None:
            break
    else:
        raise UsageError(f"{args.checkpoint}: no archive of it in any root's store (ckptd archive list)")
    try:
        m = parse(data)
    except ValueError as exc:
        raise IOFault(f"{mkey}: {exc}") from None
    if (m.run, m.checkpoint) != (run, name):  # another checkpoint's manifest copied over this one's
        raise IOFault(f"{mkey}: names {m.run}/{m.checkpoint}, not {run}/{name}: not restored")
    into = Path(os.path.abspath(args.to)) if args.to else (root.path / run if run != "." else root.path)
    dest = into / name
    if os.path.lexists(dest):
        raise UsageError(f"{dest} exists: restore --to another directory, or move it away first")
    into.mkdir(parents=True, exist_ok=True)
    clean_stale_restores(into)
    tmp, held = _new_temp(into, name)
    try:
        with Ticker(f"restore {args.checkpoint}", quiet=getattr(args, "quiet", False)) as ticker:
            _download(store, m, tmp / name, ticker)
        # Whole, or not there at all; never over what appeared there meanwhile.
        src_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        dst_fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _rename_noreplace(name, src_fd, name, dst_fd)
        except FileExistsError:
            raise UsageError(f"{dest} appeared while it was restored: left as it is, nothing restored") from None
        finally:
            os.close(src_fd)
            os.close(dst_fd)
    except StoreError as exc:
        raise IOFault(f"not restored: {exc}") from None
    finally:
        _remove_own(into, tmp.name, held)
    how = "every file verified" if all(f.sha256 is not None for f in m.files) else (
        "every file's CRC32C verified; its manifest, written before ckptd recorded SHA-256, has no SHA-256")
    print(f"restored {dest} ({len(m.files)} files, {format_size(m.size)}, {how})")
    return EX_OK


def _new_temp(into: Path, name: str) -> tuple[Path, int]:
    """A new hidden directory in `into` to restore `name` into, and a descriptor of it holding an
    exclusive flock(2) for as long as this restore runs: what tells another restore's
    `clean_stale_restores` that it is not a killed one's. Where the filesystem refuses flock on a
    directory (NFS), held by nothing: then no restore can tell, and none removes it."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f"{RESTORE_TMP}{name}-", dir=into))
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            # Blocks only while another restore's cleaning, which took it between mkdtemp and here,
            # removes it: then it is gone (below) and another is made.
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return tmp, fd
        try:
            if os.lstat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _remove_own(into: Path, name: str, held: int) -> None:
    """This restore's hidden directory removed (empty once renamed into place; else what a failed
    restore downloaded), from descriptors, then its hold let go."""
    try:
        into_fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if os.stat(name, dir_fd=into_fd, follow_symlinks=False).st_ino == os.fstat(held).st_ino:
                _remove_at(name, into_fd)
        finally:
            os.close(into_fd)
    except OSError as exc:
        log.warning("cannot remove %s: %s", into / name, exc)
    finally:
        os.close(held)


def clean_stale_restores(into: Path) -> list[str]:
    """Remove from `into` what killed restores left: directories named as a restore names its hidden
    one (`RESTORE_TMP`) that no running restore holds (flock, taken here without waiting, and held
    while removing). Never a symlink of that name, nor anything else; removed from descriptors,
    never following a link nor entering another filesystem (`removal.fs._remove_at`). One that
    cannot be locked (in use, or a filesystem without flock on directories) is left. The names
    removed."""
    try:
        into_fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    removed = []
    try:
        for entry in os.listdir(into_fd):
            if entry.startswith(RESTORE_TMP) and _remove_if_stale(entry, into_fd):
                removed.append(entry)
                log.warning("removed %s, left by a restore that did not finish", into / entry)
    finally:
        os.close(into_fd)
    return removed


def _remove_if_stale(entry: str, into_fd: int) -> bool:
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=into_fd)
    except OSError:  # a symlink (ELOOP), not a directory, gone: not a restore's
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.debug("cannot tell whether %s is in use (%s): left", entry, exc)
            return False
        st, held = os.stat(entry, dir_fd=into_fd, follow_symlinks=False), os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
            return False  # replaced since it was opened
        _remove_at(entry, into_fd)
        return True
    except OSError as exc:
        log.warning("cannot remove %s, left by a restore that did not finish: %s", entry, exc)
        return False
    finally:
        os.close(fd)


class _Writing:
    """A download's sink: each chunk written to `out` and fed to a digest (no second read)."""

    def __init__(self, out: object) -> None:
        self.out = out
        self.digest = Digest()

    def write(self, chunk: bytes) -> int:
        self.digest.update(chunk)
        return self.out.write(chunk)  # type: ignore[attr-defined, no-any-return]


def _inside(dest: Path, rel: str) -> Path:
    """`dest / rel`, confirmed to stay inside `dest` (parse refuses `..` and absolute paths; this
    is the last word before anything is made): StoreError where it would not."""
    path = Path(os.path.normpath(dest / rel))
    if outside(rel) or not path.is_relative_to(dest) or path == dest:
        raise StoreError(f"the manifest names {rel!r}, outside the checkpoint: nothing restored")
    return path


def _download(store: object, m: object, dest: Path, ticker: Ticker) -> None:
    """Every file of manifest `m` into `dest`, each checked against its size, CRC32C and SHA-256 (a
    manifest written before ckptd recorded SHA-256: CRC32C only, as `restore` then says); `ticker`
    told how far it is (drawn on a terminal once slow)."""
    total, done = m.size, 0  # type: ignore[attr-defined]
    ticker.working(f"0 of {format_size(total)} downloaded")
    if not m.is_file:  # type: ignore[attr-defined]
        dest.mkdir()
        for d in m.dirs:  # type: ignore[attr-defined]
            (_inside(dest, d)).mkdir(parents=True, exist_ok=True)
    for f in m.files:  # type: ignore[attr-defined]
        path = _inside(dest, f.path) if f.path else dest
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            got = _Writing(out)
            store.download(f.key, got)  # type: ignore[attr-defined]
            out.flush()
            os.fsync(out.fileno())
        d = got.digest
        if not f.matches(d):
            sha = f"SHA-256 {d.sha256}" if f.sha256 is not None else f"CRC32C {d.crc32c}"
            want = f.sha256 if f.sha256 is not None else f.crc32c
            raise StoreError(f"{f.key}: downloaded {d.size} bytes, {sha}; the manifest says {f.size}, {want}")
        done += d.size
        ticker.saying(f"{format_size(done)} of {format_size(total)} downloaded and verified")


def newest_archived(config: Config, run_dir: Path) -> dict[str, object] | None:
    """The archived checkpoint of the run at `run_dir` with the highest step, from its manifests
    (well formed ones only), or None: for `ckptd latest --archive`."""
    found = holder(run_dir, ((r.path, r) for r in config.roots if r.archive is not None))
    if found is None:
        raise UsageError(f"{run_dir} is in no root with an archive: configure [roots.archive] (docs/archive.md)")
    run, root = found
    store = archiver_for_plan(root, None).store
    best: dict[str, object] | None = None
    try:
        for key in store.keys(f"{store.key(run)}/", shallow=True):
            if not key.endswith(SUFFIX):
                continue
            try:
                m = parse(store.get(key) or b"")
            except ValueError:
                continue
            step = m.meta.get("step")
            if isinstance(step, int) and (best is None or step > best["step"]):  # type: ignore[operator]
                best = {"run": m.run, "checkpoint": m.checkpoint, "step": step,
                        "url": object_url(store, key.removesuffix(SUFFIX))}
    except StoreError as exc:
        raise IOFault(f"{root.path}: {exc}") from None
    return best
