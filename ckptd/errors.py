"""Errors that reach the command line, each with its exit code.

The numbers are sysexits(3)'s, so that a supervisor can tell a bad config
(do not restart) from a passing I/O fault (restart). Only `cli.main` turns
these into exit codes; everything below it raises.
"""

from __future__ import annotations

EX_OK = 0
EX_USAGE = 64
EX_NOINPUT = 66  # a root does not exist
EX_SOFTWARE = 70  # internal error: a bug
EX_IOERR = 74
EX_CONFIG = 78


class CkptdError(Exception):
    exit_code = EX_SOFTWARE


class UsageError(CkptdError):
    exit_code = EX_USAGE


class RootMissingError(CkptdError):
    exit_code = EX_NOINPUT


class ConfigError(CkptdError):
    """A config that cannot be used. `problems` holds one line per problem."""

    exit_code = EX_CONFIG

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


class IOFault(CkptdError):
    exit_code = EX_IOERR
