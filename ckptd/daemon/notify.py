"""systemd's notify protocol, in a few lines and no dependency (after synapse's `sd_notify`).

`READY=1`, `RELOADING=1`, `STOPPING=1`, `WATCHDOG=1` and `STATUS=...` go as
datagrams to `$NOTIFY_SOCKET` when it is set; otherwise nothing happens.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send `fields` (e.g. "READY=1", "STATUS=...") to systemd. Returns whether a socket was set."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
    return True


def watchdog_interval() -> float | None:
    """Half of systemd's `WatchdogSec=`, in seconds, if this process is the one being watched."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
