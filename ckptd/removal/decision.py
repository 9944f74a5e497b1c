"""What a trash entry carries of the decision that put it there, for the checks just after the
rename and for the purge, which judges again (removal/purge.py).

Beside each checkpoint renamed into the trash lies a small JSON record, `<entry>%decision`,
written and fsynced before the rename: the root, the run and the run directory's identity
(st_dev, st_ino), the checkpoint's name, why it was deleted, when, and the identity of what was
seen just before the rename (`snapshot`: every entry's relative path, kind, inode, size, mtime_ns
and ctime_ns). The purge reads it without this host's journal (another host's entry on a shared
volume, a state_dir lost since), and restores what differs from it (`changed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ckptd.discover import layouts
from ckptd.judge.evidence import TooDeep, walk

RECORD = "%decision"  # a trash entry's record: `<entry>%decision` (never a name `_trash_name` gives)

Snapshot = list[list[Any]]  # [[rel, kind, ino, size, mtime_ns, ctime_ns, nlink], ...], sorted by rel


def snapshot(name: str, dir_fd: int) -> Snapshot:
    """The identity of everything `name` (under `dir_fd`) holds, itself included, without following
    a symlink or entering another filesystem (`evidence.walk`). Raises OSError (TooDeep's entries
    are all there is to compare: a tree that deep is never deleted anyway)."""
    try:
        entries = walk(Path(f"/proc/self/fd/{dir_fd}") / name)
    except TooDeep as exc:
        entries = exc.entries
    return sorted([e.rel, e.kind, e.ino, e.size, e.mtime_ns, e.ctime_ns, e.nlink] for e in entries)


def digest(snap: Snapshot) -> str:
    """A short digest of a snapshot, for the journal's line."""
    return hashlib.sha256(json.dumps(snap, separators=(",", ":")).encode()).hexdigest()[:32]


def _same(was: list[Any], now: list[Any]) -> bool:
    """Whether one entry is what it was, by what a rename, or the purge of another name of the same
    file, does not change. Renaming the checkpoint itself changes its own ctime (and nothing else of
    it, nor anything inside): the top entry is compared without it; a directory's size and mtime
    move with what it holds, which is compared entry by entry. A file with other links (hard-linked
    from another checkpoint) has its ctime changed when one of them goes: compared by inode, size
    and mtime alone."""
    rel, kind, ino, size, mtime_ns, ctime_ns, nlink = was
    if (kind, ino) != (now[1], now[2]):
        return False
    if kind == "d":
        return True
    if (size, mtime_ns) != (now[3], now[4]):
        return False
    return rel == "" or nlink != 1 or now[6] != 1 or ctime_ns == now[5]


def changed(before: Snapshot, after: Snapshot) -> str | None:
    """What differs between two snapshots of one checkpoint, or None: a file added, removed or
    written (its inode, size, mtime or ctime: a write that kept its mtime changes the ctime)."""
    was = {row[0]: row for row in before}
    now = {row[0]: row for row in after}
    added = sorted(now.keys() - was.keys())
    gone = sorted(was.keys() - now.keys())
    written = sorted(k for k in now.keys() & was.keys() if not _same(was[k], now[k]))
    parts = [f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
             for what, names in (("added", added), ("removed", gone), ("written", [n or "itself" for n in written]))
             if names]
    return "; ".join(parts) or None


def pins_inside(snap: Snapshot) -> list[str]:
    """Every `.ckptd-keep` a snapshot holds, at any depth (its top's included)."""
    return [row[0] for row in snap if row[0] == layouts.PIN_FILE or row[0].endswith(f"/{layouts.PIN_FILE}")]


def write_record(name: str, trash_fd: int, record: dict[str, Any]) -> None:
    """Write `<name>%decision` under `trash_fd` and fsync it (and the trash): a crash after the
    rename finds it. Never replaces a file (O_EXCL), never follows a link. Raises OSError."""
    data = json.dumps(record, separators=(",", ":")).encode()
    fd = os.open(f"{name}{RECORD}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=trash_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        drop_record(name, trash_fd)
        raise
    os.close(fd)
    os.fsync(trash_fd)


def read_record(name: str, trash_fd: int) -> dict[str, Any] | None:
    """The record beside trash entry `name`, or None: none (an older ckptd's entry, another
    process's slim, no room to write it), or one that cannot be read as a record."""
    try:
        fd = os.open(f"{name}{RECORD}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=trash_fd)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("contents"), list):
        return None
    rows = record["contents"]
    if not all(isinstance(r, list) and len(r) == 7 and isinstance(r[0], str) for r in rows):
        return None
    return record


def drop_record(name: str, trash_fd: int) -> None:
    """Remove the record beside `name`, if there is one."""
    with contextlib.suppress(OSError):  # an orphan record is removed by a later purge
        os.unlink(f"{name}{RECORD}", dir_fd=trash_fd)
