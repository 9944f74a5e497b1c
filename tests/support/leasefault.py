"""`ckptd run --foreground --log-format json ARGS...` with faults injected into its volume lease's writes.

The injection seam is `ckptd.fleet.leaserecord.RecordIO.write`, the one method through which the lease
record is written (renewals, takeovers, release). While the file named by
$CKPTD_TEST_LEASE_FAULT exists, every call raises OSError with the errno named in it
(`EIO`, `ESTALE`): what a network filesystem returns when the server or the client's
connection to it fails. Why a seam and not a real fault: nothing that runs here can make one
file fail on demand. This kernel has no NFS client (CONFIG_NFS_FS unset, no module loading),
the tests run as root (permissions stop nothing), and a fault-injecting FUSE filesystem
would be a new dependency for one test. Everything else in the daemon is the real code.
"""

from __future__ import annotations

import errno
import os
import sys

from ckptd.cli import main
from ckptd.fleet import leaserecord

TRIGGER = os.environ["CKPTD_TEST_LEASE_FAULT"]
_real_write = leaserecord.RecordIO.write


def _write(self: leaserecord.RecordIO, record: leaserecord.Record) -> None:
    try:
        with open(TRIGGER) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return _real_write(self, record)
    code = getattr(errno, name)
    raise OSError(code, f"{os.strerror(code)} (injected)")


leaserecord.RecordIO.write = _write  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["run", "--foreground", "--log-format", "json", *sys.argv[1:]]))
