"""A test's end of the reaper's hold seam (`ckptd.removal.reaper.HOLD_SOCKET_ENV`): the daemon says
which checkpoint it is about to act on and waits for a line back. `PassHold` answers at once,
except at the `hold_at`-th (from 1), which it answers only when the test calls `release()`: the
pass stands still between two deletions while the test acts (a SIGHUP, a removed lock)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from ckptd.removal.reaper import HOLD_SOCKET_ENV


class PassHold:
    def __init__(self, path: Path, hold_at: int):
        self.path = path
        self.hold_at = hold_at
        self.asked: list[str] = []  # what the reaper was about to act on, in order
        self.holding = threading.Event()
        self._release = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._sock.settimeout(0.5)  # so that close() ends the thread promptly
        self._closed = threading.Event()
        self._conn: socket.socket | None = None  # the reaper's, while it waits: shut at close()
        self._thread = threading.Thread(target=self._serve, name="pass-hold", daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_SOCKET_ENV: str(self.path)}

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conn = conn
            with conn:
                conn.settimeout(30)
                try:
                    self.asked.append(conn.recv(4096).decode().strip())
                    if len(self.asked) == self.hold_at:
                        self.holding.set()
                        self._release.wait(60)
                    conn.sendall(b"go\n")
                except OSError:  # the daemon went away (a test that failed while it was held)
                    continue

    def wait_held(self, timeout: float = 60) -> str:
        """The checkpoint the pass stands still before."""
        assert self.holding.wait(timeout), f"the reaper never came to act #{self.hold_at}: {self.asked}"
        return self.asked[self.hold_at - 1]

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self._closed.set()
        self._sock.close()
        if (conn := self._conn) is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # a recv() waiting on a reaper that never spoke ends
            except OSError:
                pass
        self._thread.join(5)

    def __enter__(self) -> PassHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
