"""moto's S3 API server (`moto[server]`, the test extra) as a process of its own on 127.0.0.1: real
HTTP, real multipart uploads, stopped and started again by the tests that need the store down.

moto is not S3: it keeps whatever checksum a PUT claims without checking it against the bytes,
so a wrong checksum reaches the store (tests/archive: ckptd's own comparison must catch it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.common import REPO

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class S3Server:
    port: int = 0  # 0 until first started; then the same port each time
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and wait until it listens (it says so on stdout)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.motoserve", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, **CREDENTIALS},
            cwd=REPO,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.proc.stdout.close()
        if not line.strip():
            raise RuntimeError(f"moto server exited: {self.proc.wait()}")
        self.port = int(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("s3", endpoint_url=self.endpoint)

    def bucket(self) -> str:
        name = f"ckptd-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, running (a test that stopped it gets it back), with credentials in this
    process's environment as the standard chain reads them (and so in a `ckptd` it starts)."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    if s3_server.proc is None or s3_server.proc.poll() is not None:
        s3_server.start()
    return s3_server
