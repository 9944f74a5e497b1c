"""Reading the config: the file found (`find_config`), its TOML (`read_toml`), the models'
validation as one line per problem pointing into the document (`config.toml:
roots[0].retention.keep_last: must be >= 0 (got -1)`), then the roots that cannot be meant
(`refusals`: a system directory, a quiet period below the floor), each a ConfigError (exit 78).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ckptd.config.models import QUIET_FLOOR, Config, Daemon, Retention, Root, RunRule
from ckptd.config.units import format_duration
from ckptd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/ckptd/config.toml")

# Never a root unless Root.allow_any_path: these and everything under them ...
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/boot", "/bin", "/sbin", "/lib", "/lib32",
                "/lib64", "/libx32", "/run")
# ... and these themselves (a volume may well be mounted under /var/lib or /mnt, not as it).
SYSTEM_DIRS = ("/", "/var", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/tmp", "/tmp",
               "/home", "/root", "/mnt", "/media", "/opt", "/srv")


def refusals(config: Config) -> list[tuple[str, str]]:
    """(key, why) for each root that cannot be meant, unless its own key says it is (exit 78).

    Checked on every config ckptd reads (`parse_config`, `envconfig.effective_config`), after
    the models: `path = "/"` walked /proc and other jobs' temp directories and proposed
    deletions there; `quiet_period = 0` takes a save that pauses for a moment for finished.
    """
    out = []
    for i, root in enumerate(config.roots):
        if not root.allow_any_path:
            why = system_path(root.path) or holds(root.path, config.daemon.state_dir)
            if why is not None:
                out.append((f"roots[{i}].path", (
                    f"{str(root.path)!r} {why}: name the directory that holds the runs, "
                    "or set allow_any_path = true in its [[roots]] if it is meant"
                )))
        if root.quiet_period < QUIET_FLOOR and not root.allow_short_quiet_period:
            out.append((f"roots[{i}].quiet_period", (
                f"{format_duration(root.quiet_period)} is below {QUIET_FLOOR:g}s: a save pauses that "
                "long between its own writes, so a checkpoint still being written would look finished; "
                "set allow_short_quiet_period = true in its [[roots]] if nothing writes there while "
                "ckptd looks (a finished job, a test)"
            )))
    return out


QUIET_CEILING = 24 * 3600.0  # seconds: a quiet period longer than a day is a typo more likely than a wish


def config_warnings(config: Config) -> list[str]:
    """`key: what` for settings that are valid but probably not meant, said by check-config, plan
    and run: keep_last = 0 with keep_best = 0 (in torchtitan `keep_latest_k = 0` keeps everything;
    here it keeps only what is always kept), and a quiet period over a day (`"3650d"`: nothing is
    complete for that long, so nothing is ever deleted)."""
    out = []
    for i, root in enumerate(config.roots):
        if root.quiet_period > QUIET_CEILING:
            out.append(f"roots[{i}].quiet_period: {format_duration(root.quiet_period)} is over a day: a save "
                       "counts as finished only after that long unchanged, so nothing is deleted before then")
        rules = [("retention", root.retention)]
        for j, rule in enumerate(root.runs):
            update = {k: getattr(rule, k) for k in rule.model_fields_set if k in Retention.model_fields}
            rules.append((f"runs[{j}]", root.retention.model_copy(update=update)))
        for key, r in rules:
            if r.keep_total is None and r.keep_last == 0 and r.keep_best == 0:
                out.append(
                    f"roots[{i}].{key}: keep_last = 0 and keep_best = 0 keep only what is always kept (each "
                    "run's newest complete checkpoint, pinned ones, those a resume pointer names, anything "
                    "not complete) and delete the rest; 0 does not mean 'keep all' (as torchtitan's "
                    "keep_latest_k = 0 does): to keep every checkpoint, leave the run out of the roots")
    return out


def system_path(path: Path) -> str | None:
    """Why `path` (as written, and as it resolves: /data -> /) is no place for runs, or None."""
    for p in dict.fromkeys((os.path.normpath(path), os.path.realpath(path))):
        if p == "/":
            return "is the whole filesystem"
        if p in SYSTEM_DIRS:
            return f"is the system directory {p}"
        top = next((t for t in SYSTEM_TREES if p == t or p.startswith(f"{t}/")), None)
        if top is not None:
            return f"is in the system directory {top}"
    return None


def holds(root: Path, state_dir: Path) -> str | None:
    """Why a root may not hold the state directory (its journal, locks and caches), or None."""
    for r, s in ((os.path.normpath(root), os.path.normpath(state_dir)),
                 (os.path.realpath(root), os.path.realpath(state_dir))):
        if s == r or s.startswith(r.rstrip("/") + "/"):
            return f"holds daemon.state_dir {str(state_dir)!r}"
    return None


# --- loading -------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before", "function-plain") or part.startswith(
            ("function-", "constrained-")
        ):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _tables() -> dict[tuple[str, ...], tuple[str, type[BaseModel]]]:
    """Where each model sits in the document (key path without indexes) and how a user writes it."""
    return {
        (): ("the top level", Config),
        ("daemon",): ("[daemon]", Daemon),
        ("roots",): ("[[roots]]", Root),
        ("roots", "retention"): ("[roots.retention]", Retention),
        ("roots", "runs"): ("[[roots.runs]]", RunRule),
    }


def _unknown_key_hint(loc: tuple[int | str, ...]) -> str:
    """For `keep_last` under [[roots]]: where it belongs; for a typo: the nearest valid key."""
    import difflib

    names = tuple(str(p) for p in loc if not isinstance(p, int))
    if not names:
        return ""
    *parent, key = names
    tables = _tables()
    here = tables.get(tuple(parent))
    if here is None:
        return ""
    others = [(table, model) for path, (table, model) in tables.items() if path != tuple(parent)]
    elsewhere = [table for table, model in others if key in model.model_fields]
    if elsewhere:
        return f"; {key} belongs in {elsewhere[0]}, not {here[0]}"
    close = difflib.get_close_matches(key, sorted(here[1].model_fields), n=1, cutoff=0.7)
    if close:
        return f" (did you mean {close[0]}?)"
    for table, model in others:
        close = difflib.get_close_matches(key, sorted(model.model_fields), n=1, cutoff=0.8)
        if close:
            return f" (did you mean {close[0]}, in {table}?)"
    return ""


def _message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    msg = err["msg"]
    if kind == "extra_forbidden":
        return "unknown key" + _unknown_key_hint(tuple(err["loc"]))
    if kind == "missing":
        return "required key is missing"
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    ctx = err.get("ctx") or {}
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[
            kind
        ]
        bound = next(iter(ctx.values()), "?")
        return f"must be {op} {bound} (got {err.get('input')!r})"
    if kind in (
        "int_type",
        "int_parsing",
        "int_from_float",
        "bool_type",
        "bool_parsing",
        "string_type",
        "float_type",
        "float_parsing",
        "literal_error",
        "dict_type",
        "list_type",
        "tuple_type",
        "model_type",
    ):
        return f"{msg[0].lower()}{msg[1:]} (got {err.get('input')!r})"
    return msg


def format_validation_error(source: str, exc: ValidationError) -> list[str]:
    return [f"{source}: {_loc(e['loc'])}: {_message(e)}" for e in exc.errors()]


# A check of a valid config by a layer above the config's, which knows what the config cannot
# (the frameworks': `slim.config_refusals`): (key, why) for each setting it refuses (exit 78).
ConfigCheck = Callable[[Config], Iterable[tuple[str, str]]]


def parse_config(
    data: Mapping[str, Any], source: str = "<config>", checks: Sequence[ConfigCheck] = ()
) -> Config:
    """`data` as a Config, refused (ConfigError) on a validation error, then on `refusals` and
    each of `checks`."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc)) from None
    refused = refusals(config) + [r for check in checks for r in check(config)]
    if refused:
        raise ConfigError([f"{source}: {key}: {why}" for key, why in refused])
    return config


def load_config(path: Path) -> Config:
    return parse_config(read_toml(path), str(path))


def read_toml(path: Path) -> dict[str, Any]:
    """The config file as a TOML document, not yet validated."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None


def find_config(explicit: str | None) -> Path | None:
    """`-c`, then `$CKPTD_CONFIG`, then /etc/ckptd/config.toml if it exists."""
    if explicit:
        return Path(explicit)
    if os.environ.get("CKPTD_CONFIG"):
        return Path(os.environ["CKPTD_CONFIG"])
    if DEFAULT_CONFIG_PATH.exists():
        return DEFAULT_CONFIG_PATH
    return None
