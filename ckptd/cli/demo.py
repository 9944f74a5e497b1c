"""`ckptd demo`: a demo volume to try ckptd on; `--live`: the daemon at work on a simulated job."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from ckptd.errors import EX_OK, EX_SOFTWARE, UsageError


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd.cli import demo_volume as demo

    base = Path(os.path.abspath(args.dir))
    if args.live:
        from ckptd.cli import demo_live

        paths = (base / demo_live.CONFIG_NAME, base / demo_live.VOLUME_NAME)
        existing = [p for p in paths if os.path.lexists(p)]
        if existing and not args.force:
            raise UsageError(
                f"{' and '.join(map(str, existing))} already there: ckptd demo --live {args.dir} --force "
                "starts the demo again there, or choose another DIR"
            )
        if existing:
            shutil.rmtree(base / demo_live.VOLUME_NAME, ignore_errors=True)
            shutil.rmtree(base / "state", ignore_errors=True)
        return EX_OK if demo_live.run(base, lambda line: print(line, flush=True)) == 0 else EX_SOFTWARE
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
