"""What ckptd says about each framework volume, beside what the framework itself says (a table).

    PYTHONPATH=. python -m tests.support.fwfindings [OUT] [--frameworks orbax,dcp,...] [--reuse]

Generates the volumes with fwgen.py (or, with --reuse, reads OUT/fwgen.json from an earlier run),
ages every entry an hour with os.utime (so the default 60 s quiet period is over), then runs this
tree's ckptd with no config and default settings: ``ckptd plan ROOT --json`` on each framework's
root and ``ckptd verify PATH --json`` on every checkpoint.  Prints a markdown table: one row per
checkpoint, with the framework's verdict (its own lister/loader, recorded by fwgen), ckptd's, and
whether they agree.  Nothing here is a test: it is the list of what to fix.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckptd.cli.demo_volume import age
from tests.support import REPO, fwgen


def ckptd(*args: str, state: Path) -> tuple[int, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(state)}
    env.pop("CKPTD_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}


def framework_says(rec: dict[str, Any]) -> str:
    t = rec["truth"]
    if t.get("complete"):
        return "complete"
    if t.get("loads"):
        return "incomplete (loads, silently partial)"
    return "incomplete (does not load)" if t.get("loads") is False else "incomplete"


def verdict(rec: dict[str, Any], plan: dict[str, Any] | None) -> str:
    complete = bool(rec["truth"].get("complete"))
    if plan is None and rec.get("last"):
        return "agrees: a last copy, not a step (never listed, counted or deleted)"
    if plan is None:
        return "**MISSED**: not in the plan" if complete else "**MISSED** (not listed; it is broken)"
    if plan["state"] == "complete" and not complete:
        return "**WRONG**: ckptd complete, framework not" + (" -> deletable" if plan["action"] == "delete" else "")
    if plan["state"] != "complete" and complete:
        return "stricter than the framework"
    return "agrees"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="where the volumes go (default: a new temporary directory)")
    p.add_argument("--frameworks", default=",".join(fwgen.FRAMEWORKS))
    p.add_argument("--reuse", action="store_true", help="read OUT/fwgen.json instead of generating")
    a = p.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="fwfindings-")).resolve()
    names = [n for n in a.frameworks.split(",") if fwgen.missing(n) is None]
    if a.reuse:
        results = json.loads((out / "fwgen.json").read_text())
        for r in results.values():
            r["out_dir"] = Path(r["out_dir"])
            for rec in r["checkpoints"]:
                rec["abs_path"] = Path(rec["abs_path"])
    else:
        results = {}
        torch_names = [n for n in names if n != "orbax"]
        if "orbax" in names:
            results.update(fwgen.generate("orbax", out))
        if torch_names:
            results.update(fwgen.generate(torch_names, out))
        (out / "fwgen.json").write_text(json.dumps(results, default=str, indent=1))
    print(f"volumes under {out}; ckptd from {REPO}; no config, default settings, every mtime 1 h old\n")
    print("| framework | checkpoint | killed at | framework says | ckptd plan: state, action, layout, step, metric "
          "| ckptd verify: rc, checks not passed | verdict |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fwfindings-state-") as state:
        table(results, Path(state))
    return 0


def table(results: dict[str, dict[str, Any]], state: Path) -> None:
    """One row per checkpoint of every volume (and one per plan warning)."""
    for name, result in results.items():
        root = Path(result["out_dir"])
        age(root, time.time() - 3600)
        rc, plan = ckptd("plan", str(root), "--json", state=state)
        by_path = {Path(c["path"]).resolve(): c for c in plan.get("checkpoints", [])} if rc == 0 else {}
        for rec in result["checkpoints"]:
            path = Path(rec["abs_path"])
            if not path.exists():
                continue
            got = by_path.get(path.resolve())
            vrc, ver = ckptd("verify", str(path), "--json", state=state)
            failing = [f"{c['name']}: {c['detail']}" for c in ver.get("checks", []) if c["verdict"] != "passed"]
            plan_cell = "not listed" if got is None else \
                f"{got['state']}, {got['action']}, {got['layout']}, {got['step']}, {got['metric']}"
            if got is not None and got.get("step_unit", "step") != "step":
                plan_cell += f" ({got['step_unit']})"
            if got is not None and got.get("metric_source"):
                plan_cell += f" from {got['metric_source']}"
            metric = rec.get("metric")
            if metric is not None and got is not None and got["metric"] != metric:
                plan_cell += f" (logged: {metric})"
            ver_cell = f"{vrc}: " + ("; ".join(failing) if failing else (ver.get("state") or str(ver.get("error"))))
            print(f"| {name} | `{rec['path']}` | {rec['killed'] or ''} | {framework_says(rec)} | {plan_cell} | "
                  f"{ver_cell.replace('|', '/')} | {verdict(rec, got)} |")
        for w in plan.get("warnings", []) if rc == 0 else [f"plan exit {rc}: {plan}"]:
            print(f"| {name} | (plan warning) | | | {str(w).replace('|', '/')} | | |")


if __name__ == "__main__":
    sys.exit(main())
