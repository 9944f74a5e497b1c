"""The seam between ckptd and an object store: what archiving, its gate and restore ask of one.

Implementations: `s3.S3Store` (boto3). Every method raises `StoreError` with one line saying what
failed (store unreachable, credentials refused, an object missing), never a library's exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol


class StoreError(Exception):
    """The store could not do what was asked; the message says what and why, in one line."""


@dataclass(frozen=True)
class ObjectInfo:
    """What the store reports of one object (a HEAD): its size, and its full-object CRC32C (base64)
    where it has one. `checksum_type` is "FULL_OBJECT", "COMPOSITE" (a checksum of the parts'
    checksums, not of the bytes) or None (a single PUT's checksum is of the whole object)."""

    size: int
    crc32c: str | None
    checksum_type: str | None


@dataclass(frozen=True)
class Upload:
    """A multipart upload begun and neither completed nor aborted."""

    key: str
    upload_id: str


class Store(Protocol):
    url: str  # as configured, for messages: s3://bucket/prefix

    def key(self, *parts: str) -> str:
        """The object key of `parts` under the configured prefix."""

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and checksum, or None where there is no such object."""

    def put(self, key: str, data: bytes | bytearray, crc32c: str) -> None:
        """One object in one request, sent with its CRC32C."""

    def begin(self, key: str) -> str:
        """A multipart upload whose parts make one object with a full-object CRC32C; its id."""

    def put_part(self, key: str, upload_id: str, number: int, data: bytes | bytearray, crc32c: str) -> str:
        """One part (numbered from 1); its ETag."""

    def complete(self, key: str, upload_id: str, etags: list[str], crc32c: str) -> None:
        """The parts, in order, made one object whose full-object CRC32C is `crc32c`."""

    def abort(self, upload: Upload) -> None:
        """An unfinished multipart upload's parts discarded (they cost money until then)."""

    def uploads(self, prefix: str) -> list[Upload]:
        """The unfinished multipart uploads whose keys begin with `prefix`."""

    def create_only(self, key: str, data: bytes) -> bool:
        """Write `data` at `key` only if nothing is there; False if something was."""

    def get(self, key: str) -> bytes | None:
        """A small object's bytes (a manifest), or None where there is none."""

    def download(self, key: str, into: BinaryIO) -> None:
        """An object's bytes, streamed into `into`."""

    def keys(self, prefix: str, *, shallow: bool = False) -> Iterator[str]:
        """The keys that begin with `prefix` (`shallow`: with no "/" after it)."""

    def check(self) -> None:
        """Raise StoreError where the bucket cannot be reached or its credentials are refused."""


def object_url(store: Store, key: str) -> str:
    """The URL of the object at `key` (a full key, its prefix included), for messages:
    `s3://bucket/prefix/run/ckpt.ckptd-manifest.json`, the prefix written once."""
    prefix = store.key()
    rest = key[len(prefix):].lstrip("/") if prefix and key.startswith(f"{prefix}/") else key
    return f"{store.url}/{rest}"

