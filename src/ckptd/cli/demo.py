"""`ckptd demo`: a demo volume to try ckptd on."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ckptd.errors import EX_OK, UsageError


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd import demo

    base = Path(os.path.abspath(args.dir))
    config, volume = base / demo.CONFIG_NAME, base / demo.VOLUME_NAME
    existing = [p for p in (config, volume) if os.path.lexists(p)]
    if existing and not args.force:
        raise UsageError(
            f"{' and '.join(map(str, existing))} already there: ckptd demo {args.dir} --force "
            "writes the demo over it, or choose another DIR"
        )
    config = demo.build(base, time.time())
    print(
        f"wrote an example volume in {volume} and its config {config}; now try:\n"
        f"  ckptd plan -c {config}\n"
        f"  ckptd run --foreground --dry-run -c {config}"
    )
    return EX_OK
