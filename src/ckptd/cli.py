"""The command line. The only place that prints, installs log handlers, or picks exit codes."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptd import __version__, layouts
from ckptd.attestation import committed_summary
from ckptd.config import Config, Root, find_config, format_age, format_size
from ckptd.discover import find_runs
from ckptd.envconfig import effective_config, settings_in
from ckptd.errors import (
    EX_IOERR,
    EX_OK,
    EX_SOFTWARE,
    CkptdError,
    ConfigError,
    IOFault,
    RootMissingError,
    UsageError,
)
from ckptd.evidence import Inspector, RunContext, step_mismatch
from ckptd.journal import Journal
from ckptd.lease import (
    Leadership,
    LocalLeadership,
    VolumeLease,
    choose_leadership,
    coherence_note,
    lock_scope,
    volume_leader_seen,
)
from ckptd.model import Action, Checkpoint, State
from ckptd.mounts import holder, is_remote, mount_of, quiet_alone_problem, quiet_for, read_mounts
from ckptd.planner import Scanner, decide, unmatched_paths, world_size_warning
from ckptd.policy import Decision, Plan, inferred_modes, summarise
from ckptd.progress import Progress, Ticker
from ckptd.reaper import DRY_RUN_NOTE, Outcome, Reaper, RootLock, waiting_in_trash

log = logging.getLogger("ckptd")

EPILOG = """\
exit codes: 0 ok, 1 verify: not complete / health: unhealthy / status: no daemon running,
            64 usage, 66 root missing, 70 internal error, 74 I/O error,
            75 another ckptd holds the root, 78 config error, 141 stdout closed early (| head)
config: -c CONFIG, else $CKPTD_CONFIG, else /etc/ckptd/config.toml if it exists,
        else built-in defaults (keep the 2 newest complete checkpoints and the
        trainer's best, quiet_period 60s, no slimming); CKPTD_* variables override it
        (CKPTD_ROOTS, CKPTD_KEEP_LAST, ...: docs/reference/environment.md)
slimming: keep_full_last = N keeps the optimizer state of the N newest complete
        checkpoints only; other kept ones keep their weights (docs/slimming.md)
"""
EX_TEMPFAIL = 75
EX_PIPE = 128 + 13  # what a shell reports for a program that SIGPIPE stopped (`cat big | head -1`)
MORE = "exit codes, where the config is found, CKPTD_* variables: ckptd --help"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="ckptd",
        description="Checkpoint retention for ML training volumes, decided from evidence on disk.",
        epilog=EPILOG,
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(
        name: str, help: str, *, roots: bool = True, config: bool = True, exits: str = ""
    ) -> argparse.ArgumentParser:
        # One line, not the global epilog again: `ckptd --help` has the whole story.
        epilog = f"{exits}; {MORE}" if exits else MORE
        sp = sub.add_parser(name, help=help, description=help, epilog=epilog, formatter_class=fmt)
        if roots:
            sp.add_argument(
                "roots",
                nargs="*",
                type=_path_arg,
                metavar="ROOT",
                help="directories to manage (default: the config's roots)",
            )
        if config:
            sp.add_argument("-c", "--config", type=_path_arg, metavar="CONFIG", help="TOML config file")
        sp.add_argument("-v", "--verbose", action="store_true", help="more detail (and debug logs on stderr)")
        return sp

    sp = command("run", "the daemon: watch the roots and apply retention as checkpoints complete")
    sp.add_argument(
        "--foreground",
        action="store_true",
        help="a readable line on stderr for every state change and decision (-v: debug detail too)",
    )
    sp.add_argument("--dry-run", action="store_true", help="decide and log, but delete nothing")
    sp.add_argument("--log-format", choices=("text", "json"), help="default: the config's daemon.log_format")

    sp = command(
        "status",
        "what the running daemon sees: runs, checkpoints, states",
        roots=False,
        exits="exit 0: a daemon is running, 1: none is",
    )
    sp.add_argument("--json", action="store_true", help="print the daemons' state documents")

    sp = command("plan", "show what retention would keep, slim and delete (read-only)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress line on a terminal")
    retention_flags(sp)

    sp = command(
        "prune",
        "apply retention once: delete and slim what the plan says, crash-safely",
        exits="exit 75: another ckptd holds a root's lock, or it cannot be taken",
    )
    sp.add_argument("--dry-run", action="store_true", help="re-check and report, but change nothing")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress line on a terminal")
    retention_flags(sp)

    sp = command(
        "verify",
        "show the completeness evidence for one checkpoint",
        roots=False,
        exits="exit 0: complete, 1: not complete, 64: not a checkpoint, 66: no such path",
    )
    sp.add_argument("path", type=_path_arg, metavar="PATH", help="a checkpoint directory or file")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress line on a terminal")

    sp = command(
        "health",
        "exit 0 if the daemon's heartbeat is recent, 1 if not, saying why",
        roots=False,
        exits="exit 0: healthy, 1: unhealthy",
    )
    sp.add_argument(
        "--max-age",
        type=_positive_seconds,
        metavar="SECONDS",
        help="how old a heartbeat may be (default: 3 x the largest poll_interval, at least 30s)",
    )

    command(
        "check-config",
        "validate the config, check what `ckptd run` needs (roots, extras), print it with defaults",
        roots=False,
        exits="exit codes as `ckptd run` would give",
    )

    sp = command(
        "latest",
        "print the newest complete, full checkpoint of a run: what a restart should resume from",
        roots=False,
    )
    sp.add_argument(
        "run_dir",
        type=_path_arg,
        metavar="RUN_DIR",
        help="the run's directory (e.g. the Trainer's output_dir)",
    )
    sp.add_argument(
        "--by",
        choices=("step", "time"),
        default="step",
        help="newest by step (the default, as the frameworks number them) or by time written",
    )
    sp.add_argument(
        "--quiet-period",
        metavar="DURATION",
        help="override quiet_period (e.g. 0 when the job that wrote the run is known to be dead)",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON document")

    sp = command("demo", "write a small example volume and a config for it", roots=False, config=False)
    sp.add_argument("dir", type=_path_arg, metavar="DIR", help="where to write it (created if missing)")
    sp.add_argument("--force", action="store_true", help="overwrite an earlier demo (or anything) in DIR")
    return p


# Retention flags of plan and prune: (flag, config key, argparse type, metavar, help).
RETENTION_FLAGS = (
    ("--keep-last", "keep_last", "count", "N", "keep the N newest complete checkpoints of each run"),
    ("--keep-best", "keep_best", "count", "K", "keep the K best by --metric (else: the trainer's best)"),
    ("--metric", "metric", "text", "NAME", "the metric keep_best ranks by, e.g. eval_loss"),
    ("--mode", "mode", "mode", "min|max", "whether lower or higher --metric is better"),
    ("--keep-within", "keep_within", "text", "DURATION", "keep what was saved within DURATION of the newest"),
    ("--keep-hourly", "keep_hourly", "count", "N", "keep the newest checkpoint of each of the last N hours"),
    ("--keep-daily", "keep_daily", "count", "N", "... of each of the last N days"),
    ("--keep-weekly", "keep_weekly", "count", "N", "... of each of the last N ISO weeks"),
    ("--keep-monthly", "keep_monthly", "count", "N", "... of each of the last N months"),
)


def retention_flags(sp: argparse.ArgumentParser) -> None:
    """The retention keys as flags, overriding the config for this call (restic forget's)."""
    group = sp.add_argument_group(
        "retention, for this call",
        "each flag replaces its key in [roots.retention] and in every [[roots.runs]] rule\n"
        "that sets it; --keep-last or --keep-best replaces keep_total. The rest of the config holds.",
    )
    for flag, key, kind, metavar, help in RETENTION_FLAGS:
        kw: dict[str, Any] = {"dest": f"retention_{key}", "metavar": metavar, "help": help}
        if kind == "count":
            kw["type"] = _count
        elif kind == "mode":
            kw["choices"] = ("min", "max")
            kw.pop("metavar")
        group.add_argument(flag, **kw)


def retention_overrides(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The retention flags given: config key -> (flag, value)."""
    out = {}
    for flag, key, *_ in RETENTION_FLAGS:
        value = getattr(args, f"retention_{key}", None)
        if value is not None:
            out[key] = (flag, value)
    return out


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number (got {text!r})") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text!r})")
    return value


def _path_arg(text: str) -> str:
    """A path argument, never empty: `ckptd prune "$CKPT_ROOT"` with the variable unset passes "",
    which Path() reads as the working directory (for a service, often /). rm, ls and cd refuse an
    empty path; so does ckptd (exit 64, by the parser), for every path it takes."""
    if text == "":
        raise argparse.ArgumentTypeError("empty (an unset variable?): never taken for the working directory")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds (got {text!r})") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


# --- config --------------------------------------------------------------


def config_path(args: argparse.Namespace) -> Path | None:
    """`-c`, else `$CKPTD_CONFIG`, else /etc/ckptd/config.toml if it exists (config.find_config)."""
    path = find_config(args.config)
    if path is not None and not args.config and os.environ.get("CKPTD_CONFIG") and not path.exists():
        raise ConfigError([f"{path}: no such file (named by $CKPTD_CONFIG)"])
    return path


def load(args: argparse.Namespace) -> Config:
    """The file (or defaults), then ROOT arguments, then CKPTD_* variables (envconfig.py)."""
    roots = [Path(r) for r in getattr(args, "roots", None) or []]
    return effective_config(config_path(args), os.environ, roots, retention_overrides(args))


def with_effective_quiet(config: Config, *, say: bool = True) -> Config:
    """The config with each root's quiet period lengthened by its mount's attribute cache
    (mounts.quiet_for), saying so on stderr: what plan, prune and verify must go by."""
    mounts = read_mounts()
    roots = []
    for root in config.roots:
        quiet, _, warning = quiet_for(root.path, root.quiet_period, mounts, root.attribute_cache)
        if warning is not None and say:
            print(f"note: {root.path}: {warning}", file=sys.stderr)
        roots.append(root.model_copy(update={"quiet_period": quiet}) if quiet != root.quiet_period else root)
    return config.model_copy(update={"roots": tuple(roots)})


def require_roots(config: Config) -> None:
    if not config.roots:
        raise UsageError("no roots: name one (ckptd plan /mnt/experiments) or configure [[roots]]")
    problems = []
    for root in config.roots:
        if not os.path.lexists(root.path):
            problems.append(f"root {root.path} does not exist")
        elif not root.path.is_dir():
            problems.append(f"root {root.path} is not a directory")
    if problems:
        raise RootMissingError("\n".join(problems))


# What slimming's consolidation imports (`python -m ckptd.consolidate`: zero_to_fp32, safetensors).
SLIMMING_MODULES = ("torch", "deepspeed", "safetensors")


def missing_modules(names: Sequence[str]) -> list[str]:
    """Those of `names` that cannot be imported here (looked up, not imported: torch takes seconds)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def slimming_keys(config: Config) -> list[str]:
    """Where the config turns slimming on: `roots[0].retention.keep_full_last`, ..."""
    keys = []
    for i, root in enumerate(config.roots):
        if root.retention.keep_full_last is not None:
            keys.append(f"roots[{i}].retention.keep_full_last")
        keys += [
            f"roots[{i}].runs[{j}].keep_full_last"
            for j, rule in enumerate(root.runs)
            if rule.keep_full_last is not None
        ]
    return keys


def require_extras(config: Config) -> None:
    """What `run` and `prune` would fail on later, said before they start (exit 78)."""
    problems = []
    keys = slimming_keys(config)
    missing = missing_modules(SLIMMING_MODULES) if keys else []
    if missing:
        problems.append(
            f"{keys[0]}: slimming needs the deepspeed extra, and {', '.join(missing)} cannot be imported "
            "here: pip install 'ckptd[deepspeed]' (the CPU torch first: README, Set-up), "
            "or remove keep_full_last"
        )
    if config.daemon.metrics_listen and missing_modules(["prometheus_client"]):
        problems.append(
            "daemon.metrics_listen is set, but prometheus_client is not installed: "
            "pip install 'ckptd[metrics]'"
        )
    if problems:
        raise ConfigError(problems)


def preflight(config: Config) -> None:
    """Everything `run` checks before it starts, in its order, with its exit codes."""
    require_roots(config)
    require_extras(config)


def check_state_dir(config: Config) -> str | None:
    """Whether `run` could create and write its state directory.

    A file in the way stops any user: IOFault, exit 74, as `run` exits there. Not writable by
    this user is only a warning: the service runs as another user, and systemd's
    StateDirectory= creates the directory for it.
    """
    path = config.daemon.state_dir
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise IOFault(f"daemon.state_dir {path}: {existing} is not a directory (`ckptd run` would exit 74)")
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
    return (
        f"daemon.state_dir {path} {what} by uid {os.getuid()}: `ckptd run` as this user exits 74 "
        "(under systemd, StateDirectory= creates it for the service's user)"
    )


# --- commands ------------------------------------------------------------


def scan_all(config: Config, now: float, *, quiet: bool = False) -> tuple[dict[Path, Scanner], Plan]:
    # What was read from files is kept in state_dir when it exists (verdicts.py): the volume
    # itself is only read.
    scanners = {root.path: Scanner(root, state_dir=config.daemon.state_dir) for root in config.roots}
    roots = []
    for root in config.roots:
        bar = Progress(f"plan {root.path}", quiet=quiet)
        try:
            roots.append((root, scanners[root.path].runs(now=now, progress=bar.update)))
        finally:
            bar.done()
    return scanners, decide(roots, trash=waiting_in_trash)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load(args)
    require_roots(config)
    config = with_effective_quiet(config)
    _, plan = scan_all(config, time.time(), quiet=args.quiet)
    warnings = list(plan.warnings)
    try:
        require_extras(config)
    except ConfigError as exc:  # plan only reads: say what run and prune will refuse, and go on
        warnings += [f"{line} (ckptd run and prune refuse this config)" for line in exc.problems]
    notes = [line for root in config.roots for line in inferred_modes(root)]
    totals = summarise(plan.decisions)
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
        }
        print(json.dumps(doc, indent=2))
        return EX_OK
    print_table(plan.decisions, checks=args.verbose)
    for w in warnings:
        print(f"warning: {w}")
    for n in notes:
        print(f"note: {n}")
    print(
        f"\n{totals['keep']} keep, {totals['delete']} delete, {totals['slim']} slim "
        f"({format_size(totals['bytes_to_free'])} to free)"
    )
    return EX_OK


def _lead_for_prune(config: Config, root: Root, mounts: list) -> tuple[Leadership | None, str | None]:
    """The root's leadership taken for one prune, or (None, why not).

    A volume lease that a live holder renews is not waited for (prune exits 75); one whose
    holder is gone is watched for its duration plus margin first, as any standby must.
    """
    d = config.daemon
    kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent)
    if kind == "local":
        local = LocalLeadership(RootLock(d.state_dir, root.path), why)
        local.step()
        return (local, None) if local.held() else (None, local.blocked)
    if problem is not None:
        return None, problem
    lease = VolumeLease(root.path, duration=d.lease_duration, margin=d.lease_margin, why=why)
    deadline = time.monotonic() + d.lease_duration + d.lease_margin + 2 * lease.interval
    between_looks = threading.Event()  # never set: a timer between looks, nothing to synchronise with
    said = False
    while True:
        lease.step()
        if lease.held():
            lease.start()  # renewed while the prune runs
            return lease, None
        rec = lease.seen.record if lease.seen else None
        holder = f"{rec.holder.describe()} holds the volume lease (epoch {rec.epoch})" if rec else ""
        live = rec is not None and not rec.released and time.time() <= rec.expires + lease.margin
        if live:
            assert rec is not None
            return None, f"{holder}, renewed {max(0.0, time.time() - rec.renewed):.0f}s ago"
        if time.monotonic() >= deadline or lease.error or "lock" in (lease.blocked or ""):
            return None, "; ".join(filter(None, [holder, lease.blocked]))
        if not said:
            wait = d.lease_duration + d.lease_margin
            print(f"{root.path}: the volume lease is not renewed; waiting up to {wait:g}s to be sure its "
                  f"holder is gone ({lease.blocked})", file=sys.stderr)
            said = True
        between_looks.wait(lease.interval)


def cmd_prune(args: argparse.Namespace) -> int:
    config = load(args)
    preflight(config)
    config = with_effective_quiet(config)
    mounts = read_mounts()
    dry_run = args.dry_run or config.daemon.dry_run
    note = f" {DRY_RUN_NOTE}" if dry_run else ""
    journal = None if dry_run else Journal(config.daemon.state_dir)
    status = EX_OK
    totals = {o: 0 for o in Outcome}
    would = {"delete": [0, 0], "slim": [0, 0]}  # dry run: action -> [count, bytes]
    freed = slim_freed = 0
    trashed: list[Path] = []
    for root in config.roots:
        lead = None
        if not dry_run:
            lead, why_not = _lead_for_prune(config, root, mounts)
            if lead is None:
                print(f"skipping {root.path}: {why_not}", file=sys.stderr)
                status = max(status, EX_TEMPFAIL)
                continue
        try:
            scanner = Scanner(root, state_dir=config.daemon.state_dir)
            reaper = Reaper(
                scanner,
                journal,
                dry_run=dry_run,
                consolidate_timeout=config.daemon.consolidate_timeout,
                fence=lead.fencer() if lead is not None else None,
            )
            if lead is not None:
                reaper.foreign_wait = lead.takeover_wait()  # what another process trashed waits
            reaper.clear_work()  # what an interrupted consolidation left, into the trash
            leftover, leftover_bytes = reaper.purge()  # an earlier run's interrupted purge
            if leftover:
                print(
                    f"purged {leftover} leftover trash entries ({format_size(leftover_bytes)}) in {root.path}"
                )
            bar = Progress(f"prune {root.path}", quiet=args.quiet)
            try:
                runs = scanner.runs(now=time.time(), progress=bar.update)
            finally:
                bar.done()
            plan = decide([(root, runs)], trash=waiting_in_trash)  # what still waits there counts as free
            for w in plan.warnings:
                print(f"warning: {w}{note}")
            acting = sum(1 for d in plan.decisions if d.action is not Action.KEEP)
            # A slim may consolidate first (zero_to_fp32, silent for as long as it takes): a
            # terminal is told what is being waited for.
            ticker = Ticker(f"prune {root.path}", quiet=args.quiet or dry_run)
            with ticker:
                ticker.working(f"0 of {acting} deletions and slims done (a slim may consolidate first)")
                for n, result in enumerate(reaper.execute(plan.decisions), start=1):
                    ticker.clear()
                    status = max(status, report_result(result, totals, would, note))
                    if result.outcome is Outcome.SLIMMED:
                        slim_freed += result.moved_bytes
                    if result.outcome is Outcome.TRASHED and result.trash_path is not None:
                        trashed.append(result.trash_path)
                    ticker.working(f"{n} of {acting} deletions and slims done")
            reaper.purge(stop=lambda lead=lead: lead is not None and not lead.held())
            # What purging the deleted checkpoints freed, as the disk counts it (space.py)
            freed += sum(reaper.purged.get(p, 0) for p in trashed)
            if reaper.waiting:
                print(f"{root.path}: {reaper.waiting} trash entries another ckptd left are purged once "
                      f"they have been there {reaper.foreign_wait:g}s, re-checked first (by the next prune "
                      "or the daemon)")
        finally:
            if lead is not None:
                lead.stop()
    if journal is not None:
        journal.close()
    if dry_run:
        done = (
            f"{would['delete'][0]} would be deleted ({format_size(would['delete'][1])}), "
            f"{would['slim'][0]} would be slimmed ({format_size(would['slim'][1])} of optimizer state)"
        )
    else:
        done = (
            f"{totals[Outcome.TRASHED]} deleted ({format_size(freed)} freed), "
            f"{totals[Outcome.SLIMMED]} slimmed ({format_size(slim_freed)} of optimizer state freed)"
        )
    print(
        f"prune: {done}, {totals[Outcome.REFUSED]} refused on re-check, {totals[Outcome.FAILED]} failed{note}"
    )
    return status


def report_result(result: Any, totals: dict, would: dict[str, list[int]], note: str) -> int:
    """prune's line for one result; the exit status it calls for (EX_IOERR for a failure)."""
    d = result.decision
    totals[result.outcome] += 1
    size = format_size(d.bytes_freed)
    if result.outcome is Outcome.DRY_RUN:
        would[str(d.action)][0] += 1
        would[str(d.action)][1] += d.bytes_freed
        # "would move to .ckptd-trash/ and purge" says nothing "would delete" does not
        how = f" -> {result.detail}" if d.action is Action.SLIM else ""
        print(f"would {d.action} {d.checkpoint.rel} ({size}): {'; '.join(d.reasons)}{how}{note}")
        return EX_OK
    print(
        f"{d.action} {d.checkpoint.rel} ({size}): "
        f"{'; '.join(d.reasons)} -> {result.outcome}: {result.detail}{note}"
    )
    return EX_IOERR if result.outcome is Outcome.FAILED else EX_OK


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
    daemon = Daemon(config, config_path=path, cli_roots=[Path(r) for r in args.roots], dry_run=args.dry_run)
    return asyncio.run(daemon.serve())


def _without_c_hint(args: argparse.Namespace, config: Config) -> str | None:
    """Said when no daemon was found and nothing named where to look."""
    if args.config or os.environ.get("CKPTD_CONFIG") or os.environ.get("CKPTD_STATE_DIR"):
        return None
    return (
        f"that is the default state_dir; a daemon started with -c CONFIG keeps its state "
        f"where CONFIG says: ckptd {args.command} -c CONFIG"
    )


def role_of(root: dict[str, Any], doc: dict[str, Any]) -> str:
    """leader, standby or dry-run; from `leader` for a state file written before `role` existed."""
    role = root.get("role")
    if isinstance(role, str):
        return role
    return "dry-run" if doc.get("dry_run") else "leader" if root.get("leader") else "standby"


ROLES = {
    "leader": "leader: deletes here",
    "standby": "standby: another ckptd deletes here, this one observes",
    "dry-run": "dry run: decides, deletes nothing",
}


def cmd_status(args: argparse.Namespace) -> int:
    from ckptd.daemon import read_states

    config = load(args)
    docs = read_states(config.daemon.state_dir)
    if args.json:
        print(json.dumps(docs, indent=2))
    if not docs:
        print(f"no ckptd daemon is running (state_dir {config.daemon.state_dir})", file=sys.stderr)
        hint = _without_c_hint(args, config)
        if hint:
            print(f"  {hint}", file=sys.stderr)
        return 1
    if args.json:
        return EX_OK
    now = time.time()
    for doc in docs:
        dry = ", dry run" if doc.get("dry_run") else ""
        print(
            f"ckptd {doc['version']}, pid {doc['pid']}{dry}: up {format_age(now - doc.get('started', now))}, "
            f"heartbeat {format_age(now - doc['heartbeat'])} ago"
        )
        counters = doc.get("counters", {})
        print(
            f"  {counters.get('deleted', 0)} deleted, {counters.get('slimmed', 0)} slimmed, "
            f"{format_size(counters.get('bytes_reclaimed', 0))} reclaimed, "
            f"{counters.get('rescans', 0)} rescans after missed events"
        )
        job = doc.get("consolidation")
        if isinstance(job, dict):
            stopping = f", stopping: {job['stopping']}" if job.get("stopping") else ""
            print(f"  consolidating {job['checkpoint']} in {job['root']} (fp32 weights from {job['from']}): "
                  f"running {format_age(now - job['started'])}{stopping}")
        for root in doc["roots"]:
            role = role_of(root, doc)
            oldest = root.get("oldest_incomplete_age")
            if oldest is not None:  # as old as it is now, not as it was at the daemon's last write
                oldest += max(0.0, now - doc["heartbeat"])
            extra = f"; oldest incomplete: {format_age(oldest)}" if oldest is not None else ""
            print(f"  {root['path']}: {ROLES.get(role, role)} (observer {root['observer']}{extra})")
            for line in _lead_and_quiet_lines(root, time.time()):
                print(f"    {line}")
            rows = [("RUN", "CHECKPOINT", "STATE", "SIZE", "ACTION", "REASONS")]
            for run in root["runs"]:
                for c in run["checkpoints"]:
                    action = c["action"] or "-"
                    reasons = "; ".join(c["reasons"]) or f"not decided yet ({c['state']})"
                    if isinstance(c.get("unchanged_since"), int | float):
                        reasons = settling_now(c["unchanged_since"], root.get("effective_quiet_period"), now)
                    size = format_size(c["size_bytes"])
                    rows.append((run["run"], c["name"], c["state"], size, action, reasons))
            if len(rows) == 1:
                print("    no checkpoints yet")
                continue
            for line in columns(rows):
                print(f"    {line}")
    return EX_OK


def settling_now(since: float, quiet: float | None, now: float) -> str:
    """A settling checkpoint's reason, computed when `status` is asked: how long the daemon has
    seen it unchanged (wall-clock time of its last change, from the state file) of its quiet period."""
    age = max(0.0, now - since)
    if not isinstance(quiet, int | float):
        return f"settling, never deleted: unchanged for {format_age(age)}"
    if age >= quiet:
        return (f"settling, never deleted: unchanged for {format_age(age)} of {format_age(quiet)}: "
                "the daemon's next look decides")
    return f"settling, never deleted: unchanged for {format_age(age)} of {format_age(quiet)}"


def _lead_and_quiet_lines(root: dict[str, Any], now: float) -> list[str]:
    """`status`: who deletes here and under which lease; the quiet period, if the mount changed it."""
    lines = []
    lead = root.get("leadership")
    if lead and lead.get("kind") == "volume":
        holder = lead.get("holder")
        if holder and not lead.get("released"):
            left = lead["expires"] - now
            when = f"expires in {left:.0f}s" if left >= 0 else f"expired {-left:.0f}s ago"
            who = f"{holder['host']} pid {holder['pid']}" + (" (this ckptd)" if lead["held"] else "")
            text = f"volume lease epoch {lead['epoch']}, held by {who}, {when}"
        else:
            text = "volume lease free" + (f" (epoch {lead['epoch']} released)" if holder else "")
        waiting = f"; {lead['waiting']}" if lead.get("waiting") else ""
        error = f"; error: {lead['error']}" if lead.get("error") else ""
        lines.append(f"leadership: {text}{waiting}{error} [{lead['why']}]")
    elif lead:
        lines.append(f"leadership: local lock {lead['lock']} [{lead['why']}]")
    quiet, effective = root.get("quiet_period"), root.get("effective_quiet_period")
    if quiet is not None and effective is not None and effective != quiet:
        lines.append(f"quiet_period {quiet:g}s, watched as {effective:g}s: {root.get('attribute_cache')}")
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    config = load(args)
    path = Path(os.path.abspath(args.path))
    if not os.path.lexists(path):
        raise RootMissingError(f"{args.path}: no such file or directory")
    if path.is_symlink():
        raise UsageError(
            f"{args.path} is a symlink, and ckptd never follows symlinks: "
            f"verify {os.path.realpath(path)} itself"
        )
    root, run_rel = _root_for(with_effective_quiet(config, say=False), path)
    quiet, _, warning = quiet_for(path, root.quiet_period, read_mounts(), root.attribute_cache)
    if warning is not None:
        print(f"note: {warning}", file=sys.stderr)
        root = root.model_copy(update={"quiet_period": quiet})
    patterns = [layouts.compile_pattern(p.name) for p in root.patterns]
    is_dir = path.is_dir()

    def children() -> list[str]:
        return os.listdir(path)

    cand = layouts.recognise(path.name, is_dir, children, patterns)
    if cand is None and layouts.is_last_copy(path.name):
        raise UsageError(f"{args.path}: {layouts.LAST_COPY_NOTE}")
    if cand is None:
        held = find_runs(path, max_depth=0, patterns=patterns) if is_dir else []
        if held:
            names = [c.name for c in sorted(held[0].candidates, key=lambda c: (c.step, c.name))]
            raise UsageError(
                f"{args.path} is a run directory holding {len(names)} checkpoints "
                f"({names[0]} ... {names[-1]}): "
                f"verify one of them, e.g. ckptd verify {os.path.join(args.path, names[-1])}; "
                f"ckptd plan {args.path} shows them all"
            )
        what = "; for what a directory holds: ckptd plan PATH" if is_dir else ""
        raise UsageError(
            f"{args.path}: not a checkpoint ckptd recognises (checkpoint-N, global_stepN, "
            "iter_NNNNNNN, a DCP or Orbax step directory, a ...step=N... Lightning/NeMo "
            f"checkpoint, or a configured pattern){what}"
        )
    run_dir = path.parent
    retention, world = root.retention_for(run_rel)
    inspector = Inspector(quiet_period=root.quiet_period, mp_world_size=root.mp_world_size)
    # Reading every file's integrity of a big checkpoint takes a while: a terminal is told.
    with Ticker(f"verify {path}", quiet=args.quiet) as ticker:
        ticker.working("reading its files")
        ckpt = inspector.inspect(
            root.path,
            run_rel,
            RunContext(run_dir, frozenset(os.listdir(run_dir))),
            cand,
            now=time.time(),
            world_size=world,
            pins=frozenset(retention.pins),
            slim_files=retention.slim_files,
            pattern=root.patterns[cand.pattern] if cand.pattern is not None else None,
            slim_weights=retention.slim_weights,
        )
    warnings = step_mismatch(ckpt, os.listdir(path) if is_dir else [])
    if args.json:
        print(json.dumps({**checkpoint_json(ckpt), "warnings": warnings}, indent=2))
    else:
        slimmed = ", slimmed: weights only" if ckpt.slimmed else ""
        print(
            f"{path}: {ckpt.state}{slimmed} "
            f"({ckpt.layout} layout, step {ckpt.step}, {format_size(ckpt.size_bytes)})"
        )
        width = max(len(c.name) for c in ckpt.checks)
        for c in ckpt.checks:
            print(f"  {c.verdict:<8} {c.name:<{width}}  {c.detail}")
        for w in warnings:
            print(f"warning: {w}")
    return EX_OK if ckpt.state is State.COMPLETE else 1


def _root_for(config: Config, path: Path) -> tuple[Root, str]:
    """The configured root holding the checkpoint at `path`, and its run directory's place in it
    (`mounts.holder`: symlinks, `..` and bind mounts give the same answer as for plan and prune),
    or defaults rooted at its parent."""
    found = holder(path.parent, ((root.path, root) for root in config.roots))
    if found is None:
        return Root(path=path.parent), "."
    run_rel, root = found
    return root, run_rel


def cmd_latest(args: argparse.Namespace) -> int:
    """`resume_from_checkpoint=$(ckptd latest out/)`: the path on stdout, or exit 1 saying why not."""
    from ckptd.config import parse_duration
    from ckptd.resume import find_latest

    try:
        text = args.quiet_period
        quiet = None if text is None else parse_duration(float(text) if text.strip().isdigit() else text)
    except ValueError as exc:
        raise UsageError(f"--quiet-period: {exc}") from None
    found = find_latest(args.run_dir, config=find_config(args.config), by=args.by, quiet_period=quiet)
    if args.json:
        c = found.checkpoint
        doc = {
            "path": str(c.path) if c else None,
            "step": c.step if c else None,
            "step_unit": c.unit if c else None,
            "layout": c.layout if c else None,
            "why_none": found.why_none,
            "note": found.note,
            **({"committed": said} if c and (said := committed_summary(c.checks)) else {}),
            "passed_over": [
                {"path": str(p.path), "state": str(p.state), "why": w} for p, w in found.passed_over
            ],
        }
        print(json.dumps(doc, indent=2))
        return EX_OK if c else 1
    for c, why in found.passed_over:
        print(f"ckptd: passed over {found.rel(c)}: {why}", file=sys.stderr)
    if found.note:
        print(f"ckptd: note: {found.note}", file=sys.stderr)
    if found.checkpoint is not None and (said := committed_summary(found.checkpoint.checks)):
        print(f"ckptd: {found.rel(found.checkpoint)}: {said}", file=sys.stderr)
    if found.checkpoint is None:
        print(f"ckptd: nothing to resume from: {found.why_none}", file=sys.stderr)
        return 1
    print(found.checkpoint.path)
    return EX_OK


def cmd_health(args: argparse.Namespace) -> int:
    from ckptd.health import check

    config = load(args)
    ok, line = check(config, max_age=args.max_age, now=time.time())
    print(line)
    hint = None if ok or "heartbeat" in line else _without_c_hint(args, config)
    if hint:
        print(hint, file=sys.stderr)
    return EX_OK if ok else 1


def cmd_check_config(args: argparse.Namespace) -> int:
    path = config_path(args)
    config = load(args)
    env = settings_in(os.environ)
    with_env = f" (with {', '.join(env)} from the environment)" if env else ""
    print(json.dumps(config.model_dump(mode="json"), indent=2))
    sys.stdout.flush()  # the document first, then the verdict on stderr
    preflight(config)  # what `ckptd run` checks before it starts, with its exit codes
    warning = check_state_dir(config)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    checked = [f"{len(config.roots)} root(s) present"]
    if slimming_keys(config):
        checked.append("slimming's torch, deepspeed, safetensors importable")
    if config.daemon.metrics_listen:
        checked.append("prometheus_client importable")
    for line in volume_notes(config) + [n for root in config.roots for n in inferred_modes(root)]:
        print(f"# {line}", file=sys.stderr)
    for line in _unmatched(config):
        print(f"warning: {line}", file=sys.stderr)
    for line in _world_sizes(config):
        print(f"warning: {line}", file=sys.stderr)
    source = path if path else "no config file: built-in defaults"
    print(f"# {source}{with_env}: OK ({', '.join(checked)})", file=sys.stderr)
    return EX_OK


def _unmatched(config: Config) -> list[str]:
    """Pins and run rules that match nothing on the volume now (discovery only: no file is read)."""
    out = []
    for root in config.roots:
        patterns = [layouts.compile_pattern(p.name) for p in root.patterns]
        try:
            dirs = find_runs(root.path, max_depth=root.max_depth, patterns=patterns)
        except OSError:
            continue  # preflight said what it could; nothing to compare with
        rels = [c.name if d.rel == "." else f"{d.rel}/{c.name}" for d in dirs for c in d.candidates]
        out += unmatched_paths(root, rels, [d.rel for d in dirs])
    return out


def _world_sizes(config: Config) -> list[str]:
    """Configured world sizes that the checkpoints contradict (`planner.world_size_warning`):
    the checkpoints are inspected, as `plan` does, only in roots where a world_size is set."""
    out = []
    for root in config.roots:
        if root.world_size is None and all(r.world_size is None for r in root.runs):
            continue
        try:
            runs = Scanner(root, state_dir=config.daemon.state_dir).runs(now=time.time())
        except (OSError, CkptdError):
            continue  # preflight said what it could
        out += [w for run in runs if (w := world_size_warning(root, run)) is not None]
    return out


def volume_notes(config: Config) -> list[str]:
    """For check-config: per root, who will delete there and how, and what its mount does to quiet."""
    mounts = read_mounts()
    d = config.daemon
    out = []
    for i, root in enumerate(config.roots):
        where = f"roots[{i}] {root.path}"
        kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent)
        mount = mount_of(root.path, mounts)
        locks = lock_scope(mount)
        if kind == "volume":
            lease = f"lease {d.lease_duration:g}s + {d.lease_margin:g}s margin"
            lease += f" in {root.path / layouts.LEASE_DIR}"
            out.append(f"{where}: leadership=volume ({why}); {lease}; POSIX locks: {locks}")
            if (note := coherence_note(root.path, mounts, root.coherent)) is not None:
                out.append(f"warning: {where}: {note}")
        else:
            out.append(f"{where}: leadership=local ({why}): one deleter per state_dir")
            if (mixed := volume_leader_seen(root.path)) is not None:
                out.append(f"warning: {where}: {mixed}")
            if mount is not None and is_remote(mount.fstype):
                out.append(
                    f"warning: {where}: leadership=local on {mount.fstype}: ckptd on other hosts "
                    "sharing this volume would each delete; use leadership = \"volume\" or \"auto\""
                )
        if problem is not None:
            out.append(f"warning: {where}: {problem}")
        _, _, warning = quiet_for(root.path, root.quiet_period, mounts, root.attribute_cache)
        if warning is not None:
            out.append(f"warning: {where}: {warning}")
        if (alone := quiet_alone_problem(root.path, mounts, root.attribute_cache)) is not None and any(
                not p.evidence for p in root.patterns):
            out.append(f"warning: {where}: patterns without require or ranks complete nothing: {alone}")
    return out


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


# --- output --------------------------------------------------------------


def checks_json(c: Checkpoint) -> list[dict[str, str]]:
    return [{"name": k.name, "verdict": str(k.verdict), "detail": k.detail} for k in c.checks]


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {
        "root": str(c.root),
        "run": c.run,
        "path": str(c.path),
        "step": c.step,
        "layout": c.layout,
        "state": str(c.state),
        "size_bytes": c.size_bytes,
        "pinned": c.pinned,
        "slimmed": c.slimmed,
        "checks": checks_json(c),
    }


def decision_json(d: Decision) -> dict[str, Any]:
    c = d.checkpoint
    metric = d.metric if not isinstance(d.metric, float) or d.metric == d.metric else "nan"
    if isinstance(metric, float) and metric in (float("inf"), float("-inf")):
        metric = str(metric)
    return {
        "root": str(c.root),
        "run": c.run,
        "path": str(c.path),
        "step": c.step,
        "layout": c.layout,
        "state": str(c.state),
        "size_bytes": c.size_bytes,
        "metric": metric,
        "metric_source": d.metric_source,
        "step_unit": c.unit,
        "action": str(d.action),
        "bytes_freed": d.bytes_freed,
        "protected": d.protected,
        "reasons": list(d.reasons),
        # the training job's commit records, where it wrote them (ckptd.attest)
        **({"committed": said} if (said := committed_summary(c.checks)) else {}),
    }


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows aligned in columns; the last column is left ragged (reasons run long)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]


def print_table(decisions: Sequence[Decision], *, checks: bool = False) -> None:
    """The plan as a table; with `checks`, each checkpoint's evidence under its row."""
    header = ("RUN", "CHECKPOINT", "STEP", "STATE", "SIZE", "METRIC", "ACTION", "FREES", "REASONS")
    rows = [header]
    for d in decisions:
        c = d.checkpoint
        metric = f"{d.metric:.4g}" if isinstance(d.metric, float) else (d.metric or "-")
        if d.metric_source is not None:  # where it was read: trainer_state, file name, ...
            metric = f"{metric} ({d.metric_source})"
        rows.append(
            (
                c.run,
                c.name,
                c.step_label,
                str(c.state),
                format_size(c.size_bytes),
                str(metric),
                str(d.action),
                format_size(d.bytes_freed) if d.bytes_freed else "-",
                "; ".join((*d.reasons, *filter(None, [committed_summary(c.checks)]))),
            )
        )
    lines = columns(rows)
    print(lines[0])
    for d, line in zip(decisions, lines[1:], strict=True):
        print(line)
        if checks:
            width = max(len(k.name) for k in d.checkpoint.checks)
            for k in d.checkpoint.checks:
                print(f"    {k.verdict:<8} {k.name:<{width}}  {k.detail}")


# --- entry points --------------------------------------------------------

COMMANDS = {
    "run": cmd_run,
    "status": cmd_status,
    "health": cmd_health,
    "plan": cmd_plan,
    "prune": cmd_prune,
    "verify": cmd_verify,
    "check-config": cmd_check_config,
    "latest": cmd_latest,
    "demo": cmd_demo,
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for docker log drivers and log shippers. Times in UTC."""

    FIELDS = ("root", "run", "checkpoint", "state", "action", "reasons", "outcome", "dry_run",
              "kept", "deleted", "slimmed", "incomplete", "bytes_freed", "done", "total")

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """`2026-03-01 14:02:03.120+0100 INFO ...`: local time with its UTC offset, so lines from
    machines in other zones (or around a DST change) can be put in order."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.datetime.fromtimestamp(record.created).astimezone()
        return when.strftime("%Y-%m-%d %H:%M:%S") + f".{int(record.msecs):03d}" + when.strftime("%z")


def _stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to stderr's device:inode when stderr goes to the journal."""
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


def setup_logging(verbose: bool, log_format: str = "text", timestamps: bool = False) -> None:
    """Handlers for the `ckptd` loggers; only the command line installs them.

    The daemon (`timestamps`) logs at INFO: state changes, decisions, deletions; `-v` adds
    DEBUG (every look, every transition). The other commands log warnings only.
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif timestamps and not _stderr_is_journal():  # the journal stamps lines itself
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger("ckptd")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.DEBUG if verbose else logging.INFO if timestamps else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    # Paths are bytes on Linux: a name that is not UTF-8 is printed escaped, not a crash.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = None
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version
            sys.stdout.flush()
            return int(exc.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return UsageError.exit_code
        setup_logging(args.verbose)
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except CkptdError as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        for line in lines:
            print(f"ckptd: {line}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading --json gets a document, errors too
            try:
                doc = {"error": "\n".join(lines), "exit_code": exc.exit_code}
                print(json.dumps(doc, indent=2), flush=True)
            except BrokenPipeError:
                _stdout_closed()
        return exc.exit_code
    except OSError as exc:
        print(f"ckptd: I/O error: {exc}", file=sys.stderr)
        return EX_IOERR
    except KeyboardInterrupt:
        return 130
    except Exception:
        traceback.print_exc()
        print("ckptd: internal error (a bug: please report it with the traceback above)", file=sys.stderr)
        return EX_SOFTWARE


def _stdout_closed() -> int:
    """The reader of stdout went away (`ckptd plan | head -1`): not an error worth a message.

    stdout is pointed at /dev/null so that the interpreter's own flush at exit does not
    raise again; the exit status is a shell's for a program stopped by SIGPIPE.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EX_PIPE


def console_main() -> None:
    sys.exit(main())
