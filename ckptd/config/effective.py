"""The effective config: the file (or the defaults), then roots from the command line, then `CKPTD_*`.

Containers are configured through the environment (`docker run -e`,
compose's `environment:`, a pod's `env:`), so a handful of keys can be set
with `CKPTD_*` variables. They override the file: a variable names one key,
and wherever that key lives per root, it is set in every root. `[[roots.runs]]`
overrides still win for the runs they match, as they do over the file's
`[roots.retention]`. An empty variable counts as unset (compose writes `KEY=`
for a blank).

Everything goes through the same validation as the file, and a problem with a
variable's value is reported against the variable: `CKPTD_KEEP_LAST: must be >= 0 (got -1)`.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ckptd.config import Config, read_toml, refusals
from ckptd.config.loading import ConfigCheck, _loc, _message
from ckptd.errors import ConfigError, UsageError
from ckptd.volume import mounts


def _integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer (got {text!r})") from None


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false (got {text!r})")


def _text(text: str) -> str:
    return text.strip()


def _list(text: str) -> list[str]:
    """Comma-separated values ('http://a:2379,http://b:2379')."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _duration(text: str) -> str | float:
    """A duration with its unit ('90s'), or a bare number of seconds, as TOML's `quiet_period = 90`."""
    value = text.strip()
    try:
        return float(value)
    except ValueError:
        return value  # '90s', '10m': parsed and checked by the config's own Duration


# variable -> (where: "daemon" | "root" | "retention", key, parse). CKPTD_ROOTS and
# CKPTD_CONFIG (which file: see config.find_config) are handled on their own.
VARIABLES: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "CKPTD_STATE_DIR": ("daemon", "state_dir", _text),
    "CKPTD_DRY_RUN": ("daemon", "dry_run", _boolean),
    "CKPTD_LOG_FORMAT": ("daemon", "log_format", _text),
    "CKPTD_METRICS_LISTEN": ("daemon", "metrics_listen", _text),
    "CKPTD_LEADERSHIP": ("daemon", "leadership", _text),
    "CKPTD_ETCD_ENDPOINTS": ("daemon.etcd", "endpoints", _list),
    "CKPTD_QUIET_PERIOD": ("root", "quiet_period", _duration),
    "CKPTD_OBSERVER": ("root", "observer", _text),
    "CKPTD_WORLD_SIZE": ("root", "world_size", _integer),
    "CKPTD_TRASH_GRACE": ("root", "trash_grace", _duration),
    "CKPTD_KEEP_LAST": ("retention", "keep_last", _integer),
    "CKPTD_KEEP_BEST": ("retention", "keep_best", _integer),
    "CKPTD_KEEP_TOTAL": ("retention", "keep_total", _integer),
    "CKPTD_METRIC": ("retention", "metric", _text),
    "CKPTD_MODE": ("retention", "mode", _text),
    "CKPTD_MAX_SIZE": ("retention", "max_size", _text),
    "CKPTD_MIN_FREE": ("retention", "min_free", _text),
}
ROOTS = "CKPTD_ROOTS"  # colon-separated absolute paths; replaces the file's list of roots
KNOWN = frozenset({*VARIABLES, ROOTS, "CKPTD_CONFIG"})
# Set by ckptd for its own children and by its test suite, never by a user: not warned about
_INTERNAL = ("CKPTD_CONSOLIDATE_PARENT", "CKPTD_TEST")

log = logging.getLogger(__name__)


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A line for each `CKPTD_*` variable ckptd does not know, with the nearest it does: a
    misspelled `CKPTD_KEEP_LST` was ignored silently, and the file's keep_last applied."""
    out = []
    for name in sorted(k for k in env if k.startswith("CKPTD_") and k not in KNOWN):
        if name.startswith(_INTERNAL):
            continue
        near = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]}?" if near else f"; ckptd reads {', '.join(sorted(KNOWN))}"
        out.append(f"{name} is not a ckptd variable: ignored{hint}")
    return out


def settings_in(env: Mapping[str, str]) -> list[str]:
    """The `CKPTD_*` variables that set something (non-empty), in a stable order."""
    return sorted(k for k in env if k in KNOWN and k != "CKPTD_CONFIG" and env[k].strip())


class _Blame:
    """Whom a problem at a config location (`roots[0].retention.keep_last`) is reported against:
    the variable or command-line flag that set the key there, else the file."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.origins: list[tuple[re.Pattern[str], str]] = []  # error location -> the variable to blame
        # a table's location, a key in it, its variable
        self.tables: list[tuple[re.Pattern[str], str, str]] = []

    def setter(self, where: str) -> str | None:
        """The variable or flag that set the key at `where`, if one did."""
        return next((name for pattern, name in self.origins if pattern.match(where)), None)

    def validation_line(self, where: str, message: str) -> str:
        """A validation error at `where` as reported: against the variable that set the key, or
        against the variable of a key its table's message names, else against the file."""
        blame = self.setter(where)
        table = next((name for pattern, key, name in self.tables
                      if pattern.match(where) and re.search(rf"\b{key}\b", message)), None)  # fmt: skip
        if blame is not None:
            return f"{blame}: {message}"
        if table is not None:
            return f"{table}: {message} ({self.source}: {where})"
        return f"{self.source}: {where}: {message}"

    def refusal_line(self, where: str, why: str) -> str:
        blame = self.setter(where)
        return f"{blame}: {where}: {why}" if blame else f"{self.source}: {where}: {why}"


def _apply_roots(
    data: dict[str, Any], env: Mapping[str, str], roots: Sequence[Path], blame: _Blame
) -> list[tuple[str, ...]]:
    """Replace the file's roots with `roots` from the command line, or `$CKPTD_ROOTS`; the subtrees
    each root is restricted to (see `_pick_roots`)."""
    scopes: list[tuple[str, ...]] = []
    if roots:
        data["roots"], scopes = _pick_roots(data, [os.path.normpath(os.path.abspath(p)) for p in roots])
    elif env.get(ROOTS, "").strip():
        paths = [p for p in env[ROOTS].split(":") if p.strip()]
        data["roots"], scopes = _pick_roots(
            data, [os.path.normpath(p) if os.path.isabs(p) else p for p in paths]
        )
        blame.origins.append((re.compile(r"^roots(\[\d+\]\.path)?$"), ROOTS))
    return scopes


def _apply_variables(data: dict[str, Any], env: Mapping[str, str], blame: _Blame) -> list[str]:
    """Set the keys the `CKPTD_*` variables name (in every root, for a root's key); the problems
    of the values that do not parse."""
    problems: list[str] = []
    for name, (where, key, parse) in VARIABLES.items():
        text = env.get(name, "")
        if not text.strip():
            continue
        try:
            value = parse(text)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if where.startswith("daemon"):
            table = _table(data, "daemon")
            for sub in where.split(".")[1:]:  # daemon.etcd
                table = _table(table, sub)
            table[key] = value
            blame.origins.append((re.compile(rf"^{re.escape(where)}\.{key}(\[\d+\])?$"), name))
        else:
            for root in _tables(data, "roots"):
                table = root if where == "root" else _table(root, "retention")
                table[key] = value
            at = r"roots\[\d+\]" + (r"\.retention" if where == "retention" else "")
            blame.origins.append((re.compile(rf"^{at}\.{key}$"), name))
            # a problem of the table the key is in that names the key ("keep_total replaces
            # keep_last", the file setting keep_last) is the variable's too: both are named
            blame.tables.append((re.compile(rf"^{at}$"), key, name))
    return problems


def _apply_flags(data: dict[str, Any], retention: Mapping[str, tuple[str, Any]], blame: _Blame) -> None:
    """Set each retention flag's key in every root's retention and every run rule that sets it;
    --keep-last or --keep-best drops keep_total (the other way to count) wherever it is set."""
    for key, (flag, value) in retention.items():
        for root in _tables(data, "roots"):
            _table(root, "retention")[key] = value
            for rule in _tables(root, "runs"):
                if key in rule:
                    rule[key] = value
            if key in ("keep_last", "keep_best"):
                _table(root, "retention").pop("keep_total", None)
                for rule in _tables(root, "runs"):
                    rule.pop("keep_total", None)
        blame.origins.insert(0, (re.compile(rf"^roots\[\d+\]\.(retention|runs\[\d+\])\.{key}$"), flag))


def _validated(data: dict[str, Any], blame: _Blame, checks: Sequence[ConfigCheck]) -> Config:
    """`data` as a Config; ConfigError with each problem (validation's, then the refusals' and the
    `checks'`) against whom `blame` names, one line per variable, not one per root."""
    problems: list[str] = []
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            line = blame.validation_line(_loc(err["loc"]), _message(err))
            if line not in problems:  # one line per variable, not one per root
                problems.append(line)
        raise ConfigError(problems) from None
    refused = refusals(config) + [r for check in checks for r in check(config)]
    problems = [blame.refusal_line(where, why) for where, why in refused]
    if problems:
        raise ConfigError(problems)
    return config


def effective_config(
    path: Path | None,
    env: Mapping[str, str],
    roots: Sequence[Path] = (),
    retention: Mapping[str, tuple[str, Any]] | None = None,
    checks: Sequence[ConfigCheck] = (),
) -> Config:
    """The config in force: `path` (or the defaults), `roots` from the command line (or
    `$CKPTD_ROOTS`) replacing the file's roots, then the `CKPTD_*` settings on top, then
    `retention`: key -> (the command-line flag, its value), as `restic forget --keep-last 3`
    is the policy for that call. A flag sets its key in every root's retention and in every
    run rule that sets it; --keep-last or --keep-best replaces keep_total (the other way to
    count) wherever it is set. `checks`: what the layers above the config refuse besides
    (`loading.ConfigCheck`: the frameworks', `slim.config_refusals`)."""
    for line in unknown_variables(env):
        log.warning("%s", line)
    data = read_toml(path) if path is not None else {}
    blame = _Blame(str(path) if path is not None else "<defaults>")
    scopes = _apply_roots(data, env, roots, blame)
    problems = _apply_variables(data, env, blame)
    if problems:
        raise ConfigError(problems)
    _apply_flags(data, retention or {}, blame)
    config = _validated(data, blame, checks)
    if any(scopes):
        pairs = zip(config.roots, scopes, strict=True)
        config = config.model_copy(update={"roots": tuple(r.restricted(s) if s else r for r, s in pairs)})
    return config


def _pick_roots(data: Mapping[str, Any], paths: list[str]) -> tuple[list[Any], list[tuple[str, ...]]]:
    """Root tables for `paths` from the command line (or CKPTD_ROOTS), with the subtrees each
    is restricted to (() for the whole root).

    A path inside a configured root, or naming it by another spelling (a symlink, `..`), *is*
    that root: its retention, pins, overrides, lock and trash, restricted to the subtree.
    Given the built-in defaults instead, pins were ignored and a second lock let it run beside
    the daemon. A path that holds a configured root is refused: the
    defaults would apply to that root's runs. Any other path gets the defaults.
    The same goes for a path that is a configured root (or lies in it) by directory identity,
    not by name: a bind mount of the root, or of a directory above it.
    """
    configured: list[tuple[str, dict[str, Any]]] = []
    for table in _tables(data, "roots"):
        if isinstance(table.get("path"), str) and os.path.isabs(table["path"]):
            configured.append((os.path.realpath(table["path"]), table))
    mount_table = mounts.read_mounts() if configured else []
    picked: list[tuple[dict[str, Any], set[str]]] = []
    for p in paths:
        if not os.path.isabs(p):
            picked.append(({"path": p}, set()))  # validation says it must be absolute
            continue
        real = os.path.realpath(p)
        owner = _owner(real, configured, mount_table)
        if owner is None:
            inside = ((t["path"], mounts.located_in(r, real, mount_table)) for r, t in configured)
            held = next((path for path, rel in inside if rel not in (None, ".")), None)
            if held is not None:
                raise UsageError(
                    f"{p} holds the configured root {held}: name that root (or a directory in it) so that "
                    "its settings apply, or leave ROOT out for every configured root"
                )
            picked.append(({"path": p}, set()))
            continue
        rel, table = owner
        entry = next((e for e in picked if e[0] is table), None)
        if entry is None:
            entry = (table, set())
            picked.append(entry)
        entry[1].add(rel)
    tables = [dict(t) for t, _ in picked]
    return tables, [() if "." in subs or not subs else tuple(sorted(subs)) for _, subs in picked]


def _owner(
    real: str, configured: list[tuple[str, dict[str, Any]]], table: list[mounts.Mount]
) -> tuple[str, dict[str, Any]] | None:
    """(where `real` lies in it, its table) for the first configured root holding `real`: by
    path, or by directory identity (a bind mount), as `mounts.located_in` tells."""
    return mounts.holder(real, configured, table)


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    """data[key] as a table to write into (a non-table is left for validation to report)."""
    value = data.setdefault(key, {})
    return value if isinstance(value, dict) else {}


def _tables(data: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key)
    if not isinstance(value, list):
        return []
    return [t for t in value if isinstance(t, dict)]
