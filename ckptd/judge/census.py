"""A run's censuses: what one checkpoint must hold that the run's other checkpoints show, beyond what
it shows by itself (evidence.py). No fewer ranks' files than the run showed before it
(`against_siblings`), and no kind of file missing that every earlier complete checkpoint has
(`against_sibling_kinds`); `with_sibling_census` takes a run's checkpoints through both. Pure:
the checkpoints in, the checkpoints out, with a failed or unknown check added."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ckptd.model import Check, Checkpoint, State, Verdict

FAILED, UNKNOWN = Verdict.FAILED, Verdict.UNKNOWN

RANK_CENSUS = "rank census"


def against_siblings(c: Checkpoint, siblings: Iterable[Checkpoint]) -> Checkpoint:
    """`c`, made incomplete if it has fewer per-rank files than the run showed before it.

    Without a known world size a census can only ask that ranks 0..n-1 be there: a DDP job
    of 8 killed before rank 7's `rng_state_7.pth` passes it. The run's own history knows
    better: the newest complete checkpoint saved before `c` counted its ranks too. Fewer
    now means a rank is missing, or the job shrank: then set `world_size` for the run;
    until then the checkpoint is kept and says why (never the other way round).

    With no complete checkpoint saved before it (the one before is being written again, or an
    eval job writes into it), what the run showed before still counts: the rank files of each
    checkpoint of a lower step, whatever its state (`_against_earlier_steps`).
    """
    if c.ranks is None:
        return c
    order = (c.saved_at, c.step)  # saved earlier; by step where the times tie (a copy that reset them)
    others = [s for s in siblings if s.name != c.name]
    earlier = [
        s
        for s in others
        if s.ranks is not None and s.state is State.COMPLETE and (s.saved_at, s.step) < order
    ]
    if not earlier:
        return _against_earlier_steps(c, [s for s in others if s.step < c.step])
    last = max(earlier, key=lambda s: (s.saved_at, s.step))
    if last.ranks is None or last.ranks <= c.ranks:
        return c
    why = (
        f"{c.ranks} ranks' files, the run's last complete checkpoint {last.name} has {last.ranks}: "
        "a rank is missing, or the job shrank (then set world_size for this run)"
    )
    return replace(c, checks=(*c.checks, Check(RANK_CENSUS, FAILED, why)))


def _against_earlier_steps(c: Checkpoint, before: list[Checkpoint]) -> Checkpoint:
    """`against_siblings` where no complete checkpoint was saved before `c`: `before` are the run's
    checkpoints of a lower step, in any state. One of them with more ranks' files makes `c`
    incomplete; one being written whose rank files cannot be counted leaves `c`'s rank count
    unknown (not complete): the rank files it would show are the ones to count against."""
    counted = [s for s in before if s.ranks is not None]
    if counted and c.ranks is not None:
        most = max(counted, key=lambda s: (s.ranks or 0, s.step))
        if most.ranks is not None and most.ranks > c.ranks:
            why = (
                f"{c.ranks} ranks' files, the run's earlier checkpoint {most.name} ({most.state}) has "
                f"{most.ranks}: a rank is missing, or the job shrank (then set world_size for this run)"
            )
            return replace(c, checks=(*c.checks, Check(RANK_CENSUS, FAILED, why)))
        return c
    writing = [s for s in before if s.state in (State.WRITING, State.SETTLING)]
    if not writing:
        return c
    other = max(writing, key=lambda s: s.step)
    why = (
        f"{c.ranks} ranks' files, and no complete checkpoint of the run to count them against "
        f"({other.name} is {other.state}, its rank files not all there): the rank count is unknown "
        "until it is complete, or set world_size for this run"
    )
    return replace(c, checks=(*c.checks, Check(RANK_CENSUS, UNKNOWN, why)))


def with_sibling_census(ckpts: Iterable[Checkpoint]) -> list[Checkpoint]:
    """Every checkpoint of a run through `against_siblings`, oldest save first, so that one made
    incomplete no longer counts as a complete sibling for the next."""
    done: list[Checkpoint] = []
    for c in sorted(ckpts, key=lambda c: (c.saved_at, c.step, c.name)):
        done.append(against_sibling_kinds(against_siblings(c, done), done))
    return done


FILE_CENSUS = "file census"


def against_sibling_kinds(c: Checkpoint, siblings: Iterable[Checkpoint]) -> Checkpoint:
    """`c`, made incomplete if it lacks a kind of file (`Checkpoint.kinds`, its framework's) that
    every complete checkpoint of the run saved before it has: a save's optimizer.bin that never
    arrived looks, from inside the checkpoint, like a run that prepared no optimizer. A run that
    really stopped saving one (the Trainer resumed with save_only_model) is held, saying why."""
    if c.kinds is None:
        return c
    order = (c.saved_at, c.step)
    earlier = [
        s for s in siblings
        if s.name != c.name and s.kinds is not None and s.state is State.COMPLETE
        and (s.saved_at, s.step) < order
    ]
    if not earlier:
        return c
    missing = sorted(frozenset.intersection(*(s.kinds for s in earlier if s.kinds is not None)) - c.kinds)
    if not missing:
        return c
    last = max(earlier, key=lambda s: (s.saved_at, s.step))
    why = (
        f"{', '.join(missing)} missing, which every complete checkpoint of the run before it has "
        f"(the last: {last.name}): a file that never arrived, or the job stopped saving it"
    )
    return replace(c, checks=(*c.checks, Check(FILE_CENSUS, FAILED, why)))
