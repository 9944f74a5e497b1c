"""The command line. The only place that prints, installs log handlers, or picks exit codes.

One module per command (`plan`, `prune`, `run`, `status`, `checkpoints` for verify and latest,
`health`, `check_config`, `demo`), beside what they share: the parser (`parser`), loading the
config and scanning (`common`), printing (`output`) and logging (`logs`). `main` dispatches.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence

from ckptd.cli.archive import cmd_archive, cmd_restore
from ckptd.cli.check_config import cmd_check_config
from ckptd.cli.checkpoints import cmd_latest, cmd_verify
from ckptd.cli.demo import cmd_demo
from ckptd.cli.health import cmd_health
from ckptd.cli.logs import JsonFormatter, TextFormatter, setup_logging
from ckptd.cli.parser import EPILOG, EX_PIPE, build_parser
from ckptd.cli.plan import cmd_plan
from ckptd.cli.prune import cmd_prune
from ckptd.cli.run import cmd_run
from ckptd.cli.status import cmd_status
from ckptd.cli.trash import cmd_trash
from ckptd.errors import EX_IOERR, EX_SOFTWARE, CkptdError, UsageError

__all__ = ["COMMANDS", "EPILOG", "JsonFormatter", "TextFormatter", "build_parser", "console_main", "main",
           "setup_logging"]



COMMANDS = {
    "run": cmd_run,
    "status": cmd_status,
    "health": cmd_health,
    "plan": cmd_plan,
    "prune": cmd_prune,
    "trash": cmd_trash,
    "verify": cmd_verify,
    "check-config": cmd_check_config,
    "latest": cmd_latest,
    "demo": cmd_demo,
    "archive": cmd_archive,
    "restore": cmd_restore,
}


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
