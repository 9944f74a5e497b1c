"""`ckptd verify` and `ckptd latest`: one checkpoint's evidence, and the one to resume from."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ckptd.cli.common import load, root_for, with_effective_quiet
from ckptd.cli.output import checkpoint_json
from ckptd.cli.progress import Ticker
from ckptd.config import Root, find_config
from ckptd.decide.planner import Scanner, retention_for
from ckptd.discover import layouts
from ckptd.discover.runs import find_run, find_runs
from ckptd.errors import EX_OK, RootMissingError, UsageError
from ckptd.formatting import format_size
from ckptd.judge.attestation import committed_summary
from ckptd.judge.census import with_sibling_census
from ckptd.judge.evidence import Inspector, RunContext, step_mismatch
from ckptd.model import Checkpoint, State
from ckptd.volume.mounts import quiet_for, read_mounts


def cmd_verify(args: argparse.Namespace) -> int:
    config = load(args)
    path = Path(os.path.abspath(args.path))
    if not os.path.lexists(path):
        raise RootMissingError(f"{args.path}: no such file or directory")
    if path.is_symlink():
        raise UsageError(
            f"{args.path} is a symlink, and ckptd never follows symlinks: "
            f"verify {os.path.realpath(path)} itself"
        )
    root, run_rel = root_for(with_effective_quiet(config, say=False), path)
    quiet, _, warning = quiet_for(path, root.quiet_period, read_mounts(), root.attribute_cache)
    if warning is not None:
        print(f"note: {warning}", file=sys.stderr)
        root = root.model_copy(update={"quiet_period": quiet})
    patterns = [layouts.compile_pattern(p.name) for p in root.patterns]
    is_dir = path.is_dir()

    def children() -> list[str]:
        return os.listdir(path)

    cand = layouts.recognise(path.name, is_dir, children, patterns)
    if cand is None and not is_dir:  # one of its run's saves of one template (`recognise_among`)
        cand = layouts.recognise_with_siblings(path.name, False, os.listdir(path.parent), patterns)
    if cand is None and (why := layouts.resume_copy(path.name)) is not None:
        raise UsageError(f"{args.path}: {why}")
    if cand is None:
        held = find_runs(path, max_depth=0, patterns=patterns) if is_dir else []
        if held:
            names = [c.name for c in sorted(held[0].candidates, key=lambda c: (c.step, c.name))]
            raise UsageError(
                f"{args.path} is a run directory holding {len(names)} checkpoints "
                f"({names[0]} ... {names[-1]}): "
                f"verify one of them, e.g. ckptd verify {os.path.join(args.path, names[-1])}; "
                f"ckptd plan {args.path} shows them all"
            )
        what = "; for what a directory holds: ckptd plan PATH" if is_dir else ""
        raise UsageError(
            f"{args.path}: not a checkpoint ckptd recognises (checkpoint-N, global_stepN, "
            "iter_NNNNNNN, a DCP or Orbax step directory, a ...step=N... Lightning/NeMo "
            f"checkpoint, or a configured pattern){what}"
        )
    run_dir = path.parent
    retention, world = retention_for(root, run_rel)
    inspector = Inspector(quiet_period=root.quiet_period, mp_world_size=root.mp_world_size)
    # Reading every file's integrity of a big checkpoint takes a while: a terminal is told.
    with Ticker(f"verify {path}", quiet=args.quiet) as ticker:
        ticker.working("reading its files")
        ckpt = inspector.inspect(
            root.path,
            run_rel,
            RunContext(run_dir, frozenset(os.listdir(run_dir))),
            cand,
            now=time.time(),
            world_size=world,
            pins=frozenset(retention.pins),
            slim_files=retention.slim_files,
            pattern=root.patterns[cand.pattern] if cand.pattern is not None else None,
            slim_weights=retention.slim_weights,
        )
        ticker.working("reading the run's other checkpoints")
        ckpt = _with_run_census(root, run_rel, ckpt, now=time.time())
    warnings = step_mismatch(ckpt, os.listdir(path) if is_dir else [])
    if args.json:
        print(json.dumps({**checkpoint_json(ckpt), "warnings": warnings}, indent=2))
    else:
        slimmed = ", slimmed: weights only" if ckpt.slimmed else ""
        print(
            f"{path}: {ckpt.state}{slimmed} "
            f"({ckpt.layout} layout, step {ckpt.step}, {format_size(ckpt.size_bytes)})"
        )
        width = max(len(c.name) for c in ckpt.checks)
        for c in ckpt.checks:
            print(f"  {c.verdict:<8} {c.name:<{width}}  {c.detail}")
        for w in warnings:
            print(f"warning: {w}")
    return EX_OK if ckpt.state is State.COMPLETE else 1


def _with_run_census(root: Root, run_rel: str, ckpt: Checkpoint, *, now: float) -> Checkpoint:
    """`ckpt` with the run's censuses (`census.with_sibling_census`: no fewer ranks' files, and
    no kind of file fewer, than the run's last complete checkpoint saved before it), its siblings
    inspected as `plan` inspects them: a checkpoint one rank short of the run, which plan holds
    incomplete, is not complete here either."""
    scanner = Scanner(root)
    run_dir = find_run(root.path, run_rel, patterns=scanner.patterns)
    if run_dir is None:
        return ckpt
    siblings = [
        found for cand in run_dir.candidates
        if cand.name != ckpt.name and (found := scanner.inspect(run_dir, cand, now=now)) is not None
    ]  # fmt: skip
    return next(c for c in with_sibling_census([ckpt, *siblings]) if c.name == ckpt.name)


def cmd_latest(args: argparse.Namespace) -> int:
    """`resume_from_checkpoint=$(ckptd latest out/)`: the path on stdout, or exit 1 saying why not."""
    from ckptd.config import parse_duration
    from ckptd.resume import find_latest

    try:
        text = args.quiet_period
        quiet = None if text is None else parse_duration(float(text) if text.strip().isdigit() else text)
    except ValueError as exc:
        raise UsageError(f"--quiet-period: {exc}") from None
    found = find_latest(args.run_dir, config=find_config(args.config), by=args.by, quiet_period=quiet)
    if args.archive:
        return _latest_with_archive(args, found)
    if args.json:
        c = found.checkpoint
        doc = {
            "path": str(c.path) if c else None,
            "step": c.step if c else None,
            "step_unit": c.unit if c else None,
            "layout": c.layout if c else None,
            "why_none": found.why_none,
            "note": found.note,
            **({"committed": said} if c and (said := committed_summary(c.checks)) else {}),
            "passed_over": [
                {"path": str(p.path), "state": str(p.state), "why": w} for p, w in found.passed_over
            ],
        }
        print(json.dumps(doc, indent=2))
        return EX_OK if c else 1
    for c, why in found.passed_over:
        print(f"ckptd: passed over {found.rel(c)}: {why}", file=sys.stderr)
    if found.note:
        print(f"ckptd: note: {found.note}", file=sys.stderr)
    if found.checkpoint is not None and (said := committed_summary(found.checkpoint.checks)):
        print(f"ckptd: {found.rel(found.checkpoint)}: {said}", file=sys.stderr)
    if found.checkpoint is None:
        print(f"ckptd: nothing to resume from: {found.why_none}", file=sys.stderr)
        return 1
    print(found.checkpoint.path)
    return EX_OK


def _latest_with_archive(args: argparse.Namespace, found: object) -> int:
    """`latest --archive`: the newest complete checkpoint across the volume and the run's archive.
    The local one wins a tie (nothing to download); an archived one newer is printed as its URL,
    with the `ckptd restore` that brings it back."""
    from ckptd.cli.archive import newest_archived
    from ckptd.cli.common import load

    local = found.checkpoint  # type: ignore[attr-defined]
    archived = newest_archived(load(args), Path(os.path.abspath(args.run_dir)))
    use_archive = archived is not None and (local is None or int(archived["step"]) > local.step)  # type: ignore[call-overload]
    if args.json:
        doc = {"path": str(local.path) if local else None, "step": local.step if local else None,
               "archived": archived, "newest": "archive" if use_archive else ("local" if local else None)}
        print(json.dumps(doc, indent=2))
        return EX_OK if local or archived else 1
    if use_archive:
        assert archived is not None
        print(f"ckptd: newest is archived: ckptd restore {archived['run']}/{archived['checkpoint']}", file=sys.stderr)
        print(archived["url"])
        return EX_OK
    if local is None:
        print(f"ckptd: nothing to resume from: {found.why_none}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print(local.path)
    return EX_OK
