"""`TokenBucket`: the upload's bandwidth limit (`[roots.archive] max_bandwidth`).

Each part or small file takes its size in tokens before it is sent; the bucket refills at `rate`
bytes a second and holds at most one second's worth, so over any stretch longer than a second
what is sent stays within `rate` (plus that one second's burst). A take larger than what is there
runs the bucket into debt and waits it out: a 64 MiB part at 50 MiB/s waits about 1.3 s, and the
part itself goes at the link's speed, so the limit holds on average over a part, not within one.
Shared by the upload's threads (`concurrency`): they wait in turn, never more than `rate` in all.
The clock and the wait are passed in, so a test can measure with a clock of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0:
            raise ValueError(f"a rate must be positive (got {rate})")
        self.rate = float(rate)
        self.burst = float(rate)  # one second's worth
        self.clock = clock
        self.sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Wait until `n` bytes may be sent; the seconds waited."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)
        return wait
