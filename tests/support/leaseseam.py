"""`ckptd run --foreground -v --log-format json ARGS...` held or killed at its lease record's writes.

The seam is `ckptd.fleet.leaserecord.RecordIO.write`, the one method through which the lease record is written
(claims, renewals, release; tests/support/leasefault.py uses it too). Two faults, each in a window too
narrow for a signal from another process to land in:

- $CKPTD_TEST_LEASE_HOLD names a path: while a FIFO is there, the next write logs "holding a
  lease write (test)" and waits until the test writes to the FIFO, then goes on with the record
  it was given: a host paused (SIGSTOP, a paused VM, a hung mount) after it decided what to
  write and before the write reached the volume.
- $CKPTD_TEST_LEASE_HOLD_READ names a path: while a FIFO is there, the next read of the record
  returns only after the test writes to the FIFO: a standby paused just after it looked.
- $CKPTD_TEST_LEASE_DIE set: the first write kills the process (SIGKILL) before it starts: a
  host that dies between claiming an epoch and writing its record.

Everything else in the daemon is the real code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from ckptd.cli import main
from ckptd.fleet import leaserecord

HOLD = os.environ.get("CKPTD_TEST_LEASE_HOLD")
HOLD_READ = os.environ.get("CKPTD_TEST_LEASE_HOLD_READ")
DIE = os.environ.get("CKPTD_TEST_LEASE_DIE")
_real_write = leaserecord.RecordIO.write
_real_read = leaserecord.RecordIO.read
log = logging.getLogger("ckptd.test")


def _write(self: leaserecord.RecordIO, record: leaserecord.Record) -> None:
    if DIE:
        os.kill(os.getpid(), signal.SIGKILL)
    if HOLD and os.path.exists(HOLD):
        log.warning("holding a lease write (test): epoch %s seq %s", record.epoch, getattr(record, "seq", "?"))
        with open(HOLD, "rb") as fifo:  # blocks until the test opens it to write
            fifo.read()
        os.unlink(HOLD)
    return _real_write(self, record)


def _read(self: leaserecord.RecordIO):
    seen = _real_read(self)
    if HOLD_READ and os.path.exists(HOLD_READ):
        log.warning("holding after a lease read (test)")
        with open(HOLD_READ, "rb") as fifo:
            fifo.read()
        os.unlink(HOLD_READ)
    return seen


leaserecord.RecordIO.write = _write  # type: ignore[method-assign]
leaserecord.RecordIO.read = _read  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["run", "--foreground", "-v", "--log-format", "json", *sys.argv[1:]]))
