"""`ckptd run`: the daemon, in the foreground or under systemd."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ckptd.cli.common import config_path, load, preflight
from ckptd.cli.logs import setup_logging
from ckptd.config import config_warnings


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from ckptd.daemon import Daemon

    path = config_path(args)
    config = load(args)
    preflight(config)
    setup_logging(
        args.verbose,
        log_format=args.log_format or ("text" if args.foreground else config.daemon.log_format),
        timestamps=True,
    )
    for line in config_warnings(config):
        logging.getLogger("ckptd").warning("%s", line)
    daemon = Daemon(config, config_path=path, cli_roots=[Path(r) for r in args.roots], dry_run=args.dry_run)
    return asyncio.run(daemon.serve())
