"""`max_bandwidth`: the token bucket around the upload's sends, measured with a clock of the test's
own (it moves only when the bucket waits, or when a send is said to take time): never a sleep."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ckptd.archive.throttle import TokenBucket
from ckptd.config.archive import Archive
from tests.archive.test_archive_gate import make
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.support.volumes import volume as volume

MiB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.mark.parametrize("link_seconds_per_mib", [0.0, 0.01, 0.2])
def test_the_rate_holds_within_the_tolerance_whatever_the_link(link_seconds_per_mib):
    """200 MiB in 1 MiB sends at 10 MiB/s: a link faster than the limit is held to it (10 MiB/s
    after the first second's burst); one slower than it (5 MiB/s) is never slowed further."""
    clock = Clock()
    bucket = TokenBucket(10 * MiB, clock=clock, sleep=clock.sleep)
    waited = 0.0
    for _ in range(200):
        waited += bucket.take(MiB)
        clock.now += link_seconds_per_mib  # the send itself
    link = 200 * link_seconds_per_mib
    expected = max(link, (200 - 10) / 10)  # the limit, less the one second's burst; or the link
    assert expected - 1e-9 <= clock.now <= expected * 1.02 + 0.1, (clock.now, expected)
    if link_seconds_per_mib >= 0.1:
        assert waited == 0.0


def test_a_part_larger_than_a_seconds_worth_waits_its_time():
    clock = Clock()
    bucket = TokenBucket(50 * MiB, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        bucket.take(64 * MiB)
    assert (640 - 50) / 50 - 1e-9 <= clock.now <= 640 / 50


def test_max_bandwidth_is_a_rate():
    assert Archive(url="s3://b/p", max_bandwidth="50MiB/s").max_bandwidth == 50 * MiB
    assert Archive(url="s3://b/p", max_bandwidth="50MiB/s").model_dump(mode="json")["max_bandwidth"] == "50MiB/s"
    for bad in ("50MiB", "0MiB/s", 50):
        with pytest.raises(ValidationError, match="max_bandwidth"):
            Archive(url="s3://b/p", max_bandwidth=bad)


def test_the_archiver_sends_no_faster_than_max_bandwidth(volume, tmp_path, s3):  # noqa: F811
    """Real uploads to moto, the bucket's clock the test's: bytes sent over the clock's time."""
    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
    from tests.support.volumes import OLD

    for i, step in enumerate((50, 60)):  # shards bigger than a part: multipart sends too
        hf_deepspeed_checkpoint(volume / "big", step, world=2, mtime=OLD + i, shard_size=6 * MiB)
    reaper, plan, _ = make(volume, tmp_path, s3, max_bandwidth="1MiB/s", concurrency=1)
    clock = Clock()
    reaper.archiver.throttle = TokenBucket(MiB, clock=clock, sleep=clock.sleep)
    reaper.archiver.archive_all(plan.decisions)
    assert not reaper.archiver.failures, reaper.archiver.failures
    sent = reaper.archiver.uploaded_bytes
    assert sent > 12 * MiB
    # no faster than the limit past its one second's burst; and not held back for nothing
    assert (sent - MiB) / MiB <= clock.now <= sent / MiB * 1.01, (sent, clock.now)
