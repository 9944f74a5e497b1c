"""The S3 API through boto3 (the `ckptd[s3]` extra): AWS, MinIO, Ceph RGW, moto.

Credentials come from boto3's standard chain only (environment, profile, instance role): the
config names a bucket, a prefix and an endpoint, never a secret.

Objects carry a CRC32C the store keeps and reports on HEAD (ChecksumMode=ENABLED): a single PUT's
is of the whole object; a multipart upload is begun with ChecksumType=FULL_OBJECT so that its
checksum is of the whole object too, not of its parts' checksums (COMPOSITE), and an ETag, which for
a multipart object is no checksum of its bytes, is never relied on. Whether the stored bytes
match is decided by ckptd (`upload.Archiver`), comparing the store's answer with what it computed
from the file: some S3-compatible stores (moto among them) keep whatever checksum a PUT claims.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, BinaryIO

from ckptd.archive.manifest import MAX_MANIFEST
from ckptd.archive.store import ObjectInfo, StoreError, Upload
from ckptd.config.archive import Archive

log = logging.getLogger(__name__)


def _one_line(exc: BaseException) -> str:
    """A botocore error as one line: the store's code and message, or the connection's failure."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response["Error"]
        return f"{err.get('Code', '?')}: {err.get('Message') or ''}".rstrip(": ")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


class S3Store:
    """An S3 bucket and prefix (`Archive.url`), through one boto3 client (thread-safe)."""

    def __init__(self, cfg: Archive):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise StoreError(f"archiving to {cfg.url} needs boto3: pip install 'ckptd[s3]' ({exc})") from None
        self.url = cfg.url
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        self.storage_class = cfg.storage_class
        self._create_only_supported: bool | None = None
        config = Config(
            retries={"mode": "standard", "max_attempts": 3},  # backoff with jitter on throttling
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=max(10, cfg.concurrency * 2),
            # ckptd sends its own CRC32C (crc32c is fast; botocore's needs awscrt), and checks
            # what comes back itself.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self.client: Any = boto3.session.Session().client(
                "s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=config
            )
        except Exception as exc:
            raise StoreError(f"cannot make an S3 client for {cfg.url}: {_one_line(exc)}") from None

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as exc:  # botocore's errors, connection failures, credentials refused
            raise StoreError(f"{what} at {self.url}: {_one_line(exc)}") from exc

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p and p != ".")

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        except Exception as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise StoreError(f"cannot look at {key} at {self.url}: {_one_line(exc)}") from exc
        return ObjectInfo(int(r["ContentLength"]), r.get("ChecksumCRC32C"), r.get("ChecksumType"))

    def _class(self) -> dict[str, str]:
        return {"StorageClass": self.storage_class} if self.storage_class else {}

    def put(self, key: str, data: bytes | bytearray, crc32c: str) -> None:
        self._call(f"cannot upload {key}", self.client.put_object, Key=key, Body=data,
                   ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc32c, **self._class())

    def begin(self, key: str) -> str:
        r = self._call(f"cannot begin uploading {key}", self.client.create_multipart_upload, Key=key,
                       ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT", **self._class())
        return str(r["UploadId"])

    def put_part(self, key: str, upload_id: str, number: int, data: bytes | bytearray, crc32c: str) -> str:
        r = self._call(f"cannot upload part {number} of {key}", self.client.upload_part, Key=key,
                       UploadId=upload_id, PartNumber=number, Body=data,
                       ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc32c)
        return str(r["ETag"])

    def complete(self, key: str, upload_id: str, etags: list[str], crc32c: str) -> None:
        parts = [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, start=1)]
        self._call(f"cannot complete {key}", self.client.complete_multipart_upload, Key=key,
                   UploadId=upload_id, MultipartUpload={"Parts": parts},
                   ChecksumCRC32C=crc32c, ChecksumType="FULL_OBJECT")

    def abort(self, upload: Upload) -> None:
        self._call(f"cannot abort the upload of {upload.key}", self.client.abort_multipart_upload,
                   Key=upload.key, UploadId=upload.upload_id)

    def uploads(self, prefix: str) -> list[Upload]:
        out: list[Upload] = []
        kw: dict[str, str] = {"Prefix": prefix}
        while True:
            r = self._call(f"cannot list the unfinished uploads under {prefix}",
                           self.client.list_multipart_uploads, **kw)
            out += [Upload(u["Key"], u["UploadId"]) for u in r.get("Uploads", ())]
            if not r.get("IsTruncated"):
                return out
            kw = {"Prefix": prefix, "KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}

    def create_only(self, key: str, data: bytes) -> bool:
        """With If-None-Match: * (S3 since 2024, MinIO, moto): the store refuses to replace. A store
        that does not know the header (it answers NotImplemented) gets a HEAD, then the PUT, and
        that is logged once: two writers could race in between, and ckptd is the only one
        writing manifests under its prefix."""
        if self._create_only_supported is not False:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                self._create_only_supported = True
                return True
            except Exception as exc:
                if _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    return False
                if _code(exc) not in ("NotImplemented", "501"):
                    raise StoreError(f"cannot write {key} at {self.url}: {_one_line(exc)}") from exc
                log.warning("%s does not support If-None-Match on PUT: manifests are written after a "
                            "HEAD finds none (not atomic against another writer)", self.url)
                self._create_only_supported = False
        if self.head(key) is not None:
            return False
        self._call(f"cannot write {key}", self.client.put_object, Key=key, Body=data)
        return True

    def get(self, key: str) -> bytes | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            # at most one byte over the largest manifest: parse refuses a larger one unread
            return bytes(r["Body"].read(MAX_MANIFEST + 1))
        except Exception as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise StoreError(f"cannot read {key} at {self.url}: {_one_line(exc)}") from exc

    def download(self, key: str, into: BinaryIO) -> None:
        r = self._call(f"cannot download {key}", self.client.get_object, Key=key)
        try:
            for chunk in r["Body"].iter_chunks(8 * 1024 * 1024):
                into.write(chunk)
        except Exception as exc:
            raise StoreError(f"cannot download {key} at {self.url}: {_one_line(exc)}") from exc

    def keys(self, prefix: str, *, shallow: bool = False) -> Iterator[str]:
        base: dict[str, str] = {"Prefix": prefix, **({"Delimiter": "/"} if shallow else {})}
        kw = dict(base)
        while True:
            r = self._call(f"cannot list {prefix}", self.client.list_objects_v2, **kw)
            yield from (o["Key"] for o in r.get("Contents", ()))
            if not r.get("IsTruncated"):
                return
            kw = {**base, "ContinuationToken": r["NextContinuationToken"]}

    def check(self) -> None:
        self._call("cannot reach the bucket", self.client.head_bucket)


def open_store(cfg: Archive) -> S3Store:
    """The store `cfg` names (only S3 in this version). Raises StoreError."""
    return S3Store(cfg)
