"""What waits in a root's trash, read only: each entry with where it came from, why it was deleted,
what it holds and when its purge may take it (`trash_entries`), for `ckptd trash list`, `status`,
`plan` and the metrics. Names only and a walk of each entry; nothing here moves anything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.discover.layouts import HIDDEN_TRASH, TRASH_DIR
from ckptd.removal.decision import RECORD, read_record
from ckptd.removal.fs import _DIR_FLAGS
from ckptd.removal.purge import PURGING, _size
from ckptd.removal.trash import REVIEW, _trash_origin


@dataclass(frozen=True)
class TrashEntry:
    """One entry of a root's trash."""

    root: Path
    name: str  # its name in the trash (or at the root's top, under HIDDEN_TRASH)
    path: Path
    origin: str | None  # the path it came from, relative to the root; None: not known
    kind: str  # "checkpoint", "slim" (optimizer files), "consolidating", "review", "purging", "unknown"
    bytes: int
    trashed_at: float  # when it came in (its record's time, else its ctime)
    purge_after: float | None  # when its purge may take it (judged again first); None: never by itself
    reasons: tuple[str, ...] = field(default=())

    def json(self) -> dict[str, object]:
        return dict(name=self.name, path=str(self.path), root=str(self.root), origin=self.origin, kind=self.kind,
                    bytes=self.bytes, trashed_at=self.trashed_at, purge_after=self.purge_after,
                    reasons=list(self.reasons))


def _kind(name: str) -> tuple[str, str | None]:
    if name.endswith(REVIEW):
        origin = _trash_origin(name.removesuffix(REVIEW))
        return "review", origin[0] if origin else None
    if name.endswith(PURGING):
        origin = _trash_origin(name.removesuffix(PURGING))
        return "purging", origin[0] if origin else None
    origin = _trash_origin(name)
    if origin is None:
        return "unknown", None
    return {"": "checkpoint", "%slim": "slim", "%consolidating": "consolidating"}[origin[1]], origin[0]


def _entry(root: Path, where: Path, dir_fd: int, name: str, grace: float) -> TrashEntry | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None  # gone while we looked
    kind, origin = _kind(name)
    record = read_record(name, dir_fd) if kind == "checkpoint" else None
    trashed = record.get("time") if record is not None else None
    trashed_at = float(trashed) if isinstance(trashed, (int, float)) else st.st_ctime
    if kind == "checkpoint":
        purge_after: float | None = st.st_ctime + grace
    elif kind in ("slim", "consolidating", "purging"):
        purge_after = st.st_ctime
    else:
        purge_after = None  # held for review, or not ckptd's: never purged by itself
    reasons = record.get("reasons") if record is not None else None
    return TrashEntry(root=root, name=name, path=where / name, origin=origin, kind=kind, bytes=_size(where / name),
                      trashed_at=trashed_at, purge_after=purge_after,
                      reasons=tuple(str(r) for r in reasons) if isinstance(reasons, list) else ())


def trash_entries(root: Path, grace: float) -> list[TrashEntry]:
    """Every entry of `root`'s trash, and what was renamed into its top under ckptd's hidden name
    when there was no room for the trash, oldest first. `grace`: the root's trash_grace. [] where
    there is no trash (or it cannot be read)."""
    out: list[TrashEntry] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        for name in sorted(os.listdir(root_fd)):
            if name.startswith(HIDDEN_TRASH) and (entry := _entry(root, root, root_fd, name, grace)) is not None:
                if entry.kind != "unknown":  # a person's `.ckptd-trash.bak` is not ckptd's
                    out.append(entry)
        try:
            trash_fd = os.open(TRASH_DIR, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return sorted(out, key=lambda e: e.trashed_at)
        try:
            for name in sorted(os.listdir(trash_fd)):
                if not name.endswith(RECORD) and (entry := _entry(root, root / TRASH_DIR, trash_fd, name, grace)):
                    out.append(entry)
        finally:
            os.close(trash_fd)
    except OSError:
        pass
    finally:
        os.close(root_fd)
    return sorted(out, key=lambda e: e.trashed_at)


def summary(entries: list[TrashEntry]) -> dict[str, object]:
    """What `status`, `plan` and the metrics say of a trash: how many entries, their bytes, and
    when the next purge may take one (None: none waits for it)."""
    due = [e.purge_after for e in entries if e.purge_after is not None]
    return dict(entries=len(entries), bytes=sum(e.bytes for e in entries),
                review=sum(e.kind == "review" for e in entries), next_purge=min(due) if due else None)
