"""`ckptd check-config`: the config as ckptd reads it, with what it would warn about."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from ckptd.cli.common import check_state_dir, config_path, load, preflight, slimming_keys
from ckptd.config import Config, config_warnings
from ckptd.config.effective import settings_in
from ckptd.decide.planner import Scanner, run_names, unmatched_paths, world_size_warning
from ckptd.decide.policy import inferred_modes
from ckptd.discover import layouts
from ckptd.discover.runs import find_runs
from ckptd.errors import EX_OK, CkptdError
from ckptd.fleet.etcdlease import prefix_mismatch
from ckptd.fleet.lease import choose_leadership, coherence_note, lock_scope, volume_leader_seen
from ckptd.fleet.leaserecord import engine_leader_seen
from ckptd.volume.mounts import is_remote, mount_of, quiet_alone_problem, quiet_for, read_mounts


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
    for line in config_warnings(config) + _partial_requires(config):
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
        out += unmatched_paths(root, rels, run_names([d.rel for d in dirs]))
    return out


def _partial_requires(config: Config) -> list[str]:
    """`require` globs a save killed half-way could meet (`UserPattern.partial_requires`)."""
    from ckptd.frameworks import USER_PATTERN

    return [
        f"roots[{i}].patterns[{j}] {p.name!r}: {why}"
        for i, root in enumerate(config.roots)
        for j, p in enumerate(root.patterns)
        for why in USER_PATTERN.partial_requires(p.require)
    ]


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
        kind, why, problem = choose_leadership(root.path, d.leadership, mounts, root.coherent,
                                               etcd=bool(d.etcd.endpoints))
        mount = mount_of(root.path, mounts)
        locks = lock_scope(mount)
        if kind == "etcd":
            ttl = max(2, math.ceil(d.lease_duration))
            out.append(f"{where}: leadership=etcd ({why}); lease TTL {ttl}s at "
                       f"{', '.join(d.etcd.endpoints)}, key prefix {d.etcd.prefix}; its token fenced in "
                       f"{root.path / layouts.LEASE_DIR}")
            if (other := prefix_mismatch(root.path, d.etcd.prefix)) is not None:
                out.append(f"warning: {where}: {other}")
        elif kind == "kubernetes":
            k = d.kubernetes
            namespace = k.namespace or "<the pod's or context's namespace>"
            seconds = max(1, math.ceil(d.lease_duration))
            name = k.lease_name or "ckptd-<volume id>"
            out.append(f"{where}: leadership=kubernetes ({why}); Lease {namespace}/{name}, "
                       f"{seconds}s + {d.lease_margin:g}s margin; its leaseTransitions fenced in "
                       f"{root.path / layouts.LEASE_DIR}")
        elif kind == "volume":
            lease = f"lease {d.lease_duration:g}s + {d.lease_margin:g}s margin"
            lease += f" in {root.path / layouts.LEASE_DIR}"
            out.append(f"{where}: leadership=volume ({why}); {lease}; POSIX locks: {locks}")
            if (note := coherence_note(root.path, mounts, root.coherent)) is not None:
                out.append(f"warning: {where}: {note}")
        else:
            out.append(f"{where}: leadership=local ({why}): one deleter per state_dir")
            mixed = volume_leader_seen(root.path) or engine_leader_seen(root.path, d.lease_margin)
            if mixed is not None:
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
