"""The daemon with an archive whose store is down: a real `ckptd run` against moto's S3 API server
(stopped), its log and `ckptd status` saying what is kept and why."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from tests.support.daemonproc import DaemonProc, write_config
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=120)


def test_the_daemon_keeps_what_it_cannot_archive_and_status_says_why(tmp_path, s3):  # noqa: F811
    root = tmp_path / "vol"
    old = time.time() - 3600
    for i, step in enumerate((10, 20, 30)):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=old + i)
    bucket = s3.bucket()
    cfg = write_config(
        tmp_path / "ckptd.toml", root, tmp_path / "state", retention="keep_last = 1\nkeep_best = 0",
        root_extra=f"world_size = 2\n[roots.archive]\nurl = 's3://{bucket}/a'\nendpoint_url = '{s3.endpoint}'",
    )
    with socket.socket() as sock:  # a free port for metrics (the kernel's choice, released)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg.write_text(cfg.read_text().replace("[daemon]\n", f"[daemon]\nmetrics_listen = '127.0.0.1:{port}'\n"))
    s3.stop()
    with DaemonProc("-c", cfg) as daemon:
        failed = daemon.wait_for(lambda line: "not archived to" in line.get("message", ""), count=2, timeout=120)
        assert "tried again in 60s" in failed[0]["message"]
        start = len(daemon.lines)
        daemon.wait_message("state written", start=start, timeout=60)
        status = ckptd("status", "--json", "-c", str(cfg))
        docs = json.loads(status.stdout)
        archive = (docs[0] if isinstance(docs, list) else docs)["roots"][0]["archive"]
        assert sorted(archive["failed"]) == ["run/checkpoint-10", "run/checkpoint-20"]
        assert all("cannot" in why for why in archive["failed"].values())
        text = ckptd("status", "-c", str(cfg)).stdout
        assert "not archived" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert f'ckptd_archive_failing_checkpoints{{root="{root}"}} 2.0' in metrics
        assert f'ckptd_archive_uploaded_bytes_total{{root="{root}"}} 0.0' in metrics
        age = next(line for line in metrics.splitlines() if line.startswith("ckptd_archive_oldest_failure_age_seconds{"))
        assert float(age.rsplit(" ", 1)[1]) >= 0
        # both wait for their archive: retention would delete them, and the store is down
        assert f'ckptd_archive_pending_checkpoints{{root="{root}"}} 2.0' in metrics
        waited = next(line for line in metrics.splitlines() if line.startswith("ckptd_archive_oldest_pending_age_seconds{"))
        assert float(waited.rsplit(" ", 1)[1]) >= float(age.rsplit(" ", 1)[1])
    assert sorted(os.listdir(root / "run")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
