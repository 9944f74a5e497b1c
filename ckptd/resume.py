"""The resume side: which checkpoint a restarted job should load. Reads only.

`ckptd latest RUN_DIR` (and `ckptd.latest(run_dir)`) names the newest checkpoint that is complete
(the same evidence as retention, less the quiet period: every rank's files, the framework's own
markers, whole files) and full (not slimmed: a slimmed one has lost its optimizer state), passing
over newer saves that were killed mid-way. The frameworks' own "resume from the last one" takes
the highest-numbered directory whatever its state (transformers' `get_last_checkpoint`,
accelerate's `load_state()`, torchtitan, Orbax read with options other than the writer's): a save
killed mid-way breaks the restart, or silently loses a rank's RNG state.

"Newest" is the highest step (then the time it was written), as those frameworks read it once the
incomplete ones are passed over; a run numbered by epoch or save count is ordered by that, then
time. When a checkpoint with a lower step was written *after* it (a new job writing checkpoint-300
beside a day-old checkpoint-5000, or a rollback), the highest step is still named, and a note says
so: taking the one written last silently would resume from an earlier point whenever an old
checkpoint is copied back in (a copy gets a new mtime); `by="time"` takes the one written last.
No daemon is needed: this is a look at the disk, with the config's patterns and world sizes.
Where a run's saves carry commit records (`ckptd.attest`), a complete one without them is passed
over for the newest attested one.

No quiet period is waited out by default: at resume time the writer that quiescence guards
against is the job being restarted, and a job restarted seconds after it died would otherwise find
its newest saves "still being written" and start again from step 0. The framework's contract (its
markers, every rank's files, the file that comes last), the whole-file checks and the commit
records decide alone. An observer choosing while training runs passes `quiet_period`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckptd import frameworks
from ckptd.config import Config, Root, find_config
from ckptd.config.effective import effective_config
from ckptd.decide.planner import CONFIG_CHECKS, Scanner
from ckptd.discover import layouts
from ckptd.discover.runs import RunDir, find_runs
from ckptd.errors import CkptdError, RootMissingError, UsageError
from ckptd.judge.attestation import committed_summary
from ckptd.model import Checkpoint, State, deciding_check
from ckptd.volume import mounts

BY = ("step", "time")
RESUME_QUIET = 0.0  # seconds: the job being restarted is the writer a quiet period would wait for

log = logging.getLogger(__name__)


class NothingToResumeError(CkptdError):
    """Checkpoints exist in the run, but none is complete and full (`latest(..., strict=True)`)."""

    exit_code = 1

    def __init__(self, found: Latest):
        super().__init__(f"{found.run_dir}: nothing to resume from: {found.why_none}")
        self.found = found


@dataclass(frozen=True)
class Latest:
    """What `find_latest` found: the checkpoint to resume from, or why there is none."""

    run_dir: Path
    checkpoint: Checkpoint | None
    passed_over: tuple[tuple[Checkpoint, str], ...] = ()  # newer ones not taken, with why
    why_none: str | None = None
    note: str | None = None  # e.g. a lower step written after the one named
    seen: int = 0  # how many checkpoints the run holds, resumable or not

    @property
    def path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint is not None else None

    def rel(self, c: Checkpoint) -> str:
        """`c`'s path relative to the run directory asked about."""
        return _rel(self.run_dir, c)


def latest(
    run_dir: str | os.PathLike[str],
    *,
    config: Config | str | os.PathLike[str] | None = None,
    by: str = "step",
    quiet_period: float | None = None,
    strict: bool = False,
) -> Path | None:
    """The checkpoint a restart of the run in `run_dir` should load, or None when there is none.

    For training scripts: `trainer.train(resume_from_checkpoint=ckptd.latest("out"))` (None starts
    afresh). `config` is a config file, a `Config`, or None for the usual search ($CKPTD_CONFIG,
    /etc/ckptd/config.toml, then the defaults; `CKPTD_*` variables apply): its patterns and world
    sizes decide what is complete. No quiet period is waited out (the job being restarted is the
    writer); an observer choosing while training still runs passes `quiet_period` (seconds, e.g.
    60), so that a save in progress is not named. `by="time"` takes the one written last rather
    than the highest step. Each newer checkpoint passed over is logged at WARNING with why; where
    the run holds checkpoints but none can be resumed from, that is logged at WARNING and None
    returned, or `NothingToResumeError` raised with `strict=True` (a run with no checkpoints at
    all is a first start: None, logged at INFO). Raises `ckptd.errors.CkptdError` for a missing
    directory, a bad config, or a directory that is a checkpoint or holds several runs.
    """
    found = find_latest(run_dir, config=config, by=by, quiet_period=quiet_period)
    for c, why in found.passed_over:
        log.warning("ckptd.latest: passed over %s: %s", found.rel(c), why)
    if found.note:
        log.warning("ckptd.latest: note: %s", found.note)
    if found.checkpoint is None:
        if found.seen and strict:
            raise NothingToResumeError(found)
        level = logging.WARNING if found.seen else logging.INFO
        log.log(level, "ckptd.latest: %s: nothing to resume from: %s", found.run_dir, found.why_none)
    return found.path


def find_latest(
    run_dir: str | os.PathLike[str],
    *,
    config: Config | str | os.PathLike[str] | None = None,
    by: str = "step",
    quiet_period: float | None = None,
    now: float | None = None,
    env: Mapping[str, str] | None = None,
) -> Latest:
    """`latest`, with what was passed over and why (`ckptd latest` prints it). `quiet_period`
    None waits out none (`RESUME_QUIET`), whatever the config says: see the module's doc."""
    if by not in BY:
        raise UsageError(f"by must be one of {', '.join(BY)} (got {by!r})")
    path = Path(os.path.abspath(run_dir))
    if not path.is_dir():
        raise RootMissingError(f"{run_dir}: no such directory")
    _refuse_a_checkpoint(path)
    root = _root(path, config, os.environ if env is None else env)
    quiet = RESUME_QUIET if quiet_period is None else float(quiet_period)
    root = root.model_copy(update={"quiet_period": quiet})
    rel = root.scope[0] if root.scope else "."
    scanner = Scanner(root)
    runs = _the_run(path, find_runs(path, max_depth=root.max_depth, patterns=scanner.patterns))
    now = time.time() if now is None else now
    ckpts: list[Checkpoint] = []
    for d in runs:
        where = _join(rel, d.rel)
        ckpts += scanner.inspect_run(RunDir(root.path, where, d.names, d.candidates), now=now).checkpoints
    return choose(path, ckpts, by=by)


def choose(run_dir: Path, ckpts: list[Checkpoint], *, by: str = "step") -> Latest:
    """The newest complete, full checkpoint of `ckpts` (by step, or by time written); pure."""
    key = Checkpoint.sort_key if by == "step" else _written_key
    resumable = [c for c in ckpts if c.state is State.COMPLETE and not c.slimmed]
    # Where the job writes commit records (ckptd.attest), a complete save without them is not its
    # own (a copy-in, or a save made without the hook): the attested ones are preferred.
    attested = [c for c in resumable if committed_summary(c.checks)]
    unattested = {id(c) for c in resumable if attested and c not in attested}
    resumable = attested or resumable
    chosen = max(resumable, key=key) if resumable else None
    newer = sorted((c for c in ckpts if chosen is None or key(c) > key(chosen)), key=key, reverse=True)
    passed = tuple(
        (c, UNATTESTED if id(c) in unattested else why_not(c)) for c in newer if c not in resumable
    )
    if chosen is None:
        if not ckpts:
            why = f"no checkpoints in {run_dir} (none that ckptd recognises)"
        else:
            shown = "; ".join(f"{_rel(run_dir, c)}: {w}" for c, w in passed[:3])
            more = f"; and {len(passed) - 3} more" if len(passed) > 3 else ""
            why = f"none of its {len(ckpts)} checkpoints is complete and full: {shown}{more}"
        return Latest(run_dir, None, passed, why_none=why, seen=len(ckpts))
    note = None
    other = max(resumable, key=_written_key if by == "step" else Checkpoint.sort_key)
    if other is not chosen:
        if by == "step":
            note = (
                f"{_rel(run_dir, other)} (step {other.step_label}) was written after "
                f"{_rel(run_dir, chosen)}: a new job in this directory, or a rollback? Naming the highest "
                "step; --by time names the one written last"
            )
        else:
            note = (
                f"{_rel(run_dir, other)} has a higher step than {_rel(run_dir, chosen)}, which was written "
                "last (--by time)"
            )
    return Latest(run_dir, chosen, passed, note=note, seen=len(ckpts))


UNATTESTED = (
    "complete, but without the commit records this run's other saves have "
    "(a copy-in, or saved without ckptd.attest?)"
)


def why_not(c: Checkpoint) -> str:
    """Why a checkpoint cannot be resumed from, in a line."""
    if c.state is State.COMPLETE and c.slimmed:
        return "slimmed by ckptd (weights only: its optimizer state is gone)"
    problem = deciding_check(c.checks)
    return f"{c.state}: {problem.name} {problem.verdict}: {problem.detail}" if problem else str(c.state)


def _rel(run_dir: Path, c: Checkpoint) -> str:
    return os.path.relpath(c.path, run_dir)


def _written_key(c: Checkpoint) -> tuple[float, int, str]:
    return (c.written_at, c.step, c.name)


def _root(path: Path, config: Config | str | os.PathLike[str] | None, env: Mapping[str, str]) -> Root:
    """The root `path` belongs to: a configured one (restricted to `path`), else the defaults."""
    if isinstance(config, Config):  # the configured root holding it, as for a config file (`mounts.holder`)
        found = mounts.holder(path, ((root.path, root) for root in config.roots))
        if found is not None:
            rel, root = found
            return root.restricted((rel,))
        return Root(path=path)
    file = Path(config) if config is not None else find_config(None)
    return effective_config(file, env, [path], checks=CONFIG_CHECKS).roots[0]


def _refuse_a_checkpoint(path: Path) -> None:
    """A checkpoint named as RUN_DIR would make its insides look like checkpoints (a Trainer
    checkpoint's global_step directory): name the run."""
    try:
        cand = layouts.recognise(path.name, True, lambda: os.listdir(path))
    except OSError:
        cand = None
    if cand is not None:
        raise UsageError(f"{path} is a checkpoint ({cand.layout}): name the run directory that holds it")


def _the_run(path: Path, found: list[RunDir]) -> list[RunDir]:
    """The run `path` names: itself when it holds checkpoints, else the one run below it, which may
    be several directories of one run key (`frameworks.run_key`: Lightning's version_0,
    version_1... of one experiment, a resumed fit writing into a new version directory), taken
    together as retention takes them (`planner.experiments`)."""
    if not found:
        return []
    here = [d for d in found if d.rel == "."]
    if here:
        return here
    keys = sorted({frameworks.run_key(d.rel) for d in found})
    if len(keys) == 1:
        return found
    names = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    raise UsageError(f"{path} holds {len(keys)} runs ({names}): name one of them")


def _join(rel: str, sub: str) -> str:
    if sub == ".":
        return rel
    return sub if rel == "." else f"{rel}/{sub}"
