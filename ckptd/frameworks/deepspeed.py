"""DeepSpeed's own checkpoints: `global_step<N>/` beside the `latest` tag pointer.

`engine.save_checkpoint(save_dir, tag)` writes every rank's optimizer shard
(`[bf16_]zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt`) and the model states (`mp_rank_<m>_model_states.pt`,
one per data-parallel rank under ZeRO-3) into `<save_dir>/<tag>/`, and rank 0 writes `latest`
before the other ranks finish: `latest` is a resume pointer, never completeness evidence. The
census (every rank's shard, the world sizes from the model states' own metadata, remembered by the
engine while the file is the same) is `census` here; the frameworks that save through DeepSpeed (the
Trainer, accelerate, Lightning's DeepSpeedStrategy) ask for it on their tags (`Save.deepspeed`).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from ckptd.formatting import format_age
from ckptd.frameworks import dsmeta
from ckptd.frameworks.base import (
    CONSOLIDATED,
    FAILED,
    MTIME_SLACK,
    PASSED,
    UNKNOWN,
    Evidence,
    Framework,
    MemoryKind,
    OrderProblems,
    Save,
    pointer_target,
    run_pointer,
    write_span,
)
from ckptd.model import Candidate, Check, Entry
from ckptd.volume import mounts, volread

LAYOUT = "deepspeed"
_NAME = re.compile(r"global_step(\d+)")  # engine.save_checkpoint's default tag: f"global_step{global_steps}"

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
DS_FILE = re.compile(r"(?:[^/]+/)?(?:bf16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt")
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


# zero_to_fp32 (deepspeed/utils/zero_to_fp32.py) reads the model states and the optimizer shards of one
# tag, of mp_rank_00 only, and knows nothing of pipeline layer files.
_MODEL_STATES_0 = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_MODEL_PARALLEL = re.compile(r".*mp_rank_(?!00_)\d+_.*\.pt")
_PIPELINE_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def consolidation_problem(tag: str, names: Collection[str]) -> str | None:
    """Why zero_to_fp32 cannot consolidate the tag directory `tag` holding `names`, or None."""
    if not set(names) & set(_MODEL_STATES_0):
        return f"no model states in {tag} to consolidate from"
    if any(_MODEL_PARALLEL.fullmatch(n) for n in names):
        return "model-parallel shards (mp_rank_01...): zero_to_fp32 consolidates mp_rank_00 only"
    if any(_PIPELINE_LAYER.fullmatch(n) for n in names):
        return "pipeline-parallel layer files: zero_to_fp32 cannot consolidate them"
    return None


def model_states_file(files: Collection[str], inside: str) -> str:
    """The model-states file zero_to_fp32 is pointed at, in the tag directory `inside` ("" or "<tag>/")."""
    model = _MODEL_STATES_0[0]
    return model if f"{inside}{model}" in files else _MODEL_STATES_0[1]


def zero_to_fp32_reads(name: str) -> bool:
    return name.endswith(("model_states.pt", "optim_states.pt"))


def global_step_dirs(files: dict[str, Entry]) -> list[str]:
    return sorted(
        rel
        for rel, e in files.items()
        if e.kind == "d" and "/" not in rel and re.fullmatch(r"global_step\d+", rel)
    )


def deepspeed_tag_dirs(files: dict[str, Entry]) -> list[str]:
    """Top-level directories holding DeepSpeed model states (accelerate names its tag `pytorch_model`)."""
    return sorted(
        {rel.partition("/")[0] for rel in files if rel.count("/") == 1 and rel.endswith("model_states.pt")}
    )


class DeepSpeed(Framework):
    layout = LAYOUT
    named_alone = True
    names_first = True
    slim_weights = (CONSOLIDATED,)  # only what ckptd consolidates from its shards
    checkpoint_is_tag = True

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = _NAME.fullmatch(name) if is_dir else None
        return Candidate(name, int(m[1]), LAYOUT, True) if m else None

    def evidence(self, save: Save) -> Evidence:
        return Evidence([census(save, "")[0]])

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return [""]

    def slim_keeps(self, name: str) -> bool:
        return name.endswith("model_states.pt")  # what zero_to_fp32 and a resume need besides the shards

    def consolidation_source(self, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
        problem = consolidation_problem(name, {rel for rel in files if rel and "/" not in rel})
        return (None, problem) if problem else (name, None)

    def consolidation_paths(self, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
        return ".", name, f"{name}/{model_states_file(files, '')}"  # the tag's save_dir is the run directory

    def consolidation_reads(self, name: str) -> bool:
        return zero_to_fp32_reads(name)

    def save_file(self, rel: str) -> bool:
        return bool(DS_FILE.fullmatch(rel))

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return latest_pointer(run_path, names)


FRAMEWORK = DeepSpeed()


# --- the shard census ----------------------------------------------------------------------


def _world_sizes(save: Save, gs: str, stage3: bool) -> dsmeta.WorldSizes | str:
    """World sizes from the model-states file, else from config; or why not."""
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else "mp_rank_00_model_states.pt"
    rel = f"{gs}/{name}" if gs else name
    entry = save.files.get(rel)
    if entry is not None:
        ckpt = save.path

        def read() -> dsmeta.WorldSizes | str:
            try:
                return dsmeta.read_world_sizes(ckpt / rel)
            except dsmeta.MetadataUnavailable as exc:
                return str(exc)

        found = save.remembered(MemoryKind.WORLD, entry, read)  # an OSError: the volume is failing
        if isinstance(found, dsmeta.WorldSizes):
            return found
        why = found
    else:
        why = f"{name} missing"
    if save.world_size is not None:
        return dsmeta.WorldSizes(save.world_size, save.mp_world_size, None, "config world_size")
    return why  # type: ignore[return-value]


def census(save: Save, gs: str) -> tuple[Check, dsmeta.WorldSizes | None]:
    """The shard census of one `global_step*` directory (`gs`; "" for the checkpoint itself).

    Optimizer shards that a slim marker lists as `removed` are not demanded.
    """
    name = f"deepspeed shards{f' ({gs})' if gs else ''}"
    here, slimmed = _present(save.files, save.removed, gs)
    here_or_slimmed = here | slimmed
    stage3 = any(_ZERO3_MODEL.fullmatch(n) for n in here)
    sizes = _world_sizes(save, gs, stage3)
    if isinstance(sizes, str):
        if not here - {""}:
            return Check(name, FAILED, f"{gs or 'directory'} is empty"), None
        return Check(name, UNKNOWN, f"cannot count shards: {sizes}"), None
    # Optimizer shards are expected from what the checkpoint itself shows: ZeRO-3 names, a
    # ZeRO stage or bf16 in the saved ds_config, the model states' own structure
    # (`WorldSizes.shards`: a ds_config saved as a path says nothing), or any shard present.
    shard_present = any(_OPTIM.fullmatch(n) for n in here_or_slimmed)
    bf16 = any(n.startswith("bf16_zero_pp_rank_") for n in here_or_slimmed) or (
        not shard_present and bool(sizes.bf16)
    )
    zero = stage3 or (sizes.stage or 0) > 0 or sizes.shards or shard_present
    expected = _expected(sizes, stage3, zero, bf16)
    missing = [n for n in expected if n not in here_or_slimmed]
    origin = f"dp_world_size={sizes.dp}, mp_world_size={sizes.mp} from {sizes.source}"
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return Check(name, FAILED, f"{shown} missing ({origin})"), sizes
    if (mixed := _partitions_differ(save, gs, here)) is not None:
        return Check(name, FAILED, f"files from two saves: {mixed} ({origin})"), sizes
    present = len(expected) - len(slimmed & set(expected))
    gone = (
        f", {len(expected) - present} optimizer shards removed by slimming"
        if present < len(expected)
        else ""
    )
    kind = _zero_kind(sizes, stage3, zero)
    return Check(name, PASSED, f"{present}/{len(expected)} files present{gone}, {kind} ({origin})"), sizes


# A torch.save zip keeps each tensor's storage as its own member, `<archive>/data/<key>`.
_STORAGE = re.compile(r"[^/]+/data/\d+")


def tensor_bytes(path: Path) -> int | str:
    """The bytes of every tensor a torch.save zip holds (its storage members, from the zip's central
    directory: no tensor is read), or why they cannot be counted."""
    try:
        with volread.open_file(path) as f, zipfile.ZipFile(f) as zf:
            members = zf.infolist()
    except volread.NotRegularFile as exc:
        return str(exc)
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        return f"not a readable zip: {exc}"
    return sum(m.file_size for m in members if _STORAGE.fullmatch(m.filename))


def _partitions_differ(save: Save, gs: str, here: set[str]) -> str | None:
    """Whether the optimizer shards of one model-parallel rank come from saves of different models:
    every data-parallel rank's partition of one save is the same size (DeepSpeed pads the flat groups
    to a multiple of the data-parallel world: stage_1_and_2.py, stage3.py), so their shards hold the
    same bytes of tensors. A re-save of the tag in place by a job with another model, one of whose
    ranks died before its files, leaves shards of two sizes beside each other (rank 0's old model
    states and shard, rank 1's new shard: newer, so no order says so). Counted from each shard's zip
    directory, remembered while the file is the same; a shard that cannot be counted says nothing
    here (the integrity check speaks of it). Only shards that ended more than `MTIME_SLACK` apart
    are counted: a job restarts and reaches its save again in more time than that, so shards that
    close are one save's (and most saves cost no read here)."""
    prefix = f"{gs}/" if gs else ""
    by_mp: dict[int, dict[int, str]] = {}
    for n in here:
        if (o := _OPTIM.fullmatch(n)) is not None:
            by_mp.setdefault(int(o[3]), {})[int(o[2])] = n
    for shards in by_mp.values():
        times = [save.files[prefix + n].mtime_ns for n in shards.values()]  # `here` is from the files
        if len(shards) < 2 or max(times) - min(times) <= MTIME_SLACK * 1e9:
            continue
        counted: dict[int, str] = {}  # bytes of tensors -> the lowest rank's shard holding that many
        for _, n in sorted(shards.items()):
            rel = prefix + n
            found = save.remembered_file(rel, lambda rel=rel: tensor_bytes(save.path / rel))
            if isinstance(found, int):
                counted.setdefault(found, rel)
        if len(counted) > 1:
            (a, ra), (b, rb) = list(counted.items())[:2]
            return (
                f"{ra} holds {a:,} bytes of tensors and {rb} {b:,}: every rank's partition of one save "
                "is the same size (a re-save in place by another model, a rank of which died?)"
            )
    return None


def _present(files: Mapping[str, Entry], removed: frozenset[str], gs: str) -> tuple[set[str], set[str]]:
    """The names directly in the tag directory `gs` ("" for the checkpoint itself; "" names it),
    and the optimizer shards a slim marker lists as removed that are not there."""
    prefix = f"{gs}/" if gs else ""
    # A FIFO, socket or device named like a shard is not one (nothing can load it, and the
    # consolidator would block reading it): only files, or links to them, are present.
    here = {
        rel[len(prefix) :]
        for rel, e in files.items()
        if rel.startswith(prefix)
        and "/" not in rel[len(prefix) :]
        and (e.kind in ("f", "l") or rel == gs)
    }
    slimmed = {
        n
        for rel in removed
        if rel.startswith(prefix) and _OPTIM.fullmatch(n := rel[len(prefix) :]) and n not in here
    }
    return here, slimmed


def _expected(sizes: dsmeta.WorldSizes, stage3: bool, zero: bool, bf16: bool) -> list[str]:
    """The files one save of these world sizes writes into its tag directory: the model states
    (ZeRO-3's one per data-parallel rank), and each rank's optimizer shard under ZeRO."""
    expected: list[str] = []
    for m in range(sizes.mp):
        if stage3:
            expected += [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(sizes.dp)]
        else:
            expected.append(f"mp_rank_{m:02d}_model_states.pt")
        if zero:
            opt = "bf16_" if bf16 else ""
            expected += [
                f"{opt}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt" for r in range(sizes.dp)
            ]
    return expected


def _zero_kind(sizes: dsmeta.WorldSizes, stage3: bool, zero: bool) -> str:
    if stage3:
        return "ZeRO-3"
    if sizes.stage is not None:
        return f"ZeRO-{sizes.stage}"
    return "ZeRO" if zero else "no ZeRO"


def shard_order(files: Mapping[str, Entry], tags: Iterable[str]) -> tuple[bool, OrderProblems]:
    """For one save's order (`evidence.one_save`), in each tag directory (`tags`, "" for the
    checkpoint itself): each rank's optimizer shard not older than the model states its process
    wrote before it (engine.py save_checkpoint: _save_checkpoint, then _save_zero_checkpoint), and
    no shard of another rank older than rank 0's model states by more than writing them can have
    taken (`write_span` of their size). DeepSpeed 0.19's save_checkpoint has no barrier between
    rank 0's model states and the other ranks' shards (_create_zero_checkpoint_files only makes the
    directory), so every rank starts its shard as rank 0 starts the model states, and a shard can end
    before them by at most their write time; one older than that is from an earlier save of the tag
    (a re-save in place whose rank died before its shard). `files`: the trainer's (ckptd's own left
    out). Returns whether any shard had model states to tell by, and
    the problems."""
    checked, problems = False, []
    for tag in tags:
        prefix = f"{tag}/" if tag else ""
        here = {
            rel[len(prefix) :]: e for rel, e in files.items() if rel.startswith(prefix) and e.kind == "f"
        }
        # (dp rank or None, mp rank) -> its model states: ZeRO-3's per rank, else mp_rank_XX's
        states = {
            (int(m[1]) if m[1] is not None else None, int(m[2])): (m[0], e)
            for n, e in here.items()
            if (m := _MODEL_STATES.fullmatch(n))
        }
        for name, shard in here.items():
            if not (o := _OPTIM.fullmatch(name)):
                continue
            rank, mp = int(o[2]), int(o[3])
            # The model states the same process wrote just before this shard (ZeRO-3's own, or
            # mp_rank_XX's, written by data-parallel rank 0), else rank 0's: one lookup a shard.
            found = states.get((rank, mp)) or states.get((None, mp))
            if found is None:
                continue
            checked = True
            ms_name, e = found
            same = (rank, mp) in states or rank == 0
            gap = (e.mtime_ns - shard.mtime_ns) / 1e9
            if gap > (MTIME_SLACK if same else write_span(e.size)):
                who = "the same rank" if same else "DeepSpeed"
                why = (
                    f"rank {rank}'s shard {prefix}{name} is {format_age(gap)} older than {prefix}{ms_name}, "
                    f"which {who} writes before it"
                )
                problems.append((gap, why))
    return checked, problems


# --- the resume pointer `latest` -----------------------------------------------------------

LATEST = "latest"


def latest_pointer(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """What DeepSpeed's `latest` names (the tag `load_checkpoint` loads; a user rolls it back to
    resume from an earlier one), read as engine.py load_checkpoint reads it: `os.path.join(load_dir,
    tag)` (`pointer_target`), so `global_step10/`, `./global_step10` and the absolute path all name
    global_step10. Rank 0 writes it before the other ranks finish: not completeness evidence, but
    never deleted. One that is there but cannot be read (a FIFO, EACCES, EIO, longer than a pointer
    can be) may name any checkpoint of the run: every one is named by it, kept until it can be read."""
    found: dict[str, str] = {}
    if LATEST not in names:
        return found
    label = "DeepSpeed's latest"
    text = run_pointer(found, run_path, LATEST, names, label)
    if text is None:
        return found
    named, why = pointer_target(run_path, text), label
    if not named and os.path.isabs(text):
        named, why = _absolute_elsewhere(run_path, text, names, label)
    for name in named:
        found.setdefault(name, why)
    return found


def _absolute_elsewhere(
    run_path: Path, text: str, names: Collection[str], label: str
) -> tuple[set[str], str]:
    """What an absolute `latest` that does not resolve inside the run names here. Another host
    may mount the volume at another path (the trainer's node writes /data/ckpt/run/global_step10,
    this one sees /vol/run): through a mount of the same directory seen here (a bind
    mount: `mounts.located_in`), the run's entry it lies in; an existing directory elsewhere, not
    this run's, nothing here; otherwise a last component naming one of the run's entries names it,
    and any other cannot be told: it may name any checkpoint here, as an unreadable pointer."""
    target = os.path.normpath(text)
    rel = mounts.located_in(target, run_path)
    if rel is not None:
        return ({rel.split("/", 1)[0]} if rel != "." else set()), label
    if os.path.isdir(target):
        return set(), label  # a directory of its own, elsewhere: DeepSpeed loads that, not ours
    name = os.path.basename(target)
    if name in names and name != LATEST:
        return {name}, f"{label} (an absolute path not seen here, taken to name its last component {name})"
    why = f"{label} ({target[:200]!r} is not seen here; it may name any checkpoint here)"
    return set(names), why
