"""The file formats the frameworks write, read only as far as whether one file is whole.

torch.save's zip (its directory sits at the end, so a truncated one has no end record at its very
end: `is_zip`), a safetensors header (its offsets must fit the file), a tar's members (NeMo's
`.nemo`, written in place). Each reads a few bytes at known offsets, never the whole file. An
OSError is not a verdict: it passes through, so that the verdict cache (judge/verdicts.py) does not
remember it. Here, below the frameworks and the engine, because both read them: the engine's file
integrity check (judge/wholefile.py) and the frameworks that find such files where no suffix says
so (composer.py, pattern.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ckptd.volume import volread

ZIP_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors itself refuses headers over 100 MB


_EOCD = b"PK\x05\x06"  # end of central directory: the last thing a zip writer writes
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"  # a central directory entry
_LOCAL = b"PK\x03\x04"  # a member's local header: where a zip writer starts
_EOCD_SEARCH = 22 + 0xFFFF  # the record, and the longest comment it may carry


def is_zip(path: str | Path, size: int) -> bool:
    """Whether the file ends exactly in a zip's end record, consistent with its central directory.

    A file cut off mid-write can still hold a whole zip *inside* it (a tensor whose bytes
    happen to be one), and `zipfile.is_zipfile` accepts an end record anywhere in the last
    64 KiB. So: the end record must end the file (with its comment, if any), the central
    directory it points at must end exactly where the record (or torch's zip64 record,
    which it writes even for small files) begins, and an entry must start there. Three
    preads for a torch.save file.
    An OSError is not a verdict: it passes through, so that it is not remembered.
    """
    fd = volread.open_regular(path)
    try:
        return _zip_directory_ok(fd, size)
    except struct.error:
        return False
    finally:
        os.close(fd)


_TAIL = 8192  # bytes read at once from a zip's end: torch's end records and central directory fit


def _zip_directory_ok(fd: int, size: int) -> bool:
    if size < 22:
        return False
    tail_at = max(0, size - _TAIL)
    tail = os.pread(fd, size - tail_at, tail_at)  # one read where three were: the records are at the end

    def pread(n: int, at: int) -> bytes:
        """`os.pread(fd, n, at)`, from the tail already read when it lies there."""
        inside = tail_at <= at and at + n <= size  # else read it: the file may have grown since its stat
        return tail[at - tail_at : at - tail_at + n] if inside else os.pread(fd, n, at)

    # The last 22 bytes lie in the tail (it ends at `size`, 22 bytes or more): `pread(22, size - 22)`.
    eocd_at, record = size - 22, tail[size - 22 - tail_at :]
    if not (record[:4] == _EOCD and record[20:22] == b"\0\0"):  # not torch's: a comment follows it
        n = min(size, _EOCD_SEARCH)
        end = os.pread(fd, n, size - n)
        i = end.rfind(_EOCD)
        while i >= 0 and not (
            len(end) - i >= 22 and i + 22 + struct.unpack_from("<H", end, i + 20)[0] == len(end)
        ):
            i = end.rfind(_EOCD, 0, i)
        if i < 0:
            return False
        eocd_at, record = size - n + i, end[i : i + 22]
    disk, cd_disk, here, total, cd_size, cd_offset = struct.unpack_from("<4xHHHHII", record)
    if disk or cd_disk or here != total:
        return False  # a multi-disk archive: no torch file is one
    maxed = 0xFFFF in (here, total) or 0xFFFFFFFF in (cd_size, cd_offset)
    candidates = []  # (where the central directory must end, its size, its offset)
    if eocd_at >= 20 + 56 and (locator := pread(20, eocd_at - 20))[:4] == _EOCD64_LOCATOR:
        (at,) = struct.unpack_from("<Q", locator, 8)
        zip64 = pread(56, at) if at < eocd_at else b""
        whole = len(zip64) == 56 and zip64[:4] == _EOCD64
        if whole and at + 12 + struct.unpack_from("<Q", zip64, 4)[0] == eocd_at - 20:
            size64, offset64 = struct.unpack_from("<QQ", zip64, 40)
            candidates.append((at, size64, offset64))
    if not maxed:
        candidates.append((eocd_at, cd_size, cd_offset))
    for end, length, offset in candidates:
        if offset + length == end and (length == 0 or pread(4, offset) == _CENTRAL):
            # and it begins as torch.save's writer begins it, with its first member's local header:
            # a copier that made the file at full size and wrote its chunks out of order (AzCopy,
            # aria2c, rclone's multi-thread copies into the final name) can leave the end records
            # whole over zeros where the first members belong
            return length == 0 or pread(4, 0) == _LOCAL
    return False


TAR_BLOCK = 512
MAX_TAR_MEMBERS = 100_000


def tar_problem(path: str | Path, size: int) -> str | None:
    """Why a tar archive (one a framework writes in place, with no marker and not atomically: NeMo's
    `.nemo`, save_restore_connector.py `tarfile.open(filename, "w:")`) is not whole, or None.

    Walks the member headers (one pread each, such an archive has a handful): every member's data
    must lie within the file, and the archive must end in tar's end-of-archive zero blocks. A
    gzip-compressed one cannot be checked without reading it all, and passes unchecked.
    """
    fd = volread.open_regular(path)  # an OSError is not a verdict (NotRegularFile: never read)
    try:
        if os.pread(fd, 2, 0) == b"\x1f\x8b":
            return None  # gzip: its end cannot be checked cheaply (NeMo writes plain tar since 1.x)
        if size < 2 * TAR_BLOCK or size % TAR_BLOCK:
            return f"{size} bytes: not a whole number of tar blocks (truncated?)"
        offset = 0
        for _ in range(MAX_TAR_MEMBERS):
            header = os.pread(fd, TAR_BLOCK, offset)
            if len(header) < TAR_BLOCK:
                return "ends inside a tar header (truncated?)"
            if header == bytes(TAR_BLOCK):
                return None if os.pread(fd, TAR_BLOCK, offset + TAR_BLOCK) == bytes(TAR_BLOCK) else (
                    "no end-of-archive blocks (truncated?)")
            stored = header[148:156].split(b"\0")[0].strip()
            if not stored or int(stored, 8) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
                return f"a tar header at byte {offset} has a bad checksum (truncated or not a tar)"
            field = header[124:136]
            if field[0] & 0x80:  # GNU base-256, for members over 8 GiB
                length = int.from_bytes(field[1:], "big")
            else:
                length = int(field.split(b"\0")[0].strip() or b"0", 8)
            offset += TAR_BLOCK + -(-length // TAR_BLOCK) * TAR_BLOCK
            if offset > size:
                return "a member runs past the end of the file (truncated?)"
        return f"more than {MAX_TAR_MEMBERS} members: not checked further"
    except ValueError as exc:  # an OSError passes through: not remembered (verdicts.py)
        return f"unreadable: {exc}"
    finally:
        os.close(fd)


def safetensors_problem(path: str | Path, size: int) -> str | None:
    """Why a safetensors file is not whole, or None."""
    if size < 8:
        return f"{size} bytes: too short for a header"
    try:
        with volread.open_file(path) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"header length {n} runs past the end of the file ({size} bytes)"
            if n > MAX_SAFETENSORS_HEADER:
                return f"header length {n} is larger than this tool will parse"
            header = json.loads(f.read(n))
    except (ValueError, struct.error, RecursionError) as exc:  # an OSError passes through: not a verdict
        return f"unreadable header: {exc}"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data_len = size - 8 - n
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {key!r} has no data_offsets"
        end = max(end, offsets[1])
    if end > data_len:
        return f"tensors need {end} data bytes, the file has {data_len} (truncated?)"
    return None
