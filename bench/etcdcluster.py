"""A real 3-member etcd cluster on 127.0.0.1 ports: Debian's `etcd-server` (`.ci/run` installs it).
For bench.takeover, and for the tests (tests/support/etcd.py: the fixture)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Member:
    def __init__(self, name: str, client: int, peer: int, data: Path, log: Path):
        self.name, self.client, self.peer, self.data, self.log = name, client, peer, data, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client}"

    def start(self, cluster: str, state: str = "new") -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["etcd", "--name", self.name, "--data-dir", str(self.data),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer}",
                 "--initial-cluster", cluster, "--initial-cluster-state", state,
                 "--initial-cluster-token", "ckptd-test", "--log-outputs", "stderr"],
                stdout=out, stderr=out, stdin=subprocess.DEVNULL)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


class Cluster:
    """Three members; `endpoints` for ckptd's config."""

    def __init__(self, where: Path):
        ports = free_ports(6)
        self.members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1], where / f"m{i}", where / f"m{i}.log")
                        for i in range(3)]
        self.cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self, timeout: float = 30) -> None:
        for m in self.members:
            m.start(self.cluster)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30, members: list[Member] | None = None) -> None:
        tick = threading.Event()  # never set: a timer between looks
        deadline = time.monotonic() + timeout
        for m in members or self.members:
            while not m.healthy():
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member {m.name} not healthy in {timeout}s:\n"
                                         + m.log.read_text()[-3000:])
                tick.wait(0.1)

    def stop(self) -> None:
        for m in self.members:
            m.stop()
