"""`[roots.archive]`: where a root's checkpoints are copied before retention deletes them (ckptd/archive/).

Credentials never appear here: the S3 client takes them from the standard chain (the environment,
a profile, an instance role), so a config file can be shared and committed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, field_validator

from ckptd.config.units import Size, format_size_exact, parse_size

# S3's own bounds on a multipart upload's parts (all but the last): 5 MiB to 5 GiB.
MIN_PART = 5 * 1024**2
MAX_PART = 5 * 1024**3


def _parse_rate(value: Any) -> int:
    """`"50MiB/s"` -> bytes a second."""
    if not isinstance(value, str) or not value.strip().endswith("/s"):
        raise ValueError(f"expected a rate like '50MiB/s' (got {value!r})")
    rate = parse_size(value.strip()[:-2].strip())
    if rate <= 0:
        raise ValueError(f"must be more than 0 (got {value!r})")
    return rate


Rate = Annotated[int, BeforeValidator(_parse_rate), PlainSerializer(lambda n: f"{format_size_exact(n)}/s")]


class Archive(BaseModel):
    """An object store each checkpoint of the root is archived to, verified, before it is deleted."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    url: str = Field(
        description="Where to archive: 's3://bucket/prefix'; a checkpoint goes to "
        "<prefix>/<run>/<checkpoint>/..., its manifest to <prefix>/<run>/<checkpoint>.ckptd-manifest.json."
    )
    endpoint_url: str | None = Field(
        None, description="An S3-compatible store's endpoint (MinIO, Ceph RGW): 'http://127.0.0.1:9000'."
    )
    region: str | None = Field(None, description="The bucket's region; unset: the standard chain's.")
    when: Literal["before-delete", "on-complete"] = Field(
        "before-delete",
        description="'before-delete': archive a checkpoint when retention would delete it, and delete it "
        "only once the archive is verified; 'on-complete': archive every complete checkpoint at the "
        "next pass after it completes, kept or not.",
    )
    required: bool = Field(
        strict=True,
        default=True,
        description="Never delete locally what is not archived and verified (store down, credentials "
        "refused, a file changed while it was read: kept, and `plan` says why). false: a checkpoint "
        "that cannot be archived is deleted as if there were no archive.",
    )
    concurrency: int = Field(
        strict=True, default=4, ge=1, le=64, description="Files uploaded at once (memory: this x part_size)."
    )
    part_size: Size = Field(
        64 * 1024**2,
        description="Files larger than this are uploaded in parts of this size (5MiB to 5GiB, S3's bounds).",
    )
    max_bandwidth: Rate | None = Field(
        None,
        description="At most this much uploaded a second, all of the root's uploads together: '50MiB/s'. "
        "Held on average over each part (a part waits its turn, then goes at the link's speed); "
        "unset: no limit.",
    )
    verify: Literal["checksum", "read-back"] = Field(
        "checksum",
        description="How an archived object is verified before its local copy may go: 'checksum': the "
        "size and full-object CRC32C the store reports (a HEAD), compared with what ckptd computed; "
        "'read-back': every object downloaded again and its CRC32C computed by ckptd, just before the "
        "rename into the trash and again before the purge (catches a store, or anyone writing to the "
        "bucket, that keeps a claimed checksum over other bytes; costs a download of the checkpoint twice).",
    )
    storage_class: str | None = Field(
        None, description="The objects' storage class: 'STANDARD_IA', 'GLACIER_IR', ...; unset: the bucket's."
    )

    @field_validator("url")
    @classmethod
    def _s3_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"must be 's3://bucket/prefix' (got {v!r})")
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError(f"names a bucket and a prefix only, never credentials (got {v!r})")
        return v.rstrip("/")

    @field_validator("part_size")
    @classmethod
    def _part_bounds(cls, v: int) -> int:
        if not MIN_PART <= v <= MAX_PART:
            raise ValueError(f"must be between 5MiB and 5GiB, S3's bounds on a part (got {v})")
        return v

    @property
    def bucket(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def prefix(self) -> str:
        return urlsplit(self.url).path.strip("/")
