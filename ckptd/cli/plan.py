"""`ckptd plan`: what the daemon would do now, and why."""

from __future__ import annotations

import argparse
import json
import time

from ckptd.archive.gate import gated_plan
from ckptd.cli.common import load, require_extras, require_roots, scan_all, with_effective_quiet
from ckptd.cli.output import checks_json, decision_json, print_table
from ckptd.config import config_warnings
from ckptd.decide.policy import inferred_modes, summarise
from ckptd.errors import EX_OK, ConfigError
from ckptd.formatting import format_size
from ckptd.removal.inventory import summary, trash_entries


def cmd_plan(args: argparse.Namespace) -> int:
    config = load(args)
    require_roots(config)
    config = with_effective_quiet(config)
    _, plan = scan_all(config, time.time(), quiet=args.quiet)
    plan = gated_plan(plan, config.roots, config.daemon.state_dir)  # [roots.archive]: what must wait for it
    warnings = list(plan.warnings) + config_warnings(config)
    try:
        require_extras(config)
    except ConfigError as exc:  # plan only reads: say what run and prune will refuse, and go on
        warnings += [f"{line} (ckptd run and prune refuse this config)" for line in exc.problems]
    notes = [line for root in config.roots for line in inferred_modes(root)]
    totals = summarise(plan.decisions)
    # What earlier deletions left waiting for their purge (restorable: `ckptd trash list`)
    trash = {str(root.path): summary(trash_entries(root.path, config.trash_grace(root))) for root in config.roots}
    if args.json:
        checkpoints = []
        for d in plan.decisions:
            row = decision_json(d)
            if args.verbose:
                row["checks"] = checks_json(d.checkpoint)
            checkpoints.append(row)
        doc = {
            "roots": [str(root.path) for root in config.roots],
            "checkpoints": checkpoints,
            "warnings": warnings,
            "notes": notes,
            "totals": totals,
            "trash": trash,
        }
        print(json.dumps(doc, indent=2))
        return EX_OK
    print_table(plan.decisions, checks=args.verbose)
    for w in warnings:
        print(f"warning: {w}")
    for n in notes:
        print(f"note: {n}")
    for path, waiting in trash.items():
        if waiting["entries"]:
            print(f"trash: {waiting['entries']} deleted earlier wait in {path}/.ckptd-trash "
                  f"({format_size(waiting['bytes'])}), restorable until their purge: `ckptd trash list`")
    print(
        f"\n{totals['keep']} keep, {totals['delete']} delete, {totals['slim']} slim "
        f"({format_size(totals['bytes_to_free'])} to free)"
    )
    return EX_OK
