"""`ckptd run --foreground --log-format json ARGS...` that waits, on a FIFO, at the reaper's fence.

$CKPTD_TEST_FENCE_FIFOS names a directory. Where it holds a FIFO named `before` (the fence said
yes and the rename is next: the window a leader stopped by SIGSTOP, a paused VM or a hung mount
sits in) or `after` (the rename done, the fence not yet asked again), the reaper logs "waiting
at the fence <where> a rename", opens it and reads until the test writes, then removes it and
goes on. The test stops the whole process with SIGSTOP while it waits there, so its lease lapses
as a stopped host's would. Why a seam and not a signal alone: the window is microseconds wide,
and no timing from another process lands in it. Everything else in the daemon is the real code.
"""

from __future__ import annotations

import logging
import os
import sys

from ckptd.cli import main
from ckptd.removal import recheck

FIFOS = os.environ["CKPTD_TEST_FENCE_FIFOS"]
_real = recheck.Fence.why_not
log = logging.getLogger("ckptd.test")


def _wait_if(where: str) -> None:
    path = os.path.join(FIFOS, where)
    if not os.path.exists(path):
        return
    log.warning("waiting at the fence %s a rename (test)", where)
    with open(path, "rb") as fifo:  # blocks until the test opens it to write
        fifo.read()
    os.unlink(path)


def _fenced(self: recheck.Fence, *, after: bool = False) -> str | None:
    if after:
        _wait_if("after")
        return _real(self, after=True)
    why = _real(self)
    if why is None:
        _wait_if("before")
    return why


recheck.Fence.why_not = _fenced  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["run", "--foreground", "-v", "--log-format", "json", *sys.argv[1:]]))
