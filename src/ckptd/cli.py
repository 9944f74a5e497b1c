"""The command line. The only place that prints, installs log handlers, or picks exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptd import __version__, layouts
from ckptd.config import Config, Root, find_config, format_size
from ckptd.envconfig import effective_config, settings_in
from ckptd.errors import EX_IOERR, EX_OK, EX_SOFTWARE, CkptdError, RootMissingError, UsageError
from ckptd.evidence import Inspector, RunContext
from ckptd.journal import Journal
from ckptd.model import Checkpoint, State
from ckptd.planner import Scanner, decide
from ckptd.policy import Decision, Plan, summarise
from ckptd.reaper import DRY_RUN_NOTE, LockHeld, Outcome, Reaper, RootLock

log = logging.getLogger("ckptd")

EPILOG = """\
exit codes: 0 ok, 1 verify: not complete / health: unhealthy, 64 usage, 66 root missing,
            70 internal error, 74 I/O error, 75 another ckptd holds the root, 78 config error
config: -c CONFIG, else $CKPTD_CONFIG, else /etc/ckptd/config.toml if it exists,
        else built-in defaults (keep the 2 newest complete checkpoints and the
        trainer's best, quiet_period 60s, no slimming); CKPTD_* variables override it
        (CKPTD_ROOTS, CKPTD_KEEP_LAST, ...: see the README)
slimming: keep_full_last = N keeps the optimizer state of the N newest complete
        checkpoints only; other kept ones keep their weights (see README)
"""
EX_TEMPFAIL = 75


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

    def command(name: str, help: str, *, roots: bool = True, config: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, epilog=EPILOG, formatter_class=fmt)
        if roots:
            sp.add_argument(
                "roots", nargs="*", metavar="ROOT", help="directories to manage (default: the config's roots)"
            )
        if config:
            sp.add_argument("-c", "--config", metavar="CONFIG", help="TOML config file")
        sp.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
        return sp

    sp = command("run", "the daemon: watch the roots and apply retention as checkpoints complete")
    sp.add_argument(
        "--foreground",
        action="store_true",
        help="debug mode: a human-readable line on stderr for every state change and decision",
    )
    sp.add_argument("--dry-run", action="store_true", help="decide and log, but delete nothing")
    sp.add_argument("--log-format", choices=("text", "json"), help="default: the config's daemon.log_format")

    sp = command("status", "what the running daemon sees: runs, checkpoints, states", roots=False)
    sp.add_argument("--json", action="store_true", help="print the daemons' state documents")

    sp = command("plan", "show what retention would keep, slim and delete (read-only)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")

    sp = command("prune", "apply retention once: delete and slim what the plan says, crash-safely")
    sp.add_argument("--dry-run", action="store_true", help="re-check and report, but change nothing")

    sp = command("verify", "show the completeness evidence for one checkpoint", roots=False)
    sp.add_argument("path", metavar="PATH", help="a checkpoint directory or file")
    sp.add_argument("--json", action="store_true", help="print one JSON document")

    sp = command("health", "exit 0 if the daemon's heartbeat is recent, 1 if not, saying why", roots=False)
    sp.add_argument(
        "--max-age",
        type=float,
        metavar="SECONDS",
        help="how old a heartbeat may be (default: 3 x the largest poll_interval, at least 30s)",
    )

    command("check-config", "validate the config and print it with defaults filled in", roots=False)

    sp = command("demo", "write a small example volume and a config for it", roots=False, config=False)
    sp.add_argument("dir", metavar="DIR", help="where to write it (created if missing)")
    return p


# --- config --------------------------------------------------------------


def load(args: argparse.Namespace) -> Config:
    """The file (or defaults), then ROOT arguments, then CKPTD_* variables (envconfig.py)."""
    roots = [Path(r) for r in getattr(args, "roots", None) or []]
    return effective_config(find_config(args.config), os.environ, roots)


def require_roots(config: Config) -> None:
    if not config.roots:
        raise UsageError("no roots: name one (ckptd plan /mnt/experiments) or configure [[roots]]")
    for root in config.roots:
        if not root.path.is_dir():
            raise RootMissingError(f"root {root.path} does not exist or is not a directory")


# --- commands ------------------------------------------------------------


def scan_all(config: Config, now: float) -> tuple[dict[Path, Scanner], Plan]:
    # What was read from files is kept in state_dir when it exists (verdicts.py): the volume
    # itself is only read.
    scanners = {root.path: Scanner(root, state_dir=config.daemon.state_dir) for root in config.roots}
    roots = [(root, scanners[root.path].runs(now=now)) for root in config.roots]
    return scanners, decide(roots)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load(args)
    require_roots(config)
    _, plan = scan_all(config, time.time())
    if args.json:
        doc = {"checkpoints": [decision_json(d) for d in plan.decisions], "warnings": list(plan.warnings)}
        print(json.dumps(doc, indent=2))
        return EX_OK
    print_table(plan.decisions)
    for w in plan.warnings:
        print(f"warning: {w}")
    s = summarise(plan.decisions)
    print(
        f"\n{s['keep']} keep, {s['delete']} delete, {s['slim']} slim "
        f"({format_size(s['bytes_to_free'])} to free)"
    )
    return EX_OK


def cmd_prune(args: argparse.Namespace) -> int:
    config = load(args)
    require_roots(config)
    dry_run = args.dry_run or config.daemon.dry_run
    note = f" {DRY_RUN_NOTE}" if dry_run else ""
    journal = None if dry_run else Journal(config.daemon.state_dir)
    status = EX_OK
    totals = {o: 0 for o in Outcome}
    freed = slim_freed = 0
    for root in config.roots:
        lock = RootLock(config.daemon.state_dir, root.path)
        try:
            if not dry_run:
                lock.acquire()
        except LockHeld as exc:
            print(f"skipping {root.path}: {exc}", file=sys.stderr)
            status = max(status, EX_TEMPFAIL)
            continue
        try:
            scanner = Scanner(root, state_dir=config.daemon.state_dir)
            reaper = Reaper(
                scanner, journal, dry_run=dry_run, consolidate_timeout=config.daemon.consolidate_timeout
            )
            leftover, leftover_bytes = reaper.purge()  # an earlier run's interrupted purge
            if leftover:
                print(
                    f"purged {leftover} leftover trash entries ({format_size(leftover_bytes)}) in {root.path}"
                )
            plan = decide([(root, scanner.runs(now=time.time()))])
            for w in plan.warnings:
                print(f"warning: {w}{note}")
            for result in reaper.execute(plan.decisions):
                d = result.decision
                totals[result.outcome] += 1
                print(
                    f"{d.action} {d.checkpoint.rel} ({format_size(d.bytes_freed)}): "
                    f"{'; '.join(d.reasons)} -> {result.outcome}: {result.detail}{note}"
                )
                if result.outcome is Outcome.FAILED:
                    status = max(status, EX_IOERR)
                if result.outcome is Outcome.SLIMMED:
                    slim_freed += result.moved_bytes
            _, purged_bytes = reaper.purge()
            freed += purged_bytes
        finally:
            lock.release()
    if journal is not None:
        journal.close()
    if dry_run:
        done = f"{totals[Outcome.DRY_RUN]} would be deleted or slimmed"
    else:
        # Slims' optimizer files went through the trash too: purged bytes include them.
        done = (
            f"{totals[Outcome.TRASHED]} deleted ({format_size(max(freed - slim_freed, 0))} freed), "
            f"{totals[Outcome.SLIMMED]} slimmed ({format_size(slim_freed)} of optimizer state freed)"
        )
    print(
        f"prune: {done}, {totals[Outcome.REFUSED]} refused on re-check, {totals[Outcome.FAILED]} failed{note}"
    )
    return status


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from ckptd.daemon import Daemon

    path = find_config(args.config)
    config = load(args)
    require_roots(config)
    setup_logging(
        args.verbose or args.foreground,
        log_format=args.log_format or ("text" if args.foreground else config.daemon.log_format),
        timestamps=True,
    )
    daemon = Daemon(config, config_path=path, cli_roots=[Path(r) for r in args.roots], dry_run=args.dry_run)
    return asyncio.run(daemon.serve())


def cmd_status(args: argparse.Namespace) -> int:
    from ckptd.daemon import read_states

    config = load(args)
    docs = read_states(config.daemon.state_dir)
    if args.json:
        print(json.dumps(docs, indent=2))
        return EX_OK if docs else 1
    if not docs:
        print(f"no ckptd daemon is running (state_dir {config.daemon.state_dir})", file=sys.stderr)
        return 1
    for doc in docs:
        age = time.time() - doc["heartbeat"]
        dry = " (dry run)" if doc.get("dry_run") else ""
        print(f"ckptd {doc['version']} pid {doc['pid']}, last heartbeat {age:.0f}s ago{dry}")
        counters = doc.get("counters", {})
        print(
            f"  {counters.get('deleted', 0)} deleted, {format_size(counters.get('bytes_reclaimed', 0))} "
            f"reclaimed, {counters.get('rescans', 0)} rescans after missed events"
        )
        for root in doc["roots"]:
            role = "deletes" if root["leader"] else "standby"
            oldest = root.get("oldest_incomplete_age")
            extra = f", oldest incomplete {oldest:.0f}s" if oldest is not None else ""
            print(f"  {root['path']} ({root['observer']}, {role}{extra})")
            for run in root["runs"]:
                for c in run["checkpoints"]:
                    reasons = "; ".join(c["reasons"])
                    print(
                        f"    {run['run']}/{c['name']}  {c['state']}  {format_size(c['size_bytes'])}  "
                        f"{c['action'] or '-'}: {reasons}"
                    )
    return EX_OK


def cmd_verify(args: argparse.Namespace) -> int:
    config = load(args)
    path = Path(os.path.abspath(args.path))
    if not os.path.lexists(path):
        raise RootMissingError(f"{args.path}: no such file or directory")
    root = _root_for(config, path)
    patterns = [layouts.compile_pattern(p) for p in root.patterns]
    is_dir = path.is_dir() and not path.is_symlink()

    def children() -> list[str]:
        return os.listdir(path)

    cand = layouts.recognise(path.name, is_dir, children, patterns)
    if cand is None or path.is_symlink():
        print(
            f"{args.path}: not a checkpoint ckptd recognises (symlinks are never followed)", file=sys.stderr
        )
        return 1
    run_dir = path.parent
    run_rel = "." if run_dir == root.path else os.path.relpath(run_dir, root.path)
    retention, world = root.retention_for(run_rel)
    inspector = Inspector(quiet_period=root.quiet_period, mp_world_size=root.mp_world_size)
    ckpt = inspector.inspect(
        root.path,
        run_rel,
        RunContext(run_dir, frozenset(os.listdir(run_dir))),
        cand,
        now=time.time(),
        world_size=world,
        pins=frozenset(retention.pins),
        slim_files=retention.slim_files,
    )
    if args.json:
        print(json.dumps(checkpoint_json(ckpt), indent=2))
    else:
        slimmed = ", slimmed: weights only" if ckpt.slimmed else ""
        print(
            f"{path}: {ckpt.state}{slimmed} "
            f"({ckpt.layout} layout, step {ckpt.step}, {format_size(ckpt.size_bytes)})"
        )
        width = max(len(c.name) for c in ckpt.checks)
        for c in ckpt.checks:
            print(f"  {c.verdict:<8} {c.name:<{width}}  {c.detail}")
    return EX_OK if ckpt.state is State.COMPLETE else 1


def _root_for(config: Config, path: Path) -> Root:
    """The configured root holding `path`, or defaults rooted at its parent."""
    for root in config.roots:
        if path.is_relative_to(root.path) and path != root.path:
            return root
    return Root(path=path.parent)


def cmd_health(args: argparse.Namespace) -> int:
    from ckptd.health import check

    config = load(args)
    ok, line = check(config, max_age=args.max_age, now=time.time())
    print(line)
    return EX_OK if ok else 1


def cmd_check_config(args: argparse.Namespace) -> int:
    path = find_config(args.config)
    config = load(args)
    env = settings_in(os.environ)
    with_env = f" (with {', '.join(env)} from the environment)" if env else ""
    print(f"# {path if path else 'no config file: built-in defaults'}{with_env}: OK", file=sys.stderr)
    print(json.dumps(config.model_dump(mode="json"), indent=2))
    return EX_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd import demo

    config = demo.build(Path(os.path.abspath(args.dir)), time.time())
    print(f"wrote an example volume and {config}; now try:\n  ckptd plan -c {config}")
    return EX_OK


# --- output --------------------------------------------------------------


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {
        "run": c.run,
        "path": str(c.path),
        "step": c.step,
        "layout": c.layout,
        "state": str(c.state),
        "size_bytes": c.size_bytes,
        "pinned": c.pinned,
        "slimmed": c.slimmed,
        "checks": [{"name": k.name, "verdict": str(k.verdict), "detail": k.detail} for k in c.checks],
    }


def decision_json(d: Decision) -> dict[str, Any]:
    c = d.checkpoint
    metric = d.metric if not isinstance(d.metric, float) or d.metric == d.metric else "nan"
    if isinstance(metric, float) and metric in (float("inf"), float("-inf")):
        metric = str(metric)
    return {
        "run": c.run,
        "path": str(c.path),
        "step": c.step,
        "layout": c.layout,
        "state": str(c.state),
        "size_bytes": c.size_bytes,
        "metric": metric,
        "action": str(d.action),
        "bytes_freed": d.bytes_freed,
        "protected": d.protected,
        "reasons": list(d.reasons),
    }


def print_table(decisions: Sequence[Decision]) -> None:
    header = ("RUN", "CHECKPOINT", "STEP", "STATE", "SIZE", "METRIC", "ACTION", "FREES", "REASONS")
    rows = [header]
    for d in decisions:
        c = d.checkpoint
        metric = f"{d.metric:.4g}" if isinstance(d.metric, float) else (d.metric or "-")
        rows.append(
            (
                c.run,
                c.name,
                str(c.step),
                str(c.state),
                format_size(c.size_bytes),
                str(metric),
                str(d.action),
                format_size(d.bytes_freed) if d.bytes_freed else "-",
                "; ".join(d.reasons),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=False)) + "  " + r[-1])


# --- entry points --------------------------------------------------------

COMMANDS = {
    "run": cmd_run,
    "status": cmd_status,
    "health": cmd_health,
    "plan": cmd_plan,
    "prune": cmd_prune,
    "verify": cmd_verify,
    "check-config": cmd_check_config,
    "demo": cmd_demo,
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for docker log drivers and log shippers."""

    FIELDS = ("run", "checkpoint", "state", "action", "reasons", "outcome")

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def _stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to stderr's device:inode when stderr goes to the journal."""
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


def setup_logging(verbose: bool, log_format: str = "text", timestamps: bool = False) -> None:
    """Handlers for the `ckptd` loggers; only the command line installs them."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif timestamps and not _stderr_is_journal():  # the journal stamps lines itself
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
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
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version
            return int(exc.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return UsageError.exit_code
        setup_logging(args.verbose)
        return COMMANDS[args.command](args)
    except CkptdError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"ckptd: {line}", file=sys.stderr)
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


def console_main() -> None:
    sys.exit(main())
