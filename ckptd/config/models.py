"""The config's models: `[daemon]`, `[[roots]]` with `[roots.retention]`, `[[roots.runs]]` and
`[[roots.patterns]]`, and the document they make up (`Config`).

Every model forbids unknown keys, so a typo (`keep_lats = 3`) is an error rather than a silently
ignored line. The config reference (docs/reference/configuration.md) is generated from these
models' descriptions (`python -m tools.docgen`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ckptd.config.archive import Archive
from ckptd.config.units import Duration, FreeSpaceFloor, Size, format_duration, parse_listen
from ckptd.volume import mounts

# The default of the `slim_files` setting (user-facing: config reference, config.example.toml):
# DeepSpeed's optimizer shards, in its tag or in a Trainer checkpoint's, and the Trainer's optimizer.pt.
DEFAULT_SLIM_FILES = ("global_step*/*optim_states.pt", "optimizer.pt")
# Retention's thinning by time, finest first (rules.time_buckets).
TIME_BUCKETS = ("keep_hourly", "keep_daily", "keep_weekly", "keep_monthly")
# How long a deleted checkpoint waits in the trash by default: longer than a pass and a reload (a
# decision made under a config since changed meets the new one at its purge), long enough to read the
# log line and run `ckptd trash restore`, and short beside a large model's save interval, so a run
# seldom has more than one deleted checkpoint waiting; min_free takes it sooner when space is short.
TRASH_GRACE = 15 * 60.0
# Below this, a save's own pauses look quiet (Root.allow_short_quiet_period).
QUIET_FLOOR = 5.0

def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=), else $XDG_STATE_HOME/ckptd, else ~/.local/state/ckptd."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(xdg) / "ckptd"


# --- the models ----------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class Retention(_Strict):
    """Which checkpoints of a run to keep. Rules combine as a union."""

    keep_last: int = Field(
        strict=True, default=2, ge=0, description="Keep the N newest complete checkpoints of each run."
    )
    keep_best: int = Field(
        strict=True,
        default=1,
        ge=0,
        description="Keep the K best checkpoints by `metric`. Without `metric`, keep the one the "
        "trainer recorded as best (`best_model_checkpoint` in trainer_state.json).",
    )
    metric: str | None = Field(
        None,
        description="Metric name in trainer_state.json's log_history, e.g. 'eval_loss'; mapped as the "
        "Trainer maps metric_for_best_model ('loss' means 'eval_loss', not the training loss).",
    )
    mode: Literal["min", "max"] | None = Field(
        None,
        description="Whether lower or higher `metric` is better. Unset: as the HF Trainer infers "
        "greater_is_better (training_args.py TrainingArguments.__post_init__): 'min' for a name ending "
        "in 'loss' (or another lower-is-better name: perplexity, ppl, wer, cer, error, mse, mae, rmse), "
        "else 'max'.",
    )
    keep_missing_metric: bool = Field(
        strict=True,
        default=True,
        description="With keep_best and metric: keep checkpoints that have no value for the metric.",
    )
    keep_total: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="The Trainer's save_total_limit: keep at most N complete checkpoints, the newest and "
        "the best (by `metric`, else the trainer's best_model_checkpoint) counted inside the N, as the "
        "Trainer rotates them. Replaces keep_last and keep_best (a union keeps the best beside the N "
        "newest). Never deletes what is always kept (newest complete by step and by time, pinned, in "
        "flight, named by a resume pointer): those stay, over the limit if need be.",
    )
    keep_every_steps: int = Field(
        strict=True,
        default=0,
        ge=0,
        description="Keep checkpoints whose step is a multiple of N (0: off); not checkpoints numbered "
        "by epoch or save count.",
    )
    keep_within: Duration | None = Field(
        None,
        description="Keep checkpoints written within this long of when the run's newest save began (a "
        "pin or a touch of an old checkpoint does not move it).",
    )
    keep_hourly: int = Field(
        strict=True,
        default=0,
        ge=0,
        description="Keep the newest checkpoint of each of the last N hours that have one, by when "
        "each save ended, in UTC (restic's forget --keep-hourly; counted back from the run's newest "
        "save, never from now). 0: off.",
    )
    keep_daily: int = Field(
        strict=True, default=0, ge=0,
        description="Keep the newest checkpoint of each of the last N days (UTC) that have one; as "
        "keep_hourly.",
    )
    keep_weekly: int = Field(
        strict=True, default=0, ge=0,
        description="Keep the newest checkpoint of each of the last N ISO weeks (UTC, Monday first) that "
        "have one; as keep_hourly.",
    )
    keep_monthly: int = Field(
        strict=True, default=0, ge=0,
        description="Keep the newest checkpoint of each of the last N calendar months (UTC) that have "
        "one; as keep_hourly.",
    )
    max_size: Size | None = Field(
        None, description="Per run: delete the oldest unprotected checkpoints until the run fits."
    )
    min_free: FreeSpaceFloor | None = Field(
        None,
        description="Per filesystem (bytes or '%'): delete the oldest unprotected checkpoints "
        "until this much is free.",
    )
    pins: tuple[str, ...] = Field(
        (),
        description="Checkpoint paths relative to the root that are always kept: each matches the path "
        "literally ('exp[ablation]/checkpoint-1') or as a glob ('team-a/*/checkpoint-500'); a trailing "
        "slash, './' or the absolute path of a checkpoint under the root are the same pin.",
    )
    keep_full_last: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="Keep the optimizer state of only the N newest complete full checkpoints of each "
        "run: older ones that a rule keeps are slimmed to their weights (fp32 weights consolidated "
        "first with DeepSpeed's zero_to_fp32 when they have none, see slim_weights). Unset: never slim.",
    )
    slim_weights: Literal["fp32", "as-saved"] = Field(
        "fp32",
        description="Which weights a slimmed checkpoint keeps. 'fp32': fp32 weights; where the checkpoint "
        "holds only 16-bit (or unknown-dtype) weights, its fp32 master weights are consolidated from "
        "the DeepSpeed optimizer shards with zero_to_fp32 into fp32/ first, and without shards to "
        "consolidate from it is not slimmed. 'as-saved': the weights as the trainer saved them.",
    )
    slim_files: tuple[str, ...] = Field(
        DEFAULT_SLIM_FILES,
        description="What slimming removes: globs on paths relative to the checkpoint directory (for a "
        "bare DeepSpeed checkpoint, to the directory holding global_step<N>/); '*' stays within one "
        "path segment. Weights, *model_states.pt and trainer_state.json are never removed; a glob that would "
        "remove what loading the weights needs (config.json, the tokenizer files) is refused.",
    )

    @field_validator("slim_files")
    @classmethod
    def _relative_globs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for glob in v:
            parts = glob.split("/")
            if not glob or glob.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"a slim_files glob is a relative path without '.' or '..' (got {glob!r})")
        # A glob that would remove what loading the weights needs is refused too, by whoever reads
        # the config with the frameworks at hand (`slim.config_refusals`, passed to effective_config).
        return v

    @model_validator(mode="after")
    def _total_or_union(self) -> Retention:
        both = {"keep_last", "keep_best"} & self.model_fields_set
        if self.keep_total is not None and both:
            raise ValueError(
                f"keep_total replaces {' and '.join(sorted(both))}: it is the Trainer's save_total_limit, "
                "which counts the best inside the limit; set one or the other"
            )
        return self

    @property
    def direction(self) -> Literal["min", "max"]:
        """`mode`, or as the Trainer infers it from `metric` when unset (`inferred_mode`)."""
        return self.mode if self.mode is not None else inferred_mode(self.metric or "")

    def describe(self) -> str:
        """The rules in force, for reasons: `keep_last=2 and keep_best=1 (eval_loss, min)`."""
        if self.keep_total is not None:
            best = f"best by {self.metric}, {self.direction}" if self.metric else "the trainer's best"
            parts = [f"keep_total={self.keep_total} (save_total_limit: {best} counted)"]
        else:
            parts = [f"keep_last={self.keep_last}"]
        if self.keep_total is None and self.keep_best:
            best = f"keep_best={self.keep_best}"
            best += f" ({self.metric}, {self.direction})" if self.metric else " (trainer's best)"
            parts.append(best)
        if self.keep_every_steps:
            parts.append(f"keep_every_steps={self.keep_every_steps}")
        if self.keep_within is not None:
            parts.append(f"keep_within={format_duration(self.keep_within)}")
        parts += [f"{key}={n}" for key in TIME_BUCKETS if (n := getattr(self, key))]
        return " and ".join(parts)


# Lower is better for these beside the Trainer's own rule (a name ending in "loss"): a metric named
# for an error rate or a distance. Matched at the end of the name, after "_" or "-" ("eval_wer").
_LOWER_IS_BETTER = ("perplexity", "ppl", "wer", "cer", "error", "mse", "mae", "rmse")


def inferred_mode(metric: str) -> Literal["min", "max"]:
    """The direction the HF Trainer gives `metric_for_best_model` without `greater_is_better`
    (transformers training_args.py `TrainingArguments.__post_init__`: greater is better unless the
    name ends in "loss"), a known lower-is-better name also minimised."""
    name = metric.lower()
    if name.endswith("loss") or any(
        name == n or name.endswith((f"_{n}", f"-{n}", f"/{n}")) for n in _LOWER_IS_BETTER
    ):
        return "min"
    return "max"


class RunRule(Retention):
    """Overrides of retention keys for the runs whose path matches `match`."""

    match: str = Field(
        description="The run's path relative to the root, literally or as a glob, e.g. 'team-a/*' "
        "('.' for checkpoints directly in the root; './', a trailing slash, the absolute path are the same). "
        "A Lightning experiment's run is named by its directory (the one holding lightning_logs/, or "
        "a logger's save_dir/name), for every version_N/checkpoints below it; its full path matches too."
    )
    world_size: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="DeepSpeed data-parallel world size for these runs (see roots.world_size).",
    )

    @model_validator(mode="after")
    def _per_filesystem(self) -> RunRule:
        if "min_free" in self.model_fields_set:
            raise ValueError("min_free is per filesystem: set it in [roots.retention], not per run")
        return self


class Pattern(_Strict):
    """A checkpoint name pattern of the user's own, with the evidence that completes a checkpoint."""

    name: str = Field(
        description="The checkpoint's name with one {step} field, e.g. 'ckpt_{step}', or one {time} "
        "field where the name has no step (a date and time written year first, e.g. "
        "'checkpoint_{time}' for checkpoint_2024-05-01_12-00-00: the time orders the saves); '*' "
        "matches any run of characters within the name, '?' one (e.g. 'ep*-ba{step}-rank0.pt')."
    )
    require: tuple[str, ...] = Field(
        (),
        description="Globs on paths inside the checkpoint ('*' stays within a segment) that must each "
        "match a file before it can be complete, e.g. ['model.pt', 'COMMITTED'].",
    )
    ranks: str | None = Field(
        None,
        description="A file each rank writes, with one {rank} field, e.g. 'shard_{rank}.pt': ranks "
        "0..world_size-1 must all be there (world_size, else the run's last complete checkpoint).",
    )

    @field_validator("name")
    @classmethod
    def _one_step_field(cls, v: str) -> str:
        if v.count("{step}") + v.count("{time}") != 1 or "/" in v:
            raise ValueError(f"a pattern is one name with exactly one {{step}} or {{time}} field (got {v!r})")
        if v not in ("{step}", "{time}") and v.replace("*", "").replace("?", "") in ("{step}", "{time}"):
            raise ValueError(f"a pattern needs a fixed part beside its field and wildcards (got {v!r}): "
                             "it would take any numbered file or directory for a checkpoint")
        return v

    @field_validator("ranks")
    @classmethod
    def _one_rank_field(cls, v: str | None) -> str | None:
        if v is not None and (v.count("{rank}") != 1 or v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"ranks is a relative path with exactly one {{rank}} field (got {v!r})")
        return v

    @field_validator("require")
    @classmethod
    def _relative(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for glob in v:
            if not glob or glob.startswith("/") or any(p in ("", ".", "..") for p in glob.split("/")):
                raise ValueError(f"a require glob is a relative path without '.' or '..' (got {glob!r})")
        return v

    @property
    def evidence(self) -> bool:
        return bool(self.require or self.ranks)


def _pattern(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


def relative_spelling(spelling: str, root: Path, key: str) -> str:
    """A path (or glob) a user wrote in the config for something under `root`, as the path
    relative to the root it names: a trailing slash, './' and '//' dropped, an absolute path
    under the root (as configured, or resolved) made relative. Raises ValueError naming `key`
    for one that names nothing under the root: empty, absolute elsewhere, or climbing out."""
    if not spelling.strip():
        raise ValueError(f"{key}: empty: it names nothing")
    text = spelling
    if text.startswith("/"):
        text = os.path.normpath(text)
        for top in dict.fromkeys((os.path.normpath(root), os.path.realpath(root))):
            if text == top:
                text = "."
                break
            if text.startswith(top.rstrip("/") + "/"):
                text = text[len(top.rstrip("/")) + 1 :]
                break
        else:
            resolved = _resolved_under(text, root)
            if resolved is None:
                raise ValueError(f"{key}: {spelling!r} is not under the root {root}: it would never match")
            text = resolved
    out = os.path.normpath(text)
    if out == ".." or out.startswith("../"):
        raise ValueError(f"{key}: {spelling!r} climbs out of the root: it would never match")
    return out


def _resolved_under(path: str, root: Path) -> str | None:
    """An absolute spelling's place under `root` by what its directory resolves to: a symlink to
    the root (/vol -> /data/vol, the root configured as /data/vol), or, where it
    exists, a bind mount of it (`mounts.located_in`). Its last component is kept as written
    (a pin names the checkpoint, not what a link of that name points to)."""
    head, name = os.path.split(path)
    rel = mounts.located_in(head, root)
    return None if rel is None else os.path.normpath(os.path.join(rel, name))


def path_matches(rel: str, spelling: str) -> bool:
    """Whether a path relative to the root is what a pin or a run rule names: the very path
    (`exp[ablation]/checkpoint-1`, whose brackets fnmatch would read as a character class),
    or a match of the glob."""
    from fnmatch import fnmatchcase

    return rel == spelling or fnmatchcase(rel, spelling)


def pin_matches(rel: str, pin: str) -> bool:
    """Whether a pin keeps the checkpoint at `rel`: the pin names it (`path_matches`), or names a
    path inside it (its DeepSpeed tag, a weights file), as a `.ckptd-keep` placed there does."""
    if path_matches(rel, pin):
        return True
    parts = pin.split("/")
    depth = rel.count("/") + 1
    return len(parts) > depth and path_matches(rel, "/".join(parts[:depth]))


class Root(_Strict):
    """A directory tree holding runs, each run a directory of checkpoints."""

    path: Path = Field(description="Absolute path of the volume or directory to manage.")
    quiet_period: Duration = Field(
        60.0, description="A checkpoint must be unchanged this long before it can be complete."
    )
    attribute_cache: Duration | None = Field(
        None,
        description="How long this mount's client may cache attributes, where ckptd cannot read it "
        "from the mount table (FUSE, filesystems it does not recognise): added to quiet_period, as "
        "NFS's actimeo is. There, a checkpoint on quiet alone is never complete until this is set.",
    )
    coherent: bool | None = Field(
        None,
        description="Whether every read here sees another host's last write (close-to-open or better). "
        "Unset: known for local disks, NFS without nocto, Lustre, GPFS, CephFS and ceph-fuse; unknown "
        "elsewhere (other FUSE, unrecognised filesystems), as volume leadership says at start-up. "
        "false: volume leadership never leads here.",
    )
    observer: Literal["auto", "inotify", "polling"] = Field(
        "auto", description="How `ckptd run` watches: inotify, polling (NFS, Lustre, FUSE), or auto."
    )
    poll_interval: Duration = Field(10.0, description="How often `ckptd run` polls in-flight checkpoints.")
    reconcile_interval: Duration = Field(
        300.0, description="How often `ckptd run` re-examines everything, whatever the events said."
    )
    stall_after: Duration = Field(
        6 * 3600.0, description="An incomplete checkpoint untouched this long is reported as stalled."
    )
    max_depth: int = Field(
        strict=True, default=4, ge=0, le=32, description="How deep under the root to look for runs."
    )
    patterns: tuple[Annotated[Pattern, BeforeValidator(_pattern)], ...] = Field(
        (),
        description="Checkpoint names of your own: 'ckpt_{step}', or a table naming the evidence that "
        "completes one: {name = 'ckpt_{step}', require = ['COMMITTED'], ranks = 'shard_{rank}.pt'}. "
        "Without evidence, a checkpoint is complete on quiet alone (the weakest evidence there is).",
    )
    world_size: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="The job's data-parallel world size, used only where a checkpoint does not say: "
        "DeepSpeed's when mp_rank_00_model_states.pt cannot be read, and the number of per-rank "
        "files (rng_state_<rank>.pth) a checkpoint without DeepSpeed must hold.",
    )
    mp_world_size: int = Field(
        strict=True, default=1, ge=1, description="DeepSpeed model-parallel world size, with world_size."
    )
    allow_any_path: bool = Field(
        strict=True,
        default=False,
        description="Let `path` be '/', a system directory (/proc, /sys, /dev, /etc, /usr, /boot, /bin, "
        "/sbin, /lib, /run, /var itself, ...) or a directory holding daemon.state_dir; refused "
        "otherwise (exit 78): such a root holds other programs' files, not runs of checkpoints.",
    )
    allow_short_quiet_period: bool = Field(
        strict=True,
        default=False,
        description=f"Let quiet_period be below {QUIET_FLOOR:g}s; refused otherwise (exit 78): a save "
        "pauses that long between its own writes (a rank waiting on the others, a shard being "
        "serialised), and a checkpoint still being written would look finished.",
    )
    trash_grace: Duration | None = Field(
        None,
        description="How long a deleted checkpoint waits in <root>/.ckptd-trash before it is purged, "
        "judged again first; unset: daemon.trash_grace.",
    )
    retention: Retention = Field(default_factory=Retention, description="The retention policy.")
    runs: tuple[RunRule, ...] = Field((), description="Per-run overrides, first match wins.")
    archive: Archive | None = Field(
        None, description="An object store to archive checkpoints to, verified, before they are deleted."
    )
    # Set only from the command line: `ckptd prune /vol/team` with /vol configured is /vol (its
    # retention, pins, overrides, lock and trash), restricted to these subtrees (`restricted`).
    _scope: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"must be an absolute path (got {str(v)!r})")
        return Path(os.path.normpath(v))

    @property
    def scope(self) -> tuple[str, ...]:
        """The subtrees (relative to the root) a command was restricted to; () for all of it."""
        return self._scope

    def restricted(self, subtrees: tuple[str, ...]) -> Root:
        """This root, restricted to `subtrees` (relative paths; "." is the whole root)."""
        copy = self.model_copy()
        copy._scope = () if "." in subtrees else tuple(sorted(set(subtrees)))
        return copy

    def in_scope(self, rel: str) -> bool:
        """Whether the run (or directory) at `rel` lies within the scope."""
        return not self._scope or any(rel == s or rel.startswith(f"{s}/") for s in self._scope)

    @model_validator(mode="after")
    def _paths_as_written(self) -> Root:
        """Pins and run rules' `match` as relative paths (`relative_spelling`), so that each is
        matched as the user wrote it, not never (a pin written `run/ckpt/` matched
        nothing, silently, and the checkpoint it pinned was deleted)."""
        def pins(r: Retention, where: str) -> tuple[str, ...]:
            out = tuple(relative_spelling(p, self.path, f"{where}.pins[{i}]") for i, p in enumerate(r.pins))
            if "." in out:
                raise ValueError(f"{where}.pins: '.' is the root itself; a pin names checkpoints under it")
            return out

        runs = tuple(
            rule.model_copy(update={
                "match": relative_spelling(rule.match, self.path, f"runs[{i}].match"),
                "pins": pins(rule, f"runs[{i}]"),
            })
            for i, rule in enumerate(self.runs)
        )
        retention = self.retention.model_copy(update={"pins": pins(self.retention, "retention")})
        # Frozen, and a model validator must return `self` itself: set in place, once, here.
        object.__setattr__(self, "retention", retention)
        object.__setattr__(self, "runs", runs)
        return self

    def rule_for(self, run: str, key: str | None = None) -> int | None:
        """Which of `runs` applies to the run directory `run` (relative to the root): the first whose
        `match` names the directory, or `key`, the run it belongs to (`frameworks.run_key`: a
        Lightning experiment's name, for each of its version_N/checkpoints); None for none. The
        config knows no framework: whoever applies it passes `key` (None: `run` is its own run)."""
        key = run if key is None else key
        for i, rule in enumerate(self.runs):
            if path_matches(run, rule.match) or (key != run and path_matches(key, rule.match)):
                return i
        return None

    def retention_for(self, run: str, key: str | None = None) -> tuple[Retention, int | None]:
        """The retention policy and world size for a run (its path relative to the root, and the
        run it belongs to: `rule_for`)."""
        i = self.rule_for(run, key) if self.runs else None
        if i is not None:
            rule = self.runs[i]
            overrides = {k: getattr(rule, k) for k in rule.model_fields_set if k in Retention.model_fields}
            if "pins" in overrides:  # pins add up: a run rule never unpins what the root pins
                overrides["pins"] = (*self.retention.pins, *overrides["pins"])
            if {"keep_last", "keep_best"} & overrides.keys() and "keep_total" not in overrides:
                overrides["keep_total"] = None  # the run asks for the union: not the root's keep_total
            world = rule.world_size if rule.world_size is not None else self.world_size
            return self.retention.model_copy(update=overrides), world
        return self.retention, self.world_size


class Etcd(_Strict):
    """Where etcd is, for `leadership = "etcd"` (the `etcd` extra: etcd3gw, through etcd's HTTP
    gateway, etcd 3.4 or later)."""

    endpoints: tuple[str, ...] = Field(
        (),
        description="The cluster's client URLs, e.g. ['https://10.0.0.5:2379', ...]: each is tried in "
        "turn. Also $CKPTD_ETCD_ENDPOINTS (comma-separated).",
    )
    prefix: str = Field(
        "/ckptd/",
        description="Keys are <prefix><volume id>/leader, the volume id kept in <root>/.ckptd/volume-id.",
    )
    ca: Path | None = Field(None, description="The CA bundle that signed the servers' certificates (https).")
    cert: Path | None = Field(None, description="This client's certificate (TLS client auth); with key.")
    key: Path | None = Field(None, description="This client's private key; with cert.")

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from urllib.parse import urlsplit

        for url in v:
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
                raise ValueError(f"{url!r} is not http(s)://HOST:PORT")
        return v

    @model_validator(mode="after")
    def _pair(self) -> Etcd:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together (TLS client auth needs both)")
        return self


class Kubernetes(_Strict):
    """Where the Lease is, for `leadership = "kubernetes"` (the `kubernetes` extra: lightkube). The
    API server and credentials: `kubeconfig`, else $KUBECONFIG, else the pod's service account
    (in a pod), else ~/.kube/config."""

    namespace: str | None = Field(
        None,
        description="The Lease's namespace. Default: the pod's own (in a pod), else the kubeconfig "
        "context's, else 'default'.",
    )
    lease_name: str | None = Field(
        None,
        description="The Lease's name (a DNS-1123 subdomain). Default: ckptd-<volume id>, the id kept "
        "in <root>/.ckptd/volume-id, so every pod names the same Lease wherever it mounts the volume. "
        "With more than one root, leave it unset: each root needs a Lease of its own.",
    )
    kubeconfig: Path | None = Field(
        None, description="A kubeconfig file (its current context). Default: $KUBECONFIG, then in-cluster."
    )

    @field_validator("namespace")
    @classmethod
    def _label(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", v)):
            raise ValueError(f"{v!r} is not a namespace name (DNS-1123 label: a-z, 0-9, '-', at most 63)")
        return v

    @field_validator("lease_name")
    @classmethod
    def _subdomain(cls, v: str | None) -> str | None:
        label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
        if v is not None and (len(v) > 253 or not re.fullmatch(rf"{label}(\.{label})*", v)):
            raise ValueError(f"{v!r} is not a Lease name (DNS-1123 subdomain: a-z, 0-9, '-', '.', at most "
                             "253)")
        return v


class Daemon(_Strict):
    """The daemon's own settings, one table for all roots."""

    state_dir: Path = Field(
        default_factory=default_state_dir, description="Where the journal, locks and state file live."
    )
    dry_run: bool = Field(strict=True, default=False, description="Decide and log, but delete nothing.")
    log_format: Literal["text", "json"] = Field("text", description="Log lines for people or for machines.")
    consolidate_timeout: Duration = Field(
        2 * 3600.0,
        description="Longest a zero_to_fp32 consolidation (before slimming) may run; it is killed "
        "after, and nothing is removed.",
    )
    trash_grace: Duration = Field(
        TRASH_GRACE,
        description="How long a deleted checkpoint waits in <root>/.ckptd-trash (where `ckptd trash "
        "restore` puts it back) before it is purged, judged again first under the config then; "
        "sooner when min_free needs the space. 0: at the first purge.",
    )
    metrics_listen: str | None = Field(
        None,
        description="Serve Prometheus metrics at http://HOST:PORT/metrics, e.g. '127.0.0.1:9464'; "
        "off when unset. Needs the `metrics` extra (prometheus_client).",
    )
    # before leadership: its validator reads it
    etcd: Etcd = Field(default_factory=Etcd, description="Where etcd is, for leadership = 'etcd'.")
    kubernetes: Kubernetes = Field(
        default_factory=Kubernetes, description="Where the Lease is, for leadership = 'kubernetes'."
    )
    leadership: Literal["auto", "local", "volume", "etcd", "kubernetes"] = Field(
        "auto",
        description="How one ckptd is made the deleter of a root: 'local' (a lock in state_dir: one "
        "host), 'volume' (a lease on the volume, in <root>/.ckptd/: any number of hosts sharing it), "
        "'etcd' (an etcd lease and key per root, [daemon.etcd]; the token fenced on the volume too), "
        "'kubernetes' (a coordination.k8s.io Lease per root, [daemon.kubernetes]; its leaseTransitions "
        "fenced on the volume too), "
        "'auto' (etcd where endpoints are set, else volume on network filesystems, local elsewhere). "
        "Every host must resolve to the same.",
    )
    lease_duration: Duration = Field(
        30.0,
        description="With volume, etcd or kubernetes leadership: how long a lease lasts unrenewed (renewed "
        "every third of it; etcd's TTL, in whole seconds, at least 2; a Lease's leaseDurationSeconds). "
        "A leader that cannot renew for this long "
        "stops deleting.",
    )
    lease_margin: Duration = Field(
        10.0,
        description="With volume or kubernetes leadership: how much longer a standby waits after a lease "
        "runs out before taking over. Covers clock skew between hosts and a pause between a leader's last "
        "check and its rename: keep it above both.",
    )

    @field_validator("metrics_listen")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_listen(v)
        return v

    @field_validator("lease_duration", "lease_margin")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be > 0 (got {format_duration(v)})")
        return v

    @field_validator("leadership")
    @classmethod
    def _etcd_named(cls, v: str, info: ValidationInfo) -> str:
        etcd = info.data.get("etcd")
        if v == "etcd" and etcd is not None and not etcd.endpoints:
            raise ValueError("leadership = 'etcd' needs [daemon.etcd] endpoints (or $CKPTD_ETCD_ENDPOINTS)")
        return v


class Config(_Strict):
    daemon: Daemon = Field(default_factory=Daemon, description="The daemon's own settings.")
    roots: tuple[Root, ...] = Field((), description="The directory trees to manage.")

    def trash_grace(self, root: Root) -> float:
        """How long a checkpoint deleted in `root` waits in its trash: the root's, else the daemon's."""
        return self.daemon.trash_grace if root.trash_grace is None else root.trash_grace

    @field_validator("roots")
    @classmethod
    def _disjoint_roots(cls, roots: tuple[Root, ...]) -> tuple[Root, ...]:
        # Nested roots would see the same runs twice, with two policies.
        # By path (/mnt/data -> /data and /data/team overlap), and, where the roots exist, by
        # directory identity and the mount table: /mnt bind-mounted from /data/team.
        table = mounts.read_mounts() if len(roots) > 1 else []
        for j, b in enumerate(roots):
            for i, a in enumerate(roots[:j]):
                if _overlap(str(a.path), str(b.path), table):
                    raise ValueError(
                        f"roots[{j}].path {str(b.path)!r} overlaps roots[{i}].path {str(a.path)!r}"
                    )
        return roots

    @model_validator(mode="after")
    def _one_lease_per_root(self) -> Config:
        if self.daemon.kubernetes.lease_name is not None and len(self.roots) > 1:
            raise ValueError("daemon.kubernetes.lease_name names one Lease, and there are "
                             f"{len(self.roots)} roots: leave it unset (each root's is then "
                             "ckptd-<its volume id>)")
        return self

    @field_validator("roots")
    @classmethod
    def _disjoint_archives(cls, roots: tuple[Root, ...]) -> tuple[Root, ...]:
        # Two roots archiving under one prefix would share keys (<prefix>/<run>/<checkpoint>): the
        # second root's checkpoint would meet the first's manifest, never match it, and be kept forever.
        for j, b in enumerate(roots):
            for i, a in enumerate(roots[:j]):
                if a.archive is not None and b.archive is not None and _same_keys(a.archive, b.archive):
                    raise ValueError(
                        f"roots[{j}].archive.url {b.archive.url!r} overlaps roots[{i}].archive.url "
                        f"{a.archive.url!r}: two roots would archive under the same keys; give each its "
                        "own prefix"
                    )
        return roots


def _same_keys(a: Archive, b: Archive) -> bool:
    """Whether two archives can name one object: the same store, and one prefix inside the other."""
    if (_endpoint(a.endpoint_url), a.bucket) != (_endpoint(b.endpoint_url), b.bucket):
        return False
    p, q = a.prefix, b.prefix
    return not p or not q or p == q or q.startswith(f"{p}/") or p.startswith(f"{q}/")


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def _endpoint(url: str | None) -> str:
    """An endpoint URL as the store it reaches, so one store spelled two ways compares equal:
    scheme and host lower-cased, a loopback name for 127.0.0.1, the scheme's default port
    spelled out, a trailing "/" dropped, AWS's own endpoints (and none) as "". Two spellings
    that differ only in DNS (an alias of one host) cannot be told from here; those stay apart."""
    if not url:
        return ""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return url
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower().rstrip(".")
    if host in _LOOPBACK:
        host = "127.0.0.1"
    if host == "s3.amazonaws.com" or (host.startswith("s3.") and host.endswith(".amazonaws.com")):
        return ""
    port = port or {"http": 80, "https": 443}.get(scheme, 0)
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _overlap(a: str, b: str, table: list[mounts.Mount]) -> bool:
    return mounts.located_in(a, b, table) is not None or mounts.located_in(b, a, table) is not None
