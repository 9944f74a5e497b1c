"""Finding runs and their checkpoints under a root. Reads only.

A run is any directory that directly holds checkpoints, at any depth up to
`max_depth`, so `<root>/<run>/checkpoint-N` and `<root>/<team>/<run>/checkpoint-N`
both work. Directories a framework makes on the way to its checkpoints
(Lightning's `lightning_logs/version_N/checkpoints`, NeMo's timestamped version,
torchtitan's `checkpoint`) do not count against `max_depth`: Lightning's default
tree under team/run folders is 5 levels down, below the default of 4, and was
found empty without a word. Raising the default instead would list every
directory one or two levels deeper on a big volume (datasets included), and
watch them; these names cost a listing only where they exist.
Checkpoints are not descended into, symlinks are never followed,
and hidden directories (the trash among them) are skipped. A directory below the root that
holds a `.ckptd/` or `.ckptd-trash/` is another ckptd's root (one with a root nested in ours,
its own config, pins and trash): it is not ours, and nothing in it is a run of ours.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptd.discover import layouts
from ckptd.model import Candidate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunDir:
    root: Path
    rel: str  # relative to the root; "." for the root itself
    names: frozenset[str]  # everything in the run directory
    candidates: tuple[Candidate, ...]

    @property
    def path(self) -> Path:
        return self.root if self.rel == "." else self.root / self.rel


def _list(path: str) -> list[os.DirEntry[str]] | None:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return None  # vanished while we looked
    except PermissionError as exc:
        log.warning("cannot list %s: %s", path, exc.strerror)
        return None


def find_runs(
    root: Path,
    *,
    max_depth: int = 4,
    patterns: Collection[re.Pattern[str]] = (),
    visited: dict[str, int] | None = None,
    framework_dirs: bool = True,
    below_root: bool = False,
) -> list[RunDir]:
    """Every run under `root`, with the checkpoint candidates it holds, sorted by path.

    `visited`, if given, receives every directory listed (relative to `root`)
    with the mtime it had just before it was listed: a later stat showing a
    different mtime means its entries changed (targeted polling). `framework_dirs=False`:
    framework-made directories count against `max_depth` like any other. `below_root`: `root`
    is a directory inside the configured root, so it too may be another ckptd's root.
    """
    runs: list[RunDir] = []
    # (path, rel, depth, its entries if listed already, its mtime just before that listing)
    stack: list[_Pending] = [(str(root), ".", 0, None, None)]
    while stack:
        path, rel, depth, entries, mtime = stack.pop()
        if entries is None or (visited is not None and mtime is None):
            listed = _listing(path, timed=visited is not None)
            if listed is None:
                continue
            entries, mtime = listed
        if (rel != "." or below_root) and _another_root(path, (e.name for e in entries)):
            continue
        if visited is not None:
            visited[rel] = mtime  # type: ignore[assignment]
        candidates, loose, below = _look_in(entries, patterns, timed=visited is not None)
        for e, children, children_mtime in below:
            free = framework_dirs and layouts.is_framework_dir(e.name)
            if depth < max_depth or free:
                sub_rel = e.name if rel == "." else f"{rel}/{e.name}"
                stack.append((e.path, sub_rel, depth if free else depth + 1, children, children_mtime))
        if loose:
            candidates += layouts.recognise_among(loose)
        if candidates:
            names = frozenset(e.name for e in entries)
            if (layout := layouts.unnamed_save(names)) is not None:
                _unnamed(path, layout)  # its checkpoints are the save's parts: no run, nothing deleted
                continue
            runs.append(RunDir(root, rel, names, tuple(sorted(candidates, key=_order))))
    return sorted(runs, key=lambda r: r.rel)


_Pending = tuple[str, str, int, "list[os.DirEntry[str]] | None", "int | None"]
_Below = tuple[os.DirEntry[str], "list[os.DirEntry[str]] | None", "int | None"]


def _listing(path: str, *, timed: bool) -> tuple[list[os.DirEntry[str]], int | None] | None:
    """A directory's entries, with its mtime taken just before they were listed when `timed`
    (targeted polling: a later stat showing another mtime means they changed); None if gone."""
    mtime = None
    if timed:
        try:
            mtime = os.stat(path, follow_symlinks=False).st_mtime_ns
        except OSError:
            return None
    entries = _list(path)
    return None if entries is None else (entries, mtime)


def _look_in(
    entries: list[os.DirEntry[str]], patterns: Collection[re.Pattern[str]], *, timed: bool
) -> tuple[list[Candidate], list[str], list[_Below]]:
    """One directory's entries sorted out: the checkpoints recognised, the files no name alone
    identified (`layouts.recognise_among` takes them together), and the directories to descend
    into, each with its entries if recognising it listed them already."""
    candidates: list[Candidate] = []
    loose: list[str] = []
    below: list[_Below] = []
    for e in entries:
        if e.name in (layouts.TRASH_DIR, layouts.LEASE_DIR) or e.name.startswith(layouts.HIDDEN_TRASH) \
                or e.is_symlink():
            continue  # never followed, never touched
        try:
            is_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            continue
        listed: list[tuple[list[os.DirEntry[str]], int | None] | None] = []

        def names(e: os.DirEntry[str] = e, listed: list = listed) -> list[str]:
            # Listed once: recognising a directory needs its entries, and so does descending
            # into it (with its mtime taken first, for targeted polling).
            got = _listing(e.path, timed=timed)
            listed.append(got)
            return [c.name for c in got[0]] if got is not None else []

        cand = layouts.recognise(e.name, is_dir, names, patterns)
        children, children_mtime = listed[0] if listed and listed[0] is not None else (None, None)
        if children is not None and _another_root(e.path, (c.name for c in children)):
            continue
        if cand is not None:
            candidates.append(cand)
        elif not is_dir:
            loose.append(e.name)
        elif not e.name.startswith("."):
            below.append((e, children, children_mtime))
    return candidates, loose, below


_TOLD: set[str] = set()
# What ckptd makes in every root it deletes in, and nowhere else: the root lock, the trash. Not `.ckptd/`
# alone: a checkpoint's commit records live in a `.ckptd/` of its own (attest.RECORD_DIR).
ROOT_MARKS = (layouts.ROOT_LOCK_FILE, layouts.TRASH_DIR)


def _another_root(path: str, names: Iterable[str]) -> bool:
    """Whether the directory at `path`, holding `names`, is another ckptd's root; said once per process.

    Its root lock (`.ckptd/local.lock`, made by every ckptd that deletes there) or `.ckptd-trash/`
    says so. Whether that ckptd is alive does not matter: its config (pins, retention) and its
    trash are not ours to know, so nothing of it is ours to delete. A stale one stays until
    a person removes those directories."""
    names = set(names)
    if layouts.TRASH_DIR not in names and (
        layouts.LEASE_DIR not in names or not os.path.lexists(os.path.join(path, layouts.ROOT_LOCK_FILE))
    ):
        return False
    if path not in _TOLD:
        _TOLD.add(path)
        log.warning("%s is another ckptd's root (it holds %s or %s): not ours; nothing in it is "
                    "looked at or deleted from here", path, layouts.ROOT_LOCK_FILE, layouts.TRASH_DIR)
    return True


def _unnamed(path: str, layout: str) -> None:
    """Say once per process that the directory at `path` is taken for one save, not a run."""
    if path not in _TOLD:
        _TOLD.add(path)
        log.warning(
            "%s holds one %s save (under a name of the user's): what looks like checkpoints in it are "
            "its parts; it is no run, and nothing in it is deleted", path, layout,
        )


def depth_of(rel: str) -> int:
    """How much of `max_depth` the directory at `rel` (relative to the root) has used: its path
    segments, less those a framework made (`layouts.is_framework_dir`)."""
    if rel == ".":
        return 0
    return sum(1 for part in rel.split("/") if not layouts.is_framework_dir(part))


def _order(c: Candidate) -> tuple[int, str]:
    return (c.step, c.name)


def find_run(root: Path, rel: str, *, patterns: Collection[re.Pattern[str]] = ()) -> RunDir | None:
    """One run directory re-listed (no descent): for re-checks just before deleting."""
    path = root if rel == "." else root / rel
    runs = find_runs(path, max_depth=0, patterns=patterns, framework_dirs=False, below_root=rel != ".")
    if not runs:
        return None
    return RunDir(root, rel, runs[0].names, runs[0].candidates)
