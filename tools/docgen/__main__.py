"""`python -m tools.docgen [--check]`: rewrite the generated reference pages, or check them."""

from __future__ import annotations

import argparse
import sys

from tools.docgen import UndocumentedError, stale, write


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tools.docgen", description=__doc__)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    args = p.parse_args()
    try:
        if args.check:
            old = stale()
            for rel in old:
                print(f"{rel} is stale: run python -m tools.docgen", file=sys.stderr)
            return 1 if old else 0
        for rel in write():
            print(f"wrote {rel}")
    except UndocumentedError as exc:
        print(f"docgen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
