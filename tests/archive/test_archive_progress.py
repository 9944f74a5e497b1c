"""How far an upload or a restore is: a line on a terminal (`ckptd prune` under a real pty), and
the daemon's log every minute of a long upload (the archiver's clock the test's own)."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys

from ckptd.archive.upload import PROGRESS_EVERY
from ckptd.cli.progress import Ticker
from tests.archive.test_archive_cli import setup
from tests.archive.test_archive_gate import make
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.support.volumes import volume as volume

MiB = 1024 * 1024


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_ticker_says_how_far_a_step_is_without_restarting_its_time():
    now = [0.0]
    out = Tty()
    ticker = Ticker("prune /vol", stream=out, clock=lambda: now[0])
    ticker.working("archiving run/checkpoint-10: 0 B of 12.0MiB sent")
    now[0] = 3.0
    ticker.saying("archiving run/checkpoint-10: 6.0MiB of 12.0MiB sent")
    ticker.draw()
    assert out.getvalue().endswith("prune /vol: archiving run/checkpoint-10: 6.0MiB of 12.0MiB sent, 3s")


def test_a_long_upload_is_logged_every_minute_and_told_each_part(volume, tmp_path, s3, caplog):  # noqa: F811
    from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
    from tests.support.volumes import OLD

    for i, step in enumerate((50, 60)):
        hf_deepspeed_checkpoint(volume / "big", step, world=2, mtime=OLD + i, shard_size=6 * MiB)
    reaper, plan, _ = make(volume, tmp_path, s3, concurrency=1)
    t = [0.0]

    def clock() -> float:  # each look at the clock: 25 s later (a slow link)
        t[0] += 25.0
        return t[0]

    told: list[tuple[str, int, int]] = []
    reaper.archiver.clock = clock
    reaper.archiver.on_progress = lambda rel, done, total: told.append((rel, done, total))
    with caplog.at_level(logging.INFO, logger="ckptd.archive.upload"):
        reaper.archiver.archive_all([d for d in plan.decisions if d.checkpoint.run == "big"])
    assert not reaper.archiver.failures, reaper.archiver.failures
    mine = [x for x in told if x[0] == "big/checkpoint-50"]
    assert mine[-1][1] == mine[-1][2] > 12 * MiB and [d for _, d, _ in mine] == sorted(d for _, d, _ in mine)
    lines = [r.getMessage() for r in caplog.records if "bytes sent" in r.getMessage()]
    assert lines and all(line.startswith("big/checkpoint-50: archiving to s3://") for line in lines), lines
    assert PROGRESS_EVERY == 60.0


def test_prune_on_a_terminal_says_what_it_is_archiving(tmp_path, s3):  # noqa: F811
    """A real pty; max_bandwidth makes the upload take several seconds (the bucket waits, the
    test only reads until ckptd exits)."""
    root, cfg, _ = setup(tmp_path, s3, shard_size=3 * MiB, steps=(10, 20))
    cfg.write_text(cfg.read_text().replace("concurrency = 1", 'concurrency = 1\nmax_bandwidth = "2MiB/s"'))
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "-c", str(cfg)],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other end closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "archiving run/checkpoint-10: " in text and " sent, " in text, text
    assert sorted(os.listdir(root / "run")) == ["checkpoint-20"]
