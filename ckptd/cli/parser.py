"""The argument parser: every command, its options and --help, and the exit codes it documents."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ckptd import __version__
from ckptd.errors import UsageError

EPILOG = """\
exit codes: 0 ok, 1 verify: not complete / health: unhealthy / status: no daemon running /
            latest: nothing to resume from, 64 usage, 66 root missing, 70 internal error,
            74 I/O error (a busy metrics port too), 75 another ckptd holds the root,
            78 config error, 130 interrupted, 141 stdout closed early (| head)
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
        "trash",
        "what waits in the trash before its purge, and the undo: list, restore, purge",
        roots=False,
        exits="exit 66: nothing in the trash by that name, 75: purge: another ckptd holds a root",
    )
    actions = sp.add_subparsers(dest="trash_command", metavar="ACTION", parser_class=_Parser, required=True,
                                help="list, restore or purge")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        ap = actions.add_parser(name, help=help, description=help, formatter_class=fmt)
        ap.add_argument("-c", "--config", type=_path_arg, metavar="CONFIG", default=argparse.SUPPRESS,
                        help="TOML config file")
        ap.add_argument("--root", dest="roots", action="append", type=_path_arg, metavar="ROOT",
                        default=argparse.SUPPRESS, help="only this root (default: the config's roots)")
        return ap

    ap = action("list", "each entry: where it came from, why, its bytes, when its purge may take it")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap = action("restore", "put an entry back where it came from (beside it, if that name is taken)")
    ap.add_argument("name", nargs="?", metavar="NAME",
                    help="the entry, as `trash list` names it, or the path it came from")
    ap.add_argument("--all", action="store_true", help="every checkpoint in the trash")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin what is restored (the next pass may delete it again)")
    ap = action("purge", "purge what may go now, judged again first, as the daemon would")
    ap.add_argument("--now", action="store_true", help="without waiting out trash_grace")

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
        help="for an observer choosing while training runs: pass over saves changed within DURATION "
        "(default 0: at a restart the job that wrote the run is the one being restarted)",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("--archive", action="store_true",
                    help="also look in the run's root's archive: an archived checkpoint newer than any "
                    "on the volume is printed as its URL (ckptd restore brings it back)")

    sp = command("archive", "what each root's archive holds: archived, failed, interrupted, pending", roots=False)
    sp.add_argument("action", choices=("list",), help="list: every archived checkpoint, those that failed, and those still to be archived")
    sp.add_argument("target", nargs="?", type=_path_arg, metavar="ROOT|RUN",
                    help="a root, a directory in one, or a run as the archive names it (default: all)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")

    sp = command(
        "restore",
        "download a checkpoint from its root's archive, every file verified, into a directory that "
        "appears only when whole",
        roots=False,
    )
    sp.add_argument("checkpoint", metavar="RUN/CHECKPOINT", help="as `ckptd archive list` names it")
    sp.add_argument("--to", type=_path_arg, metavar="DIR",
                    help="where to put it (default: its run's directory in its root)")

    sp = command("demo", "write a small example volume and a config for it", roots=False, config=False)
    sp.add_argument("dir", type=_path_arg, metavar="DIR", help="where to write it (created if missing)")
    sp.add_argument("--force", action="store_true", help="overwrite an earlier demo (or anything) in DIR")
    sp.add_argument(
        "--live",
        action="store_true",
        help="run the daemon for ~30 s on a simulated 8-rank DeepSpeed job saving into DIR, one rank slow; "
        "print its decisions and what the Trainer's save_total_limit would have deleted",
    )
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
