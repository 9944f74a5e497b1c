"""Bytes as the filesystem counts them. Pure: no I/O.

What deleting a file frees is its allocated blocks (`st_blocks * 512`: a sparse file frees
less than its size, a small file a whole block), and only when its last link goes: a file
hard-linked into several checkpoints (a dedup pass, `cp -al`, `rsync --link-dest`) frees
nothing while one of them is kept. So each checkpoint carries its size counted once per inode
(`du`), and the inodes it shares with something outside it (`Shared`); a `Ledger` says what
deleting checkpoints one after another frees, each inode counted once, when its last link
among those counted goes.

On a filesystem that shares extents between files (reflinks, snapshots: extents.py), deleting
frees only the blocks no other file shares: a `Ledger` may be told what each checkpoint's
deletion leaves allocated (`held`), and counts it as not freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ckptd.model import Checkpoint, Entry

BLOCK = 512  # st_blocks counts 512-byte units, whatever the filesystem's block size (stat(2))


class Shared(NamedTuple):
    """An inode of a checkpoint with links outside it too."""

    dev: int
    ino: int
    nlink: int  # its links, everywhere
    bytes: int  # allocated
    here: int  # its links inside the checkpoint


def footprint(entries: Iterable[Entry]) -> tuple[int, tuple[Shared, ...]]:
    """(bytes allocated, each inode once; the inodes also linked from outside these entries)."""
    total = 0
    seen: dict[tuple[int, int], list[int]] = {}  # (dev, ino) -> [nlink, bytes, links here]
    for e in entries:
        if e.kind == "m":  # another filesystem: never deleted, frees nothing here
            continue
        if e.kind != "f" or e.nlink <= 1:  # a directory's nlink counts its subdirectories, not links
            total += e.blocks * BLOCK
            continue
        key = (e.dev, e.ino)
        found = seen.get(key)
        if found is None:
            seen[key] = [e.nlink, e.blocks * BLOCK, 1]
            total += e.blocks * BLOCK
        else:
            found[2] += 1
    shared = tuple(
        Shared(dev, ino, nlink, size, here)
        for (dev, ino), (nlink, size, here) in sorted(seen.items())
        if here < nlink and nlink > 1
    )
    return total, shared


def own_bytes(c: Checkpoint) -> int:
    """What deleting `c` alone frees: its inodes with no link outside it."""
    return c.size_bytes - sum(s.bytes for s in c.shared)


class Ledger:
    """What deleting checkpoints frees, one after another, each inode counted once.

    `Ledger.disk()`: an inode is freed when every one of its links (`nlink`) has gone, as the
    filesystem frees it. `Ledger.within(kept)`: when no checkpoint of `kept` (a run's, for its
    `max_size`) links it any more, as `du` of what is left would count.
    """

    def __init__(
        self,
        remaining: dict[tuple[int, int], int] | None = None,
        held: Callable[[Checkpoint], int] | None = None,
    ):
        self._remaining = remaining  # (dev, ino) -> links left; None: start from each nlink
        self._gone: dict[tuple[int, int], int] = {}  # links removed so far
        self._held = held  # what deleting a checkpoint leaves allocated (shared extents)
        self.freed = 0

    @classmethod
    def disk(cls, held: Callable[[Checkpoint], int] | None = None) -> Ledger:
        """What the filesystem frees; `held(c)`: of `c`'s blocks, those its deletion leaves
        allocated (extents a reflink copy or a snapshot shares: extents.held)."""
        return cls(held=held)

    @classmethod
    def within(cls, kept: Iterable[Checkpoint]) -> Ledger:
        remaining: dict[tuple[int, int], int] = {}
        for c in kept:
            for s in c.shared:
                remaining[(s.dev, s.ino)] = remaining.get((s.dev, s.ino), 0) + s.here
        return cls(remaining)

    def _left(self, s: Shared) -> int:
        key = (s.dev, s.ino)
        start = s.nlink if self._remaining is None else self._remaining.get(key, s.here)
        return start - self._gone.get(key, 0)

    def gain(self, c: Checkpoint) -> int:
        """What deleting `c` too would free, after those already counted."""
        out = own_bytes(c)
        for s in c.shared:
            if self._left(s) - s.here <= 0 < self._left(s):
                out += s.bytes
        if self._held is not None:
            out = max(0, out - self._held(c))
        return out

    def add(self, c: Checkpoint) -> int:
        """Count `c` as deleted; what that freed."""
        got = self.gain(c)
        for s in c.shared:
            key = (s.dev, s.ino)
            self._gone[key] = self._gone.get(key, 0) + s.here
        self.freed += got
        return got


def freed_by(entries: Iterable[Entry]) -> int:
    """What removing every one of `entries` frees now (the purge of one trash entry): an inode's
    blocks when all its links are among them."""
    total, shared = footprint(entries)
    return total - sum(s.bytes for s in shared)
