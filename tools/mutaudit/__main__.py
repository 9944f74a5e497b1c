"""Mutation audit: does each safety test fail when the protection it checks is removed?

    python -m tools.mutaudit                 # every mutation, each with its own test files
    python -m tools.mutaudit R1 S2e          # some of them
    python -m tools.mutaudit --set broad R4  # with another set of test files (muts.SETS)
    python -m tools.mutaudit --list

Each mutation (tools/mutaudit/muts.py) is applied alone to a throwaway `git worktree` of
HEAD (committed code only), its tests run there with pytest -x, and the worktree is
restored before the next. CAUGHT: a test failed. SURVIVED: every test passed, so nothing
checks that protection. EQUIV: it survives, and muts.py says why it cannot be caught (an
equivalent mutation). Exits 1 if anything survived. Takes about 23 minutes for all of them on 2
cores (the 29 lease, fence and attribute-cache mutations, F, V and N, add 8), most of it the
DeepSpeed and daemon tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.mutaudit.muts import MUTS, SETS

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _apply(worktree: Path, mutation: dict) -> None:
    for name, old, new in mutation["edits"]:
        path = worktree / "ckptd" / name
        text = path.read_text()
        if text.count(old) != 1:
            n = text.count(old)
            raise SystemExit(f"{mutation['id']}: the text to mutate occurs {n} times in {name}: fix muts.py")
        path.write_text(text.replace(old, new))


def _run(worktree: Path, tests: list[str], basetemp: Path) -> tuple[bool, str, float]:
    env = {**os.environ, "PYTHONPATH": str(worktree)}
    env.pop("CKPTD_CONFIG", None)
    basetemp.parent.mkdir(parents=True, exist_ok=True)  # pytest makes the basetemp, not its parents
    t0 = time.monotonic()
    # A basetemp of its own per mutation: a mutated test can leave a mount behind in its tmp_path,
    # and pytest's clean-up of a shared basetemp would then fail every later run at setup (ERROR),
    # which reads as caught.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(basetemp), *tests],
                          cwd=worktree, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    failed = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR tests"))]
    if proc.returncode not in (0, 1) and not failed:
        raise SystemExit(f"pytest could not run ({proc.returncode}):\n{out[-2000:]}")
    return bool(failed), (failed[0] if failed else out.strip().splitlines()[-1]), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.mutaudit", description=__doc__.splitlines()[0])
    p.add_argument("ids", nargs="*", help="mutation ids (default: all)")
    p.add_argument("--set", choices=sorted(SETS), help="run these test files for every mutation instead")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = p.parse_args(argv)
    chosen = [m for m in MUTS if not args.ids or m["id"] in args.ids]
    unknown = set(args.ids) - {m["id"] for m in MUTS}
    if unknown:
        raise SystemExit(f"unknown mutation ids: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m['id']:6} {m['what']}")
        return 0
    base = Path(tempfile.mkdtemp(prefix="ckptd-mutaudit-"))
    worktree = base / "wt"
    _git("worktree", "add", "--detach", str(worktree), "HEAD")
    survived = []
    try:
        for m in chosen:
            tests = SETS[args.set] if args.set else m["tests"]
            tests = SETS[tests] if isinstance(tests, str) else tests
            _apply(worktree, m)
            try:
                caught, detail, secs = _run(worktree, tests, base / "tmp" / m["id"])
            finally:
                _git("checkout", "--", "ckptd", cwd=worktree)
            verdict = "CAUGHT" if caught else "SURVIVED"
            if not caught and m.get("equivalent"):
                verdict, detail = "EQUIV", m["equivalent"]  # survives by design: nothing to catch
            elif not caught:
                survived.append(m["id"])
            print(f"{m['id']:6} {verdict:8} {secs:6.1f}s  {m['what']}: {detail[:120]}", flush=True)
    finally:
        _git("worktree", "remove", "--force", str(worktree))
        shutil.rmtree(base, ignore_errors=True)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} caught or equivalent; "
          f"survived: {', '.join(survived) or 'none'}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
