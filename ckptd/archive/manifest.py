"""A checkpoint's files as read (`snapshot`), and the manifest that says its archive is whole.

The identity of each entry is (dev, inode, size, mtime_ns, ctime_ns), as the verdict cache keeps it
(verdicts.py). A checkpoint whose every entry still has the identity it had when it was read for
upload holds the bytes that were read: nothing was replaced, rewritten or added. The ctime is what
tells a file rewritten in place to the same size with its mtime put back (`os.utime`, a copy that
keeps times): no call can set it. A rename, chmod or another hard link changes it too, without
touching the bytes: the gate then reads that file again and compares its SHA-256 (`gate`). A rewrite
within the timestamp tick of the look that read the file keeps even its ctime: the upload reads such
a racily clean file once more after its tick (`upload.Archiver._after_tick`).

The manifest (`<prefix>/<run>/<checkpoint>.ckptd-manifest.json`) is written last, create-only: while
it is missing, whatever objects are there are an archive in progress, never a whole one. Each file
has two checksums, computed from the bytes read for upload in the same pass: its CRC32C (what the S3
API stores and reports on HEAD, to catch corruption cheaply) and its SHA-256 (what every comparison
of bytes by ckptd itself uses: read-back, restore, the gate's re-read; a CRC32C is affine, and 4
chosen bytes give other bytes with the same one). A manifest written before SHA-256 was recorded
has none (`FileEntry.sha256` None): the gate then compares the object's SHA-256 with the local
file's, both computed now (gate.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

FORMAT = "ckptd-archive/1"
SUFFIX = ".ckptd-manifest.json"
_CHUNK = 8 * 1024 * 1024

Identity = tuple[int, int, int, int, int]  # dev, inode, size, mtime_ns, ctime_ns


class NotArchivable(Exception):
    """A checkpoint holding something no object can stand for (a symlink, a device, a FIFO, a name
    no object key can carry)."""


def key_problem(name: str) -> str | None:
    """Why a file or directory name cannot be part of an object key, or None. S3 keys are UTF-8,
    and a control character (a newline) does not survive its XML listings as the same key."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"{name.encode('utf-8', 'surrogateescape')!r} is not a UTF-8 name"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return f"{name!r} holds a control character (a newline?)"
    return None


@dataclass(frozen=True)
class Snapshot:
    """Every regular file of a checkpoint with its identity, by its path inside it ("" for a
    checkpoint that is one file), and its directories (restored empty ones included)."""

    files: dict[str, Identity]
    dirs: tuple[str, ...]
    is_file: bool

    def differs(self, other: Snapshot, *, but_ctime: bool = False, but_removed: bool = False) -> str | None:
        """What changed between two looks, in a few words, or None. `but_ctime`: a file whose
        ctime alone changed is not told (`touched` names those). `but_removed`: files and
        directories gone are not told either (what a purge killed halfway left)."""
        if self.is_file != other.is_file:
            return "it was replaced"
        added = sorted(other.files.keys() - self.files.keys())
        gone = [] if but_removed else sorted(self.files.keys() - other.files.keys())
        n = 4 if but_ctime else 5
        both = self.files.keys() & other.files.keys()
        changed = sorted(k for k in both if self.files[k][:n] != other.files[k][:n])
        for what, names in (("added", added), ("removed", gone), ("changed", changed)):
            if names:
                more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                return f"{names[0] or 'the file'}{more} {what}"
        if set(self.dirs) != set(other.dirs) and not (but_removed and set(other.dirs) <= set(self.dirs)):
            return "its directories changed"
        return None

    def touched(self, other: Snapshot) -> list[str]:
        """The files whose ctime alone differs in `other`: renamed, chmod-ed, linked, or rewritten
        with their mtime put back; only their bytes can tell which."""
        return sorted(k for k, i in self.files.items()
                      if k in other.files and other.files[k][:4] == i[:4] and other.files[k] != i)


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def snapshot(path: Path, *, key: str | None = None) -> Snapshot:
    """Walk the checkpoint without following a symlink. Raises NotArchivable or OSError. `key`:
    its run and name (`run/checkpoint`), checked as well."""
    for part in (key or "").split("/"):
        if (why := key_problem(part)) is not None:
            raise NotArchivable(f"{why}: no object key can name it")
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return Snapshot({"": identity(st)}, (), True)
    if not stat.S_ISDIR(st.st_mode):
        raise NotArchivable(f"{path} is neither a file nor a directory")
    files: dict[str, Identity] = {}
    dirs: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(path / rel if rel else path) as it:
            for e in it:
                sub = f"{rel}/{e.name}" if rel else e.name
                if (why := key_problem(e.name)) is not None:
                    raise NotArchivable(f"{why}: no object key can name it")
                est = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(est.st_mode):
                    dirs.append(sub)
                    stack.append(sub)
                elif stat.S_ISREG(est.st_mode):
                    files[sub] = identity(est)
                else:
                    what = "a symlink" if stat.S_ISLNK(est.st_mode) else "not a regular file or a directory"
                    raise NotArchivable(f"{sub} is {what}")
    return Snapshot(files, tuple(sorted(dirs)), False)


def crc32c_b64(value: int) -> str:
    """A CRC32C as S3 writes it: the four bytes big-endian, base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class Digest:
    """A stream's size, CRC32C and SHA-256, fed chunk by chunk (memory: nothing kept); also a sink
    for a download (`write`). hashlib and crc32c release the GIL over a large chunk."""

    def __init__(self) -> None:
        import crc32c

        self._crc32c = crc32c.crc32c
        self._crc = 0
        self._sha = hashlib.sha256()
        self.size = 0

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._crc = self._crc32c(chunk, self._crc)
        self._sha.update(chunk)
        self.size += len(chunk)

    def write(self, chunk: bytes) -> int:
        self.update(chunk)
        return len(chunk)

    @property
    def crc32c(self) -> str:
        return crc32c_b64(self._crc)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


def fd_digest(fd: int) -> Digest:
    """The digest of what is left to read from `fd`, read through once."""
    d = Digest()
    while chunk := os.read(fd, _CHUNK):
        d.update(chunk)
    return d


def file_digest(path: Path) -> Digest:
    """The digest of a file's bytes, read through once (never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return fd_digest(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FileEntry:
    path: str  # inside the checkpoint; "" for a checkpoint that is one file
    key: str  # its object
    size: int
    crc32c: str  # base64, of the whole file
    identity: Identity  # as read for upload
    sha256: str | None = None  # hex, of the whole file; None in a manifest written before it was recorded

    def matches(self, d: Digest) -> bool:
        """Whether bytes of digest `d` are this file's: size and CRC32C, and SHA-256 where recorded
        (where it is not, the caller compares another copy's SHA-256: gate.py)."""
        return (d.size, d.crc32c) == (self.size, self.crc32c) and self.sha256 in (None, d.sha256)


@dataclass(frozen=True)
class Manifest:
    run: str
    checkpoint: str
    files: tuple[FileEntry, ...]
    dirs: tuple[str, ...]
    is_file: bool
    meta: dict[str, object]  # framework, step, metrics, ckptd's verdict, when, where from

    def snapshot(self) -> Snapshot:
        return Snapshot({f.path: f.identity for f in self.files}, self.dirs, self.is_file)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def dumps(self) -> bytes:
        doc = {
            "format": FORMAT,
            "run": self.run,
            "checkpoint": self.checkpoint,
            "is_file": self.is_file,
            "files": [
                {"path": f.path, "key": f.key, "size": f.size, "crc32c": f.crc32c,
                 "identity": list(f.identity), **({"sha256": f.sha256} if f.sha256 is not None else {})}
                for f in self.files
            ],
            "dirs": list(self.dirs),
            **self.meta,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()


# The largest manifest read: ckptd writes about 200 bytes a file, so this is millions of files;
# anything larger is not one ckptd wrote, and parsing it would only cost memory
MAX_MANIFEST = 256 * 1024 * 1024


def parse(data: bytes) -> Manifest:
    """A manifest read back. Raises ValueError saying what is wrong with it."""
    if len(data) > MAX_MANIFEST:
        raise ValueError(f"larger than any manifest ckptd writes ({len(data)} bytes)")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:  # nested deeper than json's recursion allows: not one ckptd wrote
        raise ValueError("not JSON ckptd can read (nested too deep)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest")
    try:
        files = tuple(
            FileEntry(str(f["path"]), str(f["key"]), int(f["size"]), str(f["crc32c"]),
                      tuple(int(x) for x in f["identity"]), _sha256(f.get("sha256")))  # type: ignore[arg-type]
            for f in doc["files"]
        )
        fixed = {"format", "run", "checkpoint", "is_file", "files", "dirs"}
        meta = {k: v for k, v in doc.items() if k not in fixed}
        m = Manifest(str(doc["run"]), str(doc["checkpoint"]), files, tuple(doc["dirs"]), bool(doc["is_file"]), meta)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a field is missing or malformed ({exc!r})") from None
    if not files or any(len(f.identity) != 5 for f in files):
        raise ValueError("lists no file, or a file without its identity")
    for path in [f.path for f in files] + [str(d) for d in m.dirs]:
        if outside(path):
            raise ValueError(f"names a path outside the checkpoint ({path!r})")
    return m


def _sha256(value: object) -> str | None:
    """A file's recorded SHA-256: 64 lowercase hex digits, or None where the manifest has none."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= set("0123456789abcdef"):
        raise ValueError(f"a sha256 that is not 64 hex digits ({value!r})")
    return value


def outside(rel: str) -> bool:
    """Whether a path a manifest names (a file's, a directory's) could lead out of its checkpoint:
    absolute, or climbing with `..`."""
    return rel.startswith("/") or ".." in rel.split("/") or "\0" in rel


def manifest_key(ckpt_key: str) -> str:
    return f"{ckpt_key}{SUFFIX}"


def file_key(ckpt_key: str, rel: str) -> str:
    return f"{ckpt_key}/{rel}" if rel else ckpt_key
