"""What the commands share: the config found and loaded, roots, extras and state_dir checked,
one scan and plan of every root."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptd.cli.parser import retention_overrides
from ckptd.cli.progress import Progress
from ckptd.config import Config, Root, find_config
from ckptd.config.effective import effective_config
from ckptd.decide.planner import CONFIG_CHECKS, Scanner, decide
from ckptd.decide.policy import Plan
from ckptd.errors import ConfigError, IOFault, RootMissingError, UsageError
from ckptd.removal.purge import waiting_in_trash
from ckptd.volume.mounts import holder, quiet_for, read_mounts


def config_path(args: argparse.Namespace) -> Path | None:
    """`-c`, else `$CKPTD_CONFIG`, else /etc/ckptd/config.toml if it exists (config.find_config)."""
    path = find_config(args.config)
    if path is not None and not args.config and os.environ.get("CKPTD_CONFIG") and not path.exists():
        raise ConfigError([f"{path}: no such file (named by $CKPTD_CONFIG)"])
    return path


def load(args: argparse.Namespace) -> Config:
    """The file (or defaults), then ROOT arguments, then CKPTD_* variables (envconfig.py)."""
    roots = [Path(r) for r in getattr(args, "roots", None) or []]
    return effective_config(
        config_path(args), os.environ, roots, retention_overrides(args), checks=CONFIG_CHECKS
    )


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


# What slimming's consolidation imports (`python -m ckptd.removal.zero_to_fp32`: zero_to_fp32, safetensors).
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


def kubernetes_problems(d: Any) -> list[str]:
    """For `leadership = "kubernetes"`: the client missing, or no API server to find (exit 78)."""
    if missing_modules(["lightkube"]):
        return ["daemon.leadership: kubernetes, but lightkube is not installed: pip install 'ckptd[kubernetes]'"]
    from ckptd.fleet.kubelease import KubeConfigMissing, kube_source

    try:
        kind, where = kube_source(d.kubernetes.kubeconfig)
    except KubeConfigMissing as exc:
        return [f"daemon.kubernetes: {exc}"]
    if kind == "kubeconfig" and not where.is_file():
        return [f"daemon.kubernetes.kubeconfig: {where} does not exist"]
    return []


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
    d = config.daemon
    if (d.leadership == "etcd" or (d.leadership == "auto" and d.etcd.endpoints)) and missing_modules(["etcd3gw"]):
        problems.append(
            f"daemon.leadership: etcd ({d.leadership}), but etcd3gw is not installed: pip install 'ckptd[etcd]'"
        )
    if d.leadership == "kubernetes":
        problems += kubernetes_problems(d)
    archived = [i for i, root in enumerate(config.roots) if root.archive is not None]
    if archived and (missing := missing_modules(["boto3", "crc32c"])):
        problems.append(
            f"roots[{archived[0]}].archive is set, but {', '.join(missing)} cannot be imported here: "
            "pip install 'ckptd[s3]'"
        )
    if problems:
        raise ConfigError(problems)


def preflight(config: Config) -> None:
    """Everything `run` checks before it starts, in its order, with its exit codes."""
    require_roots(config)
    require_extras(config)
    from ckptd.decide.planner import refuse_a_checkpoint_as_root

    for root in config.roots:
        # before prune's root lock or a volume lease makes .ckptd/ in it
        refuse_a_checkpoint_as_root(root)  # UsageError, exit 64


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


def without_c_hint(args: argparse.Namespace, config: Config) -> str | None:
    """Said when no daemon was found and nothing named where to look."""
    if args.config or os.environ.get("CKPTD_CONFIG") or os.environ.get("CKPTD_STATE_DIR"):
        return None
    return (
        f"that is the default state_dir; a daemon started with -c CONFIG keeps its state "
        f"where CONFIG says: ckptd {args.command} -c CONFIG"
    )


def root_for(config: Config, path: Path) -> tuple[Root, str]:
    """The configured root holding the checkpoint at `path`, and its run directory's place in it
    (`mounts.holder`: symlinks, `..` and bind mounts give the same answer as for plan and prune),
    or defaults rooted at its parent."""
    found = holder(path.parent, ((root.path, root) for root in config.roots))
    if found is None:
        return Root(path=path.parent), "."
    run_rel, root = found
    return root, run_rel
