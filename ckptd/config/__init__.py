"""The config: TOML in, validated pydantic models out.

Every model forbids unknown keys, so a typo (`keep_lats = 3`) is an error
rather than a silently ignored line. Errors come back as one line per
problem, pointing into the document: `config.toml: roots[0].retention.keep_last:
must be >= 0 (got -1)`.

- `units`: durations, sizes, free-space floors and `host:port`, parsed (and written back by
  ckptd/formatting.py).
- `models`: `[daemon]`, `[[roots]]`, `[roots.retention]`, `[[roots.runs]]`, `[[roots.patterns]]`
  and the paths they name (pins, run rules); the config reference is generated from them.
- `loading`: finding and reading the file, one line per validation error, the refusals (exit 78).

`from ckptd.config import ...` is the API; the modules are how it is laid out.
"""

from ckptd.config.loading import (
    DEFAULT_CONFIG_PATH,
    SYSTEM_DIRS,
    SYSTEM_TREES,
    config_warnings,
    find_config,
    format_validation_error,
    holds,
    load_config,
    parse_config,
    read_toml,
    refusals,
    system_path,
)
from ckptd.config.models import (
    DEFAULT_SLIM_FILES,
    QUIET_FLOOR,
    TIME_BUCKETS,
    Config,
    Daemon,
    Etcd,
    Kubernetes,
    Pattern,
    Retention,
    Root,
    RunRule,
    default_state_dir,
    inferred_mode,
    path_matches,
    pin_matches,
    relative_spelling,
)
from ckptd.config.units import (
    Duration,
    FreeSpace,
    FreeSpaceFloor,
    Size,
    parse_duration,
    parse_free_space,
    parse_listen,
    parse_size,
)
from ckptd.errors import ConfigError  # what loading raises: one line per problem
from ckptd.formatting import format_age, format_duration, format_size  # ckptd/formatting.py's, kept here too

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_SLIM_FILES",
    "QUIET_FLOOR",
    "SYSTEM_DIRS",
    "SYSTEM_TREES",
    "TIME_BUCKETS",
    "Config",
    "ConfigError",
    "Daemon",
    "Etcd",
    "Kubernetes",
    "Duration",
    "FreeSpace",
    "FreeSpaceFloor",
    "Pattern",
    "Retention",
    "Root",
    "RunRule",
    "Size",
    "config_warnings",
    "default_state_dir",
    "find_config",
    "format_age",
    "format_duration",
    "format_size",
    "format_validation_error",
    "holds",
    "inferred_mode",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_free_space",
    "parse_listen",
    "parse_size",
    "path_matches",
    "pin_matches",
    "read_toml",
    "refusals",
    "relative_spelling",
    "system_path",
]
