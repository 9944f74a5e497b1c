"""What the daemon's parts share (`DaemonState`), after uvicorn's `ServerState`: the config in
force, each root as it is run, dry_run, the counters, the clock, the journal, the metrics, the
paths the watcher hinted at. Each part is handed this and the few collaborators it calls (named
in its constructor), never the whole `Daemon`: what a part can reach is what its signature says.

Plain data, no behaviour: who writes what is the parts' own business (a reload swaps the config,
the roots and dry_run, on the filesystem thread; the loop appends hints; the filesystem and purge
threads count).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptd.config import Config
    from ckptd.daemon.metrics import Metrics
    from ckptd.daemon.roots import RootRuntime
    from ckptd.journal import Journal


class DaemonState:
    """The state the daemon's parts share."""

    def __init__(self, config: Config, *, dry_run: bool, clock: Callable[[], float]):
        self.config = config  # the config in force (a reload replaces it)
        self.dry_run = dry_run  # the command line's --dry-run or the config's (a reload may switch it)
        self.clock = clock  # monotonic: deadlines, quiet periods
        self.roots: list[RootRuntime] = []  # each configured root as it is run (roots.py)
        self.counters = collections.Counter[str]()  # deleted, bytes_reclaimed, ...: the state file, metrics
        self.started = time.time()  # wall clock, for `ckptd status`
        self.journal: Journal | None = None  # None in a dry run: nothing is moved to record
        self.metrics: Metrics | None = None  # with [daemon] metrics_listen (metrics.py)
        # Paths watchdog's handler saw change, appended on the loop, taken by the filesystem thread.
        self.hints: collections.deque[str] = collections.deque()
