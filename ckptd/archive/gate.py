"""The archive gate: why a checkpoint must not be deleted (or slimmed) yet, or None.

Asked by the reaper's re-check just before the rename (removal/recheck.py), by the purge just
before the irreversible removal (removal/purge.py, of the entry in the trash), and by `plan`. With
`required = true`, a checkpoint may go only where:
- its manifest is there and well formed, and names this very checkpoint;
- every file it lists is at the store with the size and full-object CRC32C it records;
- the checkpoint on disk is, entry for entry, what was read for upload: the same files and
  directories, each with the identity (dev, inode, size, mtime_ns, ctime_ns) the manifest
  records; a file whose ctime alone moved (renamed into the trash, chmod-ed, or rewritten in
  place with its mtime put back) is read again and its SHA-256 compared with the manifest's;
- its checksums were computed from these files by this ckptd (a local record, state_dir/archive/),
  or, where there is no such record (a manifest written by hand, a lost state_dir), every file is
  read again here and its SHA-256 compared with the manifest's.
With `verify = "read-back"`, every object is also downloaded and its SHA-256 computed here (not in
a dry run: `plan` does not download). Anything that cannot be checked (the store down, credentials
refused) is a reason to keep.

Bytes are compared by SHA-256, never by CRC32C alone: a CRC32C is affine, and anyone who can write
the bucket or the volume can choose 4 bytes that keep it over other bytes. A manifest written
before ckptd recorded SHA-256 (`FileEntry.sha256` None) is still trusted, but where its CRC32C
would be the only word (read-back, a file whose ctime moved) the object is downloaded and its
SHA-256 compared with the local file's, both computed here. Without such a comparison (no
read-back, no record, every ctime as recorded) its CRC32C is compared, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckptd.archive.manifest import (
    Digest,
    FileEntry,
    Manifest,
    NotArchivable,
    Snapshot,
    file_digest,
    identity,
    manifest_key,
    parse,
    snapshot,
)
from ckptd.archive.store import Store, StoreError
from ckptd.archive.upload import has_record, write_record
from ckptd.config import Root
from ckptd.decide.policy import Decision, Plan
from ckptd.model import Action, Checkpoint


def archive_problem(
    store: Store, c: Checkpoint, state_dir: Path | None, *, missing_ok: bool = False
) -> str | None:
    """Why `c`'s archive does not yet allow deleting it locally, or None. `missing_ok` (a dry run,
    `plan`): no archive yet is no reason where the store can be reached, as it would be archived first."""
    return problem_at(store, c.run, c.name, c.path, state_dir, missing_ok=missing_ok)


def problem_at(
    store: Store, run: str, name: str, path: Path, state_dir: Path | None, *, missing_ok: bool = False,
    read_back: bool = False, part_removed: bool = False,
) -> str | None:
    """`archive_problem` of checkpoint `name` of `run` whose files are at `path` now (its place in
    its run, or its entry in the trash, which the purge asks about). `read_back` (`verify =
    "read-back"`): every object is downloaded and its SHA-256 computed here, not taken from the
    store. `part_removed`: what a purge killed halfway left at `path`; the archive must be whole
    and verified as ever, and what is left of the checkpoint what was archived, files and
    directories gone excepted."""
    mkey = manifest_key(store.key(run, name))
    try:
        data = store.get(mkey)
        if data is None:
            snapshot(path, key=f"{run}/{name}")  # one that never can be archived says so
            if missing_ok:
                store.check()
                return None
            return f"not archived to {store.url} yet"
        try:
            m = parse(data)
        except ValueError as exc:
            return f"its manifest {mkey} is not one ckptd can trust: {exc}"
        if (m.run, m.checkpoint) != (run, name):
            return f"its manifest {mkey} names {m.run}/{m.checkpoint}, not this checkpoint"
        here = snapshot(path)
        what = m.snapshot().differs(here, but_ctime=True, but_removed=part_removed)
        if what is not None:
            return (f"differs from its archive at {store.url} ({what} since it was archived): "
                    "kept; ckptd never replaces an archive")
        why = _objects_problem(store, m, name, path, read_back=read_back) or _rewritten(store, m, here, path)
        if why is not None:
            return why
        if has_record(state_dir, store.url, mkey, data):
            return None
        for f in m.files:  # not written by this ckptd: read every file again
            if part_removed and f.path not in here.files:
                continue
            fpath = path / f.path if f.path else path
            d = file_digest(fpath)
            if not f.matches(d) or identity(os.stat(fpath, follow_symlinks=False))[:4] != f.identity[:4]:
                return f"its manifest {mkey} does not match {f.path or name} here ({_differ(d, f)})"
        write_record(state_dir, store.url, mkey, data)
        return None
    except StoreError as exc:
        return f"its archive cannot be checked: {exc}"
    except NotArchivable as exc:
        return f"cannot be archived: {exc}; kept because required = true"
    except OSError as exc:
        return f"cannot be compared with its archive: {exc}"
    except Exception as exc:  # a bug, or an answer nobody foresaw: keep
        return f"its archive cannot be checked: {type(exc).__name__}: {exc}"


def _objects_problem(store: Store, m: Manifest, name: str, path: Path, *, read_back: bool) -> str | None:
    """Why the objects `m` lists are not what was read: missing, or another size or CRC32C (as the
    store reports it; `read_back`: another size, CRC32C or SHA-256 as downloaded now; a file whose
    manifest records no SHA-256 is compared with the file at `path`). Or None."""
    for f in m.files:
        there = store.head(f.key)
        if there is None:
            return f"its archived {f.path or name} is missing from {store.url}"
        if there.size != f.size or there.crc32c != f.crc32c or there.checksum_type not in (None, "FULL_OBJECT"):
            return (f"its archived {f.path or name} at {store.url} is not what was read "
                    f"({there.size} bytes, CRC32C {there.crc32c}; the manifest says {f.size}, {f.crc32c})")
    if read_back:
        for f in m.files:
            got = Digest()
            store.download(f.key, got)  # type: ignore[arg-type]
            if not f.matches(got):
                return (f"its archived {f.path or name} at {store.url} reads back as {got.size} bytes, "
                        f"{_differ(got, f)}; the manifest says {f.size} bytes")
            if f.sha256 is None and (why := _against_local(got, f, path, name, store)) is not None:
                return why
    return None


def _against_local(got: Digest, f: FileEntry, path: Path, name: str, store: Store) -> str | None:
    """An object whose manifest records no SHA-256 (written by an older ckptd), downloaded as
    `got`: why it is not the local file's bytes (SHA-256 compared), or None."""
    here = file_digest(path / f.path if f.path else path)
    if here.sha256 == got.sha256:
        return None
    return (f"its archived {f.path or name} at {store.url} reads back with SHA-256 {got.sha256}, the file "
            f"here has {here.sha256} (its manifest, written before ckptd recorded SHA-256, has none)")


def _differ(d: Digest, f: FileEntry) -> str:
    """How bytes of digest `d` differ from file `f`'s in its manifest, in a few words."""
    if d.crc32c != f.crc32c:
        return f"CRC32C {d.crc32c}, not {f.crc32c}"
    if f.sha256 is not None and d.sha256 != f.sha256:
        return f"SHA-256 {d.sha256}, not {f.sha256}: the same CRC32C over other bytes"
    return f"{d.size} bytes, not {f.size}"


def _rewritten(store: Store, m: Manifest, here: Snapshot, path: Path) -> str | None:
    """Of the files whose ctime alone moved since `m` was written (renamed: a checkpoint that is one
    file, in the trash; chmod-ed; or rewritten in place with its mtime put back), the first whose
    bytes are not what was archived: by SHA-256; where the manifest records none, compared with
    the object downloaded now. Or None."""
    entries = {f.path: f for f in m.files}
    for rel in m.snapshot().touched(here):
        f = entries[rel]
        d = file_digest(path / rel if rel else path)
        if not f.matches(d):
            why = _differ(d, f)
        elif f.sha256 is None:
            there = Digest()
            store.download(f.key, there)  # type: ignore[arg-type]
            why = None if there.sha256 == d.sha256 else f"SHA-256 {d.sha256}, its object's {there.sha256}"
        else:
            why = None
        if why is not None:
            return (f"differs from its archive at {store.url} ({rel or 'the file'} rewritten in place since "
                    f"it was archived: {why}): kept; ckptd never replaces an archive")
    return None


def gated_plan(plan: Plan, roots: Sequence[Root], state_dir: Path | None) -> Plan:
    """`plan` as the reaper would carry it out with each root's archive: a deletion or slim that
    would be refused for want of a verified archive (the store cannot be reached, its archive
    differs) is a keep, saying why; one still to be archived says it will be first. Reads only
    (the store, and every file of a checkpoint whose manifest this ckptd did not write)."""
    from ckptd.archive.upload import archiver_for_plan

    archivers = {r.path: archiver_for_plan(r, state_dir) for r in roots if r.archive is not None}
    if not archivers:
        return plan
    out = []
    for d in plan.decisions:
        archiver = archivers.get(d.checkpoint.root)
        if archiver is None or d.action not in (Action.DELETE, Action.SLIM):
            out.append(d)
            continue
        why = archiver.problem(d.checkpoint, dry_run=True)
        if why is None:
            note = f"archived to {archiver.store.url} first, verified"
            out.append(Decision(d.checkpoint, d.action, (*d.reasons, note), d.protected, d.metric, d.metric_source))
        else:
            out.append(Decision(d.checkpoint, Action.KEEP, (*d.reasons, f"kept: {why}"), True, d.metric,
                                d.metric_source))
    return Plan(tuple(out), plan.warnings)
