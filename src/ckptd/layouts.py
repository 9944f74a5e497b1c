"""Recognising checkpoints by name and shape.

Pure: each function gets names (an entry, its siblings, its children) and
answers whether it is a checkpoint, of which layout, at which step. Anything
not recognised here is never touched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

HF = "hf"  # Hugging Face Trainer: checkpoint-<step>/
DEEPSPEED = "deepspeed"  # bare DeepSpeed: global_step<step>/ beside `latest`
MEGATRON = "megatron"  # Megatron-LM: iter_<step:07d>/ + latest_checkpointed_iteration.txt
DCP = "dcp"  # torch.distributed.checkpoint: a directory of *.distcp + .metadata
ORBAX = "orbax"  # Orbax: [<prefix>_]<step>/, in progress as <that>.orbax-checkpoint-tmp*
TORCHTITAN = "torchtitan"  # torchtitan: <dump>/checkpoint/step-<N>/ (DCP, or its last save in HF format)
LIGHTNING = "lightning"  # Lightning's ModelCheckpoint: epoch=E-step=S[-val_loss=V].ckpt
NEMO = "nemo"  # NeMo: <name>--val_loss=V-epoch=E[-step=S].ckpt/.nemo, or a distributed-checkpoint dir
ACCELERATE = "accelerate"  # accelerate's save_state(): checkpoint_<n>/, step_<n>/, epoch_<n>/
PATTERN = "pattern"  # a user pattern such as ckpt_{step}

# What a checkpoint's number counts, when it is not a training step (`Candidate.unit`): ckptd
# orders a run by it, then by time, and says so in `plan`.
STEP = "step"
EPOCH = "epoch"  # a Lightning/NeMo name without a step: `epoch=3-val_loss=0.52.ckpt`, accelerate's epoch_<n>
CONSUMED_SAMPLES = "consumed_samples"  # NeMo 2 under Megatron: `...-epoch=0-consumed_samples=8000.0`
SAVE = "save"  # accelerate's automatic naming: checkpoint_<n> counts saves, not steps

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
NEMO_UNFINISHED_SUFFIX = "-unfinished"
ORBAX_TMP = ".orbax-checkpoint-tmp"
PIN_FILE = ".ckptd-keep"
TRASH_DIR = ".ckptd-trash"
# A checkpoint renamed into its root when the trash could not be made (a full disk): purged as trash
HIDDEN_TRASH = f"{TRASH_DIR}."
LEASE_DIR = ".ckptd"  # the volume lease (lease.py)

_HF = re.compile(r"checkpoint-(\d+)")
_DEEPSPEED = re.compile(r"global_step(\d+)")
_MEGATRON = re.compile(r"iter_(\d{7,})")
# Orbax's step names (orbax/checkpoint/_src/path/step.py: `<step_prefix>_<step>`, the step
# zero-padded to step_format_fixed_length if set) and its tmp directories (`TMP_DIR_STEP_PATTERN`).
_ORBAX = re.compile(r"(?:.+_)?(\d+)")
_ORBAX_TMP = re.compile(r"(?:.+_)?(\d+)\.orbax-checkpoint-tmp.*")
_TORCHTITAN = re.compile(r"step-(\d+)")  # torchtitan/components/checkpoint.py _create_checkpoint_id
TORCHTITAN_HF_INDEX = "model.safetensors.index.json"  # its last save in HF format (last_save_in_hf)
# Lightning names a file from its template's fields, `name=value` joined by '-'
# (ModelCheckpoint._format_checkpoint_name, auto_insert_metric_name); NeMo's default template is
# `{name}--{monitor:.4f}-{epoch}` (+ `-{step}` or `-{consumed_samples}`). A field follows the
# start or a '-': `warmup_step=100` in a Hydra sweep directory (`lr=0.1,warmup_step=100`) is not
# a step. Values are numbers as Python formats them (`-0.40`, `1e-05`, `8000.0`, `nan`, `inf`).
_FIELD = re.compile(
    r"(?:^|-)([A-Za-z_][A-Za-z0-9_.]*)=(-?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))(?=-|$)"
)
# Lightning's `last.ckpt` (save_last; `last-v1.ckpt` on a clash; a CHECKPOINT_NAME_LAST template
# such as `{epoch}-last`) and NeMo's `<name>--...-last` copies: rewritten in place or renamed
# each save, never a step of their own. A resume takes them (Lightning's ckpt_path="last",
# NeMo's resume_if_exists): ckptd never counts them and never deletes them.
_LAST_COPY = re.compile(r"(?:.*-)?last(?:-v\d+)?")
LAST_COPY_NOTE = (
    "a last copy (Lightning's last.ckpt, NeMo's -last): rewritten or renamed at every save and what a "
    "resume from 'last' loads; not a step: ckptd never counts it and never deletes it"
)
# Directories frameworks make on the way to their checkpoints; discovery does not count them
# against max_depth: Lightning's `lightning_logs/version_<N>/checkpoints/`, NeMo 2's
# `<name>/<%Y-%m-%d_%H-%M-%S>/checkpoints/`, torchtitan's `checkpoint/`, accelerate's `checkpoints/`.
_FRAMEWORK_DIR = re.compile(r"lightning_logs|version_\d+|checkpoints?|\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")
# A model-parallel rank's own directory beside its siblings: NeMo 1 without a distributed
# checkpoint saves each rank's file as <dir>/mp_rank_<tp:02d>/<name>.ckpt, or
# <dir>/tp_rank_<tp:02d>_pp_rank_<pp:03d>/<name>.ckpt with pipeline parallelism, and with an FSDP
# sharded checkpoint <dir>/mp_rank_<tp:02d>_fsdp_shard_<dp:05d>/ or (no model parallelism)
# <dir>/fsdp_shard_<dp:05d>/, under ONE unfinished marker <dir>/<name>-unfinished
# (nemo/utils/app_state.py and get_rank.py inject_model_parallel_rank, uninjected by
# nemo_model_checkpoint.py format_checkpoint_unfinished_marker_path); Megatron-LM's
# mp_rank_<tp:02d>[_<pp:03d>] likewise.
_RANK_DIR = re.compile(r"mp_rank_\d+(?:_\d+)?(?:_fsdp_shard_\d+)?|tp_rank_\d+_pp_rank_\d+|fsdp_shard_\d+")

# Files Orbax writes into a finalized step directory.
ORBAX_METADATA = "_CHECKPOINT_METADATA"
ORBAX_COMMIT = "commit_success.txt"
_ORBAX_MARKERS = frozenset({ORBAX_METADATA, ORBAX_COMMIT})

# accelerate's Accelerator.save_state(): `checkpoint_<n>` with automatic_checkpoint_naming (a
# save counter), `step_<n>`/`epoch_<n>` as its examples name them; recognised by the files
# only it writes (accelerate/checkpointing.py save_accelerator_state: models, then
# optimizer.bin, scheduler.bin, sampler.bin, scaler.pt, and random_states_<process>.pkl last).
_ACCELERATE = re.compile(r"(?:checkpoint|step|epoch)_(\d+)")
_ACCELERATE_MARKER = re.compile(
    r"(?:optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin|random_states_\d+\.pkl|scaler\.pt"
)


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int  # what the run is ordered by: a training step, unless `unit` says otherwise
    layout: str
    is_dir: bool
    in_progress: bool = False  # the layout's own "not finished" name (Orbax tmp)
    pattern: int | None = None  # which of the root's patterns matched (PATTERN layout)
    unit: str = STEP  # what `step` counts: STEP, EPOCH, CONSUMED_SAMPLES or SAVE


def name_fields(name: str) -> dict[str, str]:
    """The `name=value` fields of a Lightning or NeMo checkpoint name, extension removed:
    `epoch=3-step=40-val_loss=0.52.ckpt` -> {'epoch': '3', 'step': '40', 'val_loss': '0.52'}."""
    stem = name.removesuffix(".ckpt").removesuffix(".nemo")
    return {m[1]: m[2] for m in _FIELD.finditer(stem)}


def is_last_copy(name: str) -> bool:
    """Lightning's `last.ckpt` or a NeMo `-last` copy: not a step of its own (see _LAST_COPY)."""
    return bool(_LAST_COPY.fullmatch(name.removesuffix(".ckpt").removesuffix(".nemo")))


def is_rank_dir(name: str) -> bool:
    """One model-parallel rank's directory (`mp_rank_00`, `tp_rank_00_pp_rank_000`, NeMo's FSDP
    `mp_rank_00_fsdp_shard_00000` and `fsdp_shard_00000`): its checkpoints
    are parts of checkpoints whose other parts are in its sibling rank directories."""
    return bool(_RANK_DIR.fullmatch(name))


def is_framework_dir(name: str) -> bool:
    """A directory a framework makes on the way to its checkpoints (not counted against max_depth)."""
    return bool(_FRAMEWORK_DIR.fullmatch(name))


def _order_from_fields(fields: dict[str, str]) -> tuple[int, str] | None:
    """What a Lightning/NeMo name orders by: its step, else NeMo's consumed samples, else its epoch
    (then time, within one epoch)."""
    for key, unit in (("step", STEP), ("consumed_samples", CONSUMED_SAMPLES), ("epoch", EPOCH)):
        value = fields.get(key)
        if value is not None and re.fullmatch(r"\d+(?:\.0*)?", value):
            return int(value.partition(".")[0]), unit
    return None


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`ckpt_{step}` -> a regex matching the whole name, the step captured."""
    before, after = pattern.split("{step}")
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


def recognise_by_name(
    name: str, is_dir: bool, patterns: Collection[re.Pattern[str]] = ()
) -> Candidate | None:
    """Layouts that a name alone identifies."""
    if is_dir:
        for regex, layout in ((_HF, HF), (_DEEPSPEED, DEEPSPEED), (_MEGATRON, MEGATRON)):
            if m := regex.fullmatch(name):
                return Candidate(name, int(m[1]), layout, is_dir)
        if m := _ORBAX_TMP.fullmatch(name):
            return Candidate(name, int(m[1]), ORBAX, is_dir, in_progress=True)
    for i, regex in enumerate(patterns):
        if m := regex.fullmatch(name):
            return Candidate(name, int(m[1]), PATTERN, is_dir, pattern=i)
    if not is_dir and (cand := _registry().recognise_file(name)) is not None:
        return cand  # a file a framework module claims by its suffix (frameworks.recognise_file)
    if not (is_dir or name.endswith((".ckpt", ".nemo"))):
        return None
    if name.endswith(NEMO_UNFINISHED_SUFFIX) or is_last_copy(name):
        return None
    order = _order_from_fields(name_fields(name))
    if order is None:
        return None
    # NeMo's names carry `<name>--`; its distributed checkpoints are directories, its archives .nemo.
    layout = NEMO if is_dir or name.endswith(".nemo") or "--" in name else LIGHTNING
    return Candidate(name, order[0], layout, is_dir, unit=order[1])


def recognise_by_contents(name: str, children: Collection[str]) -> Candidate | None:
    """Layouts that need a look inside: DCP, finalized Orbax and accelerate directories.

    A numeric directory is an Orbax step only with Orbax's own files in it, so
    a run or team directory that happens to be called `42` is never mistaken
    for a checkpoint; `step_3` is accelerate's only with accelerate's own files.
    """
    if (m := _ORBAX.fullmatch(name)) and _ORBAX_MARKERS & set(children):
        return Candidate(name, int(m[1]), ORBAX, True)
    if (m := _ACCELERATE.fullmatch(name)) and any(_ACCELERATE_MARKER.fullmatch(c) for c in children):
        unit = {"checkpoint": SAVE, "epoch": EPOCH}.get(name.partition("_")[0], STEP)
        return Candidate(name, int(m[1]), ACCELERATE, True, unit=unit)
    is_dcp = ".metadata" in children or any(c.endswith(".distcp") for c in children)
    titan = is_dcp or TORCHTITAN_HF_INDEX in children or "sharded" in children
    if titan and (m := _TORCHTITAN.fullmatch(name)):
        return Candidate(name, int(m[1]), TORCHTITAN, True)
    if is_dcp and (m := _LAST_INT.search(name)):
        return Candidate(name, int(m[1]), DCP, True)
    return None


_HELD_FILES = (".ckpt", ".nemo", PIN_FILE)  # files that may be held: Lightning's and NeMo's, pins
# Numbered DCP directories frameworks put inside a checkpoint as its parts: FSDP's under the
# Trainer and accelerate (`pytorch_model_fsdp_<i>/`, `optimizer_<i>/`: one per model or optimizer,
# accelerate's save_fsdp_model, save_fsdp_optimizer). Unnumbered ones (NeMo 2's `weights/`) are parts.
_DCP_PART = re.compile(r"(?:pytorch_model|model|optimizer|optim|scheduler)(?:_fsdp)?(?:_\d+)?")
# A DCP directory named as a save of a run is one (`step_10/`, `step-10`, `iter_100`, `20`): a
# script given the checkpoint as its output directory saved there, and that run is kept whole.
_DCP_SAVE_NAME = re.compile(r"(?:.*[_-])?(?:steps?|iter|iteration|global_step|checkpoint|ckpt|epoch)[_=-]?\d+"
                            r"|\d+")


def _dcp_is_a_run_save(name: str, sibling_dirs: Collection[str]) -> bool:
    """Whether a DCP directory inside a checkpoint is a save of a run held there, not its part:
    named as a save, or one of several directories numbered alike (`save_10/`, `save_20/`)."""
    if _DCP_PART.fullmatch(name):
        return False
    if _DCP_SAVE_NAME.fullmatch(name):
        return True

    def stem(n: str) -> str | None:
        m = _LAST_INT.search(n)
        return None if m is None else f"{n[: m.start()]}#{n[m.end() :]}"

    own = stem(name)
    return own is not None and any(s != name and stem(s) == own for s in sibling_dirs)


def held(layout: str, rels: Collection[str], dirs: Collection[str]) -> list[str]:
    """What a checkpoint directory of `layout` holds that is not its own part, as paths relative
    to it: checkpoints of a run of its own, at any depth, recognised as discovery recognises
    them (a job given `--output_dir out/checkpoint-500` writes checkpoint-100, -200 inside it;
    an Orbax CheckpointManager directory named like a user pattern holds its numbered steps),
    and pins below its top (`.ckptd-keep`, or a file's `<name>.ckptd-keep`); Lightning's and
    NeMo's last copies too (`last.ckpt`: what that run resumes from). Such a directory is
    never deleted as one checkpoint. `rels`: everything in it, relative to it, and `dirs`: the
    directories among them, from the walk evidence makes anyway: no extra I/O.

    Its own parts are not counted: a DeepSpeed tag directory (`global_stepN/`) directly in a
    Trainer, accelerate or Lightning checkpoint, Orbax's items directly in a step, and
    torch.distributed.checkpoint directories (FSDP's `pytorch_model_fsdp_0/`, NeMo's `weights/`:
    the evidence demands their `.metadata` as parts), unless named as a run's saves (`step_10/`,
    or several numbered alike: `_dcp_is_a_run_save`). Parts of a held checkpoint are not listed
    again.
    """
    items = sorted([(d, True) for d in dirs if d] + [(f, False) for f in rels if f.endswith(_HELD_FILES)])
    kids: dict[str, list[str]] | None = None

    def children(rel: str) -> list[str]:  # listed once, and only if a directory's name is not enough
        nonlocal kids
        if kids is None:
            kids = {}
            for r in rels:
                if r:
                    parent, _, name = r.rpartition("/")
                    kids.setdefault(parent, []).append(name)
        return kids.get(rel, [])

    dir_set = set(dirs)

    def dir_names(parent: str) -> set[str]:
        return {c for c in children(parent) if (f"{parent}/{c}" if parent else c) in dir_set}

    found: list[str] = []
    seen: set[str] = set()
    for rel, is_dir in items:
        parent, _, name = rel.rpartition("/")
        if seen and parent:
            parts = parent.split("/")
            if any("/".join(parts[: i + 1]) in seen for i in range(len(parts))):
                continue  # a part of a checkpoint already listed
        if name.endswith(PIN_FILE):
            if parent or name != PIN_FILE:  # `.ckptd-keep` at its top pins the checkpoint itself
                found.append(rel)
                seen.add(rel)
            continue
        if not is_dir and not name.endswith((".ckpt", ".nemo")):
            continue  # only Lightning's and NeMo's checkpoints are files
        if not parent and is_dir and not framework(layout).checkpoint_is_tag and _DEEPSPEED.fullmatch(name):
            continue  # its own DeepSpeed tag (the Trainer's global_stepN/), the common case: no more to do
        cand = recognise(name, is_dir, lambda rel=rel: children(rel))
        if cand is None and name.endswith((".ckpt", ".nemo")) and is_last_copy(name):
            found.append(rel)  # a nested run's last.ckpt: what its resume loads
            seen.add(rel)
            continue
        if cand is None:
            continue
        if framework(cand.layout).owns_top_dcp and not _dcp_is_a_run_save(name, dir_names(parent)):
            continue  # its own part (FSDP's pytorch_model_fsdp_0/), whose .metadata the evidence demands
        own = framework(layout)
        if not parent and own.items_like_steps and framework(cand.layout) is own and not cand.in_progress:
            continue  # an Orbax item (its own commit_success.txt, in commit-file mode)
        found.append(rel)
        seen.add(rel)
    return found


def nemo_unfinished_marker(name: str) -> str:
    """NeMo's marker for `name`: the name without .ckpt/.nemo, plus `-unfinished`."""
    return name.removesuffix(".nemo").removesuffix(".ckpt") + NEMO_UNFINISHED_SUFFIX


_FRAMEWORKS = None


def _registry():  # -> the ckptd.frameworks module
    """frameworks/, which imports this module: imported on first use."""
    global _FRAMEWORKS
    if _FRAMEWORKS is None:
        from ckptd import frameworks

        _FRAMEWORKS = frameworks
    return _FRAMEWORKS


def framework(layout: str):  # -> frameworks.base.Framework
    """`layout`'s framework: what it says of its own names and parts."""
    return _registry().get(layout)


def recognise(
    name: str,
    is_dir: bool,
    children: Callable[[], Collection[str]],
    patterns: Collection[re.Pattern[str]] = (),
) -> Candidate | None:
    """Whether `name` (an entry of a candidate run directory) is a checkpoint.

    A directory recognised by a loose rule (a NeMo-style name, a user pattern,
    DCP or Orbax contents) is not a checkpoint if it holds checkpoints itself:
    then it is a run, and deleting it "as a checkpoint" would delete the run.
    """
    cand = recognise_by_name(name, is_dir, patterns)
    if not is_dir:
        return cand
    if cand is not None and (framework(cand.layout).named_alone or cand.in_progress):
        return cand
    inside = children()
    if cand is None:
        cand = recognise_by_contents(name, inside)
    elif cand.pattern is not None and (known := recognise_by_contents(name, inside)) is not None:
        # A user's pattern over a save a framework recognises by its own files (accelerate's step_10/):
        # that framework's evidence, not quiet alone; the pattern's own evidence is asked besides.
        cand = replace(known, pattern=cand.pattern)
    if cand is None:
        return None
    if not framework(cand.layout).recognised_inside(name, inside):
        return None
    if any(recognise_by_name(c, True, patterns) for c in inside):
        return None
    return cand
