"""Count the suite, to show a reorganisation of tests/ lost nothing.

    python -m tools.testcount            # collected test ids (with and without --run-slow) + assertions
    python -m tools.testcount --ids /tmp/ids-before   # also the ids, to diff against a later run
    python -m tools.testcount --no-collect   # the assertion count only (no pytest run)

Collected ids come from `pytest --collect-only -q` run in a subprocess against this checkout
(the checkout first on PYTHONPATH). Assertions are counted from the AST of every .py file under tests/:
each `assert` statement and each `pytest.raises(...)` / `raises(...)` call, split into the test
files (test_*.py) and everything else (conftest, tests/support/). A move of tests between files keeps
both totals; a lost test or assertion lowers one of them.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def _is_raises(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "raises" and isinstance(func.value, ast.Name) and func.value.id == "pytest"
    return isinstance(func, ast.Name) and func.id == "raises"


def count_assertions(root: Path = TESTS) -> dict[str, int]:
    counts = {"test_files": 0, "assert_tests": 0, "raises_tests": 0, "assert_other": 0, "raises_other": 0}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = "tests" if path.name.startswith("test_") else "other"
        if where == "tests":
            counts["test_files"] += 1
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                counts[f"assert_{where}"] += 1
            elif _is_raises(node):
                counts[f"raises_{where}"] += 1
    return counts


def collected(*extra: str, ids_out: Path | None = None) -> int:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra]
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if ids_out is not None:
        # the test's name without its file: a test moved to another file keeps it
        ids_out.write_text("".join(sorted(i.split("::", 1)[1] + "\n" for i in ids)))
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
    m = re.search(r"(\d+) tests? collected", proc.stdout)
    if proc.returncode != 0 or m is None or int(m.group(1)) != len(ids):
        print(f"collect {' '.join(extra)}: rc={proc.returncode} {tail[0]}", file=sys.stderr)
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-collect", action="store_true", help="skip the pytest collection")
    parser.add_argument("--ids", type=Path, help="write the collected ids, without their file, sorted, here "
                        "(diff two of them: a moved test keeps its name)")
    args = parser.parse_args(argv)
    counts = count_assertions()
    total = sum(v for k, v in counts.items() if k != "test_files")
    print(f"test files: {counts['test_files']}")
    print(f"asserts in test files: {counts['assert_tests']}  "
          f"pytest.raises in test files: {counts['raises_tests']}")
    print(f"asserts elsewhere in tests/: {counts['assert_other']}  "
          f"raises elsewhere: {counts['raises_other']}")
    print(f"assertions total: {total}")
    if not args.no_collect:
        print(f"collected test ids: {collected(ids_out=args.ids)}")
        print(f"collected test ids --run-slow: {collected('--run-slow')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
