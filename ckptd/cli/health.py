"""`ckptd health`: the daemon's liveness for a probe or a health check."""

from __future__ import annotations

import argparse
import sys
import time

from ckptd.cli.common import load, without_c_hint
from ckptd.errors import EX_OK


def cmd_health(args: argparse.Namespace) -> int:
    from ckptd.daemon.health import check

    config = load(args)
    ok, line = check(config, max_age=args.max_age, now=time.time())
    print(line)
    hint = None if ok or "heartbeat" in line else without_c_hint(args, config)
    if hint:
        print(hint, file=sys.stderr)
    return EX_OK if ok else 1
