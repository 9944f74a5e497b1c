"""From config to plan: discover, inspect, decide. Reads only.

The thin I/O shell around the pure policy: it finds runs, gathers evidence,
asks the filesystem how much space is free, and hands all of that to
`policy` as plain data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ckptd import frameworks
from ckptd.config import Retention, Root, path_matches, pin_matches
from ckptd.decide import extents, policy, rules
from ckptd.decide.policy import Decision, Plan
from ckptd.discover.layouts import compile_pattern, recognise
from ckptd.discover.runs import RunDir, depth_of, find_run, find_runs
from ckptd.errors import RootMissingError, UsageError
from ckptd.frameworks import is_rank_dir
from ckptd.judge.census import with_sibling_census
from ckptd.judge.evidence import (
    EVIDENCE,
    QUIET_ALONE,
    Inspector,
    QuietJudge,
    RunContext,
    mixed_save,
    on_quiet_alone,
    resume_pointers,
)
from ckptd.judge.slim import config_refusals
from ckptd.judge.verdicts import Verdicts, cache_path
from ckptd.model import QUIET, Candidate, Check, Checkpoint, Run, State, Verdict
from ckptd.volume import mounts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskSpace:
    free: int  # bytes available to unprivileged users
    total: int


def disk_space(path: Path) -> DiskSpace:
    st = os.statvfs(path)
    return DiskSpace(free=st.f_bavail * st.f_frsize, total=st.f_blocks * st.f_frsize)


# How far above a root to look for a checkpoint holding it (a Trainer's checkpoint-N/global_stepN/
# is two levels, a DCP part of a NeMo rank directory three).
_ROOT_ANCESTORS = 4


def refuse_a_checkpoint_as_root(root: Root, patterns: list[re.Pattern[str]] | None = None) -> None:
    """Refuse a root that is a checkpoint, or lies inside one, as the directory above would see it
    (`recognise`): discovery from there takes the checkpoint's own parts for a run of checkpoints
    (accelerate's FSDP `pytorch_model_fsdp_0/` and `optimizer_0/` are DCP saves, a Trainer's
    `global_step<N>/` is DeepSpeed's), and retention would delete them from it. `Scanner.in_scope`
    refuses the same for a subtree of a configured root. Asked before anything is written there
    (prune's root lock would make `.ckptd/` inside the checkpoint)."""
    if patterns is None:
        patterns = [compile_pattern(p.name) for p in root.patterns]
    # As the walk sees it: a symlink to a checkpoint (`ln -s run/step_1 link`) is the checkpoint.
    here = top = Path(os.path.realpath(root.path))
    for _ in range(_ROOT_ANCESTORS):
        if here.parent == here:
            return
        try:
            cand = recognise(here.name, True, lambda d=here: os.listdir(d), patterns)
        except OSError:
            return  # an ancestor that cannot be listed: nothing to say about it
        if cand is not None:
            what = "is a checkpoint" if here == top else f"is inside the checkpoint {here}"
            raise UsageError(
                f"{root.path} {what}: name its run or a directory above it (a checkpoint's own "
                "directories would be taken for a run of checkpoints)"
            )
        here = here.parent


class Scanner:
    """Inspects the runs of one root. Keeps what its inspector read (`verdicts.py`) between scans.

    With a `state_dir` that exists, what was read is also kept there across processes: loaded
    here, saved by `save_verdicts` (after `runs`, and by the daemon's tracker after each full
    scan). The state_dir is not created for this: `ckptd plan` stays free of side effects on a
    machine where no ckptd ever ran.
    """

    def __init__(
        self,
        root: Root,
        quiet: QuietJudge | None = None,
        *,
        state_dir: Path | None = None,
        verdicts: Verdicts | None = None,
    ):
        self.root = root
        self.quiet = quiet  # the daemon's settler; None: compare mtimes with the wall clock
        self.patterns = [compile_pattern(p.name) for p in root.patterns]
        self.verdict_file = cache_path(state_dir, root.path) if state_dir is not None else None
        if verdicts is None:
            verdicts = Verdicts()
            if self.verdict_file is not None:
                verdicts.load(self.verdict_file, root.path)
        self.inspector = Inspector(
            quiet_period=root.quiet_period, mp_world_size=root.mp_world_size, verdicts=verdicts
        )
        self._context: tuple[RunDir, str] | None = None  # the last run's `_context_key`
        # Quiet alone, where the mount's attribute cache is unknown and not declared, completes
        # nothing (mounts.quiet_alone_problem): a checkpoint written on another host can look
        # unchanged here for as long as that cache lasts.
        self.quiet_alone = mounts.quiet_alone_problem(root.path, mounts.read_mounts(), root.attribute_cache)
        # The config a saved checkpoint's evidence may have depended on, beyond its run's
        # retention (`_context_key`): patterns (their evidence rules), world sizes, the root.
        self._config_key = repr((str(root.path), root.patterns, root.world_size, root.mp_world_size,
                                 self.quiet_alone))

    @property
    def verdicts(self) -> Verdicts:
        return self.inspector.verdicts

    def save_verdicts(self) -> None:
        """Write what was proven to `state_dir`, if there is one and anything changed."""
        if self.verdict_file is not None and self.verdicts.dirty and self.verdict_file.parent.is_dir():
            self.verdicts.save(self.verdict_file, self.root.path)

    def check_root(self) -> None:
        if not self.root.path.is_dir():
            raise RootMissingError(f"root {self.root.path} does not exist or is not a directory")

    def runs(self, *, now: float, progress: Callable[[int, int], None] | None = None) -> list[Run]:
        """Every run of the root, each checkpoint inspected (or restored, `restore`); what was read
        is saved (`save_verdicts`). `progress(done, total)` is told after each run, in checkpoints."""
        self.check_root()
        refuse_a_checkpoint_as_root(self.root, self.patterns)
        dirs = find_runs(self.root.path, max_depth=self.root.max_depth, patterns=self.patterns)
        scoped = self.in_scope(dirs)
        total, done, runs = sum(len(d.candidates) for d in scoped), 0, []
        for d in scoped:
            runs.append(self.inspect_run(d, now=now))
            done += len(d.candidates)
            if progress is not None:
                progress(done, total)
        if not self.root.scope:  # restricted to subtrees: the others' records stay
            self.verdicts.retain(str(c.path) for r in runs for c in r.checkpoints)
        self.save_verdicts()
        return runs

    def in_scope(self, dirs: list[RunDir]) -> list[RunDir]:
        """The runs within the subtrees a command was restricted to (`Root.scope`), found by a
        discovery from the root itself, so that a subtree inside a run or a checkpoint is never
        mistaken for a run (a Trainer checkpoint named as ROOT would make its global_step
        directory look like a checkpoint of its own)."""
        for sub in self.root.scope:
            where = self.root.path / sub
            if not where.is_dir():
                raise RootMissingError(f"{where} does not exist or is not a directory")
            inside = next((d for d in dirs if d.rel == "." or sub.startswith(f"{d.rel}/")), None)
            if inside is not None:
                raise UsageError(
                    f"{where} is inside the run {inside.path}: name the run itself or a directory above it"
                )
        kept = [d for d in dirs if self.root.in_scope(d.rel)]
        # A NeMo step's parts are in every model-parallel rank's directory: judged together or not at all.
        ranks: dict[str, list[RunDir]] = defaultdict(list)
        for d in dirs:
            parent, _, name = d.rel.rpartition("/")
            if d.rel != "." and is_rank_dir(name):
                ranks[parent].append(d)
        for group in ranks.values():
            scoped = [d for d in group if self.root.in_scope(d.rel)]
            if scoped and len(scoped) < len(group):
                raise UsageError(
                    f"{scoped[0].path} is one model-parallel rank of the checkpoints in "
                    f"{scoped[0].path.parent}: name the directory above the ranks"
                )
        return kept

    def inspect_run(self, run_dir: RunDir, *, now: float) -> Run:
        ckpts = []
        for cand in run_dir.candidates:
            c = self.restore(run_dir, cand, now=now) or self.inspect(run_dir, cand, now=now)
            if c is not None:
                ckpts.append(c)
        ckpts = with_sibling_census(ckpts)
        resume = resume_pointers(run_dir.path, run_dir.names)
        return Run(self.root.path, run_dir.rel, tuple(sorted(ckpts, key=Checkpoint.sort_key)), resume)

    def restore(self, run_dir: RunDir, cand: Candidate, *, now: float) -> Checkpoint | None:
        """The checkpoint as an earlier look (saved in state_dir) found it, if none of its
        directories changed since, nor a file whose contents it rests on (a stat each:
        `Verdicts.restorable`), nor its run directory's context, nor the config its evidence
        depended on; else None (inspect it).

        Its quiet check is judged afresh: by the settler, for the daemon, which then walks it in
        full when its quiet period ends before it can count as complete; by the wall clock
        against the saved newest mtime, for `plan` and `prune`. A file rewritten in place to the
        same size within one timestamp tick is invisible to any stat: the reaper's last check reads
        the run again, strictly, and decides it again before it acts (`Reaper._decided_otherwise`).
        """
        path = run_dir.path / cand.name
        saved = self.verdicts.restorable(str(path), self._context_key(run_dir))
        if saved is None:
            return None
        c = replace(saved, root=self.root.path, run=run_dir.rel, name=cand.name, step=cand.step,
                    layout=cand.layout, unit=cand.unit)  # fmt: skip
        rel = cand.name if run_dir.rel == "." else f"{run_dir.rel}/{cand.name}"
        if self.quiet is not None:
            quiet = self.quiet(rel, c.fingerprint, int(c.newest_mtime * 1e9))
        else:
            quiet = self.inspector._quiet(int(c.newest_mtime * 1e9), now)
        return replace(c, checks=(quiet, *(k for k in c.checks if k.name != QUIET)))

    def _context_key(self, run_dir: RunDir) -> str:
        """What a saved checkpoint's evidence depended on besides its own files: the config that
        applies to its run, and its run directory's context (`run_context`)."""
        if self._context is not None and self._context[0] is run_dir:
            return self._context[1]  # a run's checkpoints are looked at one after another
        retention, world = retention_for(self.root, run_dir.rel)
        metric = retention.metric if retention.keep_best or retention.keep_total is not None else None
        slim_weights = retention.slim_weights if retention.keep_full_last is not None else None
        key = (self._config_key, world, sorted(retention.pins), retention.slim_files, metric, slim_weights)
        text = repr((key, run_context(run_dir))).encode("utf-8", "surrogateescape")
        digest = hashlib.blake2b(text, digest_size=16).hexdigest()
        self._context = (run_dir, digest)
        return digest

    def inspect(self, run_dir: RunDir, cand: Candidate, *, now: float) -> Checkpoint | None:
        """One checkpoint's evidence; None if it vanished while we looked (not ours to decide about)."""
        retention, world = retention_for(self.root, run_dir.rel)
        try:
            found = self.inspector.inspect(
                self.root.path,
                run_dir.rel,
                RunContext(run_dir.path, run_dir.names),
                cand,
                now=now,
                world_size=world,
                pins=frozenset(retention.pins),
                quiet=self.quiet,
                slim_files=retention.slim_files,
                pattern=self.root.patterns[cand.pattern] if cand.pattern is not None else None,
                metric=retention.metric if retention.keep_best or retention.keep_total is not None else None,
                slim_weights=retention.slim_weights if retention.keep_full_last is not None else None,
            )
            if self.quiet_alone is not None:
                found = replace(found, checks=tuple(
                    Check(EVIDENCE, Verdict.UNKNOWN, self.quiet_alone)
                    if k.name == EVIDENCE and k.verdict is Verdict.PASSED and k.detail.endswith(QUIET_ALONE)
                    else k
                    for k in found.checks))
            found = replace(found, checks=self.verdicts.share_checks(found.checks))  # memory
            self.verdicts.keep_checkpoint(str(run_dir.path / cand.name), found, self._context_key(run_dir))
            return found
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            raise  # the volume itself is failing: the caller backs off
        except Exception as exc:  # a bug, or a file we did not foresee: never a reason to delete
            log.exception("cannot inspect %s/%s", run_dir.rel, cand.name)
            why = Check("inspection", Verdict.UNKNOWN, f"could not be inspected: {type(exc).__name__}: {exc}")
            return Checkpoint(self.root.path, run_dir.rel, cand.name, cand.step, cand.layout, (why,))

    def reinspect(self, run_rel: str, name: str, *, now: float) -> Checkpoint | None:
        """One checkpoint, looked at afresh: None if it is gone or no longer recognised.

        For the reaper's re-check just before it acts: every entry is walked and stat'ed again,
        and a file is read again unless this process itself read it at the same identity; a
        verdict loaded from `state_dir` is never used here (`Verdicts.strict`).
        """
        run_dir = find_run(self.root.path, run_rel, patterns=self.patterns)
        cand = next((c for c in run_dir.candidates if c.name == name), None) if run_dir else None
        if run_dir is None or cand is None:
            return None
        with self.verdicts.strict():
            return self.inspect(run_dir, cand, now=now)


    def reinspect_run(self, run_rel: str, *, now: float) -> Run | None:
        """Every checkpoint of one run looked at afresh (`reinspect`), strictly: None if the run is
        gone. A NeMo model-parallel rank's directory comes with the newest step every rank holds
        whole named as resumed from (`with_whole_steps`), its sibling ranks looked at as well.

        For the reaper's last check: it decides the run again from what its files say now.
        """
        run_dir = find_run(self.root.path, run_rel, patterns=self.patterns)
        if run_dir is None:
            return None
        with self.verdicts.strict():
            run = self.inspect_run(run_dir, now=now)
            parent, _, name = run_rel.rpartition("/")
            if run_rel == "." or not is_rank_dir(name):
                return run
            siblings = []
            for other in sorted(os.listdir(run_dir.path.parent)):
                rel = f"{parent}/{other}" if parent else other
                if other != name and is_rank_dir(other):
                    found = find_run(self.root.path, rel, patterns=self.patterns)
                    if found is not None:
                        siblings.append(self.inspect_run(found, now=now))
        return with_whole_steps([run, *siblings])[0]

    def reinspect_experiment(self, run_rel: str, *, now: float) -> Run | None:
        """The run the directory `run_rel` belongs to as retention decides it (`experiments`), every
        checkpoint looked at afresh, strictly: its directory alone (`reinspect_run`), or every
        directory of its run key (`frameworks.run_key`: each version_N of a Lightning experiment),
        re-discovered, merged as the plan merges them. None if the directory is gone.

        For the reaper's last check, which decides the run again: a checkpoint of version_0 goes
        only if the experiment decided again from every version's files does the same.
        """
        key = frameworks.run_key(run_rel)
        if key == run_rel:
            return self.reinspect_run(run_rel, now=now)
        where = self.root.path if key == "." else self.root.path / key
        depth = max(0, self.root.max_depth - depth_of(key))
        found = find_runs(where, max_depth=depth, patterns=self.patterns, below_root=key != ".")
        rels = [_join_rel(key, d.rel) for d in found]
        if run_rel not in rels:
            return None
        runs = []
        with self.verdicts.strict():
            for rel in rels:
                if frameworks.run_key(rel) != key:
                    continue
                run_dir = find_run(self.root.path, rel, patterns=self.patterns)
                if run_dir is not None:
                    runs.append(self.inspect_run(run_dir, now=now))
        return next((r for r in experiments(self.root, runs) if any(c.run == run_rel for c in r.checkpoints)),
                    None)


def _join_rel(rel: str, sub: str) -> str:
    if sub == ".":
        return rel
    return sub if rel == "." else f"{rel}/{sub}"


# What the config cannot check itself, knowing no framework (`slim.config_refusals`: a slim_files
# glob that would remove what loading the weights needs): passed wherever a config is read (the
# commands, a reload, `ckptd latest`) to `effective_config`, refused like its own problems (exit 78).
CONFIG_CHECKS = (config_refusals,)


def rule_for(root: Root, rel: str) -> int | None:
    """Which of `root`'s run rules applies to the run directory `rel`: one naming the directory, or
    the run it belongs to (`frameworks.run_key`: a Lightning experiment's name); None for none."""
    return root.rule_for(rel, frameworks.run_key(rel))


def retention_for(root: Root, rel: str) -> tuple[Retention, int | None]:
    """The retention policy and world size for the run directory `rel`, by the rule `rule_for` finds."""
    return root.retention_for(rel, frameworks.run_key(rel))


def rule_dir(run: Run) -> str:
    """A directory of `run` (relative to its root), for the config's rule and world size: an
    experiment's directories all have the same rule (`experiments` merges no others)."""
    return run.checkpoints[0].run if run.checkpoints else run.rel


def experiments(root: Root, runs: list[Run]) -> list[Run]:
    """`runs` (one per directory of checkpoints) as retention decides them: the directories of one
    run key (`frameworks.run_key`: each `version_N/checkpoints` of a Lightning experiment, each
    launch's timestamp directory of a NeMo one) taken as ONE run, ordered by step across them, when
    each carries the step count on from the ones before it. (`ckptd latest` looks at every
    directory of the run key: `resume._the_run`.)

    Launches are taken in the order their directories number them (`_launch_order`). A resumed
    launch continues the count (Lightning's fit with `ckpt_path` restores global_step, and
    ModelCheckpoint names its saves by it): its lowest step is above every step of the launch
    before it (and of those that one continued). A launch whose steps overlap theirs started the
    count afresh (a fit from scratch under the same name) or went back to an earlier save: a
    trajectory of its own, kept apart, its newest checkpoint protected as its own run's, as before
    (in doubt, keep); a later launch whose steps are above it continues it. Steps are
    those of the names (the unit too: a step and an epoch are not compared), so the reaper's
    re-check merges exactly as the plan did. Directories the config gives different rules are
    never merged. A merged run's `rel` is the run key; each checkpoint keeps its own directory
    (`Checkpoint.run`). A run key of one directory is that directory's run, unchanged.
    """
    by_key: dict[tuple[str, int | None], list[Run]] = {}
    slots: list[Run | tuple[str, int | None]] = []  # in the order given: a run, or where its key's go
    for run in runs:
        key = frameworks.run_key(run.rel)
        if key == run.rel or not run.checkpoints:
            slots.append(run)
            continue
        group = (key, root.rule_for(run.rel, key) if root.runs else None)
        if group not in by_key:
            by_key[group] = []
            slots.append(group)
        by_key[group].append(run)
    if not by_key:
        return runs
    out: list[Run] = []
    for slot in slots:
        if isinstance(slot, Run):
            out.append(slot)
        else:
            out += _launches(slot[0], by_key[slot])
    return out


def _launches(key: str, group: list[Run]) -> list[Run]:
    """One run key's directories as runs: the launches that carry the step count on merged
    (`experiments`), in launch order."""
    if len(group) == 1:
        return group
    chains: list[list[Run]] = []
    span: tuple[str, int] | None = None  # the unit and highest step of the chain so far
    for run in sorted(group, key=_launch_order):
        units = {c.unit for c in run.checkpoints}
        lo, hi = min(c.step for c in run.checkpoints), max(c.step for c in run.checkpoints)
        unit = next(iter(units)) if len(units) == 1 else ""  # "": mixed, continues nothing
        if span is not None and unit and span[0] == unit and lo > span[1]:
            chains[-1].append(run)  # lo > the chain's highest step: so hi is its highest now
        else:
            chains.append([run])
        span = (unit, hi)
    out = []
    for chain in chains:
        if len(chain) == 1:
            out.append(chain[0])
            continue
        ckpts = tuple(sorted((c for r in chain for c in r.checkpoints), key=Checkpoint.sort_key))
        resume = {name: why for r in chain for name, why in r.resume.items()}
        out.append(Run(chain[0].root, key, ckpts, resume))
    return out


def _launch_order(run: Run) -> list[tuple[str, int]]:
    """The order launches were made in, as their directories number them: `version_2` before
    `version_10` (the loggers' next version is the highest + 1), NeMo's timestamps as they read."""
    return [(text, int(num or -1)) for text, num in _NUMBERED.findall(run.rel)]


_NUMBERED = re.compile(r"(\D*)(\d*)")


def run_context(run_dir: RunDir) -> object:
    """What of the run directory a checkpoint's evidence reads besides the checkpoint itself: the
    names that are not checkpoints (NeMo's `-unfinished` markers, pin files beside file
    checkpoints, Megatron's tracker) and the stat of each file a framework's evidence reads there
    (`Framework.run_files`, `outside_run_files`: rewritten in place)."""
    others = tuple(sorted(run_dir.names.difference(c.name for c in run_dir.candidates)))
    stats: list[tuple[int, int, int, int] | None] = []
    paths = [run_dir.path / name for name in frameworks.RUN_FILES if name in others]
    paths += [p for f in frameworks.REGISTRY for p in f.outside_run_files(run_dir.path, run_dir.names)]
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            stats.append(None)
            continue
        stats.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return (others, *stats) if stats else others


MODEL_PARALLEL = "NeMo's model-parallel ranks"


def with_whole_steps(runs: list[Run]) -> list[Run]:
    """`runs`, each model-parallel rank's directory (`mp_rank_00/`, `mp_rank_01/` beside each other:
    `frameworks.is_rank_dir`) with the newest step that every rank holds complete named as what the
    framework resumes from (`Run.resume`), so every rank keeps its part of it.

    Each rank directory is a run of its own, and a step is one file in each. Judged apart, a rank
    that saved a step the others have not yet (or whose save NeMo marks unfinished) has a newer
    "newest complete" than the others, and retention would delete its part of the last step every
    rank has: nothing resumable would be left. A rank directory with no checkpoint at all is no
    run, and not counted.
    """
    groups: dict[tuple[Path, str], list[Run]] = defaultdict(list)
    for run in runs:
        parent, _, name = run.rel.rpartition("/")
        if run.rel != "." and is_rank_dir(name):
            groups[(run.root, parent)].append(run)
    named: dict[int, tuple[str, str]] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        complete = [{c.name for c in r.checkpoints if c.state is State.COMPLETE} for r in group]
        whole = set.intersection(*complete)
        if not whole:
            continue
        newest = max((c for c in group[0].checkpoints if c.name in whole), key=Checkpoint.sort_key)
        ranks = sorted(r.rel.rpartition("/")[2] for r in group)
        why = f"{MODEL_PARALLEL} {ranks[0]}..{ranks[-1]} as the newest step all {len(ranks)} hold complete"
        for r in group:
            named[id(r)] = (newest.name, why)
    if not named:
        return runs
    return [
        replace(r, resume={**r.resume, named[id(r)][0]: named[id(r)][1]}) if id(r) in named else r
        for r in runs
    ]


def run_names(run_rels: list[str]) -> list[str]:
    """What a run rule's `match` may name: each run directory, and the run it belongs to
    (`frameworks.run_key`: a Lightning experiment's name)."""
    return list(dict.fromkeys([*run_rels, *map(frameworks.run_key, run_rels)]))


def unmatched_paths(root: Root, ckpt_rels: list[str], run_rels: list[str]) -> list[str]:
    """Warnings for the pins that match no checkpoint of the root, and the run rules that match
    no run: mistyped, most likely, and then what the user meant to keep is not kept. Not said
    for a command restricted to part of the root (the rest was not looked at)."""
    if root.scope:
        return []
    out = []
    rules = [("retention.pins", p) for p in root.retention.pins]
    rules += [(f"runs[{i}].pins", p) for i, rule in enumerate(root.runs) for p in rule.pins]
    for key, pin in dict.fromkeys(rules):
        if not any(pin_matches(rel, pin) for rel in ckpt_rels):
            out.append(f"{root.path}: {key}: {pin!r} matches no checkpoint (mistyped?): it keeps nothing")
    for i, rule in enumerate(root.runs):
        if not any(path_matches(rel, rule.match) for rel in run_rels):
            out.append(f"{root.path}: runs[{i}].match: {rule.match!r} matches no run (mistyped?)")
    return out


# What the evidence says about ranks (evidence.py: `rank_files` with a configured world size, the
# DeepSpeed census's origin): "rng_state_4.pth missing (4/8 ranks)", "(dp_world_size=4,
# mp_world_size=1 from mp_rank_00_model_states.pt)".
_RANKS_SHORT = re.compile(r" missing \((\d+)/(\d+) ranks\)$")
_DS_WORLD = re.compile(r"\(dp_world_size=(\d+), mp_world_size=\d+ from (?!config world_size)(.+)\)$")
_RANK_CHECKS = ("rng states", "random states", "ranks (")


def world_size_key(root: Root, run: str) -> str:
    """The config key a run's world size comes from: `runs[1].world_size` or `world_size`."""
    i = rule_for(root, run)
    if i is not None:
        return f"runs[{i}].world_size" if root.runs[i].world_size is not None else "world_size"
    return "world_size"


def world_size_warning(root: Root, run: Run) -> str | None:
    """Where a configured world_size disagrees with what the run's checkpoints show, or None.

    A world_size of 8 on a 4-rank job holds every checkpoint "incomplete (4/8 ranks)" forever:
    nothing is deleted and the disk fills, each checkpoint saying only that a rank is missing.
    Shown: the model states' own dp_world_size (DeepSpeed records it; the config stands in only
    where that file cannot be read, as in an image without torch), or rank files that fall short
    by the same count in every quiet checkpoint and pass in none.
    """
    _, world = retention_for(root, rule_dir(run))
    if world is None:
        return None
    key = world_size_key(root, rule_dir(run))
    most: tuple[int, str] | None = None  # the most ranks' files a quiet checkpoint holds, and which
    for c in reversed(run.checkpoints):  # newest first: the example named is the newest
        quiet = any(k.name == QUIET and k.verdict is Verdict.PASSED for k in c.checks)
        for k in c.checks:
            if k.name.startswith("deepspeed shards") and (m := _DS_WORLD.search(k.detail)):
                if int(m[1]) != world:
                    return (
                        f"{run.path}: {key} = {world}, but {c.name}'s {m[2]} records dp_world_size={m[1]}: "
                        f"where that file cannot be read (no torch), ckptd counts {world} ranks' shards and "
                        f"holds the checkpoints incomplete; set {key} = {m[1]}, or remove it"
                    )
            elif k.name.startswith(_RANK_CHECKS):
                if k.verdict is Verdict.PASSED:
                    return None  # a checkpoint holds every rank the config names: it agrees
                m = _RANKS_SHORT.search(k.detail) if quiet else None
                if m and int(m[2]) == world and (most is None or int(m[1]) > most[0]):
                    most = (int(m[1]), c.name)
    if most is None:
        return None
    present, name = most
    return (
        f"{run.path}: {key} = {world}, but no checkpoint holds more than {present} ranks' files "
        f"({name}): each stays incomplete (at most {present}/{world} ranks) and nothing is deleted; set "
        f"{key} = {present} for this run, or remove it (ckptd then counts the ranks each checkpoint holds)"
    )


def _evidence_warnings(run: Run) -> list[str]:
    """What the run's checkpoints say of the evidence: complete on quiet alone, held whole (a run
    inside a checkpoint), more than one holding files from two saves. One pass over the run."""
    alone = 0
    held: list[str] = []
    mixed: list[str] = []
    for c in run.checkpoints:  # one pass: every checkpoint of every run
        # A checkpoint with files from two saves has a failed check: never complete.
        if c.state is State.COMPLETE:
            if on_quiet_alone(c):
                alone += 1
        elif mixed_save(c):
            mixed.append(c.name)
        if c.holds:
            held.append(
                f"{c.path}: {rules.held_reason(c)}: kept whole, and nothing inside it is managed "
                "(move that run out of the checkpoint to manage it)"
            )
    warnings: list[str] = []
    if alone:
        warnings.append(
            f"{run.path}: {alone} checkpoint(s) complete on quiet alone: nothing in them "
            "proves a save finished; name the evidence in the pattern (require = [...], ranks = ...)"
        )
    warnings += held
    if len(mixed) > 1:  # a job re-saves one checkpoint at a time
        shown = ", ".join(mixed[:3]) + (f" and {len(mixed) - 3} more" if len(mixed) > 3 else "")
        warnings.append(
            f"{run.path}: {len(mixed)} checkpoints hold files from two saves ({shown}), kept while "
            "so: more than a re-save in place in flight; copied without their mtimes (cp -r without "
            "-p, rsync without -t)? `ckptd verify` names the files out of order"
        )
    return warnings


def _decide_run(root: Root, run: Run) -> tuple[list[Decision], list[str]]:
    """One run's decisions under its retention (max_size included, min_free not) and its warnings."""
    retention, _ = retention_for(root, rule_dir(run))
    ds = policy.decide_run(run, retention)
    warnings = list(policy.metric_warnings(run, retention, ds))
    if (world := world_size_warning(root, run)) is not None:
        warnings.append(world)
    warnings += _evidence_warnings(run)
    if retention.max_size is not None:
        ds, w = policy.enforce_max_size(ds, retention.max_size)
        warnings += w
    return ds, warnings


def _min_free_devices(
    roots: list[tuple[Root, list[Run]]], device: Callable[[Path], int]
) -> tuple[list[list[Root]], list[str]]:
    """The roots with a min_free, grouped by filesystem (min_free is per filesystem: roots on the
    same device share one budget), and the warnings of the roots it cannot apply to."""
    by_device: dict[int, list[Root]] = defaultdict(list)
    warnings: list[str] = []
    for root, _ in roots:
        if root.retention.min_free is not None and root.scope:
            warnings.append(
                f"{root.path}: min_free={root.retention.min_free} not applied: this covers only "
                f"{', '.join(root.scope)} of the root (min_free is per filesystem: name the whole root)"
            )
        elif root.retention.min_free is not None:
            by_device[device(root.path)].append(root)
    return list(by_device.values()), warnings


def _enforce_min_free(
    decisions: list[Decision],
    dev_roots: list[Root],
    space: Callable[[Path], DiskSpace],
    extents_held: Callable[[Path], Callable[[Checkpoint], int] | None],
    trash: Callable[[Path], int] | None,
) -> tuple[list[Decision], list[str]]:
    """`decisions` with the min_free of the roots on one filesystem (`dev_roots`) applied to those
    of its checkpoints, and the warnings that gives."""
    paths = {r.path for r in dev_roots}
    disk = space(dev_roots[0].path)
    if trash is not None:
        disk = DiskSpace(free=disk.free + sum(trash(r.path) for r in dev_roots), total=disk.total)
    floors = [r.retention.min_free for r in dev_roots if r.retention.min_free is not None]
    floor = max(floors, key=lambda f: f.required(disk.total))
    # The checkpoints' roots, by identity (a run's checkpoints share one Path): most often all
    # of them are on this filesystem, and every decision is.
    seen = {id(d.checkpoint.root): d.checkpoint.root for d in decisions}
    if all(p in paths for p in seen.values()):
        idx = list(range(len(decisions)))
    else:
        idx = [i for i, d in enumerate(decisions) if d.checkpoint.root in paths]
    where = ", ".join(sorted(str(p) for p in paths))
    updated, w = policy.enforce_min_free(
        [decisions[i] for i in idx],
        free=disk.free,
        total=disk.total,
        floor=floor,
        where=where,
        held=extents_held(dev_roots[0].path),
    )
    if len(idx) == len(decisions):  # one filesystem: every decision
        return updated, w
    decisions = list(decisions)
    for i, d in zip(idx, updated, strict=True):
        decisions[i] = d
    return decisions, w


def decide(
    roots: list[tuple[Root, list[Run]]],
    space: Callable[[Path], DiskSpace] = disk_space,
    device: Callable[[Path], int] = lambda p: os.stat(p).st_dev,
    extents_held: Callable[[Path], Callable[[Checkpoint], int] | None] = extents.held_by_checkpoints,
    trash: Callable[[Path], int] | None = None,
) -> Plan:
    """The retention plan for every run of every root, budgets included.

    `extents_held(root)`: on a filesystem that shares extents, what deleting each checkpoint leaves
    allocated (extents.py), for `min_free`; None where st_blocks is what deleting frees.
    `trash(root)`: what waits in the root's trash to be purged, counted as free for `min_free`
    (removal.purge.waiting_in_trash; the daemon's `space` counts it itself).
    """
    decisions: list[Decision] = []
    warnings: list[str] = []
    for root, runs in roots:
        if not root.scope and (root.retention.pins or root.runs):  # else it has nothing to say
            rels = [c.rel for run in runs for c in run.checkpoints]
            warnings += unmatched_paths(root, rels, run_names([r.rel for r in runs]))
        for run in experiments(root, with_whole_steps(runs)):
            ds, w = _decide_run(root, run)
            warnings += w
            decisions += ds
    devices, w = _min_free_devices(roots, device)
    warnings += w
    for dev_roots in devices:
        decisions, w = _enforce_min_free(decisions, dev_roots, space, extents_held, trash)
        warnings += w
    return Plan(tuple(decisions), tuple(warnings))
